"""A light command line: `batchlm --help` answers without torch or the engine (import
cycles anywhere are `tests/test_import_graph.py`'s)."""

from __future__ import annotations

import subprocess
import sys


def test_help_loads_neither_torch_nor_the_engine():
    code = (
        "import sys\n"
        "from batchlm.pipelines import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('torch', 'ray', 'pyspark', 'batchlm.engine', 'batchlm.operators.rows')\n"
        "print('loaded:', ','.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "batchlm run conf/generate_demo.yaml" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "loaded:"
