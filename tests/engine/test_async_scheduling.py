"""Async scheduling on CPU: a step is scheduled and launched before the previous step's
tokens reach the host, and every output must equal the engine that waits for each step.

The reference is the same engine with `async_scheduling=False` (itself checked against
Hugging Face transformers in test_generate_vs_hf.py): same weights, same seeds, so tokens,
texts, logprobs and finish reasons must be identical, not merely close. The scheduler's
part (placeholders, requests held back, `sync_next`) is checked exactly by hand.
"""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams  # noqa: E402
from batchlm.engine.core.scheduler import PLACEHOLDER_TOKEN  # noqa: E402
from batchlm.engine.errors import InvalidParamError  # noqa: E402
from batchlm.engine.worker.step_buffers import fill_tokens  # noqa: E402

from .test_cuda_graphs import _prompts, _tokens  # noqa: E402
from .test_scheduler import add, make_scheduler, steps  # noqa: E402

# ---- the scheduler, by hand -----------------------------------------------------------------


def test_ahead_step_feeds_placeholders_and_holds_back_finished_lengths():
    s = make_scheduler()
    add(s, "a", range(1, 6), max_tokens=3)
    add(s, "b", range(11, 14), max_tokens=1)
    first = s.schedule()
    assert steps(first) == [
        ("a", [1, 2, 3, 4, 5], 0, [0, 1], True),
        ("b", [11, 12, 13], 0, [2], True),
    ]
    assert not first.sync_next
    # The prefill is in flight: "a" decodes its unknown token; "b" reaches max_tokens=1
    # with the token in flight, so it is not scheduled again.
    ahead = s.schedule(ahead=True)
    assert steps(ahead) == [("a", [PLACEHOLDER_TOKEN], 5, [0, 1], True)]
    assert s.requests["a"].num_inflight_tokens == 2
    assert s.requests["b"].num_inflight_tokens == 1
    assert not ahead.sync_next

    s.update_from_output(first, {"a": 40, "b": 41})
    assert s.requests["a"].output_token_ids == [40]
    assert s.requests["a"].num_inflight_tokens == 1
    assert "b" not in s.requests  # finished by length
    # "a" has 1 known + 1 in flight of max_tokens=3: one more step ahead.
    third = s.schedule(ahead=True)
    assert steps(third) == [("a", [PLACEHOLDER_TOKEN], 6, [0, 1], True)]
    assert third.finished_request_ids == {"b"}
    s.update_from_output(ahead, {"a": 42})
    # 2 known + 1 in flight = max_tokens: nothing to schedule until it lands.
    assert s.schedule(ahead=True).is_empty
    s.update_from_output(third, {"a": 43})
    assert s.requests == {} and s.running == []
    assert s.kv_cache.pool.num_free_blocks == 16


def test_ahead_step_never_preempts_and_asks_for_a_synced_step():
    # 3 blocks of 4 tokens: "a" (4 tokens) and "b" (4 tokens) fill two; growing both
    # needs four.
    s = make_scheduler(num_blocks=3)
    add(s, "a", [1, 2, 3, 4], max_tokens=8)
    add(s, "b", [5, 6, 7, 8], max_tokens=8)
    first = s.schedule()
    assert [r.request_id for r in first.scheduled] == ["a", "b"]
    ahead = s.schedule(ahead=True)
    # "a" takes the last free block; "b" cannot grow and nobody is preempted.
    assert steps(ahead) == [("a", [PLACEHOLDER_TOKEN], 4, [0, 2], True)]
    assert ahead.sync_next and ahead.preempted_request_ids == []
    assert s.num_preemptions == 0
    s.update_from_output(first, {"a": 50, "b": 51})
    s.update_from_output(ahead, {"a": 52})
    # With every output known, the scheduler may preempt: the newest ("b") yields.
    synced = s.schedule()
    assert synced.preempted_request_ids == ["b"]
    assert steps(synced) == [("a", [52], 5, [0, 2], True)]
    assert s.requests["b"].num_inflight_tokens == 0
    assert s.waiting[0].request_id == "b"


def test_sampling_that_reads_outputs_is_never_scheduled_ahead():
    s = make_scheduler()
    add(s, "pen", [1, 2, 3], max_tokens=5, repetition_penalty=1.2)
    add(s, "min", [4, 5, 6], max_tokens=5, min_tokens=2)
    add(s, "plain", [7, 8, 9], max_tokens=5)
    first = s.schedule()
    assert first.sync_next  # the next step must know these outputs
    ahead = s.schedule(ahead=True)
    assert [r.request_id for r in ahead.scheduled] == ["plain"]
    s.update_from_output(first, {"pen": 60, "min": 61, "plain": 62})
    s.update_from_output(ahead, {"plain": 63})
    second = s.schedule()
    assert steps(second) == [
        ("pen", [60], 3, [0], True),
        ("min", [61], 3, [1], True),
        ("plain", [63], 4, [2, 3], True),
    ]
    s.update_from_output(second, {"pen": 64, "min": 65, "plain": 66})
    # "min" has its 2 tokens now and may run ahead; "pen" never does.
    third = s.schedule()
    assert third.sync_next
    ahead = s.schedule(ahead=True)
    assert [r.request_id for r in ahead.scheduled] == ["min", "plain"]


