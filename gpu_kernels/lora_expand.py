"""LoRA expand: the shrink's float32 sums times each row's `Bᵀ`, added into the layer's output.

A layer's output columns are cut into slices (q | k | v of a merged projection, or one slice
for a plain one); slice s spans columns `slice_starts[s]:slice_starts[s + 1]` and reads its
own part of the shrink's output. `lora_b[slot]` (`[N, R]`, the adapter's scaling folded in)
holds every slice's rows at their output columns. Rows are grouped by slot into tiles as for
the shrink (`lora_shrink.slot_tiles`).

Grid: (tiles, column blocks); `col_blocks` lists each block's (slice, first column, end of
its slice), so no program falls outside a slice. A program sums the shrink's K splits for
its rows, rounds them to the adapter's dtype (as a PEFT layer's `lora_A` output is), and
adds `[rows, R] · [R, BLOCK_N]` into the output, each row's sum rounded once.

Under programmatic dependent launch `B` and the tile table are read before the wait (they
are no kernel's output); the shrink's sums and the output after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    FLOAT_DTYPES,
    check_power_of_2,
    check_same_device,
    check_tensor,
    dot_dtype,
    next_power_of_2,
)
from .lora_shrink import TILE_FIELDS
from .pdl import launch_options, wait_for_previous_kernel

__all__ = ["column_blocks", "lora_expand", "lora_expand_ref"]


@triton.jit
def _lora_expand_kernel(
    shrunk_ptr,  # [SPLIT_K, M, S, R] float32
    b_ptr,  # [L, N, R]
    out_ptr,  # [M, N], rows stride_om apart
    tiles_ptr,  # [T, 3] int32
    token_ids_ptr,  # int32 rows grouped by slot
    col_blocks_ptr,  # [C, 3] int32: slice, first column, end of the slice
    M,
    R,
    S,
    stride_bl,
    stride_bn,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    rows = tl.load(tiles_ptr + tile * 3 + 2)
    s = tl.load(col_blocks_ptr + block * 3)
    n0 = tl.load(col_blocks_ptr + block * 3 + 1)
    n_end = tl.load(col_blocks_ptr + block * 3 + 2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    row_mask = offs_m < rows
    n_mask = (offs_n < n_end) & (rows > 0)
    r_mask = offs_r < R
    b_tile = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :]
    b = tl.load(b_tile, mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
    token = tl.load(token_ids_ptr + first + offs_m, mask=row_mask, other=0)
    wait_for_previous_kernel(PDL)
    src = shrunk_ptr + (token.to(tl.int64)[:, None] * S + s) * R + offs_r[None, :]
    sum_mask = row_mask[:, None] & r_mask[None, :]
    shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        shrunk += tl.load(src + split * M * S * R, mask=sum_mask, other=0.0)
    # The sums in the adapter's dtype, as PEFT's `lora_A` output is, then float32 products.
    shrunk = shrunk.to(b_ptr.dtype.element_ty).to(DOT_DTYPE)
    delta = tl.dot(shrunk, tl.trans(b.to(DOT_DTYPE)), input_precision="ieee")
    dst = out_ptr + token.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = row_mask[:, None] & n_mask[None, :]
    old = tl.load(dst, mask=out_mask, other=0.0)
    tl.store(dst, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=out_mask)


def column_blocks(slice_starts: list[int], block_n: int, device: torch.device) -> torch.Tensor:
    """`[C, 3]` int32 (slice, first column, end of the slice) of every `block_n`-wide block of
    each slice's columns `slice_starts[s]:slice_starts[s + 1]`."""
    blocks = [
        (s, n, end)
        for s, (start, end) in enumerate(zip(slice_starts[:-1], slice_starts[1:], strict=True))
        for n in range(start, end, block_n)
    ]
    return torch.tensor(blocks, dtype=torch.int32, device=device).reshape(-1, 3)


def lora_expand(
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    token_ids: torch.Tensor,
    tiles: torch.Tensor,
    col_blocks: torch.Tensor,
    *,
    tile_rows: int,
    block_n: int,
    num_warps: int = 4,
) -> torch.Tensor:
    """Add each tile's rows' `shrunk · B[slot]ᵀ` into `out` in place.

    Args:
        shrunk: `[split_k, M, S, R]` float32 (`lora_shrink`'s output).
        lora_b: `[L, N, R]` adapter slots (slot stride free, the rest contiguous).
        out: `[M, N]` the layer's output (unit stride along N); updated in place.
        token_ids, tiles: the row grouping `lora_shrink` was given.
        col_blocks: `[C, 3]` int32 from `column_blocks(slice_starts, block_n)`.
        tile_rows: Most rows of a tile (as for the shrink).
        block_n: Output columns per program (the width `col_blocks` was cut with).
        num_warps: Warps per program.

    Returns:
        `out`.
    """
    check_tensor("shrunk", shrunk, ndim=4, dtypes=(torch.float32,))
    split_k, num_m, num_s, num_r = shrunk.shape
    if not shrunk.is_contiguous():
        raise ValueError("shrunk must be contiguous (lora_shrink's output)")
    check_tensor("lora_b", lora_b, ndim=3, dtypes=FLOAT_DTYPES, shape={2: num_r})
    num_n = lora_b.shape[1]
    if lora_b.stride(1) != num_r:
        raise ValueError(f"lora_b must be contiguous past its slot dimension: {lora_b.stride()}")
    check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, shape={0: num_m, 1: num_n})
    check_tensor("token_ids", token_ids, ndim=1, dtypes=(torch.int32,))
    check_tensor("tiles", tiles, ndim=2, dtypes=(torch.int32,), shape={1: TILE_FIELDS})
    check_tensor("col_blocks", col_blocks, ndim=2, dtypes=(torch.int32,), shape={1: 3})
    check_power_of_2("tile_rows", tile_rows, 16, 256, "rows per tile")
    check_power_of_2("block_n", block_n, 16, 512, "output columns per program")
    check_same_device(
        _lora_expand_kernel, shrunk=shrunk, lora_b=lora_b, out=out, tiles=tiles, cols=col_blocks
    )
    if tiles.shape[0] == 0 or col_blocks.shape[0] == 0 or num_m == 0:
        return out
    _lora_expand_kernel[(tiles.shape[0], col_blocks.shape[0])](
        shrunk,
        lora_b,
        out,
        tiles,
        token_ids,
        col_blocks,
        num_m,
        num_r,
        num_s,
        lora_b.stride(0),
        lora_b.stride(1),
        out.stride(0),
        SPLIT_K=split_k,
        BLOCK_M=tile_rows,
        BLOCK_N=block_n,
        BLOCK_R=max(16, next_power_of_2(num_r)),
        DOT_DTYPE=dot_dtype(lora_b.dtype, _lora_expand_kernel),
        num_warps=num_warps,
        **launch_options(_lora_expand_kernel, out.device),
    )
    return out


def lora_expand_ref(
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    slice_starts: list[int],
) -> torch.Tensor:
    """`out[m, slice s] += round(shrunk[m, s]) · B[slot_m, slice s]ᵀ` in float32 for rows with
    a slot, `shrunk` (`[M, S, R]` float32) rounded to B's dtype first; `out` in place."""
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        sums = shrunk[rows].to(lora_b.dtype).float()  # [rows, S, R]
        b = lora_b[slot].float()  # [N, R]
        delta = torch.cat(
            [
                sums[:, s] @ b[start:end].T
                for s, (start, end) in enumerate(
                    zip(slice_starts[:-1], slice_starts[1:], strict=True)
                )
            ],
            dim=1,
        )  # [rows, N]
        out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out
