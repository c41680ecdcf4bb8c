"""Every adapter batchlm refuses, refused before anything runs with an error naming the
adapter and the setting; the engine then serves a good call with the tokens it gave before.
Also the LoRA options of `LLM(...)` and the calls that take no adapter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchlm.engine import LLM, LoRARequest, SamplingParams
from batchlm.engine.errors import InvalidParamError

from .lora_reference import make_adapter

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 77, 908, 4012, 33]}, {"prompt_token_ids": [1, 9, 15000]}]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def edited_copy(src, dst, config=None, rename=None):
    """A copy of the adapter folder `src` with config keys replaced and weight names
    rewritten (`rename`: old substring → new)."""
    shutil.copytree(src, dst)
    if config:
        path = dst / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if rename:
        weights = load_file(dst / "adapter_model.safetensors")
        old, new = rename
        save_file(
            {k.replace(old, new): v for k, v in weights.items()}, dst / "adapter_model.safetensors"
        )
    return dst


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory):
    """An engine with a good adapter (id 1), the tokens it gives with and without it, and
    the folder of adapters to refuse."""
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("refused-loras")
    good = LoRARequest("good", 1, str(make_adapter(base, root / "good", r=8, seed=1)))
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128)
    before = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[good, None]))
    assert before[0] != tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))[0]
    return base, root, llm, good, before


def refused_folders(base, root):
    """(adapter name, folder, the setting the error must name)."""
    good = root / "good"
    return [
        ("missing", root / "no-such-folder", "is not a folder"),
        ("dora", make_adapter(base, root / "dora", r=8, use_dora=True), "use_dora=True"),
        (
            "saved-modules",
            make_adapter(base, root / "saved", r=8, modules_to_save=["lm_head"]),
            "modules_to_save",
        ),
        ("bias", make_adapter(base, root / "bias", r=8, bias="all"), "bias='all'"),
        ("rank-32", make_adapter(base, root / "rank32", r=32), "rank 32, above max_lora_rank=16"),
        (
            "lacks-module",
            edited_copy(good, root / "lacks", rename=("self_attn.q_proj", "self_attn.query")),
            "'model.layers.0.self_attn.query', a module the base model",
        ),
        (
            "lacks-target",
            edited_copy(good, root / "target", config={"target_modules": ["q_proj", "c_attn"]}),
            "target_modules names 'c_attn'",
        ),
        (
            "lm-head",
            make_adapter(base, root / "head", r=8, target_modules=["lm_head"]),
            "replaces the base model's lm_head weight",
        ),
        (
            "lm-head-weights-only",
            edited_copy(
                good, root / "head-only", rename=("model.layers.0.mlp.down_proj", "lm_head")
            ),
            "'lm_head', which is not a decoder projection",
        ),
        (
            "experts",
            edited_copy(good, root / "experts", config={"target_parameters": ["mlp.experts.w1"]}),
            "LoRA on expert weights",
        ),
        (
            "not-lora",
            edited_copy(good, root / "ia3", config={"peft_type": "IA3"}),
            "peft_type='IA3'",
        ),
    ]


def test_each_refused_adapter_names_itself_and_the_engine_goes_on(served):
    base, root, llm, good, before = served
    for i, (name, folder, setting) in enumerate(refused_folders(base, root)):
        bad = LoRARequest(name, 100 + i, str(folder))
        with pytest.raises(InvalidParamError) as e:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[good, bad])
        message = str(e.value)
        assert f"LoRA adapter {name!r}" in message and setting in message, message
        assert not llm.llm_engine.has_unfinished_requests()
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[good, None])
    assert tokens(got) == before


def test_ids_and_names_must_each_name_one_adapter(served):
    base, root, llm, good, before = served
    with pytest.raises(InvalidParamError, match="lora_int_id=0 must be >= 1"):
        LoRARequest("zero", 0, good.lora_path)
    other = str(root / "good")  # the same folder under another name: still another adapter
    with pytest.raises(
        InvalidParamError, match="lora_int_id=1, which this engine already runs as 'good'"
    ):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("twin", 1, other))
    with pytest.raises(
        InvalidParamError, match="already runs an adapter of that name as lora_int_id=1"
    ):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("good", 2, other))
    with pytest.raises(InvalidParamError, match="got 1 lora_request entries for 2 prompts"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[good])
    with pytest.raises(InvalidParamError, match="lora_request='good' must be a LoRARequest"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request="good")
    assert llm.llm_engine.list_loras() == {1}
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[good, None])
    assert tokens(got) == before


def test_pytorch_bin_weights_and_broken_files(served):
    """adapter_model.bin (read with weights_only=True) serves the same adapter; a truncated
    safetensors file is refused naming the adapter."""
    base, root, llm, good, before = served
    as_bin = shutil.copytree(root / "good", root / "as-bin")
    weights = load_file(as_bin / "adapter_model.safetensors")
    (as_bin / "adapter_model.safetensors").unlink()
    torch.save(weights, as_bin / "adapter_model.bin")
    from_bin = LoRARequest("from-bin", 50, str(as_bin))
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[from_bin, None])
    assert tokens(got) == before
    broken = shutil.copytree(root / "good", root / "broken")
    data = (broken / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidParamError, match="LoRA adapter 'broken'.*cannot read its weights"):
        llm.generate(
            PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("broken", 51, str(broken))
        )
    assert (
        tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[good, None])) == before
    )


def test_lora_options_are_checked(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    cases = [
        (dict(enable_lora=True, max_lora_rank=12), "max_lora_rank=12 must be one of"),
        (dict(enable_lora=True, max_loras=0), "max_loras=0 must be an integer >= 1"),
        (
            dict(enable_lora=True, max_loras=4, max_cpu_loras=2),
            "max_cpu_loras=2 must be >= max_loras=4",
        ),
        (dict(enable_lora=True, lora_dtype="int8"), "lora_dtype='int8'"),
        (dict(enable_lora="yes"), "enable_lora='yes' must be True or False"),
        (dict(max_loras=4), "max_loras=4 configure LoRA adapters, which are off"),
        (dict(enable_lora=True, batch_invariant=True), "batch_invariant=True does not cover LoRA"),
        (
            dict(
                enable_lora=True,
                speculative_config={
                    "method": "draft_model",
                    "model": path,
                    "num_speculative_tokens": 2,
                },
            ),
            "method='draft_model'",
        ),
        (dict(enable_lora=True, runner="pooling", convert="embed"), "pooling models"),
    ]
    for kwargs, message in cases:
        with pytest.raises(
            InvalidParamError, match=message.replace("(", r"\(").replace(")", r"\)")
        ):
            LLM(path, max_model_len=128, **kwargs)


def test_adapters_need_enable_lora_and_a_generation_call(tiny_model_factory, served):
    _, _, _, good, _ = served
    plain = LLM(str(tiny_model_factory("llama")), max_model_len=128)
    with pytest.raises(InvalidParamError, match="built without LoRA adapters.*enable_lora=True"):
        plain.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=good)
    with pytest.raises(InvalidParamError, match="built without LoRA adapters"):
        plain.enqueue(PROMPTS, GREEDY, lora_request=[None, good])
    assert not plain.llm_engine.has_unfinished_requests()
    assert (
        len(tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[None, None]))) == 2
    )
