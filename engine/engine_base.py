"""What the two engines share (`LLMEngine` generates, `PoolingEngine` pools): the
configuration, the tokenizer, the metrics, `collective_rpc`, sleep mode and shutdown.

`LLM` builds the one its model's runner needs and checks, per method, that it has it.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from .config import EngineConfig, ModelConfig
from .core.scheduler import SchedulerStats
from .metrics import EngineMetrics
from .sleep_mode import EngineSleep
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class EngineBase(ABC):
    """Args:
    config: Everything the engine is built from.
    """

    runner_type: str
    """`generate` or `pooling`: the `runner=` of the models this engine runs."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.tokenizer = (
            None
            if mc.skip_tokenizer_init
            else load_tokenizer(mc.tokenizer_path, mc.trust_remote_code)
        )
        self.vocab_size = int(mc.hf_config.vocab_size)
        self.metrics: EngineMetrics | None = None
        """Prometheus metrics; None with `disable_log_stats`."""
        if not config.disable_log_stats:
            self.metrics = EngineMetrics(mc.model, mc.max_model_len, self.stats)
        self.is_shut_down = False
        self.sleep_state = EngineSleep(config.model.enable_sleep_mode)
        """Sleep mode: what is asleep (`sleep`, `wake_up`, `is_sleeping`)."""

    @property
    def model_config(self) -> ModelConfig:
        """The model's configuration (vLLM's `llm_engine.model_config`)."""
        return self.config.model

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- sleep mode -------------------------------------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause scheduling (level 0), and free the device memory of every rank (level 1:
        weights to host memory, KV cache and CUDA graphs freed; level 2: weights dropped
        too). `mode` settles the unfinished requests first: `abort` ends them (their outputs,
        finish reason "abort", come back from the next wait), `wait` runs them to the end,
        `keep` keeps them queued (recomputed after waking). See `sleep_mode.py`."""
        state = self.sleep_state
        state.check_sleep(level, mode)
        self._settle_requests(mode, level)
        state.is_paused = True
        if level == 0:
            return
        if state.asleep:
            logger.warning("the engine is already asleep (level %d); sleep ignored", state.level)
            return
        start = time.perf_counter()
        freed = self._sleep_ranks(level)
        state.fall_asleep(level)
        logger.info(
            "sleep(level=%d) took %.3f s and freed %.2f GiB of device memory",
            level,
            time.perf_counter() - start,
            freed / 2**30,
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` freed (`tags`: `weights`, `kv_cache`, `scheduling`; None:
        everything); scheduling resumes once no memory is asleep."""
        memory_tags = self.sleep_state.tags_to_wake(tags)
        if memory_tags:
            start = time.perf_counter()
            self._wake_ranks(memory_tags)
            self.sleep_state.woke(memory_tags)
            logger.info("wake_up(%s) took %.3f s", memory_tags, time.perf_counter() - start)
        if not self.sleep_state.asleep:
            self.sleep_state.is_paused = False
            self.sleep_state.level = 0

    def is_sleeping(self) -> bool:
        """True from `sleep` (any level) until everything is awake again."""
        return self.sleep_state.is_sleeping

    @abstractmethod
    def _settle_requests(self, mode: str, level: int) -> None:
        """Before a sleep: end, finish or keep the unfinished requests (`mode`)."""

    @abstractmethod
    def _sleep_ranks(self, level: int) -> int:
        """Free every rank's device memory; the bytes rank 0's device got back."""

    @abstractmethod
    def _wake_ranks(self, tags: list[str]) -> None:
        """Restore the memory `tags` names on every rank."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a worker method (by name) or a callable (with the worker first) on every
        tensor-parallel rank; the results in rank order."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False while requests are running."""

    def stats(self) -> SchedulerStats | None:
        """The scheduler's counts (None without a scheduler)."""
        return None

    def start_metrics_server(self) -> None:
        """Serve the metrics over HTTP when `metrics_port` asks for it (after construction,
        so that a failed engine leaves no server behind)."""
        if self.metrics is not None and self.config.metrics_port is not None:
            self.metrics.start_http_server(self.config.metrics_port)

    def shutdown(self) -> None:
        """Stop the metrics server and every worker process, and free the model (and the KV
        cache) (idempotent). The engine cannot run afterwards."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        if self.metrics is not None:
            self.metrics.shutdown()
        self._release()

    @abstractmethod
    def _release(self) -> None:
        """Free the device memory and processes the engine holds (once, at shutdown)."""
