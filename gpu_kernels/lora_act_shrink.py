"""SiLU-and-mul that also starts the next projection's LoRA shrink, for steps of a few rows.

At one row, the fused LoRA kernel of a projection (`lora_fused.py`) recomputes `x · Aᵀ` in
each of its column programs; for `down_proj`, whose `A` is as wide as the MLP (14,336 inputs
in Llama-3.1-8B), those re-reads cost more than the projection's matmul hides. Its input `x`
is this activation's output, made here in column blocks by many programs: each program also
multiplies its block by the row's adapter `A` (loaded before the PDL wait, since no kernel
writes it) and stores the `[rank]` partial sums of its block. `lora_fused` given those
partials adds them up, in block order, instead of reading `A` again, so `A` is read once.

Partials are `[blocks, rows, block_r]` float32, every entry written (zeros past the rank and
for rows without an adapter), so nothing needs clearing between steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_ref, silu_mul
from .launch import (
    FLOAT_DTYPES,
    cdiv,
    check_power_of_2,
    check_same_device,
    check_tensor,
    next_power_of_2,
)
from .lora_fused import FUSED_MAX_ROWS
from .pdl import launch_options, wait_for_previous_kernel

__all__ = ["silu_and_mul_lora_shrink", "silu_and_mul_lora_shrink_ref"]


@triton.jit
def _silu_and_mul_lora_shrink_kernel(
    x_ptr,  # [M, 2 * d]
    out_ptr,  # [M, d]
    a_ptr,  # [L, 1, R, d]
    token_slots_ptr,  # [M] int32, negative: no adapter
    part_ptr,  # [P, M, BLOCK_R] float32
    M,
    d,
    R,
    stride_x,
    stride_o,
    stride_al,
    stride_ar,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    offs_r = tl.arange(0, BLOCK_R)
    slot = tl.load(token_slots_ptr + row)
    a_tile = (
        a_ptr
        + tl.maximum(slot, 0).to(tl.int64) * stride_al
        + offs_r[:, None] * stride_ar
        + cols[None, :]
    )
    a_mask = (slot >= 0) & (offs_r[:, None] < R) & mask[None, :]
    a = tl.load(a_tile, mask=a_mask, other=0.0)  # [BLOCK_R, BLOCK]
    wait_for_previous_kernel(PDL)
    row64 = row.to(tl.int64)
    gate = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row64 * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row64 * stride_o + cols, y, mask=mask)
    partial = tl.sum(a.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)  # [BLOCK_R]
    tl.store(part_ptr + (block * M + row64) * BLOCK_R + offs_r, partial)


def silu_and_mul_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    block: int = 512,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu(x[:, :d]) * x[:, d:]`, and each block's share of its rows' `· A[slot]ᵀ`.

    Args:
        x: `[M, 2 * d]` the gate and up projections, M <= `FUSED_MAX_ROWS`.
        lora_a: `[L, 1, R, d]` the next projection's adapter slots (one slice; slot stride
            free, the rest contiguous).
        token_slots: `[M]` int32 slots (negative: no adapter).
        block: Columns per program.
        num_warps: Warps per program.

    Returns:
        `([M, d]` in `x`'s dtype, `[P, M, block_r]` float32 partial sums`)`, `P` the
        column blocks, `block_r` the rank rounded up to a power of 2 (at least 16): what
        `lora_fused(..., partials=)` takes.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_m, width = x.shape
    if width % 2:
        raise ValueError(f"x must have an even last dimension, got shape {tuple(x.shape)}")
    if num_m > FUSED_MAX_ROWS:
        raise ValueError(
            f"silu_and_mul_lora_shrink takes at most {FUSED_MAX_ROWS} rows, x has {num_m}"
        )
    d = width // 2
    check_tensor("lora_a", lora_a, ndim=4, dtypes=FLOAT_DTYPES, shape={1: 1, 3: d})
    num_r = lora_a.shape[2]
    if lora_a.stride(2) != d:
        raise ValueError(f"lora_a must be contiguous past its slot dimension: {lora_a.stride()}")
    check_tensor("token_slots", token_slots, ndim=1, dtypes=(torch.int32,), shape={0: num_m})
    check_power_of_2("block", block, 16, 4096, "columns per program")
    check_same_device(_silu_and_mul_lora_shrink_kernel, x=x, lora_a=lora_a, slots=token_slots)
    block = min(block, next_power_of_2(max(d, 16)))
    block_r = max(16, next_power_of_2(num_r))
    num_p = cdiv(d, block)
    out = torch.empty(num_m, d, dtype=x.dtype, device=x.device)
    partials = torch.empty(num_p, num_m, block_r, dtype=torch.float32, device=x.device)
    if num_m == 0 or d == 0:
        return out, partials.zero_()
    _silu_and_mul_lora_shrink_kernel[(num_m, num_p)](
        x,
        out,
        lora_a,
        token_slots,
        partials,
        num_m,
        d,
        num_r,
        x.stride(0),
        out.stride(0),
        lora_a.stride(0),
        lora_a.stride(2),
        BLOCK=block,
        BLOCK_R=block_r,
        num_warps=num_warps,
        **launch_options(_silu_and_mul_lora_shrink_kernel, x.device),
    )
    return out, partials


def silu_and_mul_lora_shrink_ref(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation and the whole shrink of it (`[M, 1, R]` float32, what the partials
    add up to past the rank's padding), in PyTorch."""
    from .lora_shrink import lora_shrink_ref

    out = silu_and_mul_ref(x)
    return out, lora_shrink_ref(out, lora_a, token_slots)
