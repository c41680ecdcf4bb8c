"""`EngineLoop`: one engine on a background thread, fed table batches from any thread.

Batches from several callers (the coroutines of a Ray actor, threads of a worker) are in
the engine at the same time, so it stays full between them:

- generate / chat / loglikelihood: each batch's valid rows are queued (`submit_rows`) as
  soon as it arrives, and one loop runs engine steps (`row_stream.GenerationStream`); a
  batch is answered when its last request finishes, while the requests of later batches
  keep running.
- embed / score / classify: batches waiting while the engine is busy are run together in
  one call (same schema), so the pooling runner packs them into full token budgets.

Rows the engine refuses carry their message in `error` (the row contract). Any other
exception is an engine failure: every batch in the engine at that moment is retried on a
freshly built engine, each at most `max_batch_retries` times, then fails with
`EngineFailedError`.

Example:
    >>> loop = EngineLoop(config.build_llm, config.spec, max_batch_retries=2)
    >>> table = loop.submit(pa.table({"prompt": ["Hi"]})).result()
    >>> loop.close()
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from batchlm.engine.gc_freeze import freeze_gc_heap

from . import fault_injection
from .row_stream import GenerationStream
from .rows import (
    QUEUED_TASKS,
    ModelInfo,
    RowContractError,
    RowSpec,
    check_columns,
    process_table,
)

logger = logging.getLogger(__name__)


class EngineFailedError(RuntimeError):
    """A batch failed on every engine it was tried on (not because of one row's input)."""


@dataclass
class EngineLoopStats:
    """Counts over the loop's life; `max_batches_in_engine` > 1 shows batches overlapping."""

    num_engine_builds: int = 0
    num_engine_failures: int = 0
    num_batches: int = 0
    num_rows: int = 0
    max_batches_in_engine: int = 0
    """Generation: most batches with requests in the engine at once. Pooling: most batches
    merged into one engine call."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(eq=False)
class _Job:
    table: pa.Table
    future: Future
    num_attempts: int = 0


class EngineLoop:
    """Owns one LLM and the thread that drives it; `submit` may be called from any thread.

    Args:
        build_llm: Builds the engine; called once here and again after each engine failure.
        spec: The row contract's task and params for every batch.
        max_batch_retries: Times a batch is retried on a new engine after an engine failure.
        info: The model facts the output schema needs (read from the engine if None).
    """

    def __init__(
        self,
        build_llm: Callable[[], Any],
        spec: RowSpec,
        *,
        max_batch_retries: int = 2,
        info: ModelInfo | None = None,
    ) -> None:
        if max_batch_retries < 0:
            raise RowContractError(f"max_batch_retries={max_batch_retries} must be >= 0")
        self.spec = spec
        self.max_batch_retries = max_batch_retries
        self.stats = EngineLoopStats()
        self._build_llm = build_llm
        # Built here, in the caller's thread, so that a model that cannot load fails the
        # caller (an actor's constructor) rather than the first batch.
        self.llm = self._build()
        self.info = info or ModelInfo.from_llm(self.llm)
        self._is_generation = spec.task in QUEUED_TASKS
        self._stream = GenerationStream(self.llm, spec, self.info) if self._is_generation else None
        """Queued tasks (generate, chat, loglikelihood): the batches with requests in the
        engine (keyed by their jobs)."""
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._retry: list[_Job] = []
        self._dead: BaseException | None = None
        self._closed = False
        self._unfreeze_gc: Callable[[], None] | None = None  # set while requests run
        self._thread = threading.Thread(target=self._serve, name="batchlm-engine", daemon=True)
        self._thread.start()

    # ---- callers' side ------------------------------------------------------------------

    def submit(self, table: pa.Table) -> Future:
        """Queues a batch; the future resolves to the batch with its output columns."""
        future: Future = Future()
        try:
            # A table that does not fit the task fails alone, without touching the engine.
            check_columns(self.spec, table.column_names)
        except RowContractError as e:
            future.set_exception(e)
            return future
        if self._closed:
            future.set_exception(RuntimeError("the engine loop is closed"))
        elif self._dead is not None:
            future.set_exception(self._dead_error())
        else:
            self._inbox.put(_Job(table, future))
        return future

    def close(self) -> None:
        """Stops the thread after the batches already queued; releases the engine."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        self._thread.join()
        self._release()

    # ---- the engine thread ----------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._serve_jobs()
        finally:
            self._thaw_gc()

    def _thaw_gc(self) -> None:
        if self._unfreeze_gc is not None:
            self._unfreeze_gc()
            self._unfreeze_gc = None

    def _serve_jobs(self) -> None:
        while True:
            jobs = self._take(block=not self._num_active)
            if jobs is None:
                return
            if self._dead is not None:
                for job in jobs:
                    _fail(job, self._dead_error())
                continue
            if self._is_generation:
                for job in jobs:
                    self._guarded(self._admit, job)
                if self._num_active:
                    if self._unfreeze_gc is None:  # busy: see batchlm.engine.gc_freeze
                        self._unfreeze_gc = freeze_gc_heap()
                    self._guarded(self._step)
                if not self._num_active:
                    self._thaw_gc()
            elif jobs:
                self._guarded(self._run_pooling, jobs)

    def _take(self, block: bool) -> list[_Job] | None:
        """Retried batches first, then every batch queued so far; None once closed."""
        jobs, self._retry = self._retry, []
        if not jobs and block:
            first = self._inbox.get()
            if first is None:
                return None
            jobs.append(first)
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return jobs
            if job is None:
                # Closing: finish what is queued and in the engine, then stop.
                self._inbox.put(None)
                if not jobs and not self._num_active and not self._retry:
                    return None
                return jobs
            jobs.append(job)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        if self._dead is not None:  # the engine broke earlier in this round of batches
            for job in args[0] if args and isinstance(args[0], list) else args:
                _fail(job, self._dead_error())
            return
        try:
            fault_injection.before_engine_call(self)
            fn(*args)
        except Exception as e:
            affected = self._stream.keys() if self._stream is not None else []
            if args and isinstance(args[0], _Job) and args[0] not in affected:
                affected.append(args[0])
            elif args and isinstance(args[0], list):
                affected.extend(args[0])
            self._on_engine_failure(e, [j for j in affected if not j.future.done()])

    @property
    def _num_active(self) -> int:
        """Generation batches with requests in the engine."""
        return self._stream.num_batches if self._stream is not None else 0

    def _admit(self, job: _Job) -> None:
        if job.future.done():  # cancelled by its caller while queued
            return
        finished = self._stream.admit(job, job.table)
        if finished is not None:
            self._finish(job, finished.result)
            return
        self.stats.max_batches_in_engine = max(self.stats.max_batches_in_engine, self._num_active)

    def _step(self) -> None:
        for finished in self._stream.step():
            self._finish(finished.key, finished.result)

    def _run_pooling(self, jobs: list[_Job]) -> None:
        # Batches of one schema run as one call; a batch of another schema runs alone.
        groups: list[list[_Job]] = []
        for job in (j for j in jobs if not j.future.done()):
            if groups and groups[-1][0].table.schema.equals(job.table.schema):
                groups[-1].append(job)
            else:
                groups.append([job])
        for group in groups:
            self.stats.max_batches_in_engine = max(self.stats.max_batches_in_engine, len(group))
            merged = pa.concat_tables([j.table for j in group])
            out = process_table(self.llm, self.spec, merged, self.info)
            offset = 0
            for job in group:
                num_rows = job.table.num_rows
                self._finish(job, out.slice, offset, num_rows)
                offset += num_rows

    def _finish(self, job: _Job, build: Callable[..., pa.Table], *args: Any) -> None:
        try:
            table = build(*args)
        except Exception as e:  # a bug in building the columns: retrying cannot help
            _fail(job, e)
            return
        self.stats.num_batches += 1
        self.stats.num_rows += table.num_rows
        with contextlib.suppress(InvalidStateError):  # its caller may have cancelled it
            job.future.set_result(table)

    # ---- failures -------------------------------------------------------------------------

    def _on_engine_failure(self, error: Exception, jobs: list[_Job]) -> None:
        self.stats.num_engine_failures += 1
        logger.warning(
            "engine failure with %d batch(es) in the engine; rebuilding it",
            len(jobs),
            exc_info=error,
        )
        for job in jobs:
            job.num_attempts += 1
            if job.num_attempts > self.max_batch_retries:
                _fail(
                    job,
                    EngineFailedError(
                        f"a batch of {job.table.num_rows} rows failed on "
                        f"{job.num_attempts} engine(s) (max_batch_retries="
                        f"{self.max_batch_retries}); last error: {type(error).__name__}: {error}"
                    ),
                    cause=error,
                )
            else:
                self._retry.append(job)
        if self._stream is not None:
            self._stream.clear()
        self._thaw_gc()  # the broken engine's objects must be collectable
        self._release()
        try:
            self.llm = self._build()
            if self._stream is not None:
                self._stream.llm = self.llm
        except Exception as e:
            self._dead = e
            for job in self._retry:
                _fail(job, self._dead_error(), cause=e)
            self._retry = []

    def _dead_error(self) -> EngineFailedError:
        return EngineFailedError(
            f"the engine could not be rebuilt after a failure: "
            f"{type(self._dead).__name__}: {self._dead}"
        )

    def _build(self) -> Any:
        llm = self._build_llm()
        self.stats.num_engine_builds += 1
        return llm

    def _release(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None and hasattr(llm, "shutdown"):
            try:
                llm.shutdown()
            except Exception:  # a broken engine may fail to shut down; it is dropped anyway
                logger.debug("engine shutdown failed", exc_info=True)
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            logger.debug("could not empty the CUDA cache", exc_info=True)


def _fail(job: _Job, error: BaseException, cause: BaseException | None = None) -> None:
    if cause is not None and error.__cause__ is None:
        error.__cause__ = cause
    with contextlib.suppress(InvalidStateError):
        job.future.set_exception(error)


__all__ = ["EngineLoop", "EngineLoopStats", "EngineFailedError"]
