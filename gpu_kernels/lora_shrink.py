"""LoRA shrink: each adapted row's `x · Aᵀ` for every slice of a layer, into a float32 buffer.

A step's rows may each run a different adapter (or none). The adapters' `A` matrices sit in
fixed device slots, `lora_a[slot, slice]` (`[rank, in]`), and each row names its slot. Rows
are grouped by slot on the host (`slot_tiles`): a tile is up to `tile_rows` rows of one
slot, so a program multiplies a `[tile_rows, BLOCK_K]` block of `x` by one adapter's `A` on
the tensor cores, and `A` is read once per tile rather than once per row.

Grid: (tiles, slices, K splits). When the step has few tiles, K is split so that enough
programs stream `A`; each split stores its partial sums (`out[split]`), which the expand
kernel adds up, so no atomics and no zeroing are needed and the sum order is fixed.

The kernel runs right after the layer's own matmul. Under programmatic dependent launch it
loads `A`, the row grouping (host copies) and `x` before its wait: `x` is the input of that
matmul, whose programs signal only after their own wait, so `x`'s producer has completed
once this kernel is placed. Only the stores come after the wait.

Also here: `slot_tiles` (the host-side grouping) and `lora_shrink_ref`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import (
    FLOAT_DTYPES,
    cdiv,
    check_power_of_2,
    check_same_device,
    check_tensor,
    dot_dtype,
    next_power_of_2,
)
from .pdl import launch_options, wait_for_previous_kernel

__all__ = ["lora_shrink", "lora_shrink_ref", "max_slot_tiles", "slot_tiles", "TILE_FIELDS"]

TILE_FIELDS = 3
"""A tile row of the `tiles` array: (slot, first entry in `token_ids`, rows; 0 rows: unused)."""


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [M, K]
    a_ptr,  # [L, S, R, K]: slot l, slice s, rank row r
    tiles_ptr,  # [T, 3] int32
    token_ids_ptr,  # [>= rows of every tile] int32: rows of x grouped by slot
    out_ptr,  # [SPLIT_K, M, S, R] float32
    M,
    K,
    R,
    S,
    k_per_split,
    stride_xm,
    stride_al,
    stride_as,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    rows = tl.load(tiles_ptr + tile * 3 + 2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m < rows
    r_mask = offs_r < R
    token = tl.load(token_ids_ptr + first + offs_m, mask=row_mask, other=0)  # [BLOCK_M]
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    k_end = tl.where(rows > 0, k_end, k_start)  # an unused tile streams nothing
    x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_xm
    a_rows = a_ptr + slot.to(tl.int64) * stride_al + s * stride_as + offs_r[:, None] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_end
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_rows + ks[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(a.to(DOT_DTYPE)), acc, input_precision="ieee")
    wait_for_previous_kernel(PDL)
    dst = out_ptr + ((split * M + token.to(tl.int64)[:, None]) * S + s) * R + offs_r[None, :]
    tl.store(dst, acc, mask=row_mask[:, None] & r_mask[None, :])


def slot_tiles(token_slots: np.ndarray, tile_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Group a step's rows by adapter slot into tiles of at most `tile_rows` rows.

    Args:
        token_slots: `[M]` int: each row's slot, negative for rows without an adapter.
        tile_rows: Most rows per tile (the kernels' `BLOCK_M`).

    Returns:
        `token_ids` `[num_adapted]` int32 (the adapted rows, grouped by slot, in row order
        within a slot) and `tiles` `[num_tiles, 3]` int32 (slot, first entry in
        `token_ids`, rows).
    """
    slots = np.asarray(token_slots)
    adapted = np.flatnonzero(slots >= 0)
    order = adapted[np.argsort(slots[adapted], kind="stable")]
    sorted_slots = slots[order]
    bounds = np.flatnonzero(np.diff(sorted_slots)) + 1
    seg_start = np.concatenate(([0], bounds)) if len(order) else np.zeros(0, np.int64)
    seg_end = np.concatenate((bounds, [len(order)])) if len(order) else np.zeros(0, np.int64)
    per_segment = -(-(seg_end - seg_start) // tile_rows)
    num_tiles = int(per_segment.sum())
    first_tile = np.repeat(np.cumsum(per_segment) - per_segment, per_segment)
    starts = np.repeat(seg_start, per_segment) + (np.arange(num_tiles) - first_tile) * tile_rows
    tiles = np.empty((num_tiles, TILE_FIELDS), np.int32)
    tiles[:, 0] = sorted_slots[starts] if num_tiles else 0
    tiles[:, 1] = starts
    tiles[:, 2] = np.minimum(tile_rows, np.repeat(seg_end, per_segment) - starts)
    return order.astype(np.int32), tiles


def max_slot_tiles(num_rows: int, num_slots: int, tile_rows: int) -> int:
    """Most tiles `slot_tiles` makes for `num_rows` rows over `num_slots` slots."""
    return cdiv(num_rows, tile_rows) + min(num_slots, num_rows)


def choose_split_k(num_tiles: int, num_slices: int, num_k: int, block_k: int, sms: int) -> int:
    """K splits so that about two programs per SM stream `A` (1 for large steps)."""
    split = 1
    while num_tiles * num_slices * split * 2 <= 2 * sms and num_k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_ids: torch.Tensor,
    tiles: torch.Tensor,
    *,
    tile_rows: int,
    split_k: int = 1,
    block_k: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Each tile's rows times its slot's `A`, for every slice.

    Args:
        x: `[M, K]` activations (unit stride along K).
        lora_a: `[L, S, R, K]` adapter slots (slot stride free, the rest contiguous).
        token_ids: int32 rows of `x` grouped by slot (`slot_tiles`), at least as many as the
            tiles cover.
        tiles: `[T, 3]` int32 (slot, first entry in `token_ids`, rows <= `tile_rows`); rows
            0 marks an unused tile (a fixed-size table in a CUDA graph).
        tile_rows: Most rows of a tile (a power of two >= 16).
        split_k: Splits of K, each stored apart (`choose_split_k`).
        block_k: K elements per loaded tile.
        num_warps: Warps per program.

    Returns:
        `[split_k, M, S, R]` float32 partial sums (rows no tile covers are left unset).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_m, num_k = x.shape
    check_tensor("lora_a", lora_a, ndim=4, dtypes=FLOAT_DTYPES, shape={3: num_k})
    _, num_s, num_r, _ = lora_a.shape
    if lora_a.stride(2) != num_k or lora_a.stride(1) != num_r * num_k:
        raise ValueError(f"lora_a must be contiguous past its slot dimension: {lora_a.stride()}")
    check_tensor("token_ids", token_ids, ndim=1, dtypes=(torch.int32,))
    check_tensor("tiles", tiles, ndim=2, dtypes=(torch.int32,), shape={1: TILE_FIELDS})
    check_power_of_2("tile_rows", tile_rows, 16, 256, "rows per tile")
    check_power_of_2("split_k", split_k, 1, 64, "splits of K")
    check_power_of_2("block_k", block_k, 16, 512, "K elements per tile")
    check_same_device(_lora_shrink_kernel, x=x, lora_a=lora_a, token_ids=token_ids, tiles=tiles)
    out = torch.empty((split_k, num_m, num_s, num_r), dtype=torch.float32, device=x.device)
    num_tiles = tiles.shape[0]
    if num_tiles == 0 or num_m == 0:
        return out
    k_per_split = cdiv(cdiv(num_k, split_k), block_k) * block_k
    _lora_shrink_kernel[(num_tiles, num_s, split_k)](
        x,
        lora_a,
        tiles,
        token_ids,
        out,
        num_m,
        num_k,
        num_r,
        num_s,
        k_per_split,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        BLOCK_M=tile_rows,
        BLOCK_R=max(16, next_power_of_2(num_r)),
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(lora_a.dtype, _lora_shrink_kernel),
        num_warps=num_warps,
        **launch_options(_lora_shrink_kernel, x.device),
    )
    return out


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor):
    """`[M, S, R]` float32: row m's `x[m] · A[slot_m, s]ᵀ` for every slice (zeros for rows
    without a slot), computed slot by slot in float32."""
    num_m = x.shape[0]
    _, num_s, num_r, _ = lora_a.shape
    out = torch.zeros((num_m, num_s, num_r), dtype=torch.float32, device=x.device)
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        # [rows, K] x [S, R, K] → [rows, S, R]
        out[rows] = torch.einsum("mk,srk->msr", x[rows].float(), lora_a[slot].float())
    return out
