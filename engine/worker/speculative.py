"""The interface between the model runner and speculative decoding.

Speculative decoding (`spec_decode/`) is built on top of the runner (a draft model is a
runner of its own) and handed to it once both exist; the runner calls it through this
interface and imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ..core.scheduler import ScheduledRequest, SchedulerOutput
from .runner_output import ModelRunnerOutput


class SpeculativeDecoder(Protocol):
    """What the runner calls of speculative decoding (`spec_decode/runner.py`)."""

    block_bytes: int
    """KV bytes per block besides the target's (a draft model's cache)."""
    draft_runner: Any
    """The draft model's `ModelRunner`, or None (sleep mode puts it to sleep with the
    target's)."""

    def allocate_kv_cache(self, num_blocks: int, final: bool) -> None: ...

    def before_forward(self, out: SchedulerOutput) -> None: ...

    def sample_rows(self, reqs: Sequence[ScheduledRequest], qsl: np.ndarray) -> np.ndarray: ...

    def verify(
        self,
        logits: torch.Tensor,
        reqs: Sequence[ScheduledRequest],
        generators: dict[int, torch.Generator],
        out: ModelRunnerOutput,
    ) -> None: ...
