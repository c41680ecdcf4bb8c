"""Failures on demand for the tests of retries and resumption; off unless a test arms it.

Each place that can fail on purpose calls one function here, which does nothing unless a
test armed it. A test reaches each place through the channel that crosses its process
boundary:

- `EngineLoop` (the test's own process): `fail_engine_calls(loop, error, count)` makes the
  loop's next `count` engine calls raise `error`, as a broken device would.
- Ray engine actors (worker processes) and the `batchlm` command (a subprocess): a
  `FaultPlan` in the environment variable `BATCHLM_FAULT_INJECTION` (`plan.env()`; for
  actors, pass it as `runtime_env={"env_vars": plan.env()}` to `map_batches`).
- Spark tasks (Python workers that a running session started earlier): the Spark local
  property `SPARK_TRACE_PROPERTY`, a folder where each engine build and batch is traced
  and where a file `fail_once_partition_<n>` fails the first attempt of partition n.

Example:
    >>> plan = FaultPlan(actor=ActorFault(on_call=3, kind="exit", marker="/tmp/exits"))
    >>> ds.map_batches(EmbedActor, **map_batches_kwargs(
    ...     config, runtime_env={"env_vars": plan.env()}))
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from batchlm.engine import envs

ENV_VAR = "BATCHLM_FAULT_INJECTION"
"""The environment variable that carries a `FaultPlan` as JSON (read by `envs`)."""
SPARK_TRACE_PROPERTY = "batchlm.spark.trace_dir"
"""Spark local property: a folder for engine-build and batch traces and one-off failures."""
KILLED_EXIT_CODE = 3
"""What the `batchlm` process exits with when a plan ends it as if it were killed."""
ACTOR_FAULT_KINDS = ("exit", "raise")


@dataclass(frozen=True)
class ActorFault:
    """What a Ray engine actor does at its `on_call`-th batch."""

    on_call: int
    """The batch (1-based, counted per actor process) at which the fault happens."""
    kind: str
    """`exit`: the process ends (`os._exit(1)`) while `marker` holds fewer than `times`
    lines, one written per exit, so that a restarted actor runs on. `raise`: the next
    `times` engine calls of the actor fail, and `marker` gets one line."""
    marker: str
    """A file shared by every actor process, counting the faults that happened."""
    times: int = 1
    """How many exits, or engine calls that fail."""

    def __post_init__(self) -> None:
        if self.kind not in ACTOR_FAULT_KINDS:
            raise ValueError(f"kind={self.kind!r} is unknown; use one of exit, raise")


@dataclass(frozen=True)
class FaultPlan:
    """The faults that cross process boundaries (see the module doc)."""

    exit_after_shards: int | None = None
    """The job's process exits at once (`KILLED_EXIT_CODE`), as if killed, after committing
    this many shard files, between shards."""
    exit_after_batches: int | None = None
    """The job's process exits at once when the runner hands over a batch after this many
    were written (0: before any row; else usually mid-shard, its temporary file open)."""
    actor: ActorFault | None = None
    """What every Ray engine actor of the job does."""

    def env(self) -> dict[str, str]:
        """The environment that carries this plan into another process."""
        return {ENV_VAR: json.dumps(asdict(self))}

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{ENV_VAR} has unknown key(s) {unknown}; valid: {sorted(known)}")
        actor = data.get("actor")
        return cls(**{**data, "actor": ActorFault(**actor) if actor else None})


@lru_cache(maxsize=4)
def _parse(text: str | None) -> FaultPlan | None:
    return FaultPlan.from_json(text) if text else None


def active_plan() -> FaultPlan | None:
    """The plan in this process's environment; None (no faults) when unset."""
    return _parse(envs.fault_injection())


# ---- EngineLoop ---------------------------------------------------------------------------


@dataclass
class _ArmedFailure:
    error: BaseException
    remaining: int


_ARMED: weakref.WeakKeyDictionary[Any, _ArmedFailure] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def fail_engine_calls(loop: Any, error: BaseException, count: int = 1) -> None:
    """The next `count` engine calls of `loop` (an `EngineLoop`) raise `error`."""
    with _LOCK:
        _ARMED[loop] = _ArmedFailure(error, count)


def before_engine_call(loop: Any) -> None:
    """Called by `loop` before each engine call; raises what a test armed for it."""
    if not _ARMED:
        return
    with _LOCK:
        armed = _ARMED.get(loop)
        if armed is None or armed.remaining <= 0:
            return
        armed.remaining -= 1
    raise armed.error


# ---- Ray engine actors --------------------------------------------------------------------


def on_actor_call(num_calls: int, loop: Any) -> None:
    """Called by an engine actor as its `num_calls`-th batch arrives, `loop` its engine."""
    plan = active_plan()
    fault = plan.actor if plan is not None else None
    if fault is None or num_calls != fault.on_call:
        return
    marker = Path(fault.marker)
    if fault.kind == "raise":
        _append_pid(marker)
        fail_engine_calls(loop, RuntimeError("injected engine failure"), fault.times)
        return
    done = len(marker.read_text().splitlines()) if marker.exists() else 0
    if done < fault.times:
        _append_pid(marker)
        os._exit(1)


def _append_pid(marker: Path) -> None:
    with marker.open("a") as f:
        f.write(f"{os.getpid()}\n")


# ---- Spark tasks --------------------------------------------------------------------------


def _spark_trace_dir() -> Path | None:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    value = ctx.getLocalProperty(SPARK_TRACE_PROPERTY) if ctx is not None else None
    return Path(value) if value else None


def _trace(folder: Path, name: str, line: str) -> None:
    with open(folder / name, "a") as f:
        f.write(line + "\n")


def on_spark_engine_build(key: str) -> None:
    """Traces `<pid> <engine key>` to `engine_builds.txt`."""
    folder = _spark_trace_dir()
    if folder is not None:
        _trace(folder, "engine_builds.txt", f"{os.getpid()} {key}")


def on_spark_batch(partition_id: int, attempt: int, num_rows: int) -> None:
    """Traces `<pid> <partition> <attempt> <rows>` to `batches.txt`; fails the first attempt
    of partition n once if the file `fail_once_partition_<n>` exists (and removes it)."""
    folder = _spark_trace_dir()
    if folder is None:
        return
    _trace(folder, "batches.txt", f"{os.getpid()} {partition_id} {attempt} {num_rows}")
    if attempt != 0:
        return
    try:
        (folder / f"fail_once_partition_{partition_id}").unlink()
    except FileNotFoundError:
        return
    raise RuntimeError(f"injected failure of partition {partition_id} (attempt {attempt})")


# ---- the batchlm command ------------------------------------------------------------------


def after_shard_commit(num_committed: int) -> None:
    """Called by the job after committing its `num_committed`-th shard file."""
    plan = active_plan()
    limit = plan.exit_after_shards if plan is not None else None
    if limit is not None and num_committed >= limit:
        os._exit(KILLED_EXIT_CODE)


def before_batch_write(num_written: int) -> None:
    """Called by the job before writing a batch, `num_written` batches written so far."""
    plan = active_plan()
    limit = plan.exit_after_batches if plan is not None else None
    if limit is not None and num_written >= limit:
        os._exit(KILLED_EXIT_CODE)  # with this shard's temporary file open


__all__ = [
    "ENV_VAR",
    "SPARK_TRACE_PROPERTY",
    "KILLED_EXIT_CODE",
    "ActorFault",
    "FaultPlan",
    "active_plan",
    "fail_engine_calls",
    "before_engine_call",
    "on_actor_call",
    "on_spark_engine_build",
    "on_spark_batch",
    "after_shard_commit",
    "before_batch_write",
]
