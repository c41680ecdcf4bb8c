"""The Spark front end on PySpark 3.5, which lacks 4.0's Arrow conversions
(`createDataFrame(pa.Table)`, `DataFrame.toArrow()`): the Spark runner's and the UDFs' tests,
run again in the environment `.ci/install` makes with PySpark 3.5."""

from __future__ import annotations

import os
import subprocess

import pytest

from .conftest import REPO

VENV_PYTHON = REPO / ".venv-pyspark35" / "bin" / "python"


@pytest.mark.slow
def test_spark_runner_on_pyspark_35():
    if not VENV_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VENV_PYTHON} is missing: .ci/install makes it")
        pytest.skip("run .ci/install to make the PySpark 3.5 environment")
    version = subprocess.run(
        [str(VENV_PYTHON), "-c", "import pyspark; print(pyspark.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version.startswith("3.5."), version
    tests = ["tests/pipelines/test_runners.py", "tests/operators/test_spark_udf.py"]
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, "-k", "spark"]
    run = subprocess.run(
        [str(VENV_PYTHON), *pytest_args],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]
