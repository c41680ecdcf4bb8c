"""A checkpoint's `generation_config.json`, read as vLLM reads it: every end-of-generation id
stops a request (as Hugging Face `generate` stops on them), and its sampling values are the
defaults of calls that pass no `SamplingParams`; `generation_config="vllm"` ignores it."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.engine_args import EngineArgs
from batchlm.engine.errors import InvalidParamError

PROMPT = "List three colours:"
NUM_TOKENS = 24


def _copy_model(source: Path, target: Path, generation_config: dict | None) -> Path:
    """`source` under a new name (weights linked, not copied), with `generation_config`."""
    target.mkdir()
    for f in source.iterdir():
        if f.name == "generation_config.json":
            continue
        if f.suffix == ".safetensors":
            (target / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy(f, target / f.name)
    if generation_config is not None:
        (target / "generation_config.json").write_text(json.dumps(generation_config))
    return target


@pytest.fixture(scope="module")
def free_run(smollm2_dir):
    """SmolLM2's greedy tokens with no end-of-generation id at all."""
    llm = LLM(str(smollm2_dir), max_model_len=256, generation_config="vllm")
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    )[0]
    tokens = out.outputs[0].token_ids
    llm.shutdown()
    return out.prompt_token_ids, tokens


@pytest.fixture(scope="module")
def stop_model(smollm2_dir, free_run, tmp_path_factory):
    """SmolLM2 whose generation config adds, as an end-of-generation id, a token its greedy
    run reaches after a few tokens (and never before)."""
    _, tokens = free_run
    k = next(i for i in range(4, NUM_TOKENS) if tokens[i] not in tokens[:i] and tokens[i] != 2)
    folder = tmp_path_factory.mktemp("gen") / "smollm2-stop"
    _copy_model(smollm2_dir, folder, {"bos_token_id": 1, "eos_token_id": [2, tokens[k]]})
    return folder, k


@pytest.mark.slow
def test_every_end_of_generation_id_stops_as_hf_generate_does(stop_model, free_run):
    from transformers import AutoModelForCausalLM

    folder, k = stop_model
    prompt_ids, tokens = free_run
    llm = LLM(str(folder), max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == tokens[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    # The id stays in token_ids and out of the text, as the tokenizer's EOS does.
    assert out.text == llm.get_tokenizer().decode(tokens[:k], skip_special_tokens=True)
    assert tokens[k] in llm.llm_engine.eos_token_ids and 2 in llm.llm_engine.eos_token_ids

    # Hugging Face generate reads the same file and stops on the same token.
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        gen = hf.generate(ids, max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)
    assert gen[0, len(prompt_ids) :].tolist() == out.token_ids

    # min_tokens holds back every end-of-generation id, ignore_eos none of them stop.
    held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=k + 3, min_tokens=k + 2))
    assert tokens[k] not in held[0].outputs[0].token_ids[: k + 2]
    free = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    )
    assert free[0].outputs[0].token_ids == tokens
    llm.shutdown()

    # generation_config="vllm": the file is ignored, the request runs to max_tokens.
    plain = LLM(str(folder), max_model_len=256, generation_config="vllm")
    out = plain.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == tokens and out.finish_reason == "length"
    assert plain.llm_engine.eos_token_ids == (2,)
    plain.shutdown()


DEFAULTS_FILE = {
    "eos_token_id": 2,
    "temperature": 0.0,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.3,
    "max_new_tokens": 5,
}


