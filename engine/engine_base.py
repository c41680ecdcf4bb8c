"""What the two engines share (`LLMEngine` generates, `PoolingEngine` pools): the
configuration, the tokenizer, the metrics, `collective_rpc` and shutdown.

`LLM` builds the one its model's runner needs and checks, per method, that it has it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from .config import EngineConfig
from .core.scheduler import SchedulerStats
from .metrics import EngineMetrics
from .tokenizer import load_tokenizer


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
