"""Executors: where the ranks' workers run, and how the engine reaches all of them.

`Executor` is one rank in this process (`tensor_parallel_size=1`): the engine calls the
runner's own `execute_model`, with nothing in between. `MultiprocExecutor` keeps rank 0 in
this process and spawns ranks 1..N-1: rank 0's runner sends each step's inputs down a pipe
to every other rank before its forward, and the ranks meet in the forward's collectives.

Spawned ranks do not run the calling script again: multiprocessing's spawn start imports
the parent's `__main__` module in each child (as `__mp_main__`), so a script that builds its
`LLM` at top level, with no `if __name__ == "__main__":` guard, would build another in every
rank and fail. The ranks start as from an interactive session instead
(`worker.script_hidden`): they need nothing from the script, since what reaches them
travels by value (the engine configuration, and `collective_rpc`'s callables through
cloudpickle).

A failed rank never leaves the driver hanging: before each step the driver polls the
workers' pipes and process sentinels (one `select`), a rank's exception arrives as a
message, a dead rank breaks the gloo collectives at once (for NCCL a watchdog thread
aborts the group), and every wait on a worker has a timeout or a liveness check.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any, Protocol

import torch

from .. import envs
from ..config import EngineConfig
from ..core.scheduler import SchedulerOutput
from ..errors import EngineDeadError
from .grammar_mask import GrammarMaskSource
from .runner_output import ModelRunnerOutput, PendingOutput
from .worker import (
    FATAL,
    READY,
    RESULT,
    RPC,
    STARTED,
    STEP,
    STOP,
    RankRunner,
    RunnerFactory,
    Worker,
    WorkerProcessArgs,
    call_in_process,
    call_method,
    dumps_call,
    exit_status,
    method_name,
    release_runner,
    run_worker_process,
    script_hidden,
)

logger = logging.getLogger(__name__)

# Seconds a failing step waits for the failed rank's report (exit status or traceback).
FAILURE_REPORT_WAIT_S = 5.0
# Seconds `shutdown` waits for a worker to exit before terminating it.
SHUTDOWN_GRACE_S = 5.0


class StepRunner(RankRunner, Protocol):
    """What an executor needs of a generative rank's runner (`ModelRunner`)."""

    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(
        self, out: SchedulerOutput, grammar: GrammarMaskSource | None = None
    ) -> ModelRunnerOutput: ...

    def launch_model(
        self, out: SchedulerOutput, grammar: GrammarMaskSource | None = None
    ) -> PendingOutput: ...


