"""A step's adapters as the LoRA layers read them: each token's slot, and the tokens grouped
by slot into tiles, in device tensors that never move (so a CUDA graph captured on them
replays any step's adapters), staged from pinned host arrays with non-blocking copies.

`LoRAStepState` is how the layers learn the step's batch: the runner enters
`state.running(batch)` around the forward (not nested); outside it, or with `batch=None`,
the layers launch nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from batchlm.kernels.lora_fused import FUSED_MAX_ROWS
from batchlm.kernels.lora_shrink import TILE_FIELDS, max_slot_tiles, slot_tiles

SMALL_TILE_ROWS = 16
LARGE_TILE_ROWS = 64
LARGE_STEP_TOKENS = 1024
"""Steps above this many tokens (prefills) group rows in tiles of `LARGE_TILE_ROWS`."""


def tile_rows_for(num_tokens: int) -> int:
    return LARGE_TILE_ROWS if num_tokens > LARGE_STEP_TOKENS else SMALL_TILE_ROWS


@dataclass(frozen=True)
class LoRABatch:
    """One step's adapters, as device tensors (views of `LoRABuffers`)."""

    num_tokens: int
    """Rows of the step (padded rows included): the layers' inputs have this many."""
    token_slots: torch.Tensor  # [num_tokens] int32, each row's slot (-1: no adapter)
    token_ids: torch.Tensor  # [num_tokens] int32, the adapted rows grouped by slot
    tiles: torch.Tensor  # [num_tiles, 3] int32 (slot, first entry in token_ids, rows)
    tile_rows: int
    """Most rows of a tile (the shrink and expand kernels' `BLOCK_M`)."""
    fused: bool
    """At most `FUSED_MAX_ROWS` rows: one fused kernel per layer (no tiles)."""
    groups: tuple[tuple[int, torch.Tensor | None], ...] = ()
    """Off CUDA: `(slot, rows)` for every slot the step runs, `rows` the int64 indices of
    its tokens (None: every row), for the PyTorch path."""


class LoRAStepState:
    """The batch of the step running now, shared by every LoRA layer of a model."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None

    @contextlib.contextmanager
    def running(self, batch: LoRABatch | None) -> Iterator[None]:
        """Run the layers with `batch` (None: no adapters) for the duration."""
        if self.batch is not None:
            raise RuntimeError("a LoRA batch is already running: steps do not nest")
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None


class LoRABuffers:
    """Fixed device tensors for every step's `LoRABatch`, and their pinned host staging.

    Args:
        max_num_tokens: Most rows of a step (padded rows included).
        max_loras: Device slots (bounds the tiles).
        device: Where the model runs.
    """

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device) -> None:
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.max_loras = max_loras
        self.max_tiles = max_slot_tiles(max_num_tokens, max_loras, SMALL_TILE_ROWS)
        pin = device.type == "cuda"
        shapes = {
            "token_slots": (max_num_tokens,),
            "token_ids": (max_num_tokens,),
            "tiles": (self.max_tiles, TILE_FIELDS),
        }
        self.host = {
            k: torch.zeros(s, dtype=torch.int32, pin_memory=pin) for k, s in shapes.items()
        }
        self.tensors = {k: torch.zeros_like(t, device=device) for k, t in self.host.items()}
        self._copied: torch.cuda.Event | None = torch.cuda.Event() if pin else None
        self._copy_pending = False

    def static_batch(self, num_tokens: int) -> LoRABatch:
        """The batch a CUDA graph of `num_tokens` rows is captured with: views whose sizes
        are fixed (its tile table has room for any grouping of those rows)."""
        tile_rows = tile_rows_for(num_tokens)
        num_tiles = max_slot_tiles(num_tokens, self.max_loras, tile_rows)
        t = self.tensors
        return LoRABatch(
            num_tokens=num_tokens,
            token_slots=t["token_slots"][:num_tokens],
            token_ids=t["token_ids"][:num_tokens],
            tiles=t["tiles"][:num_tiles],
            tile_rows=tile_rows,
            fused=self._fused(num_tokens),
        )

    def stage(self, token_slots: np.ndarray, static: LoRABatch | None = None) -> LoRABatch:
        """Write a step's token slots (`[num_tokens]`, -1 for rows without an adapter,
        padded rows included) and their grouping, and start copying them to the device.

        Args:
            token_slots: Each row's slot.
            static: The graph batch being replayed: its tile table is filled to its full
                size (unused tiles of zero rows). None: an eager step's own batch.
        """
        num_tokens = len(token_slots)
        if num_tokens > self.max_num_tokens:  # larger than the buffers: tensors of its own
            return self._fresh(token_slots)
        if self._copy_pending:
            self._copied.synchronize()  # the last step's copies may still read the host arrays
        fused = self._fused(num_tokens)
        tile_rows = static.tile_rows if static is not None else tile_rows_for(num_tokens)
        host, dev = self.host, self.tensors
        host["token_slots"][:num_tokens] = torch.from_numpy(token_slots)
        dev["token_slots"][:num_tokens].copy_(host["token_slots"][:num_tokens], non_blocking=True)
        num_tiles = 0
        if not fused:
            token_ids, tiles = slot_tiles(token_slots, tile_rows)
            num_tiles = len(tiles) if static is None else static.tiles.shape[0]
            host["token_ids"][: len(token_ids)] = torch.from_numpy(token_ids)
            host["tiles"][:num_tiles] = 0
            host["tiles"][: len(tiles)] = torch.from_numpy(tiles)
            dev["token_ids"][: len(token_ids)].copy_(
                host["token_ids"][: len(token_ids)], non_blocking=True
            )
            dev["tiles"][:num_tiles].copy_(host["tiles"][:num_tiles], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
            self._copy_pending = True
        groups = host_groups(token_slots) if self.device.type != "cuda" else ()
        if static is not None:
            return dataclasses.replace(static, groups=groups) if groups else static
        return LoRABatch(
            num_tokens=num_tokens,
            token_slots=dev["token_slots"][:num_tokens],
            token_ids=dev["token_ids"][:num_tokens],
            tiles=dev["tiles"][:num_tiles],
            tile_rows=tile_rows,
            fused=fused,
            groups=groups,
        )

    def _fused(self, num_tokens: int) -> bool:
        return self.device.type == "cuda" and num_tokens <= FUSED_MAX_ROWS

    def _fresh(self, token_slots: np.ndarray) -> LoRABatch:
        num_tokens = len(token_slots)
        tile_rows = tile_rows_for(num_tokens)
        token_ids, tiles = slot_tiles(token_slots, tile_rows)

        def put(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, np.int32)).to(self.device)

        groups = host_groups(token_slots) if self.device.type != "cuda" else ()
        return LoRABatch(
            num_tokens, put(token_slots), put(token_ids), put(tiles), tile_rows, False, groups
        )


def host_groups(token_slots: np.ndarray) -> tuple[tuple[int, torch.Tensor | None], ...]:
    """`(slot, rows)` per slot in `token_slots` (rows None when every row runs it)."""
    slots = np.unique(token_slots)
    if len(slots) == 1 and slots[0] >= 0:
        return ((int(slots[0]), None),)
    return tuple(
        (int(slot), torch.from_numpy(np.flatnonzero(token_slots == slot)))
        for slot in slots
        if slot >= 0
    )
