"""`EngineLoop` over a scripted fake engine: overlap, per-batch answers, retries, merging.

The fake engine finishes a prompt of k words after k steps, so the tests control which
batch is still running; a prompt with the word HOLD (and every embed_matrix call) waits for the
test's `gate` event, and `busy` tells the test that the engine has started working. The
real engines are exercised by test_ray_data.py.
"""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from batchlm.engine.errors import InvalidPromptError
from batchlm.operators import fault_injection
from batchlm.operators.engine_loop import EngineFailedError, EngineLoop
from batchlm.operators.rows import ModelInfo, RowContractError, RowSpec

GEN = RowSpec(task="generate", sampling_params={"max_tokens": 4})
EMBED = RowSpec(task="embed")
INFO = ModelInfo(hidden_size=2)


class FakeEngine:
    def __init__(self, owner: FakeLLM) -> None:
        self.owner = owner
        self.running: dict[str, int] = {}  # request id -> steps left
        self.prompts: dict[str, str] = {}
        self.max_running = 0
        self.freeze_counts: list[int] = []  # the collector's frozen objects at each step

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[SimpleNamespace]:
        self.freeze_counts.append(gc.get_freeze_count())
        self.owner.busy.set()
        time.sleep(self.owner.step_s)
        if any("CRASH" in self.prompts[rid] for rid in self.running):
            raise RuntimeError("device lost")
        self.max_running = max(self.max_running, len(self.running))
        done = []
        for rid in list(self.running):
            if self.owner.is_held(self.prompts[rid]):
                continue
            self.running[rid] -= 1
            if self.running[rid] == 0:
                del self.running[rid]
                done.append(_output(rid, self.prompts.pop(rid)))
        return done


class FakeLLM:
    """Generation: `enqueue` + `llm_engine.step()`; pooling: `embed_matrix` ([len, 1] per text).

    `gate`: while it is not set, prompts with the word HOLD make no progress and `embed_matrix`
    waits. `busy` is set as soon as a step or an embed_matrix call starts.
    """

    def __init__(self, step_s: float = 0.0, gate: threading.Event | None = None) -> None:
        self.llm_engine = FakeEngine(self)
        self.step_s = step_s
        self.gate = gate
        self.busy = threading.Event()
        self.embed_calls: list[int] = []
        self._enqueued: list[str] = []
        self._next = 0
        self.is_shut_down = False

    def enqueue(self, prompts: list, params: object) -> list[str]:
        for i, p in enumerate(prompts):
            if p == "":
                raise InvalidPromptError(f"prompts[{i}] is empty")
        ids = []
        for p in prompts:
            rid = str(self._next)
            self._next += 1
            self.llm_engine.running[rid] = len(p.split())
            self.llm_engine.prompts[rid] = p
            ids.append(rid)
        self._enqueued.extend(ids)
        return ids

    def is_held(self, prompt: str) -> bool:
        return self.gate is not None and not self.gate.is_set() and "HOLD" in prompt.split()

    def embed_matrix(self, texts: list[str], params: object, **kwargs: object) -> np.ndarray:
        self.busy.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=10), "the test never opened the gate"
        self.embed_calls.append(len(texts))
        if any("CRASH" in t for t in texts):
            raise RuntimeError("device lost")
        return np.array([[len(t), 1.0] for t in texts], np.float32).reshape(-1, 2)

    def shutdown(self) -> None:
        self.is_shut_down = True
        self.freeze_count_at_shutdown = gc.get_freeze_count()


def _output(rid: str, prompt: str) -> SimpleNamespace:
    n = len(prompt.split())
    completion = SimpleNamespace(text=prompt.upper(), finish_reason="length", token_ids=[0] * n)
    return SimpleNamespace(request_id=rid, prompt_token_ids=[0] * n, outputs=[completion])


class Builder:
    """Counts engine builds; can be told to fail from the n-th build on."""

    def __init__(self, fail_from: int | None = None, **llm_kwargs: Any) -> None:
        self.llms: list[FakeLLM] = []
        self.num_attempts = 0
        self.fail_from = fail_from
        self.llm_kwargs = llm_kwargs

    def __call__(self) -> FakeLLM:
        self.num_attempts += 1
        if self.fail_from is not None and len(self.llms) + 1 >= self.fail_from:
            raise RuntimeError("no device")
        self.llms.append(FakeLLM(**self.llm_kwargs))
        return self.llms[-1]


def _batch(ids: list[int], words: int, column: str = "prompt", first: str = "w") -> pa.Table:
    """Rows of `words` + 1 words each; `first="HOLD"` holds them while the gate is shut."""
    texts = [" ".join([first] + ["w"] * (words - 1)) + f" {i}" for i in ids]
    return pa.table({"id": ids, column: texts})


