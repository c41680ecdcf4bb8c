"""Evaluation jobs: rows with their own sampling params (`input.columns.sampling_params`),
token-id and logprob columns in the Parquet output, and the loglikelihood task with the
prompt tokens it computed against those it was given in the summary."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.operators.rows import output_fields
from batchlm.pipelines import JobSpec, plan_job, run_job
from batchlm.pipelines.spec import JobSpecError

from .conftest import write_jsonl

BASE = {"temperature": 0, "max_tokens": 5}
CONTEXT = (
    "Rain fell on the old harbour all night, and by morning the fishing boats rocked against "
    "the stone wall while the gulls waited on the roofs. Question: what waited on the roofs?"
    "\nAnswer:"
)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def _job(tmp_path: Path, model: str, **keys) -> JobSpec:
    return JobSpec.from_dict(
        {
            "model": model,
            "engine": {"max_model_len": 128},
            "output": str(tmp_path / "out"),
            "batch_size": 4,
            **keys,
        }
    )


def test_rows_with_their_own_params_and_logprob_columns(tmp_path, model):
    rows = [
        {"id": 0, "q": "The river bends", "params": None},
        {"id": 1, "q": "A lantern glows", "params": {"max_tokens": 2}},
        {"id": 2, "q": "Copper turns green", "params": {"temperature": 0.8, "seed": 11}},
        {"id": 3, "q": "The meadow", "params": {"max_tokens": 3, "logprobs": 2}},
        {"id": 4, "q": "Granite is", "params": {"max_tokens": -3}},
    ]
    write_jsonl(tmp_path / "in" / "rows.jsonl", rows)  # JSON objects: a struct column
    job = _job(
        tmp_path,
        model,
        input={
            "path": str(tmp_path / "in"),
            "columns": {"prompt": "q", "sampling_params": "params"},
        },
        task="generate",
        sampling_params=BASE,
        output_token_ids=True,
        output_logprobs=True,
    )
    summary = run_job(job, progress=False)
    assert (summary.rows_written, summary.rows_failed) == (5, 1)
    out = pq.read_table(tmp_path / "out")
    for f in output_fields(job.config.spec, plan_job(job).info):
        assert out.schema.field(f.name).type == f.type, f.name

    llm = LLM(model, max_model_len=128)
    for row, source in zip(out.to_pylist(), rows, strict=True):
        if source["id"] == 4:
            assert "max_tokens=-3 must be >= 1" in row["error"]
            continue
        params = SamplingParams(**{**BASE, "logprobs": 0, **(source["params"] or {})})
        (ref,) = llm.generate([source["q"]], params, use_tqdm=False)
        assert row["output_token_ids"] == ref.outputs[0].token_ids, source
        widths = {len(p) for p in row["output_logprobs"]}
        assert widths <= ({1} if params.logprobs == 0 else {2, 3})


def test_a_mapped_params_column_must_exist(tmp_path, model):
    write_jsonl(tmp_path / "in" / "rows.jsonl", [{"q": "Hello"}])
    job = _job(
        tmp_path,
        model,
        input={"path": str(tmp_path / "in"), "columns": {"prompt": "q", "sampling_params": "p"}},
        task="generate",
    )
    with pytest.raises(JobSpecError, match="input.columns.sampling_params names column 'p'"):
        plan_job(job)


def test_loglikelihood_job_reports_the_prompt_tokens_it_computed(tmp_path, model):
    choices = [" the gulls", " the boats", " the fishermen", " nobody"]
    rows = [{"id": i, "context": CONTEXT, "continuation": c} for i, c in enumerate(choices)]
    rows.append({"id": 4, "context": CONTEXT, "continuation": ""})
    write_jsonl(tmp_path / "in" / "mc.jsonl", rows)
    job = _job(tmp_path, model, input=str(tmp_path / "in"), task="loglikelihood")
    summary = run_job(job, progress=False)
    out = pq.read_table(tmp_path / "out")
    assert out.column_names[-6:] == [
        "logprob",
        "is_greedy",
        "num_tokens",
        "num_input_tokens",
        "num_cached_tokens",
        "error",
    ]
    assert out["error"].to_pylist()[4] == "the continuation is empty; nothing to score"
    given = pc.sum(out["num_input_tokens"]).as_py()
    cached = pc.sum(out["num_cached_tokens"]).as_py()
    context_len = out["num_input_tokens"][0].as_py() - out["num_tokens"][0].as_py()
    assert cached == 3 * ((context_len - 1) // 16 * 16)  # choices 2-4 reuse the context
    assert (summary.prompt_tokens, summary.cached_prompt_tokens) == (given, cached)
    line = next(x for x in summary.format().splitlines() if x.startswith("prompt tokens"))
    assert f"{given} given, {given - cached} computed" in line
