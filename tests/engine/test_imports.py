"""`import batchlm.engine` stays light: no Ray, no Spark, no GGUF reader until needed."""

from __future__ import annotations

import subprocess
import sys


def test_engine_import_loads_neither_ray_nor_pyspark():
    code = (
        "import sys, batchlm.engine\n"
        "heavy = [m for m in ('ray', 'pyspark', 'gguf') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