class Executor:
    """The single rank, in this process.

    Args:
        runner: The rank's generative model runner.
    """

    world_size = 1

    def __init__(self, runner: StepRunner) -> None:
        self.driver_worker = Worker(runner)
        self.is_shut_down = False
        # The engine calls the runner directly: no indirection on the single-rank path.
        self.execute_model = runner.execute_model
        self.launch_model = runner.launch_model

    @property
    def runner(self) -> Any:
        return self.driver_worker.model_runner

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list[Any]:
        """Call `method` on every rank's worker; results in rank order.

        The calling thread runs rank 0's call itself and cannot interrupt it, so `timeout`
        is checked when it returns.
        """
        self._check_open()
        return [call_in_process(self.driver_worker, method, timeout, args, kwargs or {})]

    def check_health(self) -> None:
        """Raise `EngineDeadError` if a rank has failed."""

    def shutdown(self) -> None:
        """Free the runner's model and KV cache (idempotent)."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        release_runner(self.runner)

    def _check_open(self) -> None:
        if self.is_shut_down:
            raise EngineDeadError("the engine was shut down; build a new LLM")


@dataclass
class _WorkerHandle:
    rank: int
    process: Any  # multiprocessing.Process
    conn: Any  # multiprocessing.connection.Connection
    pid: int | None = None


class MultiprocExecutor(Executor):
    """Rank 0 here, ranks 1..N-1 in spawned processes.

    Args:
        config: The engine configuration; `config.parallel.tensor_parallel_size` ranks.
        build_runner: Builds each rank's runner (here for rank 0, in its process for the
            others).
    """

    def __init__(self, config: EngineConfig, build_runner: RunnerFactory) -> None:
        from ..distributed.parallel import create_store, create_tp_group

        self.world_size = config.parallel.tensor_parallel_size
        self.timeout_s = envs.tp_timeout_s()
        self.is_shut_down = False
        self._workers: list[_WorkerHandle] = []
        self._dead_reason: str | None = None
        self._call_ids = itertools.count()
        self._tp = None
        self._watch_stop: Any = None
        device = config.parallel.rank_device(config.device.device, 0)
        num_threads = None
        if device.type == "cpu":  # the ranks share this machine's cores
            num_threads = max(1, (os.cpu_count() or 1) // self.world_size)
        store = create_store(self.world_size, self.timeout_s)
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, self.world_size):
                parent, child = ctx.Pipe(duplex=True)
                args = WorkerProcessArgs(
                    config,
                    build_runner,
                    rank,
                    self.world_size,
                    store.port,
                    self.timeout_s,
                    num_threads,
                )
                process = ctx.Process(
                    target=run_worker_process,
                    args=(args, child),
                    name=f"batchlm-tp-rank{rank}",
                    daemon=True,
                )
                with script_hidden():
                    process.start()
                child.close()
                self._workers.append(_WorkerHandle(rank, process, parent))
            for w in self._workers:
                w.pid = self._expect(w, STARTED)
            custom = not config.parallel.disable_custom_all_reduce
            self._tp = self._while_watching(
                lambda: create_tp_group(store, 0, self.world_size, device, self.timeout_s, custom)
            )
            runner = build_runner(config, self._tp, device)
            for w in self._workers:
                self._expect(w, READY)
        except BaseException:
            self.shutdown()
            raise
        super().__init__(runner)
        self.execute_model = self._execute_model
        self.launch_model = self._launch_model
        self._store = store  # NCCL sets up its communicators at the first collective, via the store
        self._start_watchdog()
        logger.info(
            "tensor parallel: %d ranks (%s), worker pids %s",
            self.world_size,
            self._tp.backend,
            [w.pid for w in self._workers],
        )

    # ---- setup ------------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        # Every rank profiles its own memory (the CUDA profile runs collective forwards).
        return min(self.collective_rpc("determine_num_blocks", timeout=self.timeout_s))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", timeout=self.timeout_s, args=(num_blocks,))
        # From now on every step of rank 0 goes to the other ranks too.
        self.runner.step_listener = self._broadcast_step

    def _expect(self, w: _WorkerHandle, kind: str) -> Any:
        """Wait for a startup message from `w` (bounded, and failing fast if it dies)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineDeadError(
                    f"tensor-parallel rank {w.rank} did not start within {self.timeout_s} s "
                    "(BATCHLM_TP_TIMEOUT_S)"
                )
            ready = connection.wait([w.conn, w.process.sentinel], timeout=remaining)
            got = payload = None
            if w.conn in ready:
                try:
                    got, payload = w.conn.recv()
                except (EOFError, OSError):  # it exited: its pipe closed with nothing in it
                    pass
                if got == kind:
                    return payload
                if got == FATAL:
                    raise EngineDeadError(
                        f"tensor-parallel rank {w.rank} failed to start:\n{payload}"
                    )
            if ready and got is None:
                w.process.join(2.0)  # the sentinel fires just before the exit status is set
                raise EngineDeadError(
                    f"tensor-parallel rank {w.rank} exited while starting "
                    f"({exit_status(w.process)}); its own error, if any, is in this "
                    "process's stderr above"
                )

    def _while_watching(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (a blocking rendezvous) in a thread; fail fast if a worker dies."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # re-raised in the caller
                box["error"] = e

        thread = threading.Thread(target=target, name="batchlm-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            for w in self._workers:
                if not w.process.is_alive():
                    self._expect(w, READY)  # raises with the worker's report
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _start_watchdog(self) -> None:
        """NCCL collectives wait out their timeout on a dead peer; abort them instead."""
        if self._tp.backend != "nccl":
            return
        stop_r, stop_w = multiprocessing.Pipe(duplex=False)
        self._watch_stop = stop_w
        sentinels = [w.process.sentinel for w in self._workers]

        def watch() -> None:
            ready = connection.wait([*sentinels, stop_r])
            if stop_r not in ready and not self.is_shut_down:
                logger.error("a tensor-parallel worker died; aborting the process group")
                self._tp.abort()

        threading.Thread(target=watch, name="batchlm-tp-watchdog", daemon=True).start()

    # ---- steps ------------------------------------------------------------------------

    def _broadcast_step(self, inputs: Any) -> None:
        data = pickle.dumps((STEP, inputs), protocol=pickle.HIGHEST_PROTOCOL)
        for w in self._workers:
            w.conn.send_bytes(data)

    def _execute_model(self, scheduler_output: Any, grammar: Any = None) -> Any:
        return self._launch_model(scheduler_output, grammar).result()

    def _launch_model(self, scheduler_output: Any, grammar: Any = None) -> Any:
        """`runner.launch_model` (rank 0's: it alone samples, so `grammar`, the
        structured-outputs mask, is its alone), with a failure (now or when the output is
        awaited) handled like a failed step."""
        self.check_health()
        with _interrupt_deferred():
            try:
                return _WatchedOutput(self, self.runner.launch_model(scheduler_output, grammar))
            except BaseException as e:
                self._fail(e)
                raise

    def check_health(self) -> None:
        self._check_open()
        ready = connection.wait(self._watched(), timeout=0)
        if ready:
            reason = self._failure_report(ready_now=ready)
            if reason is not None:
                self._fail_with(reason)

    def _watched(self) -> list[Any]:
        return [x for w in self._workers for x in (w.conn, w.process.sentinel)]

    def _failure_report(self, ready_now: list[Any] | None = None, wait_s: float = 0.0):
        """What went wrong with a rank, or None if every rank is fine. Stale rpc results
        found on the way are dropped."""
        deadline = time.monotonic() + wait_s
        while True:
            ready = ready_now if ready_now is not None else []
            ready_now = None
            if not ready:
                ready = connection.wait(
                    self._watched(), timeout=max(0.0, deadline - time.monotonic())
                )
            for w in self._workers:
                report = None
                if w.conn in ready:
                    try:
                        kind, payload = w.conn.recv()
                    except (EOFError, OSError):
                        kind, payload = None, None
                    if kind == FATAL:
                        report = f"tensor-parallel rank {w.rank} (pid {w.pid}) failed:\n{payload}"
                if report is None and w.process.sentinel in ready:
                    w.process.join(2.0)  # the sentinel fires just before the exit status is set
                    report = (
                        f"tensor-parallel rank {w.rank} (pid {w.pid}) died "
                        f"({exit_status(w.process)})"
                    )
                if report is not None:
                    return report
            if time.monotonic() >= deadline:
                return None

    def _fail(self, cause: BaseException) -> None:
        """A step or call broke off: find the failed rank, stop the others, and raise
        `EngineDeadError` (or let the caller re-raise `cause` when no rank failed)."""
        if isinstance(cause, EngineDeadError):
            self.shutdown()
            return
        communication = isinstance(cause, (RuntimeError, OSError, EOFError))
        report = self._failure_report(wait_s=FAILURE_REPORT_WAIT_S if communication else 0.0)
        if report is None:
            # Rank 0 itself failed mid-step: the other ranks are stuck in its collectives.
            self._dead_reason = f"rank 0 failed during a step: {cause!r}"
            self.shutdown()
            return
        self._fail_with(report, cause)

    def _fail_with(self, report: str, cause: BaseException | None = None) -> None:
        self._dead_reason = report
        self.shutdown()
        raise EngineDeadError(report + "\nThe engine is stopped; build a new LLM.") from cause

    # ---- collective_rpc ---------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list[Any]:
        """Call `method` on every rank's worker; results in rank order.

        Rank 0's call runs in this thread once the other ranks have theirs; `timeout`
        bounds the wait for the other ranks' answers (TimeoutError past it), and rank 0's
        own call is checked against it when it returns, as with one rank.
        """
        self.check_health()
        args, kwargs = tuple(args), dict(kwargs or {})
        deadline = None if timeout is None else time.monotonic() + timeout
        call_id = next(self._call_ids)
        message = dumps_call((RPC, (call_id, method, args, kwargs)))
        try:
            for w in self._workers:
                w.conn.send_bytes(message)
        except OSError as e:
            self._fail(e)
            raise
        results = [call_method(self.driver_worker, method, args, kwargs)]
        if deadline is not None and time.monotonic() > deadline:
            # As with one rank: this thread cannot interrupt its own call, so it checks after.
            # The other ranks' answers to this call are dropped when the next call reads.
            raise TimeoutError(
                f"collective_rpc({method_name(method)}) took longer than timeout={timeout} s "
                "on rank 0 (this process)"
            )
        for w in self._workers:
            results.append(self._wait_result(w, call_id, deadline, timeout, method_name(method)))
        return results

    def _wait_result(
        self,
        w: _WorkerHandle,
        call_id: int,
        deadline: float | None,
        timeout: float | None,
        name: str,
    ) -> Any:
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait([w.conn, w.process.sentinel], timeout=remaining)
            if w.conn in ready:
                try:
                    kind, payload = w.conn.recv()
                except (EOFError, OSError):
                    continue  # the sentinel reports the death next round
                if kind == RESULT:
                    got_id, ok, value = payload
                    if got_id != call_id:
                        continue  # the answer to an earlier call that timed out
                    if ok:
                        return value
                    raise RuntimeError(f"collective_rpc({name}) failed on rank {w.rank}:\n{value}")
                if kind == FATAL:
                    self._fail_with(
                        f"tensor-parallel rank {w.rank} (pid {w.pid}) failed:\n{payload}"
                    )
            elif ready:
                w.process.join(2.0)  # the sentinel fires just before the exit status is set
                self._fail_with(
                    f"tensor-parallel rank {w.rank} (pid {w.pid}) died "
                    f"({exit_status(w.process)}) during collective_rpc({name})"
                )
            else:
                raise TimeoutError(
                    f"collective_rpc({name}) got no answer from rank {w.rank} within "
                    f"timeout={timeout} s"
                )

    # ---- shutdown ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(f"{self._dead_reason}\nThe engine is stopped; build a new LLM.")
        super()._check_open()

    def shutdown(self) -> None:
        """Stop every worker process (terminating any that does not exit in time) and free
        rank 0's model and KV cache. Idempotent."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        if self._watch_stop is not None:
            self._watch_stop.send(None)
        stop = pickle.dumps((STOP, None))
        for w in self._workers:
            try:
                w.conn.send_bytes(stop)
            except OSError:
                pass
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self._workers:
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(2.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        worker = getattr(self, "driver_worker", None)
        if worker is not None:
            release_runner(worker.model_runner)
        peer = self._tp.peer_all_reduce if self._tp is not None else None
        if peer is not None:
            # The other ranks are gone: nothing may still wait for them, then unmap.
            peer.abort_waits()
            try:
                torch.cuda.synchronize(peer.device)
            except RuntimeError:  # a broken device: leave the mappings to process exit
                peer = None
            if peer is not None:
                peer.close()
        self._tp = None

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [w.pid for w in self._workers]


class _WatchedOutput:
    """A launched step's pending output whose failure stops the ranks (`_fail`)."""

    def __init__(self, executor: MultiprocExecutor, pending: Any) -> None:
        self._executor = executor
        self._pending = pending

    def result(self) -> Any:
        try:
            return self._pending.result()
        except BaseException as e:
            self._executor._fail(e)
            raise


def create_executor(config: EngineConfig, build_runner: RunnerFactory) -> Executor:
    """The executor for a generative model's configuration."""
    if config.parallel.tensor_parallel_size == 1:
        return Executor(build_runner(config, None, None))
    return MultiprocExecutor(config, build_runner)


@contextlib.contextmanager
def _interrupt_deferred():
    """Ctrl-C (SIGINT) during the block is raised as KeyboardInterrupt when it ends.

    Launching a step sends its inputs to every rank and runs rank 0's share of the
    forward's collectives; a step that rank 0 left halfway would leave the other ranks
    waiting in those collectives, and the engine could only be stopped. Deferred to the end
    of the launch, an interrupt leaves every rank at the same step, so the LLM stays usable
    after it, as with one rank. A second Ctrl-C during the block is raised at once (and
    stops the engine). Only in the main thread under Python's default SIGINT handler: a
    handler of the application's own is left alone."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    interrupted = False

    def defer(signum: int, frame: Any) -> None:
        nonlocal interrupted
        if interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        interrupted = True
        logger.warning("interrupt: stopping after this step (Ctrl-C again to stop at once)")

    signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        raise KeyboardInterrupt
