"""The pooling engine: one encoder (or decoder-as-encoder) runner for embed / classify /
score / encode. No scheduler and no KV cache: `LLM`'s pooling methods pack their inputs
and run them through `pooling_runner` in one call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import EngineConfig
from .engine_base import EngineBase
from .errors import EngineDeadError
from .worker.pooling_runner import PoolingRunner
from .worker.worker import Worker, call_in_process, release_runner


class PoolingEngine(EngineBase):
    """Owns a `PoolingRunner` and the tokenizer.

    Args:
        config: Everything the engine is built from (`config.model.runner_type` is
            `pooling`).
    """

    runner_type = "pooling"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.pooling_runner = PoolingRunner(config)
        self._worker = Worker(self.pooling_runner)

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if self.is_shut_down:
            raise EngineDeadError("the engine was shut down; build a new LLM")
        return [call_in_process(self._worker, method, timeout, args, kwargs or {})]

    def reset_prefix_cache(self) -> bool:
        """A pooling model keeps no KV cache: nothing to forget (True, as vLLM answers)."""
        return True

    def _settle_requests(self, mode: str, level: int) -> None:
        """Pooling calls run to the end before returning: nothing is ever left unfinished."""

    def _sleep_ranks(self, level: int) -> int:
        return self.pooling_runner.sleep(level)

    def _wake_ranks(self, tags: list[str]) -> None:
        self.pooling_runner.wake_up(tags)

    def _release(self) -> None:
        release_runner(self.pooling_runner)
