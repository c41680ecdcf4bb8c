"""Per-token (per-row) fp8 e4m3 quantisation of activations, for fp8 × fp8 matmuls.

One program quantises `BLOCK_M` rows: it loads each row once when the row fits one block
(every hidden size of the usual models), finds its largest magnitude, and writes the e4m3
values and the row's float32 scale. Longer rows are read twice (the maximum, then the
values). The rounding is that of the PyTorch rule, step by step, so the values and scales
are equal bit for bit:

    scale = max(amax(|x|), min_amax) * (1 / 448)  # float32; 1 / 448 rounded to float32
    values = clamp(x / scale, -448, 448).to(float8_e4m3fn)  # true division, then RNE cast

The scale multiplies by the reciprocal, as PyTorch on CUDA does for `t / 448.0` (a tensor
divided by a Python number), so the rule is the same on every device. On the GPU the cast
is the hardware's (round to nearest even); under Triton's CPU interpreter, whose own fp8
cast rounds differently, the kernel rounds in integer arithmetic (`_e4m3fn_bits`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import (
    FLOAT_DTYPES,
    cdiv,
    check_same_device,
    check_tensor,
    is_interpreted,
    next_power_of_2,
)
from .pdl import launch_options, wait_for_previous_kernel

__all__ = ["Fp8PerTokenOutput", "quantize_fp8_per_token", "quantize_fp8_per_token_ref"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12
"""Default lower bound of a row's maximum: an all-zero row keeps a finite, non-zero scale."""
MAX_SINGLE_PASS_BLOCK = 16384
"""Rows up to this many columns are read once; longer ones in chunks of `LOOP_BLOCK_K`."""
LOOP_BLOCK_K = 4096
MIN_ELEMENTS_PER_PROGRAM = 2048  # short rows: several per program


class Fp8PerTokenOutput(NamedTuple):
    values: torch.Tensor
    """`[num_rows, cols]` float8_e4m3fn."""
    scale: torch.Tensor
    """`[num_rows]` float32: `values.float() * scale[:, None]` ≈ the input."""


