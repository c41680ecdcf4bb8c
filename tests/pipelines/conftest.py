"""Helpers for job tests: input files, job files, and the `batchlm` command in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_job(path: Path, job: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def sentences(start: int, count: int) -> list[dict[str, Any]]:
    """Rows `{id, text}` with distinct short sentences."""
    words = ["river", "lantern", "orchard", "copper", "meadow", "harbor", "violet", "granite"]
    return [
        {"id": i, "text": f"The {words[i % 8]} number {i} sits near the {words[(i * 3) % 8]}."}
        for i in range(start, start + count)
    ]


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    """`python3 -m batchlm.pipelines ARGS` in a subprocess; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "batchlm.pipelines", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd or REPO,
        timeout=300,
    )


@pytest.fixture
def embed_job(tmp_path: Path) -> Path:
    """An embed job over three JSONL shards (5, 4 and 3 rows) with MiniLM."""
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", sentences(0, 5))
    write_jsonl(data / "b.jsonl", sentences(5, 4))
    write_jsonl(data / "c.jsonl", sentences(9, 3))
    job = {
        "input": {"path": str(data)},
        "task": "embed",
        "model": MINILM,
        "output": {"path": str(tmp_path / "out")},
        "batch_size": 4,
    }
    return write_job(tmp_path / "job.yaml", job)
