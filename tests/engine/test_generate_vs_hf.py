"""Greedy tokens from the engine equal Hugging Face transformers' for every model family,
whatever the cache size, token budget and prefix caching do to the schedule."""

from __future__ import annotations

import itertools

import pytest

from batchlm.engine import LLM, SamplingParams

from .hf_reference import hf_greedy
from .probes import record_partial_prefills

MAX_TOKENS = 16

WORDS = (
    "river stone glass winter orange planet quiet signal market garden thunder paper "
    "silver engine forest window lantern castle ribbon copper meadow violin harbor "
).split()


def mixed_prompts(tokenizer, n: int = 16) -> list[list[int]]:
    """n prompts of 3 to ~70 tokens."""
    prompts = []
    for i in range(n):
        k = 2 + (i * 7) % 45
        text = " ".join(WORDS[(i + j * 3) % len(WORDS)] for j in range(k))
        prompts.append(tokenizer(text)["input_ids"])
    return prompts


def shared_prefix_prompts(tokenizer, n: int = 16) -> list[list[int]]:
    """n prompts sharing a ~60-token prefix (several full KV blocks), distinct tails."""
    prefix = tokenizer(" ".join(WORDS * 3))["input_ids"][:60]
    return [
        prefix + tokenizer(f" {WORDS[i]} {WORDS[-i]} number {i}")["input_ids"] for i in range(n)
    ]


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


ARCHS = [
    "llama",
    "llama-tied",
    "llama-bias",
    "llama-linear",
    "llama-dynamic",
    "llama3-rope",
    "llama-yarn",
    "mistral-window",
    "qwen2",
    "qwen3",
    "gemma2",  # soft-capped scores and logits, sliding layers between global ones
    "gemma3",  # q / k norms, local and global rotary bases
    "phi3",  # fused checkpoint tensors, LongRoPE switching lengths, partial rotary
    "olmo2",  # norms after attention and MLP, q / k norms over the whole projection
]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_under_every_schedule(arch, tiny_model_factory):
    path = tiny_model_factory(arch)
    ample = LLM(str(path), max_model_len=128, seed=0)
    tok = ample.get_tokenizer()
    prompts = mixed_prompts(tok)
    expected = hf_greedy(path, prompts, MAX_TOKENS)

    # 1. Ample KV cache, default budgets.
    assert run(ample, prompts) == expected
    assert ample.llm_engine.stats().num_preemptions == 0

    # 2. A cache of 10 blocks (160 tokens) for 16 sequences of up to ~86 tokens: the
    # scheduler must preempt and recompute.
    small = LLM(str(path), max_model_len=128, num_gpu_blocks_override=10)
    assert run(small, prompts) == expected
    assert small.llm_engine.stats().num_preemptions > 0
    assert small.llm_engine.kv_cache.num_free_blocks == 10

    # 3. A 16-token step budget: prompts longer than that are prefilled in chunks.
    chunked = LLM(str(path), max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4)
    chunks = record_partial_prefills(chunked)
    assert run(chunked, prompts) == expected
    assert chunks, "no prompt was chunked"


@pytest.mark.parametrize(
    ("arch", "enable_prefix_caching"),
    [
        *itertools.product(["llama", "qwen3", "mistral-window"], [True, False]),
        # Windows and soft-caps over cached prefixes; LongRoPE's long blocks (60+ tokens).
        *((arch, True) for arch in ["gemma2", "phi3"]),
    ],
)
def test_shared_prefixes_with_and_without_prefix_caching(
    arch, enable_prefix_caching, tiny_model_factory
):
    path = tiny_model_factory(arch)
    llm = LLM(
        str(path),
        max_model_len=128,
        enable_prefix_caching=enable_prefix_caching,
        max_num_seqs=4,  # later requests arrive after the prefix blocks are cached
    )
    prompts = shared_prefix_prompts(llm.get_tokenizer())
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert run(llm, prompts) == expected
    stats = llm.llm_engine.stats()
    if enable_prefix_caching:
        # 15 requests reuse at least the 3 full blocks of the shared 60-token prefix.
        assert stats.prefix_cache_hits >= 15 * 48
    else:
        assert stats.prefix_cache_hits == 0
    # Run again: everything (prompts and outputs) is now cached when caching is on.
    assert run(llm, prompts) == expected
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.num_kv_blocks
