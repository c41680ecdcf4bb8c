"""Sleep mode's memory mechanics: a module's tensors moved to host memory and back, and
what a runner's sleep leaves asleep.

`offload_to_host` copies every parameter, buffer and tensor attribute of a module (each
storage once, so tensors that share memory keep sharing it) to host memory (pinned on
CUDA, for fast copies back) and empties the device tensors, so that their memory can go
back to the device (`release_device_memory`); `HostCopy.restore` allocates them again
and copies the values back, into the same tensor objects.

Used by the runners' `sleep` / `wake_up` (level 1: weights to host; level 2: the model
dropped and built again from its checkpoint on waking).
"""

from __future__ import annotations

import gc
import itertools
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache")
"""What a level 1 or 2 sleep puts to sleep, and `wake_up(tags=...)` restores."""


@dataclass
class _Storage:
    """One device storage's bytes on the host, and the tensors that view it."""

    host: torch.Tensor  # [nbytes] uint8
    views: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]]
    """(tensor, storage offset, size, stride) of each tensor over the storage."""


@dataclass
class HostCopy:
    """A module's device tensors, held in host memory while the device ones are empty."""

    device: torch.device
    storages: list[_Storage] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.host.numel() for s in self.storages)

    @torch.inference_mode()
    def restore(self) -> None:
        """Allocate every tensor on the device again and copy its values back."""
        for storage in self.storages:
            on_device = storage.host.to(self.device, non_blocking=True)
            for tensor, offset, size, stride in storage.views:
                view = torch.empty(0, dtype=tensor.dtype, device=self.device)
                view.set_(on_device.untyped_storage(), offset, size, stride)
                tensor.data = view
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.storages = []


def _device_tensors(module: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """Every parameter, buffer and tensor attribute of `module` and its children on
    `device` (each tensor object once)."""
    seen: set[int] = set()
    found = []
    attributes = (
        value
        for m in module.modules()
        for value in vars(m).values()
        if isinstance(value, torch.Tensor)
    )
    for tensor in itertools.chain(module.parameters(), module.buffers(), attributes):
        if id(tensor) in seen or not on_device(tensor, device) or tensor.numel() == 0:
            continue
        seen.add(id(tensor))
        found.append(tensor)
    return found


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` lives on `device`, where a device without an index (`cuda`) means
    the current one of its type (a runner's `cuda` holds tensors on `cuda:0`)."""
    if tensor.device.type != device.type:
        return False
    if device.index is None:
        if device.type != "cuda":
            return True
        return tensor.device.index == torch.cuda.current_device()
    return tensor.device.index == device.index


@torch.inference_mode()
def offload_to_host(module: nn.Module, device: torch.device) -> HostCopy:
    """Move `module`'s device tensors to host memory; the device tensors are left empty
    (same objects, zero elements) until `HostCopy.restore`."""
    copy = HostCopy(device)
    by_storage: dict[int, _Storage] = {}
    pin = device.type == "cuda"
    tensors = _device_tensors(module, device)
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = by_storage.get(key)
        if entry is None:
            source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(source)
            entry = by_storage[key] = _Storage(host, [])
            copy.storages.append(entry)
        entry.views.append(
            (tensor, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        )
    for tensor in tensors:
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
    return copy


def release_device_memory(device: torch.device) -> None:
    """Give the memory of dropped tensors back to the device (not just to PyTorch's
    caching allocator), so that other processes and engines can use it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class SleepingRunner(Protocol):
    """What a runner offers `RunnerSleep` (`ModelRunner`, `PoolingRunner`)."""

    device: torch.device

    def weight_modules(self) -> list[nn.Module]:
        """The modules holding the weights (model, heads, a draft model)."""
        ...

    def drop_weights(self) -> None:
        """Let go of every weight tensor (level 2)."""
        ...

    def reload_weights_from_checkpoint(self) -> None:
        """Build the weights again as at start-up (level 2's wake)."""
        ...

    def free_device_state(self) -> None:
        """Drop every device tensor besides the weights (KV cache, graphs, step buffers)."""
        ...

    def restore_device_state(self) -> None:
        """Allocate them again (a fresh KV cache, zeroed)."""
        ...

    def on_weights_restored(self) -> None:
        """The weights are back (new tensors): recapture what was captured on them."""
        ...


class RunnerSleep:
    """One rank's sleep state: which of its device memory is asleep, and the host copy
    of its weights during a level-1 sleep.

    Args:
        runner: The rank's runner.
    """

    def __init__(self, runner: SleepingRunner) -> None:
        self.runner = runner
        self.level = 0
        """The level of the current sleep (0: awake)."""
        self.asleep: set[str] = set()
        """`MEMORY_TAGS` asleep now."""
        self._host: list[HostCopy] = []

    def sleep(self, level: int) -> int:
        """Free the rank's device memory (level 1: weights kept in host memory; level 2:
        dropped); returns the bytes the device got back (0 on CPU, where host and device
        memory are one)."""
        if self.asleep:
            logger.warning("this rank is already asleep (level %d); sleep ignored", self.level)
            return 0
        device = self.runner.device
        before = _free_bytes(device)
        self.runner.free_device_state()
        if level == 1:
            self._host = [offload_to_host(m, device) for m in self.runner.weight_modules()]
        else:
            self.runner.drop_weights()
        release_device_memory(device)
        self.level = level
        self.asleep = set(MEMORY_TAGS)
        return max(_free_bytes(device) - before, 0)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `tags` names (None: all): the weights (copied back from host
        memory, or after level 2 built again from the checkpoint), the KV cache (fresh,
        zeroed) and the CUDA graphs (captured once both are back)."""
        wanted = set(MEMORY_TAGS if tags is None else tags) & self.asleep
        if "weights" in wanted:
            if self._host:
                for copy in self._host:
                    copy.restore()
                self._host = []
            else:
                self.runner.reload_weights_from_checkpoint()
            self.asleep.discard("weights")
        if "kv_cache" in wanted:  # (captures the graphs when the weights are back)
            self.runner.restore_device_state()
            self.asleep.discard("kv_cache")
        elif "weights" in wanted:
            self.runner.on_weights_restored()
        if not self.asleep:
            self.level = 0


def _free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