def test_undo_of_an_ahead_step_forgets_the_tokens_in_flight():
    s = make_scheduler()
    add(s, "a", [1, 2, 3, 4, 5], max_tokens=4)
    first = s.schedule()
    ahead = s.schedule(ahead=True)
    s.undo_schedule(ahead)
    s.undo_schedule(first)
    request = s.waiting[0]
    assert request.num_inflight_tokens == 0 and request.num_computed_tokens == 0
    assert s.kv_cache.pool.num_free_blocks == 16
    again = s.schedule()  # (freed blocks go to the back of the free queue)
    assert steps(again) == [("a", [1, 2, 3, 4, 5], 0, [2, 3], True)]


def test_fill_tokens_writes_the_sampled_ids_into_their_rows():
    import numpy as np

    input_ids = torch.tensor([7, 0, 8, 0, 0], dtype=torch.int64)
    samples = torch.tensor([101, 102, 103], dtype=torch.int32)
    fill_tokens(input_ids, np.array([1, 3, 4]), np.array([2, 0, 1]), samples)
    assert input_ids.tolist() == [7, 103, 8, 101, 102]
    with pytest.raises(RuntimeError, match="no previous step sampled"):
        fill_tokens(input_ids, np.array([1]), np.array([0]), None)


# ---- the engine, against the same engine in sync mode ---------------------------------------


def _generate(path, prompts, params, async_scheduling: bool, **options):
    llm = LLM(str(path), dtype="float32", seed=0, async_scheduling=async_scheduling, **options)
    try:
        assert llm.llm_engine.config.scheduler.async_scheduling is async_scheduling
        outputs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.llm_engine
        info = {
            "from_device": engine.runner.num_tokens_from_device,
            "preemptions": engine.stats().num_preemptions,
            "free_blocks": engine.kv_cache.pool.num_free_blocks,
            "num_blocks": engine.num_kv_blocks,
            "idle": engine._inflight is None,
        }
    finally:
        llm.shutdown()
    return outputs, info


def _summary(outputs) -> list:
    """Everything a request returns that async scheduling could change."""
    rows = []
    for out in outputs:
        for c in out.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs]
            rows.append(
                (
                    out.request_id,
                    c.index,
                    list(c.token_ids),
                    c.text,
                    c.finish_reason,
                    str(c.stop_reason),
                    logprobs,
                )
            )
        if out.prompt_logprobs is not None:
            rows.append([None if d is None else sorted(d) for d in out.prompt_logprobs])
    return rows


def _assert_same(path, prompts, params, **options):
    sync, sync_info = _generate(path, prompts, params, False, **options)
    ahead, ahead_info = _generate(path, prompts, params, True, **options)
    assert _summary(ahead) == _summary(sync)
    assert sync_info["from_device"] == 0
    assert ahead_info["free_blocks"] == ahead_info["num_blocks"]  # nothing leaked
    return sync, {**ahead_info, "sync_preemptions": sync_info["preemptions"]}


def test_mixed_lengths_stops_and_seeds_equal_sync(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompts = _prompts(12, shared=0, seed=1)
    params = []
    for i in range(12):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.8, seed=100 + i, max_tokens=9))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=12, logprobs=3))
        else:
            params.append(SamplingParams(temperature=0.7, top_k=20, max_tokens=1))
    _, info = _assert_same(path, prompts, params, max_model_len=128)
    assert info["from_device"] > 0