@pytest.fixture(scope="module")
def defaults_llm(tiny_model_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen") / "tiny-defaults"
    _copy_model(tiny_model_factory("llama"), folder, DEFAULTS_FILE)
    llm = LLM(str(folder), max_model_len=128)
    yield llm
    llm.shutdown()


def test_default_sampling_params_come_from_the_file(defaults_llm, tiny_model_factory):
    defaults = defaults_llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 0.9, 20)
    assert (defaults.min_p, defaults.repetition_penalty, defaults.max_tokens) == (0.05, 1.3, 5)
    assert defaults_llm.get_default_sampling_params() is not defaults  # a new object each call
    plain = LLM(str(tiny_model_factory("llama")), max_model_len=128, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    plain.shutdown()


def test_calls_without_params_use_the_defaults(defaults_llm):
    prompts = ["red green blue", "one two three four"]
    explicit = SamplingParams(**{**_sampling(DEFAULTS_FILE), "ignore_eos": False})
    expected = [o.outputs[0].token_ids for o in defaults_llm.generate(prompts, explicit)]
    assert all(len(t) <= 5 for t in expected)
    got = defaults_llm.generate(prompts)
    assert [o.outputs[0].token_ids for o in got] == expected
    ids = defaults_llm.enqueue(prompts)
    assert [o.outputs[0].token_ids for o in defaults_llm.wait_for_completion()] == expected
    assert len(ids) == 2
    chat = defaults_llm.chat([{"role": "user", "content": "hi"}])
    assert len(chat[0].outputs[0].token_ids) <= 5


def test_rows_without_sampling_params_use_the_defaults(defaults_llm):
    from batchlm.operators.rows import RowSpec, process_table

    prompts = ["red green blue", "one two three four"]
    table = pa.table({"prompt": prompts})
    out = process_table(defaults_llm, RowSpec(task="generate"), table)
    expected = defaults_llm.generate(prompts)
    assert out.column("generated_text").to_pylist() == [o.outputs[0].text for o in expected]
    assert out.column("num_output_tokens").to_pylist() == [
        len(o.outputs[0].token_ids) for o in expected
    ]


def _sampling(values: dict) -> dict:
    names = {"max_new_tokens": "max_tokens"}
    return {names.get(k, k): v for k, v in values.items() if k != "eos_token_id"}


def test_generation_config_option_is_checked(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    with pytest.raises(InvalidParamError, match="no generation_config.json there"):
        LLM(model, generation_config=str(tmp_path))
    bad = _copy_model(Path(model), tmp_path / "bad", {"temperature": -1.0})
    with pytest.raises(InvalidParamError, match="generation_config='vllm'"):
        LLM(str(bad))
    # A folder holding a file: its values, whatever the model's own.
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    llm = LLM(model, max_model_len=128, generation_config=str(other))
    assert llm.get_default_sampling_params().max_tokens == 3
    llm.shutdown()


# ---- the constructor's named parameters ---------------------------------------------------

NAMED = (
    "runner",
    "convert",
    "tokenizer",
    "skip_tokenizer_init",
    "trust_remote_code",
    "tensor_parallel_size",
    "dtype",
    "quantization",
    "revision",
    "tokenizer_revision",
    "seed",
    "gpu_memory_utilization",
    "enforce_eager",
    "max_model_len",
    "chat_template",
    "return_sampling_mask",
    "spec_method",
    "spec_model",
    "generation_config",
    "disable_log_stats",
)


def test_constructor_names_its_parameters():
    params = inspect.signature(LLM.__init__).parameters
    assert list(params)[:2] == ["self", "model"]
    for name in NAMED:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    # Their defaults are the engine arguments' own (disable_log_stats: None, decided by
    # metrics_port).
    engine_defaults = {f.name: f.default for f in EngineArgs.__dataclass_fields__.values()}
    for name, param in params.items():
        if param.kind is inspect.Parameter.KEYWORD_ONLY and name != "disable_log_stats":
            assert param.default == engine_defaults[name], name
    assert params["disable_log_stats"].default is None
    for name in NAMED:
        assert f"    {name}:" in LLM.__doc__, f"{name} is not documented"


def test_unknown_constructor_argument_lists_the_valid_ones(tiny_model_factory):
    with pytest.raises(TypeError, match="valid ones:.*max_num_seqs"):
        LLM(str(tiny_model_factory("llama")), max_num_sequences=4)
