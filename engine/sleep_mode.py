"""Sleep mode, the engine's side: what is asleep, and the checks of `sleep` / `wake_up`.

As in vLLM (`LLM(enable_sleep_mode=True)`):

- `sleep(level=0)` pauses scheduling: requests may still be queued (`enqueue`), nothing
  runs; the device memory stays.
- `sleep(level=1)` also frees the device memory of every rank: the weights go to host
  memory (pinned on CUDA), the KV cache, the CUDA graphs and the step buffers are freed,
  and the caching allocator gives the memory back to the device.
- `sleep(level=2)` frees the weights without keeping them: waking reads them again from
  the checkpoint (or draws the same seeded random weights with `load_format="dummy"`),
  so outputs after waking equal those before at either level.
- `wake_up(tags=None)` restores everything; `tags=["weights"]`, `["kv_cache"]` restore
  one part (the CUDA graphs are captured again once both are back), `["scheduling"]`
  ends a level-0 pause. Scheduling resumes once no memory is asleep. The KV cache comes
  back empty: the prefix cache is reset.

`mode` settles the requests not finished at the time of the sleep: `abort` ends them
(their outputs come back, finish reason "abort", from the next `wait_for_completion`),
`wait` runs them to the end first, `keep` keeps them (the running ones are preempted,
their KV freed, and recomputed after waking). `generate`, `chat` and the pooling calls
raise `EngineSleepingError` while the engine sleeps; `enqueue` keeps queueing.

The ranks' memory mechanics are in `worker/sleep_mode.py`.
"""

from __future__ import annotations

import logging

from .errors import EngineSleepingError, InvalidParamError

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (0, 1, 2)
MEMORY_TAGS = ("weights", "kv_cache")
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
PAUSE_MODES = ("abort", "wait", "keep")


class EngineSleep:
    """An engine's sleep state.

    Args:
        enabled: `enable_sleep_mode`: levels 1 and 2 (memory) are allowed.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.level = 0
        """The level of the current sleep (0: no memory asleep)."""
        self.asleep: set[str] = set()
        """`MEMORY_TAGS` asleep now."""
        self.is_paused = False
        """Scheduling is paused (any level, until everything is awake)."""

    @property
    def is_sleeping(self) -> bool:
        return self.is_paused or bool(self.asleep)

    def check_sleep(self, level: int, mode: str) -> None:
        """`sleep`'s arguments checked (before anything changes)."""
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise InvalidParamError(
                f"sleep(level={level!r}): the sleep level is 0 (pause scheduling), 1 (weights "
                "to host memory, KV cache freed) or 2 (weights and KV cache freed)"
            )
        if mode not in PAUSE_MODES:
            raise InvalidParamError(
                f"sleep(mode={mode!r}): Invalid pause mode: {mode}; use 'abort', 'wait' or 'keep'"
            )
        if level >= 1 and not self.enabled:
            raise InvalidParamError(
                f"sleep(level={level}) frees the device memory, which needs sleep mode: build "
                "the LLM with enable_sleep_mode=True (or pause scheduling alone with "
                "sleep(level=0))"
            )

    def fall_asleep(self, level: int) -> None:
        self.level = level
        self.asleep = set(MEMORY_TAGS)

    def tags_to_wake(self, tags: list[str] | None) -> list[str]:
        """The memory tags a `wake_up(tags)` restores now (checked; those not asleep are
        left out, with a warning)."""
        if tags is None:
            return [t for t in MEMORY_TAGS if t in self.asleep]
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise InvalidParamError(
                f"wake_up(tags={tags!r}): tags must be None or a list such as ['weights']"
            )
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise InvalidParamError(
                f"wake_up(tags={list(tags)!r}): unknown tag(s) {unknown}; values must be in "
                f"{WAKE_TAGS} (None wakes everything)"
            )
        memory = [t for t in MEMORY_TAGS if t in tags]
        idle = [t for t in memory if t not in self.asleep]
        if idle:
            logger.warning("wake_up: %s not asleep (asleep: %s)", idle, sorted(self.asleep))
        return [t for t in memory if t in self.asleep]

    def woke(self, tags: list[str]) -> None:
        self.asleep -= set(tags)

    def check_awake(self, what: str) -> None:
        """Raise `EngineSleepingError` if `what` (a call that runs the model) cannot run."""
        if self.asleep:
            raise EngineSleepingError(
                f"{what} cannot run: the engine is asleep (sleep level {self.level}, "
                f"{' and '.join(sorted(self.asleep))} freed); call wake_up() first (queued "
                "requests are kept)"
            )
        if self.is_paused:
            raise EngineSleepingError(
                f"{what} cannot run: scheduling is paused (sleep(level=0)); call "
                "wake_up(tags=['scheduling']) first (queued requests are kept)"
            )
