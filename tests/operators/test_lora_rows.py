"""LoRA adapters in the row contract: rows across two adapters and the base model equal
`LLM.generate` / `LLM.chat` with each row's `LoRARequest` (the engine's LoRA is itself
tested against PEFT); an unknown name fails its row alone; the engine options derived from
the adapters; every mistake about adapters refused before any row runs, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from batchlm.engine import LLM, LoRARequest, SamplingParams
from batchlm.operators.config import OperatorConfig
from batchlm.operators.lora_rows import MAX_LORAS_CAP, adapter_engine_kwargs
from batchlm.operators.rows import RowContractError, RowSpec, check_columns, process_table

MAX_TOKENS = 5
SAMPLING = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
PROMPTS = ["The river bends", "A lantern glows", "Copper turns", "The meadow is", "Granite"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_adapters) -> dict[str, str]:
    return tiny_llama_adapters


@pytest.fixture(scope="module")
def config(tiny_model_factory, adapters) -> OperatorConfig:
    return OperatorConfig.create(
        str(tiny_model_factory("llama")),
        "generate",
        engine_kwargs={"max_model_len": 64},
        sampling_params=SAMPLING,
        lora_modules=adapters,
        output_token_ids=True,
    )


@pytest.fixture(scope="module")
def llm(config) -> LLM:
    """The engine as a stage builds it: LoRA options derived, both adapters given."""
    return config.build_llm()


def _lora(adapters: dict[str, str], name: str | None) -> LoRARequest | None:
    """The row's adapter as a direct call names it (ids in the order of lora_modules)."""
    if name is None:
        return None
    return LoRARequest(name, list(adapters).index(name) + 1, adapters[name])


def test_the_engine_gets_every_adapter_and_options_that_fit_them(llm, adapters):
    lora = llm.llm_engine.config.lora
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (2, 8, 2)
    assert llm.llm_engine.list_loras() == {1, 2}


