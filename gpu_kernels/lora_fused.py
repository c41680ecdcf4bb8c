"""LoRA shrink and expand in one kernel, for steps of a few rows (batch-1 decode).

At one to a few rows a decode step's LoRA work is tiny, and two launches per adapted layer
would cost more than the work (a few microseconds each, even inside a CUDA graph). Here one
launch per layer does both: each program owns `BLOCK_N` output columns of one slice, recomputes
that slice's `x · A[slot]ᵀ` for every row (`[rows, R]`, a few hundred kilobytes of `A` read
from L2), and adds `· B[slot]ᵀ` into its columns.

The kernel runs right after the layer's own matmul, and under programmatic dependent launch
does everything but the read-modify-write of the output before its wait: `A`, `B` and the
rows' slots are no kernel's output, and `x` is the input of that matmul, whose programs
signal only after their own wait, so `x`'s producer has completed once this kernel is
placed. The shrink thereby overlaps the matmul.

Given `partials` (one-slice layers whose input came from `lora_act_shrink`), the kernel adds
up the shrink's sums that the producer of `x` stored per column block of `x`, in block order,
and reads neither `x` nor `A`; it reads the partials before its wait, for the reason it may
read `x` there.

Rows are read by their slot in `token_slots` (negative: no adapter, left alone); the sums are
rounded to the adapter's dtype before the expand, as the two-kernel path does
(`lora_shrink` + `lora_expand`, whose references are this kernel's too).
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
    next_power_of_2,
)
from .pdl import launch_options, wait_for_previous_kernel

__all__ = ["FUSED_MAX_ROWS", "lora_fused", "lora_fused_ref"]

FUSED_MAX_ROWS = 4
"""Most rows `lora_fused` takes: each program reads `A` once per row."""


@triton.jit
def _lora_fused_kernel(
    x_ptr,  # [M, K]
    a_ptr,  # [L, S, R, K]
    b_ptr,  # [L, N, R]
    out_ptr,  # [M, N], rows stride_om apart
    token_slots_ptr,  # [M] int32, negative: no adapter
    col_blocks_ptr,  # [C, 3] int32: slice, first column, end of the slice
    part_ptr,  # [P, M, BLOCK_R] float32 partial sums of the shrink (PRESHRUNK)
    M,
    K,
    R,
    P,
    stride_xm,
    stride_al,
    stride_as,
    stride_ar,
    stride_bl,
    stride_bn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PRESHRUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    block = tl.program_id(0)
    s = tl.load(col_blocks_ptr + block * 3)
    n0 = tl.load(col_blocks_ptr + block * 3 + 1)
    n_end = tl.load(col_blocks_ptr + block * 3 + 2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    slots = tl.load(token_slots_ptr + offs_m, mask=offs_m < M, other=-1)  # [BLOCK_M]
    active = slots >= 0
    slot = tl.where(active, slots, 0).to(tl.int64)
    r_mask = offs_r < R
    n_mask = offs_n < n_end
    if PRESHRUNK:  # the producer of x stored the shrink's sums per column block of x
        offs_p = tl.arange(0, BLOCK_P)
        parts = tl.load(
            part_ptr
            + (offs_p[:, None, None] * M + offs_m[None, :, None]) * BLOCK_R
            + offs_r[None, None, :],
            mask=(offs_p < P)[:, None, None] & (offs_m < M)[None, :, None],
            other=0.0,
        )  # [BLOCK_P, BLOCK_M, BLOCK_R]
        summed = tl.sum(parts, axis=0)
    else:
        # [BLOCK_M, BLOCK_R, 1] rows of each row's A
        a_rows = (
            a_ptr
            + slot[:, None, None] * stride_al
            + s * stride_as
            + offs_r[None, :, None] * stride_ar
        )
        a_mask = active[:, None, None] & r_mask[None, :, None]
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        # Products summed elementwise over the K steps and reduced across the tile once at
        # the end: a reduction per step would put a cross-thread exchange on every load's
        # path.
        partial = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < K
            a = tl.load(a_rows + ks[None, None, :], mask=a_mask & k_mask[None, None, :], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=active[:, None] & k_mask[None, :], other=0.0)
            partial += a.to(tl.float32) * x.to(tl.float32)[:, None, :]
        summed = tl.sum(partial, axis=2)
    shrunk = summed.to(b_ptr.dtype.element_ty).to(tl.float32)
    b_tile = (
        b_ptr
        + slot[:, None, None] * stride_bl
        + offs_n[None, :, None] * stride_bn
        + offs_r[None, None, :]
    )
    b_mask = active[:, None, None] & n_mask[None, :, None] & r_mask[None, None, :]
    b = tl.load(b_tile, mask=b_mask, other=0.0)  # [BLOCK_M, BLOCK_N, BLOCK_R]
    delta = tl.sum(b.to(tl.float32) * shrunk[:, None, :], axis=2)  # [BLOCK_M, BLOCK_N]
    wait_for_previous_kernel(PDL)
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = active[:, None] & n_mask[None, :]
    old = tl.load(dst, mask=out_mask, other=0.0)
    tl.store(dst, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=out_mask)


def lora_fused(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    col_blocks: torch.Tensor,
    *,
    block_n: int,
    block_k: int = 512,
    num_warps: int = 8,
    partials: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add each row's `(x · A[slot]ᵀ) · B[slot]ᵀ` into `out` in place, per slice.

    Args:
        x: `[M, K]` activations, M <= `FUSED_MAX_ROWS`.
        lora_a: `[L, S, R, K]` adapter slots (slot stride free, the rest contiguous).
        lora_b: `[L, N, R]` adapter slots, the scaling folded in.
        out: `[M, N]` the layer's output; updated in place.
        token_slots: `[M]` int32 slots (negative: no adapter).
        col_blocks: `[C, 3]` int32 from `lora_expand.column_blocks(slice_starts, block_n)`.
        block_n: Output columns per program.
        block_k: K elements per loaded tile at one row, halved each time the rows double
            (the products of every row, rank and element are held until the end).
        num_warps: Warps per program.
        partials: `[P, M, block_r]` float32 sums of the shrink by column blocks of `x`
            (`lora_act_shrink.silu_and_mul_lora_shrink`), added up instead of reading `A`
            (one-slice layers only); None: the kernel does the shrink.

    Returns:
        `out`.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_m, num_k = x.shape
    if num_m > FUSED_MAX_ROWS:
        raise ValueError(f"lora_fused takes at most {FUSED_MAX_ROWS} rows, x has {num_m}")
    check_tensor("lora_a", lora_a, ndim=4, dtypes=FLOAT_DTYPES, shape={3: num_k})
    num_l, num_s, num_r, _ = lora_a.shape
    if lora_a.stride(2) != num_k or lora_a.stride(1) != num_r * num_k:
        raise ValueError(f"lora_a must be contiguous past its slot dimension: {lora_a.stride()}")
    check_tensor("lora_b", lora_b, ndim=3, dtypes=(lora_a.dtype,), shape={0: num_l, 2: num_r})
    num_n = lora_b.shape[1]
    if lora_b.stride(1) != num_r:
        raise ValueError(f"lora_b must be contiguous past its slot dimension: {lora_b.stride()}")
    check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, shape={0: num_m, 1: num_n})
    check_tensor("token_slots", token_slots, ndim=1, dtypes=(torch.int32,), shape={0: num_m})
    check_tensor("col_blocks", col_blocks, ndim=2, dtypes=(torch.int32,), shape={1: 3})
    check_power_of_2("block_n", block_n, 16, 512, "output columns per program")
    check_power_of_2("block_k", block_k, 16, 1024, "K elements per tile")
    block_r = max(16, next_power_of_2(num_r))
    if partials is not None:
        check_tensor(
            "partials", partials, ndim=3, dtypes=(torch.float32,), shape={1: num_m, 2: block_r}
        )
        if num_s != 1:
            raise ValueError(f"partials are for one-slice layers, lora_a has {num_s} slices")
    check_same_device(
        _lora_fused_kernel, x=x, lora_a=lora_a, lora_b=lora_b, out=out, slots=token_slots
    )
    if num_m == 0 or col_blocks.shape[0] == 0:
        return out
    _lora_fused_kernel[(col_blocks.shape[0],)](
        x,
        lora_a,
        lora_b,
        out,
        token_slots,
        col_blocks,
        partials if partials is not None else x,
        num_m,
        num_k,
        num_r,
        partials.shape[0] if partials is not None else 0,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        lora_b.stride(0),
        lora_b.stride(1),
        out.stride(0),
        BLOCK_M=next_power_of_2(num_m),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_K=max(16, block_k // next_power_of_2(num_m)),
        BLOCK_P=next_power_of_2(partials.shape[0]) if partials is not None else 1,
        PRESHRUNK=partials is not None,
        num_warps=num_warps,
        **launch_options(_lora_fused_kernel, x.device),
    )
    return out


def lora_fused_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    slice_starts: list[int],
) -> torch.Tensor:
    """The same sum as the two-kernel path's references (`lora_shrink_ref`, then
    `lora_expand_ref`), into `out` in place."""
    from .lora_expand import lora_expand_ref
    from .lora_shrink import lora_shrink_ref

    shrunk = lora_shrink_ref(x, lora_a, token_slots)
    return lora_expand_ref(shrunk, lora_b, out, token_slots, slice_starts)
