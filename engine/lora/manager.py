"""The model runner's adapters: the model's LoRA layers, the device slots they read, the
host cache of parsed adapters, and each step's slots.

Rank 0 decides each step's slots (`step_inputs`: the scheduler never puts more adapters in a
step than there are slots) and the loads that need; the step carries both to every rank
(`LoRAStepInputs` in `StepInputs`), and each rank copies the loads from its own cache
(`apply_loads`: reading the folder, its part of each tensor, on a miss) before the forward.
A load is one asynchronous copy into a slot on the step's stream, so a step still running
reads the slot's old adapter, and a CUDA graph captured before reads the new one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..config import LoRAConfig
from ..models.layers.activation import SiluAndMul
from .batch import LoRABatch, LoRABuffers, LoRAStepState
from .cache import AdapterCache, SlotTable
from .layers import LinearLoRA
from .layout import LoRALayout
from .peft_folder import read_peft_adapter
from .request import LoRARequest


@dataclass
class LoRAStepInputs:
    """A step's adapters, as rank 0 sends them to every rank."""

    token_slots: np.ndarray  # [num_tokens] int32, each token's slot (-1: the base model)
    loads: tuple[tuple[int, LoRARequest], ...] = field(default_factory=tuple)
    """`(slot, adapter)` copies to make before the step's forward."""


class LoRAManager:
    """Adapters for one rank's model.

    Args:
        config: The engine's LoRA options.
        model: This rank's model: its `Linear` projections get a `LinearLoRA` each.
        device: Where the model runs.
        max_num_tokens: Most rows of a step.
    """

    def __init__(
        self, config: LoRAConfig, model: nn.Module, device: torch.device, max_num_tokens: int
    ) -> None:
        self.config = config
        self.device = device
        self.layout = LoRALayout(model, config.max_lora_rank)
        self.weights = torch.zeros(
            config.max_loras, self.layout.slot_numel, dtype=config.lora_dtype, device=device
        )
        """`[max_loras, slot_numel]`: every slot's weights; each layer's are views of it."""
        self.state = LoRAStepState()
        for path, target in self.layout.targets.items():
            lora_a, lora_b = self.layout.views(target, self.weights)
            self.layout.modules[path].lora = LinearLoRA(self.state, target, lora_a, lora_b)
        for module in model.modules():  # an MLP: its activation starts down_proj's shrink
            act, down = getattr(module, "act", None), getattr(module, "down_proj", None)
            if isinstance(act, SiluAndMul) and getattr(down, "lora", None) is not None:
                act.fold = down.lora.activation
        self.cache = AdapterCache(config.max_cpu_loras, self._read, pin=device.type == "cuda")
        self.slots = SlotTable(config.max_loras)
        self.buffers = LoRABuffers(max_num_tokens, config.max_loras, device)

    @property
    def num_layers(self) -> int:
        """Projections with adapter slots."""
        return len(self.layout.targets)

    def _read(self, request: LoRARequest) -> torch.Tensor:
        return self.layout.pack(read_peft_adapter(request), self.config.lora_dtype)

    def add_adapter(self, request: LoRARequest) -> None:
        """Read and check an adapter against the model (into the host cache).

        Raises:
            InvalidParamError: the adapter is refused; the message names it and the setting.
        """
        self.cache.get(request)

    # ---- steps --------------------------------------------------------------------------

    def step_inputs(
        self, requests: Sequence[LoRARequest | None], query_lens: np.ndarray
    ) -> LoRAStepInputs | None:
        """Rank 0: the step's token slots and the loads they need, for sequences running
        `requests` (None: the base model) with `query_lens` tokens each; None when no
        sequence runs an adapter."""
        ids = [r.lora_int_id if r is not None else 0 for r in requests]
        if not any(ids):
            return None
        by_id = {r.lora_int_id: r for r in requests if r is not None}
        slot_of, loads = self.slots.assign(by_id)
        seq_slots = np.fromiter((slot_of.get(i, -1) for i in ids), np.int32, len(ids))
        return LoRAStepInputs(
            np.repeat(seq_slots, query_lens).astype(np.int32),
            tuple((slot, by_id[i]) for slot, i in loads),
        )

    def apply_loads(self, inputs: LoRAStepInputs | None) -> None:
        """Copy the step's new adapters into their slots (on the step's stream)."""
        if inputs is None:
            return
        for slot, request in inputs.loads:
            try:
                packed = self.cache.get(request)
            except BaseException:
                self.slots.forget(request.lora_int_id)
                raise
            self.weights[slot].copy_(packed, non_blocking=True)

    def stage(self, token_slots: np.ndarray, static: LoRABatch | None = None) -> LoRABatch:
        """The step's batch on the device (`LoRABuffers.stage`)."""
        return self.buffers.stage(np.asarray(token_slots, np.int32), static)

    def static_batch(self, num_tokens: int) -> LoRABatch:
        """The batch a CUDA graph of `num_tokens` rows is captured with, every row without
        an adapter until a step stages its own."""
        batch = self.buffers.static_batch(num_tokens)
        self.stage(np.full(num_tokens, -1, np.int32), batch)
        return batch

    def running(self, batch: LoRABatch | None) -> contextlib.AbstractContextManager:
        """The layers run `batch` for the duration (None: no adapters)."""
        return self.state.running(batch)

    @contextlib.contextmanager
    def step(self, token_slots: np.ndarray | None) -> Iterator[None]:
        """An eager step: stage its token slots (None: no adapter runs) and run with them."""
        batch = self.stage(token_slots) if token_slots is not None else None
        with self.running(batch):
            yield
