"""A generation run keeps the objects that existed before it out of the garbage collector's
full passes (frozen), and gives them back when it ends, however it ends; under a freeze
that is not its own, it holds full passes back instead."""

from __future__ import annotations

import gc

import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.gc_freeze import freeze_gc_heap

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(str(tiny_model_factory("llama")), max_model_len=128)


@pytest.fixture
def freeze_counts(llm, monkeypatch):
    """The collector's frozen-object count seen at each engine step."""
    seen: list[int] = []
    step = llm.llm_engine.step

    def counting_step():
        seen.append(gc.get_freeze_count())
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", counting_step)
    yield seen
    gc.unfreeze()


def test_generate_freezes_during_the_run_only(llm, freeze_counts):
    assert gc.get_freeze_count() == 0
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert freeze_counts and min(freeze_counts) > 0
    assert gc.get_freeze_count() == 0


def test_wait_for_completion_freezes_during_the_run_only(llm, freeze_counts):
    llm.enqueue([{"prompt_token_ids": [8, 9]}], PARAMS)
    outs = llm.wait_for_completion(use_tqdm=False)
    assert len(outs) == 1
    assert freeze_counts and min(freeze_counts) > 0
    assert gc.get_freeze_count() == 0


def test_a_failing_run_unfreezes(llm, monkeypatch):
    def failing_step():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.llm_engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([{"prompt_token_ids": [5, 6]}], PARAMS, use_tqdm=False)
    assert gc.get_freeze_count() == 0
    monkeypatch.undo()
    # The engine serves the next call (the failed request was aborted).
    assert len(llm.generate([{"prompt_token_ids": [5, 6]}], PARAMS, use_tqdm=False)) == 1


def is_frozen(obj: object) -> bool:
    """Whether a tracked object sits in the frozen generation: `gc.get_objects()` lists the
    generations the collector scans, never the frozen one."""
    assert gc.is_tracked(obj)
    return not any(o is obj for o in gc.get_objects())


def test_a_callers_freeze_is_left_to_the_caller(llm, monkeypatch):
    frozen_by_caller: list = []  # a tracked container the test keeps alive
    assert not is_frozen(frozen_by_caller)
    gc.freeze()
    made_after: list = []  # made after the caller's freeze, before the run
    before = gc.get_freeze_count()
    seen: list[tuple[int, bool, bool]] = []
    step = llm.llm_engine.step

    threshold = gc.get_threshold()
    held: list[int] = []

    def observing_step():
        seen.append((gc.get_freeze_count(), is_frozen(frozen_by_caller), is_frozen(made_after)))
        held.append(gc.get_threshold()[2])
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", observing_step)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
        after = gc.get_freeze_count()
        assert seen
        # The run neither unfreezes the caller's objects nor freezes its own.
        assert all(caller and not late for _, caller, late in seen)
        assert is_frozen(frozen_by_caller) and not is_frozen(made_after)
        # Only gc.freeze adds to the frozen generation; frozen objects leave it only when
        # freed. So the count never rises above the caller's and only falls, step by step.
        counts = [before, *(count for count, _, _ in seen), after]
        assert counts == sorted(counts, reverse=True)
        # Full passes (which would go over the engine's unfrozen objects) wait for the end
        # of the run; the young generations keep their thresholds.
        assert min(held) > 10**6 and gc.get_threshold() == threshold
    finally:
        gc.unfreeze()


def test_full_passes_held_back_until_the_last_holder_lets_go():
    gc.freeze()
    threshold = gc.get_threshold()
    try:
        outer = freeze_gc_heap()
        inner = freeze_gc_heap()
        assert gc.get_threshold()[:2] == threshold[:2] and gc.get_threshold()[2] > 10**6
        outer()  # in any order
        assert gc.get_threshold()[2] > 10**6
        inner()
        assert gc.get_threshold() == threshold
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def test_nothing_is_frozen_with_the_collector_off(llm, freeze_counts):
    gc.disable()
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
    finally:
        gc.enable()
    assert set(freeze_counts) == {0}
