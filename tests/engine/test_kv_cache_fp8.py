"""`kv_cache_dtype="fp8"`: the paged KV cache in float8_e4m3fn (scale 1.0, clamped to ±448).

Agreement with a full-precision cache is measured teacher-forced, as in test_quantization:
every prompt position is scored once (prompt logprobs) and the most likely next token is
compared. The prompts are prefilled in chunks of 16 tokens, so most positions attend over
keys and values read back from the fp8 cache (the later chunks' paged path), not only over
the fresh chunk's own. The Triton backend (under the interpreter on CPU) generates the same
greedy tokens as the torch backend over an fp8 cache.
"""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams  # noqa: E402
from batchlm.engine.errors import InvalidParamError  # noqa: E402

from .test_quantization import TEXTS  # noqa: E402

FP8 = torch.float8_e4m3fn
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
CHUNKED = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=16,  # chunked prefill: later chunks read the cache
    num_gpu_blocks_override=64,
    enable_prefix_caching=False,
    seed=0,
)
# Measured (CPU, float32 model, torch backend, 228 positions of the eight texts): the most
# likely token with an fp8 cache agrees with the float32 cache's on 95.6% (SmolLM2-135M)
# and 90.8% (the tiny random llama, whose logits are nearly tied) of the positions; a
# bfloat16 cache agrees on 100% of both.
MIN_AGREEMENT = {"smollm2": 0.92, "tiny": 0.85}


def _argmaxes(llm: LLM) -> list[int]:
    outs = llm.generate(TEXTS, SCORE, use_tqdm=False)
    return [
        next(t for t, lp in entry.items() if lp.rank == 1)
        for out in outs
        for entry in out.prompt_logprobs[1:]
    ]


@pytest.mark.parametrize("model", ["smollm2", "tiny"])
def test_fp8_cache_agrees_with_full_precision(model, smollm2_dir, tiny_model_factory):
    path = str(smollm2_dir if model == "smollm2" else tiny_model_factory("llama"))
    llm = LLM(path, **CHUNKED)
    assert llm.llm_engine.runner.kv_caches[0].dtype == torch.float32
    expected = _argmaxes(llm)
    llm.shutdown()
    llm = LLM(path, kv_cache_dtype="fp8", **CHUNKED)
    assert all(cache.dtype == FP8 for cache in llm.llm_engine.runner.kv_caches)
    got = _argmaxes(llm)
    llm.shutdown()
    assert len(got) == len(expected) == 228
    agreement = sum(a == b for a, b in zip(got, expected, strict=True)) / len(got)
    assert agreement >= MIN_AGREEMENT[model], agreement
    assert agreement < 1.0  # the cache really is fp8: some near-ties flip


def test_triton_backend_matches_torch_backend_over_fp8(tiny_model_factory):
    """Same rounded keys and values, same greedy tokens: prefill (whole and chunked) and
    decode kernels over the fp8 cache, against the torch backend's paths."""
    path = str(tiny_model_factory("llama"))
    options = dict(
        kv_cache_dtype="fp8_e4m3",
        dtype="float32",
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        seed=0,
    )
    prompts = [TEXTS[0][:40], TEXTS[2][:70], TEXTS[5][:25]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, attention_backend=backend, **options)
        assert llm.llm_engine.runner.kv_caches[0].dtype == FP8
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 8 for t in tokens["torch"])


def test_fp8_cache_doubles_the_blocks(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    budget = 1 << 20
    blocks = {}
    for kv_cache_dtype in ("bfloat16", "fp8", "auto"):  # auto: the float32 model's dtype
        llm = LLM(path, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget)
        runner = llm.llm_engine.runner
        blocks[kv_cache_dtype] = runner.kv_caches[0].shape[1]
        assert blocks[kv_cache_dtype] == budget // runner.block_bytes
        llm.shutdown()
    assert blocks["fp8"] == 2 * blocks["bfloat16"] == 4 * blocks["auto"]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "match"),
    [
        ("fp8_e5m2", r"kv_cache_dtype='fp8_e5m2' is not supported: the fp8 KV cache is e4m3"),
        ("int8", r"kv_cache_dtype='int8' is not supported; use one of 'auto', 'fp8', 'fp8_e4m3'"),
        (8, r"kv_cache_dtype=8 must be a string"),
    ],
)
def test_bad_kv_cache_dtype_is_named(tiny_model_factory, kv_cache_dtype, match):
    with pytest.raises(InvalidParamError, match=match):
        LLM(str(tiny_model_factory("llama")), kv_cache_dtype=kv_cache_dtype)


def test_pooling_models_refuse_an_fp8_cache(tiny_model_factory):
    with pytest.raises(InvalidParamError, match="pooling models .* keep no KV cache"):
        LLM(
            str(tiny_model_factory("llama")),
            runner="pooling",
            convert="embed",
            kv_cache_dtype="fp8",
        )