def _check_generated(table: pa.Table) -> None:
    rows = table.to_pylist()
    for row in rows:
        assert row["error"] is None
        assert row["generated_text"] == row["prompt"].upper()
        assert row["num_output_tokens"] == len(row["prompt"].split())


def test_batches_share_the_engine_and_each_is_answered_when_its_rows_are_done():
    gate = threading.Event()
    build = Builder(step_s=0.005, gate=gate)
    loop = EngineLoop(build, GEN, info=INFO)
    try:
        long = loop.submit(_batch([0, 1], words=60, first="HOLD"))
        assert build.llms[0].busy.wait(timeout=10)  # the long batch is running ...
        short = loop.submit(_batch([2, 3, 4], words=2))  # ... when the short one arrives
        _check_generated(short.result(timeout=10))
        assert not long.done()  # answered before the batch that came first
        gate.set()
        _check_generated(long.result(timeout=10))
        assert loop.stats.max_batches_in_engine == 2
        assert build.llms[0].llm_engine.max_running == 5
        assert build.llms[0]._enqueued == []  # the loop collects outputs itself
        assert loop.stats.num_engine_builds == 1
        assert (loop.stats.num_batches, loop.stats.num_rows) == (2, 5)
    finally:
        gate.set()  # a failed assertion must not leave close() waiting for held requests
        loop.close()


def test_batches_from_many_threads_each_get_their_own_rows():
    loop = EngineLoop(Builder(step_s=0.001), GEN, info=INFO)
    results: dict[int, pa.Table] = {}

    def run(k: int) -> None:
        results[k] = loop.submit(_batch([10 * k + j for j in range(5)], words=k + 1)).result(10)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loop.close()
    for k, table in results.items():
        assert table["id"].to_pylist() == [10 * k + j for j in range(5)]
        _check_generated(table)
    assert loop.stats.max_batches_in_engine >= 2


def test_refused_rows_get_their_error_and_the_rest_run():
    loop = EngineLoop(Builder(), GEN, info=INFO)
    table = pa.table({"id": [1, 2, 3], "prompt": ["a b", "", None]})
    out = loop.submit(table).result(timeout=10).to_pylist()
    loop.close()
    assert out[0]["generated_text"] == "A B" and out[0]["error"] is None
    assert out[1]["generated_text"] is None and "empty" in out[1]["error"]
    assert out[2]["generated_text"] is None and "null" in out[2]["error"]
    assert loop.stats.num_engine_failures == 0


def test_a_batch_with_no_valid_rows_is_answered_without_the_engine():
    loop = EngineLoop(Builder(), GEN, info=INFO)
    out = loop.submit(pa.table({"id": [1], "prompt": pa.array([None], pa.string())})).result(10)
    loop.close()
    assert out.column("error").to_pylist() == ["column 'prompt' is null in this row"]


def test_engine_failure_rebuilds_the_engine_and_retries_every_batch_in_it():
    build = Builder(step_s=0.002)
    loop = EngineLoop(build, GEN, info=INFO, max_batch_retries=1)
    try:
        first = loop.submit(_batch([0, 1], words=30))
        assert build.llms[0].busy.wait(timeout=10)  # the first batch is in the engine
        fault_injection.fail_engine_calls(loop, RuntimeError("device lost"))
        second = loop.submit(_batch([2, 3], words=3))
        _check_generated(first.result(timeout=10))
        _check_generated(second.result(timeout=10))
        assert loop.stats.num_engine_failures == 1
        assert loop.stats.num_engine_builds == 2
        assert build.llms[0].is_shut_down and not build.llms[1].is_shut_down
        # The broken engine went with the heap thawed (a frozen cycle would keep its
        # memory); the new one ran frozen.
        assert build.llms[0].freeze_count_at_shutdown == 0
        assert min(build.llms[1].llm_engine.freeze_counts) > 0
        assert _wait_for_thaw() == 0
    finally:
        loop.close()
        gc.unfreeze()


def test_a_batch_that_always_breaks_the_engine_fails_after_max_batch_retries():
    build = Builder()
    loop = EngineLoop(build, GEN, info=INFO, max_batch_retries=2)
    try:
        bad = loop.submit(pa.table({"id": [0], "prompt": ["CRASH now"]}))
        with pytest.raises(EngineFailedError) as e:
            bad.result(timeout=10)
        msg = str(e.value)
        assert "failed on 3 engine(s)" in msg and "max_batch_retries=2" in msg
        assert "RuntimeError: device lost" in msg
        _check_generated(loop.submit(_batch([1], words=2)).result(timeout=10))
        assert loop.stats.num_engine_builds == 4  # the first and one per failure
    finally:
        loop.close()


