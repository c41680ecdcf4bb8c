"""Sleep mode on the CPU, as vLLM 0.26 documents it (`LLM(enable_sleep_mode=True)`):
`sleep(level=1)` keeps the weights in host memory and frees the KV cache, `sleep(level=2)`
drops the weights, `wake_up(tags=...)` restores them (level 2: read again from the
checkpoint), `is_sleeping()` says so, `sleep` / `wake_up` return None; outputs after
waking equal those before. Memory released on the device is measured on the GPU
(test_sleep_mode_gpu.py, benchmarks/sleep_mode.py); here every device tensor of every
rank is checked to be empty while asleep."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import EngineSleepingError, InvalidParamError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["red green blue", "one two three four five", "the quick brown fox"]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def param_elements(worker) -> list[int]:
    """The element count of every weight of a rank (0 while asleep), read on the rank."""
    runner = worker.model_runner
    if runner.model is None:
        return []
    return [p.numel() for p in runner.model.parameters()]


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(llama):
    llm = LLM(str(llama), max_model_len=128, enable_sleep_mode=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def expected(llm):
    return tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_everything_and_waking_gives_the_same_outputs(llm, expected, level):
    runner = llm.llm_engine.runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert llm.sleep(level=level) is None
    assert llm.is_sleeping() is True and llm.llm_engine.is_sleeping()
    assert runner.kv_caches == [] and runner.decode_graphs is None and runner.buffers is None
    if level == 1:
        assert all(n == 0 for n in param_elements(llm.llm_engine.executor.driver_worker))
        held = runner.sleep_state._host
        assert sum(c.nbytes for c in held) >= weights  # the weights, on the host
    else:
        assert runner.model is None and runner.sleep_state._host == []
    assert llm.llm_engine.kv_cache.pool.cached == {}  # the prefix cache starts over
    with pytest.raises(EngineSleepingError, match="asleep.*wake_up"):
        llm.generate(PROMPTS, GREEDY)
    assert llm.wake_up() is None
    assert llm.is_sleeping() is False
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_partial_wake_ups_and_vllms_reload_recipe(llm, expected):
    runner = llm.llm_engine.runner
    llm.sleep(level=1)
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping() and runner.kv_caches and param_elements_zero(runner)
    with pytest.raises(EngineSleepingError, match="weights freed"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    # vLLM's level-2 recipe: weights first, reload_weights on every worker, then the cache.
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.collective_rpc("reload_weights") == [None]
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def param_elements_zero(runner) -> bool:
    return all(p.numel() == 0 for p in runner.model.parameters())


def test_requests_pending_at_sleep_abort_wait_or_keep(llm, expected):
    # abort: the enqueued requests end; their outputs come back, finish reason "abort".
    ids = llm.enqueue(PROMPTS, GREEDY)
    llm.sleep(level=1)
    with pytest.raises(EngineSleepingError):
        llm.wait_for_completion(use_tqdm=False)
    llm.wake_up()
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    # wait: they run to the end before the sleep.
    llm.enqueue(PROMPTS, GREEDY)
    llm.sleep(level=1, mode="wait")
    llm.wake_up()
    assert tokens(llm.wait_for_completion(use_tqdm=False)) == expected
    # keep: running requests lose their KV cache and are computed again after waking;
    # requests enqueued while asleep wait for it too.
    llm.enqueue(PROMPTS[:2], GREEDY)
    for _ in range(2):
        llm.llm_engine.step()
    assert llm.llm_engine.scheduler.running
    llm.sleep(level=2, mode="keep")
    assert not llm.llm_engine.scheduler.running
    llm.enqueue(PROMPTS[2:], GREEDY)
    llm.wake_up()
    assert tokens(llm.wait_for_completion(use_tqdm=False)) == expected


def test_level_zero_pauses_scheduling_without_sleep_mode(llama):
    llm = LLM(str(llama), max_model_len=128)
    want = tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    llm.sleep(level=0)
    assert llm.is_sleeping()
    queued = llm.enqueue(PROMPTS[:1], GREEDY)
    with pytest.raises(EngineSleepingError, match=r"paused.*wake_up\(tags=\['scheduling'\]\)"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.wake_up(tags=["scheduling"])
    assert not llm.is_sleeping()
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == queued and tokens(outs) == want
    with pytest.raises(InvalidParamError, match="enable_sleep_mode=True"):
        llm.sleep(level=1)
    assert not llm.is_sleeping()
    llm.shutdown()


def test_bad_calls_are_refused_and_repeats_change_nothing(llm, expected):
    with pytest.raises(InvalidParamError, match="sleep level is 0"):
        llm.sleep(level=3)
    with pytest.raises(InvalidParamError, match="Invalid pause mode: later"):
        llm.sleep(mode="later")
    with pytest.raises(InvalidParamError, match=r"unknown tag\(s\) \['kv'\]"):
        llm.wake_up(tags=["kv"])
    assert not llm.is_sleeping()
    llm.wake_up()  # not asleep: nothing to do
    llm.sleep(level=1)
    llm.sleep(level=2)  # already asleep: ignored, the level-1 copy is kept
    assert llm.llm_engine.runner.sleep_state.level == 1
    llm.wake_up(tags=["weights", "weights"])
    llm.wake_up(tags=["weights"])  # not asleep any more: a warning, nothing else
    llm.wake_up(tags=["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="two ranks on CUDA need two GPUs (on the CPU they run over gloo)",
)
def test_two_ranks_sleep_and_wake_together(llama):
    llm = LLM(str(llama), max_model_len=128, tensor_parallel_size=2, enable_sleep_mode=True)
    try:
        want = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        for level in (1, 2):
            llm.sleep(level=level)
            per_rank = llm.collective_rpc(param_elements)
            if level == 1:  # every weight of both ranks emptied, kept in host memory
                assert all(rank and all(n == 0 for n in rank) for rank in per_rank)
            else:  # dropped
                assert per_rank == [[], []]
            assert llm.collective_rpc(lambda w: w.model_runner.kv_caches) == [[], []]
            llm.wake_up()
            assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    finally:
        llm.shutdown()


def test_pooling_model_sleeps_and_gives_the_same_embeddings():
    llm = LLM("sentence-transformers/all-MiniLM-L6-v2", enable_sleep_mode=True)
    texts = ["A man is eating food.", "hello"]
    want = llm.embed_matrix(texts, use_tqdm=False)
    for level in (1, 2):
        llm.sleep(level=level)
        assert llm.is_sleeping()
        with pytest.raises(EngineSleepingError):
            llm.embed(texts)
        llm.wake_up()
        assert torch.equal(
            torch.from_numpy(llm.embed_matrix(texts, use_tqdm=False)), torch.from_numpy(want)
        )
    llm.shutdown()


def test_dummy_weights_are_drawn_again_alike(llama):
    llm = LLM(str(llama), max_model_len=128, load_format="dummy", enable_sleep_mode=True)
    want = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.sleep(level=2)
    llm.wake_up()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    llm.shutdown()


def test_a_device_without_an_index_is_the_current_one_of_its_type():
    """A runner's device is often plain `cuda`, its tensors on `cuda:0`: both are offloaded
    (compared without CUDA: devices are plain values)."""
    from batchlm.engine.worker.sleep_mode import on_device

    cpu_tensor = torch.zeros(1)
    assert on_device(cpu_tensor, torch.device("cpu"))
    meta = torch.zeros(1, device="meta")
    assert not on_device(meta, torch.device("cpu"))
    if torch.cuda.is_available():
        t = torch.zeros(1, device="cuda:0")
        torch.cuda.set_device(0)
        assert on_device(t, torch.device("cuda"))
        assert on_device(t, torch.device("cuda:0"))
        assert not on_device(t, torch.device("cpu"))
