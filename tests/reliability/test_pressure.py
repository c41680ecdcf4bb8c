"""Pressure and faults inside one engine: an oversubscribed KV cache, ten thousand requests,
interrupts and exceptions in the middle of `generate`, and seeded jobs run twice.

After each: the same tokens as an undisturbed run, no request left in the engine, and every
KV block back in the free pool.
"""

from __future__ import annotations

import gc
import os

import pytest

from batchlm.engine import LLM, SamplingParams

from .conftest import assert_no_leaks

BLOCK_SIZE = 8
MAX_LEN = 32
PROMPTS = [
    f"Entry {i}: the {['copper', 'violet', 'granite', 'harbor'][i % 4]} lantern number {i * 7} "
    "hangs above the old gate"
    for i in range(20)
]
# Every request grows to MAX_LEN tokens: MAX_LEN // BLOCK_SIZE blocks.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    """An ample cache (every request fits at once)."""
    return LLM(str(model_dir), max_model_len=MAX_LEN, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def token_ids(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def assert_engine_empty(llm: LLM) -> None:
    """`assert_no_leaks` plus every per-request table of the engine and runner."""
    assert_no_leaks(llm)
    engine = llm.llm_engine
    assert not engine.outputs.states
    assert not engine._stash and not engine._parents and not engine._child_parent
    assert not engine.scheduler.running and not engine.scheduler.waiting
    # Seeded requests' generators are dropped when the next step announces them finished.
    assert set(engine.runner.request_generators) <= engine.scheduler.finished_request_ids


# ---- an oversubscribed cache -------------------------------------------------------------------


def test_cache_oversubscribed_20x_gives_the_same_tokens(model_dir, reference):
    num_blocks = MAX_LEN // BLOCK_SIZE  # the least that max_model_len allows
    small = LLM(
        str(model_dir),
        max_model_len=MAX_LEN,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=num_blocks,
    )
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    needed = sum(
        -(-(len(o.prompt_token_ids) + len(o.outputs[0].token_ids)) // BLOCK_SIZE) for o in outs
    )
    assert needed >= 20 * num_blocks, f"{needed} blocks asked of {num_blocks}"
    assert small.llm_engine.scheduler.num_preemptions > 0, "the cache was never short"
    assert_engine_empty(small)
    small.shutdown()


# ---- ten thousand requests ---------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory, tokenizer_files):
    """The smallest Llama that still runs every code path (one layer, SmolLM2's tokenizer):
    ten thousand requests go through it in seconds."""
    import shutil

    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("one-layer")
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    for f in tokenizer_files:
        shutil.copy(f, out / f.name)
    return out


def test_ten_thousand_requests_keep_memory_flat(one_layer_dir):
    llm = LLM(str(one_layer_dir), max_model_len=MAX_LEN, block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    per_call, num_calls = 500, 20
    settled = 0
    for call in range(num_calls):
        prompts = [f"Request {call * per_call + i}: item {i % 37}" for i in range(per_call)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert len(outs) == per_call and all(len(o.outputs[0].token_ids) == 2 for o in outs)
        del outs
        if call == 1:  # 1,000 requests: caches and allocator pools are warm
            gc.collect()
            settled = _rss_bytes()
    gc.collect()
    final = _rss_bytes()
    assert final <= settled * 1.05, (
        f"resident memory grew from {settled / 2**20:.1f} MiB after 1,000 requests to "
        f"{final / 2**20:.1f} MiB after {per_call * num_calls:,}"
    )
    assert_engine_empty(llm)
    llm.shutdown()


# ---- interrupts and exceptions during generate -------------------------------------------------


class Fault(Exception):
    """An ordinary error from inside a step (a stand-in for a device error)."""


def _fail_on_step(monkeypatch, llm: LLM, step: int, error: BaseException, after: bool = False):
    """Make the `step`-th model execution from now raise `error`, before it computes
    anything, or with `after`, once it has (the results are then lost)."""
    engine = llm.llm_engine
    real = engine._execute_model
    calls = {"n": 0}

    def execute(scheduler_output, grammar=None):
        calls["n"] += 1
        if calls["n"] == step and not after:
            raise error
        out = real(scheduler_output, grammar)
        if calls["n"] == step:
            raise error
        return out

    monkeypatch.setattr(engine, "_execute_model", execute)
    return calls


@pytest.mark.parametrize(
    ("error", "step", "after"),
    [
        (KeyboardInterrupt(), 1, False),  # during the first prefill: nothing computed yet
        (KeyboardInterrupt(), 4, False),  # mid-decode
        (KeyboardInterrupt(), 3, True),  # the step ran, its tokens are lost
        (Fault("device fell over"), 1, False),
        (Fault("device fell over"), 6, True),
    ],
    ids=[
        "interrupt-prefill",
        "interrupt-decode",
        "interrupt-after-step",
        "error-prefill",
        "error-after-step",
    ],
)
def test_interrupted_generate_leaves_the_engine_usable(
    monkeypatch, llm, reference, error, step, after
):
    llm.reset_prefix_cache()  # the failing step computes the prompts, not the cache
    calls = _fail_on_step(monkeypatch, llm, step, error, after)
    with pytest.raises(type(error)):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert calls["n"] == step
    monkeypatch.undo()
    assert_engine_empty(llm)
    # Prefix caching is on: blocks hashed for the failed step must not be reused.
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert_engine_empty(llm)


def test_interrupt_mid_chunked_prefill_keeps_only_computed_prefix_blocks(monkeypatch, model_dir):
    """A long prompt prefilled 16 tokens a step: the chunks before the interrupt stay in the
    prefix cache (they were computed), the interrupted chunk's blocks do not."""
    llm = LLM(str(model_dir), max_model_len=128, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    prompt = {"prompt_token_ids": [(i * 37) % 5000 + 100 for i in range(100)]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = token_ids(llm.generate([prompt], params, use_tqdm=False))
    llm.reset_prefix_cache()
    _fail_on_step(monkeypatch, llm, 3, KeyboardInterrupt())  # chunks 1, 2 ran; 3 did not
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], params, use_tqdm=False)
    monkeypatch.undo()
    assert_engine_empty(llm)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert token_ids([again]) == expected
    assert again.num_cached_tokens == 32, "only the two computed chunks may be reused"
    assert_engine_empty(llm)
    llm.shutdown()


def test_interrupt_with_enqueued_requests_and_n_samples(monkeypatch, llm, reference):
    """Requests queued earlier and n > 1 parents are dropped with the interrupted call; the
    queue API and sampling with n still work afterwards."""
    llm.enqueue(PROMPTS[:5], GREEDY)
    _fail_on_step(monkeypatch, llm, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.wait_for_completion(use_tqdm=False)
    monkeypatch.undo()
    assert_engine_empty(llm)
    _fail_on_step(monkeypatch, llm, 2, Fault("boom"))
    with pytest.raises(Fault):
        llm.generate(PROMPTS[:3], SamplingParams(n=3, temperature=0.0, max_tokens=8, seed=1))
    monkeypatch.undo()
    assert_engine_empty(llm)
    llm.enqueue(PROMPTS[:5], GREEDY)
    assert token_ids(llm.wait_for_completion(use_tqdm=False)) == reference[:5]
    assert_engine_empty(llm)


# ---- determinism -------------------------------------------------------------------------------


def _seeded_job(llm: LLM) -> list[tuple[list[int], str]]:
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=i) for i in range(8)]
    outs = llm.generate(PROMPTS[:8], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


def test_the_same_seeded_job_gives_the_same_outputs_twice(monkeypatch, model_dir, llm):
    first = _seeded_job(llm)
    assert len({tuple(ids) for ids, _ in first}) > 1, "the samples should differ per seed"
    assert _seeded_job(llm) == first
    # An interrupted run in between changes nothing.
    _fail_on_step(monkeypatch, llm, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _seeded_job(llm)
    monkeypatch.undo()
    assert _seeded_job(llm) == first
    # Unseeded requests follow the engine's seed: two fresh engines agree.
    unseeded = SamplingParams(temperature=1.0, max_tokens=10)

    def fresh_run() -> list[list[int]]:
        engine = LLM(str(model_dir), max_model_len=MAX_LEN, block_size=BLOCK_SIZE, seed=7)
        try:
            return token_ids(engine.generate(PROMPTS[:8], unseeded, use_tqdm=False))
        finally:
            engine.shutdown()

    assert fresh_run() == fresh_run()
    assert_engine_empty(llm)