def test_an_engine_that_cannot_be_rebuilt_fails_every_batch_fast():
    loop = EngineLoop(Builder(fail_from=2), GEN, info=INFO)
    with pytest.raises(EngineFailedError, match="could not be rebuilt.*no device"):
        loop.submit(pa.table({"id": [0], "prompt": ["CRASH"]})).result(timeout=10)
    with pytest.raises(EngineFailedError, match="could not be rebuilt"):
        loop.submit(_batch([1], words=1)).result(timeout=10)
    loop.close()


def test_a_model_that_cannot_load_fails_the_constructor():
    with pytest.raises(RuntimeError, match="no device"):
        EngineLoop(Builder(fail_from=1), GEN, info=INFO)


def test_pooling_batches_waiting_together_run_as_one_call():
    gate = threading.Event()
    build = Builder(gate=gate)
    loop = EngineLoop(build, EMBED, info=INFO)
    try:
        first = loop.submit(_batch([0], words=1, column="text"))
        assert build.llms[0].busy.wait(timeout=10)  # the engine is busy with the first batch
        later = [loop.submit(_batch([k, k + 100], words=k, column="text")) for k in (1, 2, 3)]
        gate.set()
        outs = [f.result(timeout=10) for f in [first, *later]]
    finally:
        gate.set()
        loop.close()
    assert build.llms[0].embed_calls == [1, 6]
    assert loop.stats.max_batches_in_engine == 3
    for k, out in zip((1, 2, 3), outs[1:], strict=True):
        assert out["id"].to_pylist() == [k, k + 100]
        assert out.schema.field("embedding").type == pa.list_(pa.float32(), 2)
        lengths = [len(t) for t in out["text"].to_pylist()]
        assert [e[0] for e in out["embedding"].to_pylist()] == lengths


def test_close_finishes_queued_batches_and_refuses_new_ones():
    loop = EngineLoop(Builder(step_s=0.001), GEN, info=INFO)
    futures = [loop.submit(_batch([k], words=5)) for k in range(3)]
    loop.close()
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(_batch([9], words=1)).result(timeout=1)


def test_a_table_without_the_task_columns_fails_alone_without_touching_the_engine():
    loop = EngineLoop(Builder(), GEN, info=INFO)
    with pytest.raises(RowContractError, match=r"needs column\(s\) \['prompt'\]"):
        loop.submit(pa.table({"question": ["hi"]})).result(timeout=10)
    _check_generated(loop.submit(_batch([1], words=2)).result(timeout=10))
    loop.close()
    assert loop.stats.num_engine_failures == 0 and loop.stats.num_engine_builds == 1


def test_a_batch_cancelled_by_its_caller_does_not_break_the_engine():
    build = Builder(step_s=0.005)
    loop = EngineLoop(build, GEN, info=INFO)
    try:
        running = loop.submit(_batch([0], words=20))
        assert build.llms[0].busy.wait(timeout=10)  # the first batch is in the engine
        cancelled = loop.submit(_batch([1], words=3))
        cancelled.cancel()
        _check_generated(running.result(timeout=10))
        _check_generated(loop.submit(_batch([2], words=2)).result(timeout=10))
        assert loop.stats.num_engine_failures == 0
    finally:
        loop.close()


def test_batches_queued_behind_an_engine_that_cannot_be_rebuilt_fail_too():
    build = Builder(fail_from=2, step_s=0.01, gate=threading.Event())  # never opened
    loop = EngineLoop(build, GEN, info=INFO)
    running = loop.submit(_batch([0], words=50, first="HOLD"))
    assert build.llms[0].busy.wait(timeout=10)  # the batch is in the engine, and stays there
    fault_injection.fail_engine_calls(loop, RuntimeError("device lost"))
    queued = [loop.submit(_batch([k], words=2)) for k in (1, 2, 3)]
    for future in [running, *queued]:
        with pytest.raises(EngineFailedError, match="could not be rebuilt"):
            future.result(timeout=10)
    loop.close()
    assert build.num_attempts == 2  # no further attempt after the rebuild failed


def _wait_for_thaw(timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while gc.get_freeze_count() and time.monotonic() < deadline:
        time.sleep(0.005)
    return gc.get_freeze_count()


def test_the_heap_is_frozen_while_generation_runs_and_thawed_when_idle():
    assert gc.get_freeze_count() == 0
    build = Builder(step_s=0.001)
    loop = EngineLoop(build, GEN, info=INFO)
    try:
        _check_generated(loop.submit(_batch([0, 1], words=5)).result(timeout=10))
        steps = build.llms[0].llm_engine.freeze_counts
        assert steps and min(steps) > 0
        assert _wait_for_thaw() == 0
        # Busy again: frozen again.
        _check_generated(loop.submit(_batch([2], words=3)).result(timeout=10))
        assert min(steps[-3:]) > 0
        assert _wait_for_thaw() == 0
    finally:
        loop.close()
        gc.unfreeze()
