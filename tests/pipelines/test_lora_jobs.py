"""Jobs with LoRA adapters: rows across two adapters and the base model equal
`LLM.generate` with each row's `LoRARequest`, an unknown name fails its row alone, the
adapters' files are part of the job's identity, adapters on a store give the local ones'
rows, and every mistake about adapters stops the job before any weights load."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchlm.engine import LLM, LoRARequest, SamplingParams
from batchlm.operators.config import OperatorConfig
from batchlm.pipelines import JobSpec, cli, plan_job, run_job
from batchlm.pipelines.output import OutputConflictError
from batchlm.pipelines.spec import JobSpecError

from .conftest import write_job, write_jsonl

SAMPLING = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
ROWS = [
    {"id": 0, "q": "The river bends", "adapter": None},
    {"id": 1, "q": "The river bends", "adapter": "sql"},
    {"id": 2, "q": "The river bends", "adapter": "poem"},
    {"id": 3, "q": "A lantern glows", "adapter": "sqll"},
    {"id": 4, "q": "Copper turns green", "adapter": "poem"},
    {"id": 5, "q": "The meadow", "adapter": "sql"},
]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def expected(model, tiny_llama_adapters) -> dict[int, list[int]]:
    """id → `LLM.generate`'s tokens for that row's prompt with its `LoRARequest` (ids in the
    order of lora_modules), on an engine given the LoRA options by hand."""
    llm = LLM(model, max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    names = list(tiny_llama_adapters)
    out = {}
    for row in ROWS:
        name = row["adapter"]
        if name is not None and name not in names:
            continue
        lora = (
            None
            if name is None
            else LoRARequest(name, names.index(name) + 1, tiny_llama_adapters[name])
        )
        (ref,) = llm.generate(
            [row["q"]], SamplingParams(**SAMPLING), use_tqdm=False, lora_request=lora
        )
        out[row["id"]] = ref.outputs[0].token_ids
    llm.shutdown()
    return out


def _data(tmp_path: Path, model: str, adapters: dict[str, str] | None) -> dict:
    """The job as a job file holds it: its rows in `tmp_path/in`, output in `tmp_path/out`."""
    if not (tmp_path / "in").exists():
        write_jsonl(tmp_path / "in" / "rows.jsonl", ROWS)
    return {
        "input": {"path": str(tmp_path / "in"), "columns": {"prompt": "q", "lora": "adapter"}},
        "task": "generate",
        "model": model,
        "engine": {"max_model_len": 64},
        "sampling_params": SAMPLING,
        "lora_modules": adapters,
        "output_token_ids": True,
        "output": str(tmp_path / "out"),
        "batch_size": 4,
    }


def _job(tmp_path: Path, model: str, adapters: dict[str, str]) -> JobSpec:
    return JobSpec.from_dict(_data(tmp_path, model, adapters))


def _check_rows(out, expected: dict[int, list[int]]) -> None:
    for row in out.to_pylist():
        if row["id"] == 3:
            assert "column 'adapter': LoRA adapter 'sqll' is not among" in row["error"]
            assert "('sql', 'poem')" in row["error"] and row["generated_text"] is None
            continue
        assert row["error"] is None, row
        assert row["output_token_ids"] == expected[row["id"]], row["id"]


def test_rows_across_two_adapters_equal_generate_with_each_rows_adapter(
    tmp_path, model, tiny_llama_adapters, expected
):
    summary = run_job(_job(tmp_path, model, tiny_llama_adapters), progress=False)
    assert (summary.rows_written, summary.rows_failed) == (6, 1)
    out = pq.read_table(tmp_path / "out")
    assert out.column("adapter").to_pylist() == [r["adapter"] for r in ROWS]
    _check_rows(out, expected)
    # The same prompt under the base model and either adapter: three different completions.
    assert len({tuple(expected[i]) for i in (0, 1, 2)}) == 3


def test_changing_an_adapter_file_changes_the_job(
    tmp_path, model, tiny_llama_adapters, monkeypatch
):
    adapters = {}
    for name, path in tiny_llama_adapters.items():
        adapters[name] = str(shutil.copytree(path, tmp_path / "adapters" / name))
    job = _job(tmp_path, model, adapters)
    before = plan_job(job).manifest["config_fingerprint"]
    run_job(job, progress=False)

    def refuse(self):
        raise AssertionError("no engine is built for a job whose output is complete or refused")

    monkeypatch.setattr(OperatorConfig, "build_llm", refuse)
    assert run_job(job, progress=False).num_shards_skipped == 1  # the same job: nothing to run
    config = Path(adapters["poem"]) / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 32'))
    changed = plan_job(job).manifest["config_fingerprint"]
    assert changed != before
    with pytest.raises(OutputConflictError, match=changed):
        run_job(job, progress=False)


def test_adapters_on_a_store_give_the_local_adapters_rows(
    tmp_path, model, tiny_llama_adapters, expected, s3
):
    remote = {
        name: s3.upload(Path(path), f"adapters/{name}")
        for name, path in tiny_llama_adapters.items()
    }
    job = _job(tmp_path, model, remote)
    assert job.lora_modules == remote  # store URIs stay as given
    run_job(job, progress=False)
    _check_rows(pq.read_table(tmp_path / "out"), expected)


def test_adapter_mistakes_stop_the_job_before_any_weights_load(
    tmp_path, model, tiny_llama_adapters, monkeypatch, capsys
):
    def refuse(self):
        raise AssertionError("the job must stop before any engine is built")

    monkeypatch.setattr(OperatorConfig, "build_llm", refuse)
    good = _data(tmp_path, model, tiny_llama_adapters)
    named_lora = write_jsonl(tmp_path / "lora.jsonl", [{"prompt": "Hi", "lora": "sql"}])
    embed = {"task": "embed", "sampling_params": None, "output_token_ids": False}
    cases = {
        "column 'lora' names a LoRA adapter per row, but no lora_modules": {
            "input": {"path": str(named_lora)},
            "lora_modules": None,
        },
        r"lora_column='adapter' \(input.columns.lora in a job\).*no lora_modules": {
            "lora_modules": None
        },
        "input.columns.lora names column 'ad'": {
            "input": {**good["input"], "columns": {"prompt": "q", "lora": "ad"}}
        },
        "lora_modules: LoRA adapter 'sql'.*is not a folder": {
            "lora_modules": {"sql": str(tmp_path / "nowhere")}
        },
        "engine.enable_lora: False, but lora_modules names adapters": {
            "engine": {"enable_lora": False, "max_model_len": 64}
        },
        "lora_modules: task='embed' runs the base model": {
            **embed,
            "input": {**good["input"], "columns": {"text": "q", "lora": "adapter"}},
        },
    }
    for message, changes in cases.items():
        with pytest.raises(JobSpecError, match=message):
            plan_job(JobSpec.from_dict({**good, **changes}))
    # LoRA engine options need no enable_lora of their own: lora_modules turns it on.
    ranked = JobSpec.from_dict({**good, "engine": {"max_lora_rank": 16, "max_loras": 1}})
    assert plan_job(ranked).config.engine_kwargs == {"max_lora_rank": 16, "max_loras": 1}
    # The command exits with code 2 and the message.
    path = write_job(tmp_path / "job.yaml", {**good, "lora_modules": {"sql": str(tmp_path)}})
    assert cli.main(["run", str(path), "-q"]) == 2
    assert "lora_modules: LoRA adapter 'sql'" in capsys.readouterr().err
