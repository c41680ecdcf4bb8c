"""A worker: one tensor-parallel rank's model runner, and the loop of a worker process.

`collective_rpc` reaches `Worker` objects: a method name is looked up on the worker, a
callable is called with the worker as its first argument. Rank 0's worker lives in the
driver process; ranks 1..N-1 each run `run_worker_process` in a spawned process, which
builds its runner over its shard, then serves messages from the driver in order:

- `STEP` (`StepInputs`): run the step's forward and LM-head calls (no reply; a failure is
  reported as `FATAL` and ends the process, which also breaks rank 0's collectives);
- `RPC` (call id, method, args, kwargs): reply `RESULT` (call id, ok, value or traceback);
- `STOP`: exit.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..distributed.parallel import TPGroup
    from .model_runner import ModelRunner

STEP, RPC, STOP = "step", "rpc", "stop"
STARTED, READY, RESULT, FATAL = "started", "ready", "result", "fatal"


class RankRunner(Protocol):
    """What every rank's runner offers its worker, generative (`ModelRunner`, which also
    runs steps and holds a KV cache) or pooling (`PoolingRunner`)."""

    device: torch.device
    model: torch.nn.Module | None

    def release(self) -> None:
        """Drop the runner's device tensors so their memory returns to the device."""
        ...


RunnerFactory = Callable[["EngineConfig", "TPGroup | None", "torch.device | None"], "ModelRunner"]
"""Builds one rank's generative runner (`config, tp, device`), speculative decoding attached
where the configuration asks for it; a module-level function, so that spawned ranks get it
by reference."""


