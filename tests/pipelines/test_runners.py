"""The same job on the local, Ray and Spark runners writes the same rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from batchlm.pipelines import JobSpec, run_job

from .conftest import write_jsonl

PROMPTS = [
    "The lighthouse keeper climbed",
    "Every morning the baker",
    "",  # refused by the engine: this row gets an error, the others run
    "A glacier moves",
    "Octopuses can",
    "The train left the station and",
    "Compost heaps",
]


@pytest.fixture(scope="module")
def generate_job(tmp_path_factory, tiny_model_factory) -> JobSpec:
    """Greedy generation with a tiny random Llama over three shards of three formats."""
    root = tmp_path_factory.mktemp("runners")
    rows = [{"id": i, "line": p} for i, p in enumerate(PROMPTS)]
    (root / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:3]), root / "in" / "a.parquet")
    pa_csv.write_csv(pa.Table.from_pylist(rows[3:5]), root / "in" / "b.csv")
    write_jsonl(root / "in" / "c.jsonl", rows[5:])
    return JobSpec.from_dict(
        {
            "input": {"path": str(root / "in"), "columns": {"prompt": "line"}},
            "task": "generate",
            "model": str(tiny_model_factory("llama")),
            "engine": {"max_model_len": 64},
            "sampling_params": {"temperature": 0, "max_tokens": 6},
            "output": str(root / "local"),
            "batch_size": 2,
        }
    )


@pytest.fixture(scope="module")
def local_output(generate_job: JobSpec) -> pa.Table:
    summary = run_job(generate_job, progress=False)
    assert summary.num_shards_written == 3 and summary.rows_written == len(PROMPTS)
    assert summary.rows_failed == 1
    return pq.read_table(generate_job.output.path)


def test_local_runner(local_output: pa.Table):
    assert local_output.column("id").to_pylist() == list(range(len(PROMPTS)))
    errors = local_output.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e] == [2]
    texts = local_output.column("generated_text").to_pylist()
    assert all(t for i, t in enumerate(texts) if i != 2)
    assert set(local_output.column("num_output_tokens").to_pylist()) <= {None, 6}


@pytest.mark.parametrize("runner", ["ray", "spark"])
def test_runner_matches_local(runner: str, generate_job: JobSpec, local_output, tmp_path: Path):
    module = {"ray": "ray_data", "spark": "spark_udf"}[runner]
    if importlib.util.find_spec(f"batchlm.operators.{module}") is None:
        pytest.skip(f"operators/{module}.py is absent")
    pytest.importorskip({"ray": "ray", "spark": "pyspark"}[runner])
    job = generate_job.with_overrides(runner=runner, output=str(tmp_path / runner))
    summary = run_job(job, progress=False)
    assert summary.num_shards_written == 3 and summary.rows_written == len(PROMPTS)
    out = pq.read_table(tmp_path / runner)
    assert out.schema == local_output.schema
    assert out.to_pylist() == local_output.to_pylist()
    for name in ("part-00000-a", "part-00001-b", "part-00002-c"):
        assert (tmp_path / runner / f"{name}.parquet").exists()


def test_chat_job_on_the_local_runner(tmp_path: Path, tiny_model_factory):
    conversations = [
        [{"role": "user", "content": "Name a colour."}],
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is tea?"},
        ],
    ]
    write_jsonl(
        tmp_path / "chats.jsonl", [{"id": i, "messages": c} for i, c in enumerate(conversations)]
    )
    job = JobSpec.from_dict(
        {
            "input": str(tmp_path / "chats.jsonl"),
            "task": "chat",
            "model": str(tiny_model_factory("llama")),
            "engine": {"max_model_len": 128},
            "sampling_params": {"temperature": 0, "max_tokens": 3},
            "output": str(tmp_path / "out"),
        }
    )
    summary = run_job(job, progress=False)
    assert summary.rows_written == 2 and summary.rows_failed == 0
    out = pq.read_table(tmp_path / "out")
    assert out.column("num_output_tokens").to_pylist() == [3, 3]
    assert out.column("messages").to_pylist()[1][0]["role"] == "system"
