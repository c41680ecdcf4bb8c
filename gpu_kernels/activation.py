"""SiLU-and-mul: `silu(gate) * up` for an input laid out `[..., 2 * d] = [gate | up]`.

Rounds like the PyTorch layer (silu rounded to the activation dtype, then the product).
Pure: returns a new tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FLOAT_DTYPES, cdiv, check_same_device, check_tensor, next_power_of_2
from .pdl import launch_options, wait_for_previous_kernel

__all__ = ["silu_and_mul", "silu_and_mul_ref", "silu_mul"]

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """`silu(gate) * up` in `dtype` from float32 `gate` and `up`, rounded as the PyTorch
    layer rounds (silu to `dtype` first, then the product)."""
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d]
    out_ptr,  # [num_rows, d]
    stride_x,
    stride_o,
    d,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]`.

    Args:
        x: `[..., 2 * d]`, float32 / float16 / bfloat16.

    Returns:
        `[..., d]` in `x`'s dtype.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dimension, got shape {tuple(x.shape)}")
    check_same_device(_silu_and_mul_kernel, x=x)
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if rows.shape[0] and d:
        out_rows = out.view(-1, d)
        block = min(_BLOCK, next_power_of_2(d))
        _silu_and_mul_kernel[(rows.shape[0], cdiv(d, block))](
            rows,
            out_rows,
            rows.stride(0),
            out_rows.stride(0),
            d,
            BLOCK=block,
            **launch_options(_silu_and_mul_kernel, x.device),
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` in plain PyTorch."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