class Worker:
    """One rank: its model runner and the methods `collective_rpc` offers by name.

    Attributes:
        model_runner: The rank's `ModelRunner` (or `PoolingRunner` for pooling models).
        rank: Tensor-parallel rank (0 is the driver process).
        world_size: Number of ranks.
        device: The rank's device.
    """

    def __init__(self, model_runner: RankRunner, rank: int = 0, world_size: int = 1) -> None:
        self.model_runner = model_runner
        self.rank = rank
        self.world_size = world_size
        self.device = model_runner.device

    @property
    def model(self) -> torch.nn.Module:
        return self.model_runner.model

    # A generative rank's setup and steps, called by its executor.

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_step_inputs(self, inputs: Any) -> None:
        self.model_runner.execute_step_inputs(inputs)

    # Sleep mode, on every rank (the engine reaches them through collective_rpc).

    def sleep(self, level: int = 1) -> int:
        """Free this rank's device memory (see `ModelRunner.sleep`); the bytes freed."""
        return self.model_runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.model_runner.wake_up(tags)

    def reload_weights(
        self,
        weights_iterator: Any = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        """Load the weights again from the checkpoint (or the folder `weights_path`), vLLM's
        worker method (`llm.collective_rpc("reload_weights")`): after `wake_up(tags=
        ["weights"])` from a level-2 sleep, which already reloads them here, or to pick up a
        checkpoint rewritten in place."""
        from ..errors import InvalidParamError

        if weights_iterator is not None or not is_checkpoint_format:
            raise InvalidParamError(
                "reload_weights takes no weights_iterator here (nor is_checkpoint_format="
                "False): write the weights as a checkpoint folder and pass weights_path="
            )
        runner = self.model_runner
        if "weights" in runner.sleep_state.asleep:
            raise InvalidParamError(
                "reload_weights while the weights are asleep: wake_up(tags=['weights']) first"
            )
        runner.load_model(weights_path)
        runner.on_weights_restored()

    def pid(self) -> int:
        return os.getpid()


def call_method(worker: Worker, method: str | Callable, args: tuple, kwargs: dict) -> Any:
    """`worker.<method>(*args, **kwargs)`, or `method(worker, *args, **kwargs)`."""
    if isinstance(method, str):
        target = getattr(worker, method, None)
        if target is None or not callable(target):
            raise AttributeError(f"workers have no method {method!r}")
        return target(*args, **kwargs)
    return method(worker, *args, **kwargs)


def call_in_process(
    worker: Worker,
    method: str | Callable,
    timeout: float | None,
    args: tuple,
    kwargs: dict,
) -> Any:
    """`collective_rpc` on a rank of this process: the calling thread runs the call and
    cannot interrupt it, so `timeout` is checked when it returns (TimeoutError past it)."""
    start = time.monotonic()
    result = call_method(worker, method, tuple(args), dict(kwargs))
    if timeout is not None and time.monotonic() - start > timeout:
        raise TimeoutError(
            f"collective_rpc({method_name(method)}) took longer than timeout={timeout} s"
        )
    return result


def method_name(method: str | Callable) -> str:
    """How messages name a `collective_rpc` method: its name, or the callable's."""
    return repr(method) if isinstance(method, str) else getattr(method, "__name__", repr(method))


def release_runner(runner: RankRunner) -> None:
    """Drop the runner's device tensors and give the freed memory back to the device."""
    runner.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def dumps_call(message: Any) -> bytes:
    """Pickle a message that may hold a callable: cloudpickle (lambdas, closures, the
    calling script's functions by value), else, in an install without batchlm's
    dependencies, pickle (functions of importable modules only)."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass
class WorkerProcessArgs:
    """What a spawned rank needs to join the group and build its runner."""

    config: Any  # EngineConfig
    build_runner: RunnerFactory
    rank: int
    world_size: int
    store_port: int
    timeout_s: float
    num_threads: int | None = None
    """CPU: torch threads for this rank (the ranks share the cores)."""


def run_worker_process(args: WorkerProcessArgs, conn: Any) -> None:
    """Entry point of a spawned rank (never returns normally: the process exits)."""
    from ..distributed.parallel import connect_store, create_tp_group

    # Ctrl-C in a terminal reaches every process of its group: the driver decides what an
    # interrupt stops (see executor._interrupt_deferred); a rank goes when the driver does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn.send((STARTED, os.getpid()))
        device = args.config.parallel.rank_device(args.config.device.device, args.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif args.num_threads:
            torch.set_num_threads(args.num_threads)
        store = connect_store(args.store_port, args.world_size, args.timeout_s)
        tp = create_tp_group(
            store,
            args.rank,
            args.world_size,
            device,
            args.timeout_s,
            not args.config.parallel.disable_custom_all_reduce,
        )
        runner = args.build_runner(args.config, tp, device)
        worker = Worker(runner, args.rank, args.world_size)
        conn.send((READY, None))
    except BaseException:
        _send_fatal(conn, traceback.format_exc())
        os._exit(1)
    _serve(worker, conn)


def _serve(worker: Worker, conn: Any) -> None:
    while True:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver is gone
            os._exit(1)
        if kind == STEP:
            try:
                worker.execute_step_inputs(payload)
            except BaseException:
                _send_fatal(conn, traceback.format_exc())
                os._exit(1)
        elif kind == RPC:
            call_id, method, args, kwargs = payload
            try:
                reply = (RESULT, (call_id, True, call_method(worker, method, args, kwargs)))
            except BaseException:
                reply = (RESULT, (call_id, False, traceback.format_exc()))
            try:
                conn.send(reply)
            except Exception:  # an unpicklable result
                conn.send((RESULT, (call_id, False, traceback.format_exc())))
        elif kind == STOP:
            conn.close()
            # Skip interpreter teardown: it could wait on communicator destructors.
            os._exit(0)


def _send_fatal(conn: Any, message: str) -> None:
    try:
        conn.send((FATAL, message))
    except Exception:
        pass


@contextlib.contextmanager
def script_hidden() -> Iterator[None]:
    """While a rank's process starts: the main module looks like an interactive session's
    (no `__file__`, no `__spec__`), so multiprocessing's spawn does not import it in the
    child. Restored on exit."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def exit_status(process: Any) -> str:
    """How a rank's process ended, for messages (`exit code 1`, `killed by SIGKILL`)."""
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
