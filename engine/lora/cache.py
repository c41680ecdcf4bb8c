"""Adapters in host memory and on the device.

`AdapterCache`: parsed adapters, packed in a slot's layout, in host memory (pinned on CUDA
so that a slot load is one asynchronous copy), the least recently used dropped past
`max_cpu_loras`. `SlotTable`: which adapter each device slot holds, and which slots a step's
adapters get (least recently used slots given up first, never one the step needs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from .request import LoRARequest


class AdapterCache:
    """Packed adapters by id, at most `capacity` of them.

    Args:
        capacity: Most adapters kept (`max_cpu_loras`).
        pack: Reads and packs an adapter (raising for a refused one).
        pin: Keep the packed buffers in page-locked memory.
    """

    def __init__(
        self, capacity: int, pack: Callable[[LoRARequest], torch.Tensor], pin: bool
    ) -> None:
        self.capacity = capacity
        self._pack = pack
        self._pin = pin
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.num_loads = 0
        """Adapters read from disk over the cache's lifetime."""

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._entries

    def get(self, request: LoRARequest) -> torch.Tensor:
        """The adapter's packed weights: cached, or read now (then the least recently used
        ones past the capacity are dropped)."""
        packed = self._entries.get(request.lora_int_id)
        if packed is not None:
            self._entries.move_to_end(request.lora_int_id)
            return packed
        packed = self._pack(request)
        if self._pin:
            packed = packed.pin_memory()
        self.num_loads += 1
        self._entries[request.lora_int_id] = packed
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return packed

    def ids(self) -> list[int]:
        """Cached ids, least recently used first."""
        return list(self._entries)


class SlotTable:
    """Which adapter id each of `num_slots` device slots holds (pure bookkeeping)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        """Adapter id → its slot, least recently used first."""

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

    def assign(self, lora_int_ids: Iterable[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for a step's adapters.

        Returns:
            Adapter id → slot for every id given, and the `(slot, id)` loads this needs (ids
            not in a slot yet, in the order given).

        Raises:
            RuntimeError: more distinct ids than slots (the scheduler never forms such a step).
        """
        wanted = list(dict.fromkeys(lora_int_ids))
        if len(wanted) > self.num_slots:
            raise RuntimeError(
                f"a step runs {len(wanted)} adapters, more than the {self.num_slots} slots"
            )
        for lora_int_id in wanted:
            if lora_int_id in self._slot_of:
                self._slot_of.move_to_end(lora_int_id)
        loads = []
        needed = set(wanted)
        for lora_int_id in wanted:
            if lora_int_id in self._slot_of:
                continue
            used = set(self._slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used holder the step does not need
                victim = next(i for i in self._slot_of if i not in needed)
                slot = self._slot_of.pop(victim)
            self._slot_of[lora_int_id] = slot
            loads.append((slot, lora_int_id))
        return {i: self._slot_of[i] for i in wanted}, loads

    def forget(self, lora_int_id: int) -> None:
        """Free the adapter's slot (a load into it failed)."""
        self._slot_of.pop(lora_int_id, None)
