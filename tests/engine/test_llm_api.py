"""The `LLM` surface beyond plain generate: the queue API, n > 1, constructor options,
and a matrix of bad inputs after each of which the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tqdm.auto import tqdm

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import (
    InvalidParamError,
    InvalidPromptError,
    ModelNotFoundError,
    UnsupportedModelError,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["red green blue", "one two three four five", "the quick brown fox", "hello"]


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(str(llama), max_model_len=128)


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_queue_api_matches_generate(llm):
    expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    first = llm.enqueue(PROMPTS[:2], GREEDY)
    second = llm.enqueue(PROMPTS[2:], [GREEDY, GREEDY])
    assert len(set(first + second)) == 4
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == first + second
    assert token_ids(outs) == token_ids(expected)
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_generate_while_requests_are_enqueued(llm):
    queued = llm.enqueue(PROMPTS[:2], GREEDY)
    now = llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)
    later = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in later] == queued
    expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(later + now) == token_ids(expected)


def test_n_samples_are_independent_seeded_and_share_the_prompt(llama):
    llm = LLM(str(llama), max_model_len=128, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": list(range(100, 164))}  # 64 tokens = 4 full blocks
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) == 4  # independent draws differ
    # Siblings reuse the first one's blocks: 3 siblings x 3 full blocks (the last prompt
    # token is always recomputed) even though prefix caching is off.
    assert llm.llm_engine.stats().prefix_cache_hits == 3 * 48
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples
    # The sharing stays private to one prompt's samples.
    hits = llm.llm_engine.stats().prefix_cache_hits
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats().prefix_cache_hits == hits
    # Sample i with seed s equals a single request seeded s + i.
    single = SamplingParams(temperature=1.0, seed=13, max_tokens=8, ignore_eos=True)
    assert llm.generate([prompt], single, use_tqdm=False)[0].outputs[0].token_ids == samples[2]
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.num_kv_blocks


def test_unknown_option_is_a_type_error_listing_valid_ones(llama):
    with pytest.raises(TypeError, match="max_num_seq.*valid ones.*max_num_seqs"):
        LLM(str(llama), max_num_seq=4)


def test_dtype_auto_is_float32_on_cpu(llm):
    assert llm.llm_engine.config.model.dtype == torch.float32


def test_config_dtype_is_read_without_the_deprecated_alias():
    """transformers 5 keeps `torch_dtype` as an alias of `dtype` that logs a deprecation
    warning when read: a config without a dtype must not read it; an older config that
    stores `torch_dtype` itself is still understood."""
    from batchlm.engine.config import config_torch_dtype

    class Current:
        dtype = None

        @property
        def torch_dtype(self):
            raise AssertionError("read the deprecated alias")

    class Older:
        def __init__(self) -> None:
            self.torch_dtype = "bfloat16"

    assert config_torch_dtype(Current()) is None
    assert config_torch_dtype(Older()) is torch.bfloat16


def test_revision_picks_a_local_snapshot(llama, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny"
    for rev, commit in (("main", "a" * 40), ("v2", "b" * 40)):
        shutil.copytree(llama, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / rev).write_text(commit)
    # Make the v2 snapshot distinguishable: a different max_position_embeddings.
    cfg_path = repo / "snapshots" / ("b" * 40) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 96
    cfg_path.write_text(json.dumps(cfg))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert LLM("acme/tiny").llm_engine.config.model.max_model_len == 256
    assert LLM("acme/tiny", revision="v2").llm_engine.config.model.max_model_len == 96
    assert LLM("acme/tiny", revision="bbbbbbb").llm_engine.config.model.max_model_len == 96
    with pytest.raises(ModelNotFoundError, match="revision='v3'.*available.*main.*v2"):
        LLM("acme/tiny", revision="v3")


def test_skip_tokenizer_init_serves_token_ids_only(llama, llm):
    bare = LLM(str(llama), max_model_len=128, skip_tokenizer_init=True)
    assert bare.get_tokenizer() is None
    ids = llm.get_tokenizer()(PROMPTS[0])["input_ids"]
    out = bare.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0].outputs[0]
    expected = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected.token_ids and out.text == ""
    with pytest.raises(InvalidPromptError, match="skip_tokenizer_init"):
        bare.generate(PROMPTS[0], GREEDY, use_tqdm=False)


def test_an_unsupported_architecture_names_what_each_runner_takes(llama, tmp_path):
    import transformers

    folder = tmp_path / "gpt2"
    transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(folder)
    with pytest.raises(UnsupportedModelError) as e:
        LLM(str(folder), skip_tokenizer_init=True)
    message = str(e.value)
    assert "'GPT2LMHeadModel' is not supported" in message
    assert "Generation takes Gemma2ForCausalLM" in message  # the list, sorted
    assert "LlamaForCausalLM" in message and "BertModel" in message
    assert "cannot be used for pooling" not in message
    # A config.json whose values its transformers class refuses (Falcon computes head_dim).
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon", "head_dim": 8})
    )
    with pytest.raises(UnsupportedModelError, match=r"cannot read .*config\.json.*head_dim"):
        LLM(str(folder), skip_tokenizer_init=True)


def test_remote_code_checkpoint_is_refused(llama, tmp_path):
    folder = tmp_path / "custom"
    shutil.copytree(llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="acme-net", architectures=["AcmeForCausalLM"])
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="never runs code"):
        LLM(str(folder), trust_remote_code=True)


def test_truncate_prompt_tokens_keeps_the_end(llm):
    ids = list(range(200, 260))
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=10
    )
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-10:]
    plain = llm.generate([{"prompt_token_ids": ids[-10:]}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids[:4]


def test_reset_prefix_cache(llm):
    llm.generate([{"prompt_token_ids": list(range(300, 340))}], GREEDY, use_tqdm=False)
    assert llm.llm_engine.kv_cache.pool.cached
    assert llm.reset_prefix_cache() is True
    assert not llm.llm_engine.kv_cache.pool.cached


BAD_INPUTS = [
    ("empty string", lambda: ([""], None), InvalidPromptError, r"prompts\[0\] is empty"),
    # vLLM's prompt keys that batchlm does not act on: refused, never run as text alone.
    (
        "multi_modal_data",
        lambda: (["ok", {"prompt": "a cat", "multi_modal_data": {"image": b"..."}}], None),
        InvalidPromptError,
        r"prompts\[1\] has the key 'multi_modal_data': images, audio and video",
    ),
    (
        "mm_processor_kwargs",
        lambda: ([{"prompt": "a", "mm_processor_kwargs": {}}], None),
        InvalidPromptError,
        "'mm_processor_kwargs'",
    ),
    (
        "cache_salt",
        lambda: ([{"prompt_token_ids": [5, 6], "cache_salt": "x"}], None),
        InvalidPromptError,
        "'cache_salt': per-request prefix-cache salts are not supported",
    ),
    (
        "prompt_embeds",
        lambda: ([{"prompt_embeds": torch.zeros(2, 64)}], None),
        InvalidPromptError,
        "'prompt_embeds': embedding inputs are not supported",
    ),
    (
        "unknown key",
        lambda: ([{"prompt": "a", "promt": "b"}], None),
        InvalidPromptError,
        r"'promt': it is not a prompt key; a prompt dict takes only \['prompt', 'prompt_token_ids'\]",
    ),
    ("empty ids", lambda: ([{"prompt_token_ids": []}], None), InvalidPromptError, "empty"),
    (
        "too long",
        lambda: (["ok", {"prompt_token_ids": [5] * 129}], None),
        InvalidPromptError,
        r"prompts\[1\] has 129 tokens.*max_model_len=128",
    ),
    (
        "id outside vocab",
        lambda: ([{"prompt_token_ids": [1, 49152]}], None),
        InvalidPromptError,
        "token id 49152 outside the vocabulary",
    ),
    (
        "negative id",
        lambda: ([{"prompt_token_ids": [-1]}], None),
        InvalidPromptError,
        "token id -1",
    ),
    ("int prompt", lambda: ([42, "a"], None), InvalidPromptError, r"prompts\[0\] is a int"),
    ("dict without prompt", lambda: ([{"text": "x"}], None), InvalidPromptError, "needs 'prompt'"),
    (
        "ids not ints",
        lambda: ([{"prompt_token_ids": ["a"]}], None),
        InvalidPromptError,
        "list of ints",
    ),
    (
        "params count mismatch",
        lambda: (["a", "b"], [GREEDY]),
        InvalidParamError,
        "got 1 sampling_params for 2 prompts",
    ),
    (
        "params wrong type",
        lambda: (["a"], {"temperature": 0}),
        InvalidParamError,
        "SamplingParams",
    ),
    (
        "stop token outside vocab",
        lambda: (["a"], SamplingParams(stop_token_ids=[10**6])),
        InvalidParamError,
        "stop_token_ids",
    ),
    (
        "logit bias outside vocab",
        lambda: (["a"], SamplingParams(logit_bias={10**6: 1.0})),
        InvalidParamError,
        "logit_bias",
    ),
    (
        "allowed ids outside vocab",
        lambda: (["a"], SamplingParams(allowed_token_ids=[10**6])),
        InvalidParamError,
        "allowed_token_ids",
    ),
    (
        "truncation over max len",
        lambda: (["a"], SamplingParams(truncate_prompt_tokens=1000)),
        InvalidParamError,
        "truncate_prompt_tokens=1000",
    ),
]


@pytest.mark.parametrize("name,make,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_and_the_engine_keeps_serving(llm, name, make, exc, match):
    prompts, params = make()
    with pytest.raises(exc, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["still serving"], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1}, "temperature=-1"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_p": 0}, "top_p=0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"n": 0}, "n=0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens=5"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs=-1"),
    ],
)
def test_bad_sampling_params_raise_at_construction(kwargs, match):
    with pytest.raises(InvalidParamError, match=match):
        SamplingParams(**kwargs)


def test_constructor_chat_template_from_file(llama, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    llm = LLM(str(llama), max_model_len=128, chat_template=str(template))
    out = llm.chat([{"role": "user", "content": "hi there"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "[user] hi there\n[assistant]"
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok(out.prompt, add_special_tokens=False)["input_ids"]
    with pytest.raises(InvalidParamError):
        LLM(str(llama), max_model_len=128, chat_template=str(tmp_path / "missing.jinja"))


def test_vllm_call_options_run_unchanged_at_their_defaults(llm):
    """vLLM code passes `lora_request=None`, `priority=None` or a tqdm factory: the same
    tokens as without them; priorities are refused, naming the value, and so is anything but
    a LoRARequest (adapters themselves: tests/engine/test_lora*.py)."""
    made = []

    def bar(**kwargs):
        made.append(kwargs)
        return tqdm(**kwargs, disable=True)

    prompts = ["one two", "three four five"]
    plain = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=bar, lora_request=None)) == plain
    assert made and made[0]["total"] == 2
    llm.enqueue(prompts, GREEDY, lora_request=None, priority=None)
    assert token_ids(llm.wait_for_completion(use_tqdm=False)) == plain
    with pytest.raises(InvalidParamError, match="lora_request='my-adapter' must be a LoRARequest"):
        llm.generate(prompts, GREEDY, lora_request="my-adapter")
    with pytest.raises(InvalidParamError, match=r"priority=\[1, 0\]"):
        llm.enqueue(prompts, GREEDY, priority=[1, 0])
    with pytest.raises(InvalidParamError, match="lora_request"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, lora_request="my-adapter")
    assert not llm.llm_engine.has_unfinished_requests()
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == plain


def test_enqueue_shows_the_requests_being_added(llm):
    made = []

    class Bar:
        def __init__(self, total, desc, unit):
            self.total, self.desc, self.n, self.closed = total, desc, 0, False
            made.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    ids = llm.enqueue(PROMPTS, GREEDY, use_tqdm=Bar)
    (bar,) = made
    assert (bar.total, bar.n, bar.desc, bar.closed) == (4, 4, "Adding requests", True)
    assert [o.request_id for o in llm.wait_for_completion(use_tqdm=False)] == ids