def test_stop_strings_end_requests_with_a_step_in_flight(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompts = _prompts(6, shared=0, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [
        o.outputs[0].text for o in _generate(path, prompts, greedy, False, max_model_len=96)[0]
    ]
    # Stop on a piece of each request's own greedy text, so each stops early, mid-run.
    params = []
    for text in texts:
        stop = text[len(text) // 3 : len(text) // 3 + 3]
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=24,
                ignore_eos=True,
                stop=[stop] if stop.strip() else None,
            )
        )
    sync, info = _assert_same(path, prompts, params, max_model_len=96)
    assert info["from_device"] > 0
    assert info["idle"]  # no step left in flight once every request has ended
    stopped = [o for o in sync if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 4 and all(len(o.outputs[0].token_ids) < 24 for o in stopped)


def test_penalties_min_tokens_and_n_equal_sync(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    prompts = _prompts(6, shared=0, seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=7, max_tokens=10, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6),
        SamplingParams(temperature=1.0, seed=9, max_tokens=8, n=2),
        SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    ]
    _, info = _assert_same(path, prompts, params, max_model_len=96)
    assert info["from_device"] > 0


def test_preemption_in_a_small_cache_equals_sync(tiny_model_factory):
    """A KV cache that cannot hold every request: steps scheduled ahead block instead of
    preempting, the engine waits for the step in flight, and the synced step preempts."""
    path = tiny_model_factory("llama")
    prompts = _prompts(10, shared=20, seed=4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20 + 2 * i, ignore_eos=True) for i in range(10)
    ]
    options = dict(max_model_len=96, num_gpu_blocks_override=24, block_size=4)
    sync, info = _assert_same(path, prompts, params, **options)
    assert info["sync_preemptions"] > 0 and info["preemptions"] > 0
    assert info["from_device"] > 0


def test_static_decode_path_reads_tokens_from_the_device(tiny_model_factory):
    """The padded static-buffer path (what CUDA graphs replay), fed by the previous step's
    samples, against the plain path in sync mode (interpreted kernels on CPU)."""
    path = tiny_model_factory("llama")
    prompts = _prompts(4, shared=0, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = dict(max_model_len=64, max_num_seqs=4, attention_backend="triton", enforce_eager=True)
    sync, _ = _generate(path, prompts, params, False, **options)
    llm = LLM(str(path), dtype="float32", seed=0, async_scheduling=True, **options)
    try:
        runner = llm.llm_engine.runner
        runner.enable_decode_graphs(capture=False)
        ahead = llm.generate(prompts, params, use_tqdm=False)
        assert runner.decode_graphs.num_replays > 0
        assert runner.num_tokens_from_device > 0
    finally:
        llm.shutdown()
    assert _tokens(ahead) == _tokens(sync)


def _stepwise(path, num: int, seed: int, max_tokens: int):
    """Greedy prompts, their outputs in sync mode, and an async engine to drive by hand."""
    prompts = _prompts(num, shared=0, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync, _ = _generate(path, prompts, params, False, max_model_len=96)
    llm = LLM(str(path), dtype="float32", seed=0, async_scheduling=True, max_model_len=96)
    return prompts, params, _tokens(sync), llm


def test_queue_api_and_abort_with_a_step_in_flight(tiny_model_factory):
    prompts, params, expected, llm = _stepwise(tiny_model_factory("llama"), 5, 6, 10)
    try:
        engine = llm.llm_engine
        ids = llm.enqueue(prompts, params, use_tqdm=False)
        # Two steps: the second is launched while the first is in flight.
        engine.step()
        engine.step()
        assert engine._inflight is not None
        # The queue API finishes what is in flight.
        first = llm.wait_for_completion(use_tqdm=False)
        assert _tokens(first) == expected
        assert engine._inflight is None

        ids = llm.enqueue(prompts, params, use_tqdm=False)
        engine.step()
        engine.step()
        engine.abort_requests([ids[1]])  # its outputs are discarded
        done = []
        while engine.has_unfinished_requests():
            done += engine.step()
        assert engine._inflight is None
        got = {o.request_id: o for o in done}
        assert set(got) == {ids[i] for i in (0, 2, 3, 4)}
        for i in (0, 2, 3, 4):
            assert got[ids[i]].outputs[0].token_ids == expected[i]
        assert engine.kv_cache.pool.num_free_blocks == engine.num_kv_blocks
        # The engine goes on serving.
        again = llm.generate(prompts[:2], params, use_tqdm=False)
        assert _tokens(again) == expected[:2]
    finally:
        llm.shutdown()


def test_a_failed_launch_undoes_both_steps_and_the_engine_recovers(tiny_model_factory):
    prompts, params, expected, llm = _stepwise(tiny_model_factory("llama"), 4, 7, 8)
    try:
        engine = llm.llm_engine
        launch = engine._launch_model
        calls = {"n": 0}

        def failing_launch(sched_out, grammar=None):
            calls["n"] += 1
            if calls["n"] == 3:  # the third launch, with the second one in flight
                raise RuntimeError("device lost")
            return launch(sched_out, grammar)

        engine._launch_model = failing_launch
        llm.enqueue(prompts, params, use_tqdm=False)
        engine.step()
        engine.step()
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
        assert engine._inflight is None
        assert len(engine.scheduler.waiting) == 4 and not engine.scheduler.running
        done = llm.wait_for_completion(use_tqdm=False)
        assert _tokens(done) == expected
        assert engine.kv_cache.pool.num_free_blocks == engine.num_kv_blocks
    finally:
        llm.shutdown()


def test_async_scheduling_option_is_checked(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    # Auto: only on CUDA.
    llm = LLM(path, max_model_len=64)
    try:
        on = llm.llm_engine.config.scheduler.async_scheduling
        assert on is (llm.llm_engine.runner.device.type == "cuda")
    finally:
        llm.shutdown()
    with pytest.raises(InvalidParamError, match="async_scheduling='yes'"):
        LLM(path, max_model_len=64, async_scheduling="yes")
    with pytest.raises(InvalidParamError, match="speculative decoding"):
        LLM(
            path,
            max_model_len=64,
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
