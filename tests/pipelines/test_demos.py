"""The demo jobs in conf/ run as the README says, and write every input row once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchlm.pipelines import cli, load_job

from .conftest import REPO


def input_rows(path: Path) -> int:
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    return sum(1 for f in files for line in f.read_text().splitlines() if line.strip())


def run_demo(name: str, output: Path, capsys) -> tuple[int, str]:
    code = cli.main(["run", str(REPO / "conf" / name), "--output", str(output), "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return code, captured.out


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the demos name their input relative to the repository


def test_generate_demo(tmp_path, capsys):
    _, summary = run_demo("generate_demo.yaml", tmp_path / "gen", capsys)
    job = load_job(REPO / "conf" / "generate_demo.yaml")
    assert job.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and job.runner == "local"
    table = pq.read_table(tmp_path / "gen")
    assert table.num_rows == input_rows(REPO / job.input.path) == 40
    assert table.column("error").null_count == table.num_rows
    assert sorted(table.column("id").to_pylist()) == list(range(40))
    assert all(n >= 1 for n in table.column("num_output_tokens").to_pylist())
    assert "rows written 40 (0 failed" in " ".join(summary.split())
    assert "pq.read_table(" in summary


def test_embed_demo(tmp_path, capsys):
    run_demo("embed_demo.yaml", tmp_path / "emb", capsys)
    table = pq.read_table(tmp_path / "emb")
    assert table.num_rows == input_rows(REPO / "conf/data/passages") == 160
    vectors = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    assert vectors.shape == (160, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_score_demo(tmp_path, capsys):
    run_demo("score_demo.yaml", tmp_path / "score", capsys)
    table = pq.read_table(tmp_path / "score")
    assert table.num_rows == input_rows(REPO / "conf/data/query_passage_pairs.jsonl") == 80
    scores = np.asarray(table.column("score").to_pylist())
    relevant = np.asarray(table.column("relevant").to_pylist())
    # Same-topic pairs score higher than cross-topic ones on average (bi-encoder cosine).
    assert scores[relevant].mean() > scores[~relevant].mean() + 0.2


def test_demo_data_is_valid_jsonl():
    for path in sorted((REPO / "conf" / "data").rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            json.loads(line)
