"""The same job on the local, Ray and Spark runners writes the same rows, equal to direct
`LLM.generate` / `LLM.chat` / `LLM.embed` calls over those rows with the job's params. The
Ray and Spark runs of the generation job read their input from and write their output to an
S3-compatible store (the job's own I/O, the same for every runner, is the driver's)."""

from __future__ import annotations

import gc
import importlib.util
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.pipelines import JobSpec, run_job

from .conftest import MINILM, sentences, write_jsonl

PROMPTS = [
    "The lighthouse keeper climbed",
    "Every morning the baker",
    "",  # refused by the engine: this row gets an error, the others run
    "A glacier moves",
    "Octopuses can",
    "The train left the station and",
    "Compost heaps",
]
EMBED_ROWS = sentences(0, 7)
MIN_COSINE = 0.99999


def _write_three_formats(folder: Path, rows: list[dict]) -> Path:
    """Three shards of `rows`: Parquet, CSV and JSONL."""
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:3]), folder / "a.parquet")
    pa_csv.write_csv(pa.Table.from_pylist(rows[3:5]), folder / "b.csv")
    write_jsonl(folder / "c.jsonl", rows[5:])
    return folder


def _skip_without(runner: str) -> None:
    if runner == "local":
        return
    module = {"ray": "ray_data", "spark": "spark_udf"}[runner]
    if importlib.util.find_spec(f"batchlm.operators.{module}") is None:
        pytest.skip(f"operators/{module}.py is absent")
    pytest.importorskip({"ray": "ray", "spark": "pyspark"}[runner])


def _release(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def generate_job(tmp_path_factory, tiny_model_factory) -> JobSpec:
    """Greedy generation with a tiny random Llama over three shards of three formats."""
    root = tmp_path_factory.mktemp("runners")
    rows = [{"id": i, "line": p} for i, p in enumerate(PROMPTS)]
    return JobSpec.from_dict(
        {
            "input": {
                "path": str(_write_three_formats(root / "in", rows)),
                "columns": {"prompt": "line"},
            },
            "task": "generate",
            "model": str(tiny_model_factory("llama")),
            "engine": {"max_model_len": 64},
            "sampling_params": {"temperature": 0, "max_tokens": 6},
            "output": str(root / "local"),
            "batch_size": 2,
        }
    )


@pytest.fixture(scope="module")
def generate_reference(generate_job: JobSpec) -> dict[int, tuple[str, str, int, int]]:
    """Direct `LLM.generate` of the valid prompts with the job's engine options and params:
    id → (text, finish reason, prompt tokens, output tokens)."""
    config = generate_job.config
    llm = LLM(config.model, **config.engine_kwargs)
    ids = [i for i, p in enumerate(PROMPTS) if p]
    params = SamplingParams(**config.spec.sampling_params)
    outs = llm.generate([PROMPTS[i] for i in ids], params, use_tqdm=False)
    _release(llm)
    return {
        i: (
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            len(o.prompt_token_ids),
            len(o.outputs[0].token_ids),
        )
        for i, o in zip(ids, outs, strict=True)
    }


def _check_generated(out: pa.Table, reference: dict[int, tuple[str, str, int, int]]) -> None:
    """Every row once, in input order; valid rows equal to the direct call, the empty
    prompt with its error."""
    assert out.column("id").to_pylist() == list(range(len(PROMPTS)))
    for row in out.to_pylist():
        got = (
            row["generated_text"],
            row["finish_reason"],
            row["num_input_tokens"],
            row["num_output_tokens"],
        )
        if row["id"] in reference:
            assert row["error"] is None, row
            assert got == reference[row["id"]], row["id"]
        else:
            assert row["error"] and got == (None, None, None, None), row


@pytest.fixture(scope="module")
def local_output(generate_job: JobSpec) -> pa.Table:
    summary = run_job(generate_job, progress=False)
    assert summary.num_shards_written == 3 and summary.rows_written == len(PROMPTS)
    assert summary.rows_failed == 1
    return pq.read_table(generate_job.output.path)


def test_local_runner(local_output: pa.Table, generate_reference):
    assert local_output.column("id").to_pylist() == list(range(len(PROMPTS)))
    errors = local_output.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e] == [2]
    texts = local_output.column("generated_text").to_pylist()
    assert all(t for i, t in enumerate(texts) if i != 2)
    assert set(local_output.column("num_output_tokens").to_pylist()) <= {None, 6}
    _check_generated(local_output, generate_reference)


