"""`LinearLoRA`: a projection's adapters, called by the `Linear` layer with its input and
output (`Linear.lora`), whatever computed the output (full precision, fp8, int8).

Per adapted layer and step: on CUDA, one fused kernel when the step has at most
`FUSED_MAX_ROWS` rows, else a shrink and an expand (two launches, each covering all of the
layer's slices). At those few rows a projection after a SiLU-and-mul (`down_proj`) has its
shrink done by the activation's kernel (`activation`), so its fused kernel only adds up
partial sums and expands. On the CPU the same sums in PyTorch, slot by slot (each slot's rows
found once per step, `LoRABatch.groups`). Nothing runs for a step without
adapters. The weights are views of the manager's slot buffer, so loading an adapter into a
slot changes what every captured CUDA graph reads, and nothing else.
"""

from __future__ import annotations

import torch

from batchlm.kernels import use_triton_kernels
from batchlm.kernels.launch import num_sms
from batchlm.kernels.lora_act_shrink import silu_and_mul_lora_shrink
from batchlm.kernels.lora_expand import column_blocks, lora_expand, lora_expand_ref
from batchlm.kernels.lora_fused import lora_fused
from batchlm.kernels.lora_shrink import choose_split_k, lora_shrink, lora_shrink_ref

from .batch import SMALL_TILE_ROWS, LoRAStepState
from .layout import LoRATarget

# Launches measured on the H200 (`benchmarks/tools/bench_lora_kernels.py --sweep`, the
# Llama-3.1-8B projections at 1 and 256 rows; docs/performance.md has the figures).
SHRINK_BLOCK_K = 128
SHRINK_WARPS = 4
EXPAND_BLOCK_N = 256
EXPAND_WARPS = 4
EXPAND_BLOCK_N_LARGE_TILES = 64
"""For tiles of `batch.LARGE_TILE_ROWS` rows (prefill steps): a `[64, 256]` float32 tile
would not fit the registers of 4 warps."""
EXPAND_WARPS_LARGE_TILES = 4
FUSED_BLOCK_N = 256
FUSED_BLOCK_K = 1024
FUSED_WARPS = 4
ACT_SHRINK_BLOCK = 128
"""Columns per program of the activation that does `down_proj`'s shrink (28 programs at
Llama-3.1-8B's 14,336): not measured yet."""
ACT_SHRINK_WARPS = 8


class LinearLoRA:
    """One projection's adapter slots.

    Args:
        state: The step state every layer of the model shares.
        target: The projection (its slices and sizes).
        lora_a: `[max_loras, slices, rank, in]` (a view of the slot buffer).
        lora_b: `[max_loras, out, rank]`, the adapters' scaling folded in.
    """

    def __init__(
        self, state: LoRAStepState, target: LoRATarget, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> None:
        self.state = state
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.slice_starts = target.slice_starts
        self.num_slices = target.num_slices
        self.in_features = target.in_features
        device = lora_a.device
        self.expand_blocks = column_blocks(self.slice_starts, EXPAND_BLOCK_N, device)
        self.expand_blocks_large = column_blocks(
            self.slice_starts, EXPAND_BLOCK_N_LARGE_TILES, device
        )
        self.fused_blocks = column_blocks(self.slice_starts, FUSED_BLOCK_N, device)
        self._folded: tuple[torch.Tensor, torch.Tensor] | None = None
        """`(x, partials)` from `activation`, until this layer's call on that `x`."""

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """`silu(gate) * up` with this layer's shrink of it done on the way, when this
        layer's input is that product and the step runs the fused kernel; None otherwise
        (the caller computes the activation itself)."""
        batch = self.state.batch
        if (
            batch is None
            or not batch.fused
            or self.num_slices != 1
            or gate_up.dim() != 2
            or gate_up.shape[0] != batch.num_tokens
            or not use_triton_kernels(gate_up)
        ):
            return None
        out, partials = silu_and_mul_lora_shrink(
            gate_up,
            self.lora_a,
            batch.token_slots,
            block=ACT_SHRINK_BLOCK,
            num_warps=ACT_SHRINK_WARPS,
        )
        self._folded = (out, partials)
        return out

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add the step's adapters' `x · Aᵀ · Bᵀ` into `out` (`[n, out]`, in place) for
        the rows that run one; `out` as it is when no row does."""
        batch = self.state.batch
        if batch is None:
            return out
        if x.shape[0] != batch.num_tokens:
            raise RuntimeError(
                f"the layer got {x.shape[0]} rows, the step's LoRA batch has {batch.num_tokens}"
            )
        if not use_triton_kernels(x):
            if x.device.type != "cuda":  # the batch's groups were made for the host
                return self._add_by_slot(x, out, batch.groups)
            shrunk = lora_shrink_ref(x, self.lora_a, batch.token_slots)
            return lora_expand_ref(shrunk, self.lora_b, out, batch.token_slots, self.slice_starts)
        folded, self._folded = self._folded, None
        if batch.fused:
            return lora_fused(
                x,
                self.lora_a,
                self.lora_b,
                out,
                batch.token_slots,
                self.fused_blocks,
                block_n=FUSED_BLOCK_N,
                block_k=FUSED_BLOCK_K,
                num_warps=FUSED_WARPS,
                partials=folded[1] if folded is not None and folded[0] is x else None,
            )
        split_k = choose_split_k(
            batch.tiles.shape[0],
            self.num_slices,
            self.in_features,
            SHRINK_BLOCK_K,
            num_sms(x.device),
        )
        shrunk = lora_shrink(
            x,
            self.lora_a,
            batch.token_ids,
            batch.tiles,
            tile_rows=batch.tile_rows,
            split_k=split_k,
            block_k=SHRINK_BLOCK_K,
            num_warps=SHRINK_WARPS,
        )
        large = batch.tile_rows > SMALL_TILE_ROWS
        return lora_expand(
            shrunk,
            self.lora_b,
            out,
            batch.token_ids,
            batch.tiles,
            self.expand_blocks_large if large else self.expand_blocks,
            tile_rows=batch.tile_rows,
            block_n=EXPAND_BLOCK_N_LARGE_TILES if large else EXPAND_BLOCK_N,
            num_warps=EXPAND_WARPS_LARGE_TILES if large else EXPAND_WARPS,
        )

    def _add_by_slot(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        groups: tuple[tuple[int, torch.Tensor | None], ...],
    ) -> torch.Tensor:
        """The PyTorch path off CUDA: per slot the step runs, one shrink of its rows (all
        slices at once) and one expand per slice, rounded as the kernels round."""
        num_s, rank, num_k = self.lora_a.shape[1:]
        for slot, rows in groups:
            rows_x = x if rows is None else x[rows]  # [m, K]
            a = self.lora_a[slot].reshape(num_s * rank, num_k)
            b = self.lora_b[slot]  # [N, R]
            shrunk = (rows_x.float() @ a.float().T).to(b.dtype).float()  # [m, S * R]
            delta = torch.cat(
                [
                    shrunk[:, s * rank : (s + 1) * rank] @ b[start:end].float().T
                    for s, (start, end) in enumerate(
                        zip(self.slice_starts[:-1], self.slice_starts[1:], strict=True)
                    )
                ],
                dim=1,
            )  # [m, N]
            if rows is None:
                out.copy_((out.float() + delta).to(out.dtype))
            else:
                out[rows] = (out[rows].float() + delta).to(out.dtype)
        return out
