"""Table batches through one engine as a stream: rows enter as the engine has room, several
batches in flight, and results come out in input order.

- generate / chat / loglikelihood: `GenerationStream` queues each batch's valid rows
  (`submit_rows`) and runs engine steps; a batch is finished when its last request is,
  while the requests of the batches after it keep the engine full. `EngineLoop` drives one on its thread for many
  callers; `stream_tables` drives one in the caller's thread (the local runner, Spark).
- embed / score / classify: consecutive batches of one schema are run as one engine call,
  so the pooling runner packs them into full token budgets.

Example:
    >>> batches = ((i, table.slice(i * 64, 64)) for i in range(4))
    >>> for key, out in stream_tables(llm, spec, batches, rows_in_flight=512):
    ...     print(key, out.num_rows)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import pyarrow as pa

from batchlm.engine.gc_freeze import freeze_gc_heap

from .rows import (
    QUEUED_TASKS,
    ModelInfo,
    PendingRows,
    RowSpec,
    finish_rows,
    process_table,
    submit_rows,
)

POOLING_ROWS_PER_CALL = 65536
"""Most rows of consecutive batches merged into one pooling call: enough for full token
budgets on a large GPU and for the engine to tokenize one part of the call while the device
runs another (calls of more than two of its tokenization chunks), few enough that results
reach the caller (and the output files) steadily."""


class _Batch:
    """One batch in the engine: its rows, its queued requests and their outputs so far."""

    def __init__(self, key: Hashable, table: pa.Table, pending: PendingRows) -> None:
        self.key = key
        self.table = table
        self.pending = pending
        self.remaining = {rid for rid in pending.request_ids if rid is not None}
        self.outputs: dict[str, Any] = {}


class FinishedBatch:
    """A batch whose requests are all done; `result()` builds its output table."""

    def __init__(self, batch: _Batch, spec: RowSpec, info: ModelInfo) -> None:
        self.key = batch.key
        self._batch = batch
        self._spec = spec
        self._info = info

    def result(self) -> pa.Table:
        """The batch's rows with the task's output columns."""
        batch = self._batch
        return finish_rows(self._spec, batch.pending, batch.outputs, self._info)


class GenerationStream:
    """Generate / chat batches sharing one engine; the caller runs the steps.

    Args:
        llm: The engine (`batchlm.engine.LLM`).
        spec: The row contract's task and params.
        info: The model facts the output schema needs.
    """

    def __init__(self, llm: Any, spec: RowSpec, info: ModelInfo) -> None:
        if spec.task not in QUEUED_TASKS:
            raise ValueError(
                f"GenerationStream runs {' / '.join(QUEUED_TASKS)}, not task={spec.task!r}"
            )
        self.llm = llm
        self.spec = spec
        self.info = info
        self._batches: list[_Batch] = []
        self._owner: dict[str, _Batch] = {}  # request id -> its batch
        self.num_rows_in_engine = 0
        """Rows of the batches admitted and not finished."""

    @property
    def num_batches(self) -> int:
        """Batches with requests in the engine."""
        return len(self._batches)

    def admit(self, key: Hashable, table: pa.Table) -> FinishedBatch | None:
        """Queue the batch's valid rows; the batch finished at once when no row can run
        (every row refused), else None (it comes from `step`)."""
        pending = submit_rows(self.llm, self.spec, table)
        forget_enqueued(self.llm)
        batch = _Batch(key, table, pending)
        if not batch.remaining:
            return FinishedBatch(batch, self.spec, self.info)
        for rid in batch.remaining:
            self._owner[rid] = batch
        self._batches.append(batch)
        self.num_rows_in_engine += table.num_rows
        return None

    def step(self) -> list[FinishedBatch]:
        """One engine step; the batches it finished."""
        finished = []
        for out in self.llm.llm_engine.step():
            batch = self._owner.pop(out.request_id, None)
            if batch is None:
                continue
            batch.outputs[out.request_id] = out
            batch.remaining.discard(out.request_id)
            if not batch.remaining:
                self._batches.remove(batch)
                self.num_rows_in_engine -= batch.table.num_rows
                finished.append(FinishedBatch(batch, self.spec, self.info))
        return finished

    def keys(self) -> list[Hashable]:
        """The keys of the batches in the engine, in admission order."""
        return [b.key for b in self._batches]

    def clear(self) -> None:
        """Forget every batch (after an engine failure: the engine is rebuilt)."""
        self._batches.clear()
        self._owner.clear()
        self.num_rows_in_engine = 0

    def abort(self) -> None:
        """Drop the requests still in the engine (the caller stopped, or an exception), so
        that they hold no KV blocks; their batches are forgotten."""
        ids = list(self._owner)
        self.clear()
        if ids and not self.llm.llm_engine.is_shut_down:
            self.llm.llm_engine.abort_requests(ids)


def stream_tables(
    llm: Any,
    spec: RowSpec,
    batches: Iterable[tuple[Hashable, pa.Table]],
    info: ModelInfo | None = None,
    *,
    rows_in_flight: int,
) -> Iterator[tuple[Hashable, pa.Table]]:
    """Each `(key, table)` of `batches` with its output columns, in input order.

    Batches are read from `batches` as the engine has room: generation keeps about
    `rows_in_flight` rows in the engine; pooling merges consecutive batches of one schema
    into calls of up to `POOLING_ROWS_PER_CALL` rows. An exception (or the caller stopping
    early) drops the requests still in the engine.
    """
    info = info or ModelInfo.from_llm(llm)
    if spec.task in QUEUED_TASKS:
        yield from _generation_stream(llm, spec, iter(batches), info, rows_in_flight)
    else:
        yield from _pooling_stream(llm, spec, iter(batches), info)


def _generation_stream(
    llm: Any,
    spec: RowSpec,
    batches: Iterator[tuple[Hashable, pa.Table]],
    info: ModelInfo,
    rows_in_flight: int,
) -> Iterator[tuple[Hashable, pa.Table]]:
    stream = GenerationStream(llm, spec, info)
    order: list[Hashable] = []  # keys admitted, in input order
    done: dict[int, pa.Table] = {}  # position in `order` -> result
    next_out = 0
    is_exhausted = False
    try:
        while True:
            # The heap is frozen while the engine runs (see batchlm.engine.gc_freeze) and
            # thawed before each yield: a caller that stops iterating, or drops the
            # iterator in a reference cycle, never leaves its process's heap frozen.
            unfreeze = freeze_gc_heap()
            try:
                while not is_exhausted and stream.num_rows_in_engine < rows_in_flight:
                    item = next(batches, None)
                    if item is None:
                        is_exhausted = True
                        break
                    key, table = item
                    order.append(key)
                    finished = stream.admit(len(order) - 1, table)
                    if finished is not None:
                        done[len(order) - 1] = finished.result()
                ready = []
                while next_out in done:
                    ready.append((order[next_out], done.pop(next_out)))
                    next_out += 1
                is_done = next_out == len(order) and is_exhausted
                if not ready and not is_done:
                    for finished in stream.step():
                        done[finished.key] = finished.result()  # type: ignore[index]
            finally:
                unfreeze()
            yield from ready
            if is_done:
                return
    finally:
        stream.abort()


def _pooling_stream(
    llm: Any,
    spec: RowSpec,
    batches: Iterator[tuple[Hashable, pa.Table]],
    info: ModelInfo,
) -> Iterator[tuple[Hashable, pa.Table]]:
    group: list[tuple[Hashable, pa.Table]] = []

    def run(group: list[tuple[Hashable, pa.Table]]) -> Iterator[tuple[Hashable, pa.Table]]:
        merged = pa.concat_tables([t for _, t in group])
        out = process_table(llm, spec, merged, info)
        offset = 0
        for key, table in group:
            yield key, out.slice(offset, table.num_rows)
            offset += table.num_rows

    num_rows = 0
    for key, table in batches:
        if group and not group[0][1].schema.equals(table.schema):
            yield from run(group)
            group, num_rows = [], 0
        group.append((key, table))
        num_rows += table.num_rows
        if num_rows >= POOLING_ROWS_PER_CALL:
            yield from run(group)
            group, num_rows = [], 0
    if group:
        yield from run(group)


def forget_enqueued(llm: Any) -> None:
    """`LLM.enqueue` remembers ids for a later `wait_for_completion()`; a stream collects
    its outputs from the engine's steps itself, so that list would only grow."""
    enqueued = getattr(llm, "_enqueued", None)
    if isinstance(enqueued, list):
        enqueued.clear()


__all__ = ["FinishedBatch", "GenerationStream", "POOLING_ROWS_PER_CALL", "stream_tables"]