@pytest.mark.parametrize("runner", ["ray", "spark"])
def test_runner_matches_local(
    runner: str, generate_job: JobSpec, local_output, generate_reference, s3
):
    _skip_without(runner)
    source = s3.upload(Path(generate_job.input.path), "in")
    job = generate_job.with_overrides(runner=runner, input=source, output=s3.uri(runner))
    summary = run_job(job, progress=False)
    assert summary.num_shards_written == 3 and summary.rows_written == len(PROMPTS)
    out = pq.read_table(f"{s3.bucket}/{runner}", filesystem=s3.fs)
    assert out.schema == local_output.schema
    assert out.to_pylist() == local_output.to_pylist()
    names = ("part-00000-a", "part-00001-b", "part-00002-c")
    assert set(s3.keys(runner)) == {f"{runner}/{n}.parquet" for n in names} | {
        f"{runner}/_batchlm_manifest.json"
    }
    _check_generated(out, generate_reference)


# ---- embed ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_job(tmp_path_factory) -> JobSpec:
    """MiniLM embeddings over three shards of three formats."""
    root = tmp_path_factory.mktemp("embed-runners")
    rows = [{"id": r["id"], "passage": r["text"]} for r in EMBED_ROWS]
    return JobSpec.from_dict(
        {
            "input": {
                "path": str(_write_three_formats(root / "in", rows)),
                "columns": {"text": "passage"},
            },
            "task": "embed",
            "model": MINILM,
            "output": str(root / "unused"),
            "batch_size": 2,
        }
    )


@pytest.fixture(scope="module")
def embed_reference(embed_job: JobSpec) -> np.ndarray:
    """Direct `LLM.embed` of every row, in id order: [num_rows, 384]."""
    config = embed_job.config
    llm = LLM(config.model, **config.engine_kwargs)
    outs = llm.embed([r["text"] for r in EMBED_ROWS], use_tqdm=False)
    _release(llm)
    return np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)


def _application_handler(signum, frame) -> None:
    """A SIGINT handler of the application's own."""


@pytest.mark.parametrize("runner", ["local", "ray", "spark"])
def test_embed_runner_matches_direct_embed(
    runner: str, embed_job: JobSpec, embed_reference: np.ndarray, tmp_path: Path
):
    _skip_without(runner)
    job = embed_job.with_overrides(runner=runner, output=str(tmp_path / runner))
    # PySpark's SparkContext installs its own SIGINT handler in the process that starts it
    # and leaves it there after `stop()`: the runner starts a session here and must put
    # back the handler it found.
    if runner == "spark":
        from pyspark.sql import SparkSession

        assert SparkSession.getActiveSession() is None
    found = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, _application_handler)
    try:
        summary = run_job(job, progress=False)
        assert signal.getsignal(signal.SIGINT) is _application_handler
    finally:
        signal.signal(signal.SIGINT, found)
    assert summary.rows_written == len(EMBED_ROWS) and summary.rows_failed == 0
    out = pq.read_table(tmp_path / runner)
    assert out.column("id").to_pylist() == [r["id"] for r in EMBED_ROWS]
    assert out.column("passage").to_pylist() == [r["text"] for r in EMBED_ROWS]
    assert out.column("error").null_count == out.num_rows
    assert out.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    got = np.asarray(out.column("embedding").to_pylist(), dtype=np.float32)
    cosine = (got * embed_reference).sum(1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(embed_reference, axis=1)
    )
    assert cosine.min() >= MIN_COSINE, cosine


# ---- chat -----------------------------------------------------------------------------------


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
    llm = LLM(job.config.model, **job.config.engine_kwargs)
    reference = llm.chat(
        conversations, SamplingParams(**job.config.spec.sampling_params), use_tqdm=False
    )
    _release(llm)
    assert out.column("generated_text").to_pylist() == [o.outputs[0].text for o in reference]
    assert out.column("num_input_tokens").to_pylist() == [
        len(o.prompt_token_ids) for o in reference
    ]
