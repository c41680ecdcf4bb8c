"""The demo jobs in conf/ run as the README says, and write every input row once."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchlm.operators.rows import ModelInfo, output_fields
from batchlm.pipelines import JobSpec, cli, load_job
from batchlm.pipelines.shards import find_input_files, plan_shards, read_shard

from .conftest import REPO

EXAMPLES = REPO / "examples"

DEMO_ROWS = {
    "generate_demo.yaml": 40,
    "embed_demo.yaml": 160,
    "score_demo.yaml": 80,
    "extract_demo.yaml": 16,
    "lora_demo.yaml": 12,
    "caption_demo.yaml": 4,
}
"""Each demo job's rows, as the README's table of demos states them."""


def input_rows(path: Path) -> int:
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    return sum(1 for f in files for line in f.read_text().splitlines() if line.strip())


def read_input(job: JobSpec) -> pa.Table:
    """The job's input rows as the job reads them: every shard, in order."""
    shards = plan_shards(find_input_files(job.input), job.input.rows_per_shard)
    return pa.concat_tables(read_shard(s) for s in shards)


def read_output(output: Path, job: JobSpec) -> pa.Table:
    """The written output, read back and checked: each input row once and unchanged, in
    input order, followed by the task's declared columns, and no row failed."""
    table = pq.read_table(output)
    source = read_input(job)
    declared = [f.name for f in output_fields(job.config.spec, ModelInfo(1, 1))]
    assert table.column_names == [*source.column_names, *declared]
    assert table.num_rows == source.num_rows
    assert table.select(source.column_names).equals(source)
    assert table.column("error").null_count == table.num_rows, table.column("error")
    for name in declared[:-1]:
        assert table.column(name).null_count == 0, name
    return table


def run_demo(name: str, output: Path, capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["run", str(REPO / "conf" / name), "--output", str(output), "-q", *args])
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
    table = read_output(tmp_path / "gen", job)
    assert table.num_rows == input_rows(REPO / job.input.path) == 40
    assert table.column("error").null_count == table.num_rows
    assert sorted(table.column("id").to_pylist()) == list(range(40))
    assert all(n >= 1 for n in table.column("num_output_tokens").to_pylist())
    assert "rows written 40 (0 failed" in " ".join(summary.split())
    assert "pq.read_table(" in summary


def test_embed_demo(tmp_path, capsys):
    run_demo("embed_demo.yaml", tmp_path / "emb", capsys)
    table = read_output(tmp_path / "emb", load_job(REPO / "conf" / "embed_demo.yaml"))
    assert table.num_rows == input_rows(REPO / "conf/data/passages") == 160
    vectors = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    assert vectors.shape == (160, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_score_demo(tmp_path, capsys):
    run_demo("score_demo.yaml", tmp_path / "score", capsys)
    table = read_output(tmp_path / "score", load_job(REPO / "conf" / "score_demo.yaml"))
    assert table.num_rows == input_rows(REPO / "conf/data/query_passage_pairs.jsonl") == 80
    scores = np.asarray(table.column("score").to_pylist())
    relevant = np.asarray(table.column("relevant").to_pylist())
    # Same-topic pairs score higher than cross-topic ones on average (bi-encoder cosine).
    assert scores[relevant].mean() > scores[~relevant].mean() + 0.2


def test_extract_demo(tmp_path, capsys):
    run_demo("extract_demo.yaml", tmp_path / "extract", capsys)
    job = load_job(REPO / "conf" / "extract_demo.yaml")
    table = read_output(tmp_path / "extract", job)
    assert table.num_rows == input_rows(REPO / job.input.path) == 16
    schema = job.structured_outputs["json"]
    for text, reason in zip(
        table.column("generated_text").to_pylist(),
        table.column("finish_reason").to_pylist(),
        strict=True,
    ):
        jsonschema.validate(json.loads(text), schema)  # every row: JSON that fits the schema
        assert reason == "stop"


def test_lora_demo(tmp_path, capsys):
    """The adapters the example script makes, where the test puts them (the demo reads them
    from the current directory's out/lora_adapters, where the script writes them)."""
    pytest.importorskip("peft")
    spec = importlib.util.spec_from_file_location("lora_generate", EXAMPLES / "lora_generate.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    adapters = example.make_adapters(tmp_path / "adapters")
    overrides = [f"lora_modules.{name}={path}" for name, path in adapters.items()]
    job = load_job(REPO / "conf" / "lora_demo.yaml", overrides)
    assert job.lora_modules == {"red": adapters["red"], "blue": adapters["blue"]}
    run_demo("lora_demo.yaml", tmp_path / "lora", capsys, *(f"--set={o}" for o in overrides))
    table = read_output(tmp_path / "lora", job)
    rows = table.to_pylist()
    assert [r["adapter"] for r in rows] == [None, "red", "blue"] * 4
    for name in ("red", "blue"):  # each adapter changes what the base model writes
        changed = [
            base["generated_text"] != adapted["generated_text"]
            for base, adapted in zip(rows[0::3], rows[1 + (name == "blue") :: 3], strict=True)
        ]
        assert any(changed), name


def test_caption_demo(tmp_path, capsys):
    """The tiny LLaVA the example script makes, where the test puts it."""
    spec = importlib.util.spec_from_file_location("image_chat", EXAMPLES / "image_chat.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.make_model(tmp_path / "tiny_llava")
    run_demo("caption_demo.yaml", tmp_path / "captions", capsys, f"--set=model={model}")
    table = read_output(tmp_path / "captions", load_job(REPO / "conf" / "caption_demo.yaml"))
    assert table.column("file").to_pylist()[0] == "conf/data/images/red_circle.png"
    assert len(set(table.column("generated_text").to_pylist())) > 1  # the images matter


def test_every_demo_runs_over_the_data_in_conf():
    jobs = sorted(p.name for p in (REPO / "conf").glob("*.yaml"))
    assert jobs == sorted(DEMO_ROWS)
    read = set()
    for name in jobs:
        read.update(f.path for f in find_input_files(load_job(REPO / "conf" / name).input))
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "conf" / "data").rglob("*.jsonl")}
    assert {str(Path(p)) for p in read} == on_disk, "a data file that no demo reads"


@pytest.mark.parametrize("name", sorted(DEMO_ROWS))
def test_demo_data_is_valid_jsonl_with_the_columns_the_job_reads(name):
    job = load_job(REPO / "conf" / name)
    lines = []
    for file in find_input_files(job.input):
        lines += [json.loads(line) for line in Path(file.path).read_text().splitlines()]
    assert all(isinstance(row, dict) for row in lines)
    table = read_input(job)
    assert table.num_rows == len(lines) == DEMO_ROWS[name]
    assert table.to_pylist() == lines  # pyarrow reads each line as written
    ids = table.column("id").to_pylist()
    assert len(set(ids)) == len(ids), "ids are unique"
    for column in job.config.spec.input_columns:
        values = table.column(column).to_pylist()
        assert all(isinstance(v, str) and v.strip() for v in values), column