@triton.jit
def _e4m3fn_bits(v):
    """float32 `v` in [-448, 448] (or NaN) → its float8_e4m3fn bit pattern (int32), rounded
    to nearest even; what the GPU's conversion does, in integer arithmetic (Triton's CPU
    interpreter rounds float → fp8 half away from zero and truncates subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    is_nan = v != v
    sign = tl.where(bits < 0, 0x80, 0)
    mag = tl.where(is_nan, 0, bits & 0x7FFFFFFF)  # |v| as bits; NaN kept out of the sums
    # |v| >= 2^-6: keep 3 of the 23 mantissa bits, round the 20 others to nearest even (a
    # carry moves into the exponent), then re-bias the exponent from 127 to 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # |v| < 2^-6: a multiple of 2^-9 (8 of them make the smallest normal, bits 0x08); the
    # float add rounds |v| * 2^9 to an integer, to nearest even.
    subnormal = (tl.abs(v) * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    out = tl.where(mag < 0x3C800000, subnormal, normal)  # 0x3C800000: 2^-6 in float32
    return tl.where(is_nan, 0x7F, out | sign)


@triton.jit
def _quantize_store(
    x, scale, out_ptrs, mask, FP8_MAX: tl.constexpr, SOFTWARE_FP8_CAST: tl.constexpr
):
    """Store `clamp(x / scale, ±FP8_MAX)` as e4m3 (x `[BLOCK_M, BLOCK_K]`, scale `[BLOCK_M]`)."""
    scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))  # IEEE, as PyTorch
    scaled = tl.clamp(scaled, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if SOFTWARE_FP8_CAST:
        q = _e4m3fn_bits(scaled).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        q = scaled.to(tl.float8e4nv)  # round to nearest even
    tl.store(out_ptrs, q, mask=mask)


@triton.jit
def _quantize_fp8_per_token_kernel(
    x_ptr,  # [num_rows, K] float32 / float16 / bfloat16
    out_ptr,  # [num_rows, K] float8_e4m3fn
    scale_ptr,  # [num_rows] float32
    num_rows,
    stride_xm,
    stride_om,
    stride_s,
    min_amax,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    SOFTWARE_FP8_CAST: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    out_rows = out_ptr + rows[:, None] * stride_om
    cols = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    if SINGLE_PASS:
        mask = row_mask[:, None] & (cols < K)
        x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_M]
        scale = tl.maximum(amax, min_amax) * INV_FP8_MAX
        _quantize_store(x, scale, out_rows + cols, mask, FP8_MAX, SOFTWARE_FP8_CAST)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k + cols < K)
            x = tl.load(x_rows + k + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.maximum(amax, min_amax) * INV_FP8_MAX
        for k in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k + cols < K)
            x = tl.load(x_rows + k + cols, mask=mask, other=0.0).to(tl.float32)
            _quantize_store(x, scale, out_rows + k + cols, mask, FP8_MAX, SOFTWARE_FP8_CAST)
    tl.store(scale_ptr + rows * stride_s, scale, mask=row_mask)


def quantize_fp8_per_token(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    *,
    min_amax: float = MIN_AMAX,
    block_k: int | None = None,
) -> Fp8PerTokenOutput:
    """Quantise each row of `x` to float8_e4m3fn with its own float32 scale.

    Args:
        x: `[num_rows, cols]` float32 / float16 / bfloat16 with unit stride along `cols` (rows
            may be strided, e.g. a slice of a wider tensor).
        out: Optional `[num_rows, cols]` float8_e4m3fn destination (unit stride along `cols`).
        scale_out: Optional `[num_rows]` float32 destination for the scales.
        min_amax: Lower bound of each row's largest magnitude (keeps all-zero rows finite).
        block_k: Columns per load (a power of two). Default: the whole row when it has at
            most 16384 columns, else chunks of 4096 (rows then read twice). Tests set it to
            exercise the chunked path on small rows.

    Returns:
        `Fp8PerTokenOutput(values, scale)`: `out` and `scale_out` when given. `values` is
        row-major and `scale[:, None]` is `[num_rows, 1]` contiguous, as
        `torch._scaled_mm` takes them for row-wise scaling.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_rows, num_cols = x.shape
    tensors = {"x": x}
    if out is None:
        out = torch.empty(num_rows, num_cols, dtype=FP8_DTYPE, device=x.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(FP8_DTYPE,), shape={0: num_rows, 1: num_cols})
        tensors["out"] = out
    if scale_out is None:
        scale_out = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    else:
        check_tensor("scale_out", scale_out, ndim=1, dtypes=(torch.float32,),
                     shape={0: num_rows}, last_dim_contiguous=False)  # fmt: skip
        tensors["scale_out"] = scale_out
    check_same_device(_quantize_fp8_per_token_kernel, **tensors)
    if num_cols == 0:
        raise ValueError("x has 0 columns; a row needs at least one value to have a scale")
    if not min_amax > 0:
        raise ValueError(f"min_amax={min_amax} must be > 0 (it keeps all-zero rows finite)")
    if block_k is None:
        block_k = next_power_of_2(num_cols)
        if block_k > MAX_SINGLE_PASS_BLOCK:
            block_k = LOOP_BLOCK_K
    elif block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two >= 16")
    block_m = min(max(MIN_ELEMENTS_PER_PROGRAM // block_k, 1), 16)
    if num_rows:
        _quantize_fp8_per_token_kernel[(cdiv(num_rows, block_m),)](
            x,
            out,
            scale_out,
            num_rows,
            x.stride(0),
            out.stride(0),
            scale_out.stride(0),
            min_amax,
            K=num_cols,
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            SINGLE_PASS=block_k >= num_cols,
            FP8_MAX=FP8_MAX,
            INV_FP8_MAX=1.0 / FP8_MAX,
            SOFTWARE_FP8_CAST=is_interpreted(_quantize_fp8_per_token_kernel),
            num_warps=min(max(block_m * block_k // 512, 1), 16),
            **launch_options(_quantize_fp8_per_token_kernel, x.device),
        )
    return Fp8PerTokenOutput(out, scale_out)


def quantize_fp8_per_token_ref(x: torch.Tensor, min_amax: float = MIN_AMAX) -> Fp8PerTokenOutput:
    """`quantize_fp8_per_token` in plain PyTorch (`x`: `[num_rows, cols]`)."""
    amax = x.abs().amax(dim=-1).float()  # exact in x.dtype
    scale = amax.clamp(min=min_amax) * (1.0 / FP8_MAX)  # [num_rows]
    scaled = x.float() / scale[:, None]
    return Fp8PerTokenOutput(scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale)