def test_rows_across_two_adapters_equal_generate_with_each_rows_lora_request(llm, config, adapters):
    names = [None, "sql", "poem", "sql", None, "poem", "sql"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    table = pa.table({"id": range(len(names)), "prompt": prompts, "lora": names})
    out = process_table(llm, config.spec, table)
    assert out.column("lora").to_pylist() == names  # passed through
    assert out.column("error").null_count == len(names)
    params = SamplingParams(**SAMPLING)
    expected = [
        llm.generate([p], params, use_tqdm=False, lora_request=_lora(adapters, n))[0]
        for p, n in zip(prompts, names, strict=True)
    ]
    got = out.to_pylist()
    for row, ref in zip(got, expected, strict=True):
        assert row["output_token_ids"] == ref.outputs[0].token_ids, row
        assert row["generated_text"] == ref.outputs[0].text
    # Each adapter changes the tokens of the same prompt (rows 0 / 3 / 5 share prompt 0's
    # text only by position: compare the same prompt under the three).
    same = pa.table({"prompt": [PROMPTS[0]] * 3, "lora": [None, "sql", "poem"]})
    tokens = process_table(llm, config.spec, same).column("output_token_ids").to_pylist()
    assert len({tuple(t) for t in tokens}) == 3


def test_chat_rows_take_their_adapters(llm, config, adapters):
    spec = RowSpec("chat", sampling_params=SAMPLING, lora_modules=adapters)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    names = ["poem", None, "sql"]
    table = pa.table({"messages": [json.dumps(m) for m in messages], "lora": names})
    out = process_table(llm, spec, table)
    params = SamplingParams(**SAMPLING)
    for row, m, n in zip(out.to_pylist(), messages, names, strict=True):
        (ref,) = llm.chat(m, params, use_tqdm=False, lora_request=_lora(adapters, n))
        assert row["error"] is None and row["generated_text"] == ref.outputs[0].text


def test_loglikelihood_rows_take_their_adapters(llm, adapters):
    spec = RowSpec("loglikelihood", lora_modules=adapters)
    context, continuation = [5, 17, 300, 4000, 12], [77, 901, 33]
    names = ["sql", None, "poem"]
    table = pa.table({"context": [context] * 3, "continuation": [continuation] * 3, "lora": names})
    out = process_table(llm, spec, table).to_pylist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for row, n in zip(out, names, strict=True):
        (ref,) = llm.generate(
            [{"prompt_token_ids": context + continuation}],
            params,
            use_tqdm=False,
            lora_request=_lora(adapters, n),
        )
        positions = ref.prompt_logprobs[len(context) :]
        want = sum(p[t].logprob for p, t in zip(positions, continuation, strict=True))
        assert row["error"] is None and row["logprob"] == pytest.approx(want, abs=1e-4), n
    assert len({round(r["logprob"], 4) for r in out}) == 3


def test_an_unknown_adapter_fails_its_row_and_the_others_run(llm, config, adapters):
    names = ["sql", "sq1", None, "", "poem"]
    table = pa.table({"prompt": PROMPTS, "lora": names})
    out = process_table(llm, config.spec, table).to_pylist()
    for i in (1, 3):
        error = out[i]["error"]
        assert f"column 'lora': LoRA adapter {names[i]!r} is not among" in error, error
        assert "('sql', 'poem')" in error and "null for the base model" in error
        assert out[i]["generated_text"] is None
    params = SamplingParams(**SAMPLING)
    for i in (0, 2, 4):
        (ref,) = llm.generate(
            [PROMPTS[i]], params, use_tqdm=False, lora_request=_lora(adapters, names[i])
        )
        assert out[i]["error"] is None and out[i]["output_token_ids"] == ref.outputs[0].token_ids
    numbers = process_table(llm, config.spec, pa.table({"prompt": PROMPTS[:2], "lora": [3, None]}))
    errors = numbers.column("error").to_pylist()
    assert "must hold an adapter's name (text) or null" in errors[0] and errors[1] is None
    # A column pandas filled with NaN (no adapter anywhere): the base model.
    nan = pa.table({"prompt": PROMPTS[:1], "lora": pa.array([float("nan")])})
    assert process_table(llm, config.spec, nan).column("error").to_pylist() == [None]


def test_a_mapped_adapter_column_and_rows_without_it(llm, adapters):
    spec = RowSpec("generate", sampling_params=SAMPLING, lora_modules=adapters, lora_column="ad")
    out = process_table(llm, spec, pa.table({"prompt": PROMPTS[:2], "ad": ["poem", None]}))
    assert out.column("error").null_count == 2
    # Without the column every row runs the base model.
    plain = process_table(llm, spec, pa.table({"prompt": PROMPTS[:2]}))
    base = process_table(
        llm, RowSpec("generate", sampling_params=SAMPLING), plain.select(["prompt"])
    )
    assert plain.column("generated_text").equals(base.column("generated_text"))
    assert out.column("generated_text")[1] == base.column("generated_text")[1]


# ---- refused before any row runs ----------------------------------------------------------


def test_adapter_mistakes_are_config_errors(adapters):
    with pytest.raises(
        RowContractError, match="column 'lora' names a LoRA adapter per row, but no lora_modules"
    ):
        check_columns(RowSpec("generate"), ["prompt", "lora"])
    with pytest.raises(RowContractError, match="task='embed' runs the base model"):
        check_columns(RowSpec("embed"), ["text", "lora"])
    with pytest.raises(RowContractError, match="lora_column='adapter'.*no lora_modules"):
        RowSpec("generate", lora_column="adapter")
    with pytest.raises(RowContractError, match="lora_modules: task='score' runs the base model"):
        RowSpec("score", lora_modules=adapters)
    with pytest.raises(RowContractError, match="must name at least one adapter"):
        RowSpec("generate", lora_modules={})
    with pytest.raises(RowContractError, match="names are strings"):
        RowSpec("generate", lora_modules={1: "/adapters/a"})
    with pytest.raises(RowContractError, match="enable_lora=False.*drop enable_lora"):
        OperatorConfig.create(
            "m", "generate", engine_kwargs={"enable_lora": False}, lora_modules=adapters
        )


def test_local_paths_are_made_absolute_and_key_the_engine(adapters, monkeypatch):
    folder = Path(adapters["sql"])
    monkeypatch.chdir(folder.parent)
    spec = RowSpec("generate", lora_modules={"sql": folder.name, "s3": "s3://bucket/a/"})
    assert spec.lora_modules == {"sql": str(folder), "s3": "s3://bucket/a/"}
    assert RowSpec(**spec.to_dict()) == spec
    plain = OperatorConfig.create("m", "generate")
    with_adapters = OperatorConfig.create("m", "generate", lora_modules={"sql": str(folder)})
    assert plain.engine_fingerprint() != with_adapters.engine_fingerprint()


def _fake_adapter(folder: Path, r: int, **config) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": r, **config}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


def test_engine_options_derived_from_the_adapters(tmp_path):
    many = {f"a{i}": _fake_adapter(tmp_path / f"a{i}", r=4) for i in range(MAX_LORAS_CAP + 1)}
    many["wide"] = _fake_adapter(tmp_path / "wide", r=16, rank_pattern={"q_proj": 20})
    spec = RowSpec("generate", lora_modules=many)
    kwargs = adapter_engine_kwargs({"max_model_len": 64}, spec.adapters)
    assert kwargs == {
        "max_model_len": 64,
        "enable_lora": True,
        "max_loras": MAX_LORAS_CAP,
        "max_cpu_loras": len(many),
        "max_lora_rank": 32,  # rank_pattern's 20, rounded up to a rank the engine takes
    }
    given = {"max_loras": 2, "max_lora_rank": 64, "max_cpu_loras": 3}
    assert adapter_engine_kwargs(given, spec.adapters) == {**given, "enable_lora": True}
    one = RowSpec("generate", lora_modules={"a": many["a0"]})
    assert adapter_engine_kwargs({}, one.adapters)["max_lora_rank"] == 8
    huge = RowSpec("generate", lora_modules={"huge": _fake_adapter(tmp_path / "huge", r=1024)})
    with pytest.raises(RowContractError, match="'huge' has rank 1024, above the largest"):
        adapter_engine_kwargs({}, huge.adapters)


def test_a_bad_adapter_fails_the_engine_build_naming_it(tiny_model_factory, adapters, tmp_path):
    model = str(tiny_model_factory("llama"))
    empty = tmp_path / "empty"
    empty.mkdir()
    config = OperatorConfig.create(
        model, "generate", lora_modules={**adapters, "empty": str(empty)}
    )
    with pytest.raises(
        RowContractError,
        match=r"lora_modules: LoRA adapter 'empty' .*adapter_config.json is missing",
    ):
        config.build_llm()
    # Read and checked against the model as the engine starts: rank 8 above max_lora_rank=1.
    small = OperatorConfig.create(
        model,
        "generate",
        engine_kwargs={"max_lora_rank": 1, "max_model_len": 64},
        lora_modules=adapters,
    )
    with pytest.raises(RowContractError, match=r"lora_modules: LoRA adapter 'sql'.*max_lora_rank"):
        small.build_llm()
