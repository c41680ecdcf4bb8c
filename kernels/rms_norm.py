"""RMSNorm, optionally fused with the residual add before it, one row per program.

Rounding follows the PyTorch layer step by step (sum in the activation dtype, normalise in
float32, round, then scale by the weight), so results match it to the last bit or two.
Both functions are pure: they return new tensors and never write their inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2
from .pdl import launch_options, wait_for_previous_kernel

__all__ = [
    "RMSNormOutput",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "rms_norm",
    "rms_norm_ref",
]


class RMSNormOutput(NamedTuple):
    out: torch.Tensor
    """The normalised `x + residual`."""
    residual: torch.Tensor
    """`x + residual`, the residual stream for the next layer."""


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden_size]
    residual_ptr,  # [num_rows, hidden_size] (unused without HAS_RESIDUAL)
    weight_ptr,  # [hidden_size]
    out_ptr,  # [num_rows, hidden_size]
    residual_out_ptr,  # [num_rows, hidden_size] (unused without HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = rms_norm_row(x, w, eps, HIDDEN)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_row(x, w, eps, HIDDEN: tl.constexpr):
    """One row `x` (the activation dtype, zeros past HIDDEN) normalised and scaled by `w`,
    in float32: the mean square in float32, the normalised row rounded to x's dtype, then
    the weight, as the PyTorch layer rounds."""
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, 0) / HIDDEN
    normed = (h * tl.rsqrt(mean_square + eps)).to(x.dtype)
    return normed.to(tl.float32) * w.to(tl.float32)


def row_warps(block: int) -> int:
    """Warps for a program that holds one row of `block` elements."""
    return min(max(block // 256, 1), 16)


def check_norm_args(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> int:
    """Raise `ValueError` unless `x` (floating, with a hidden dimension), `residual` (None,
    or x's shape and dtype), `weight` (`[hidden]`) and `eps` (> 0) suit a norm; returns the
    hidden size."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=False)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    hidden = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, shape={0: hidden})
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), last_dim_contiguous=False)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}; they must match"
            )
    if eps <= 0:
        raise ValueError(f"eps={eps} must be > 0")
    return hidden


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as `[num_rows, hidden]` with unit stride along hidden, a view when possible."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> RMSNormOutput | torch.Tensor:
    hidden = check_norm_args(x, residual, weight, eps)
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        tensors["residual"] = residual
    check_same_device(_rms_norm_kernel, **tensors)
    x_rows = as_rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out_rows = out.view(-1, hidden)
    if residual is not None:
        r_rows = as_rows(residual)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ro_rows = residual_out.view(-1, hidden)
    else:
        r_rows, ro_rows, residual_out = x_rows, out_rows, None
    num_rows = x_rows.shape[0]
    if num_rows and hidden:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x_rows,
            r_rows,
            weight,
            out_rows,
            ro_rows,
            x_rows.stride(0),
            r_rows.stride(0),
            out_rows.stride(0),
            ro_rows.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=row_warps(block),
            **launch_options(_rms_norm_kernel, x.device),
        )
    return out if residual_out is None else RMSNormOutput(out, residual_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x) * weight` over the last dimension.

    Args:
        x: `[..., hidden_size]`, float32 / float16 / bfloat16.
        weight: `[hidden_size]`.
        eps: Added to the mean square before the square root.

    Returns:
        The shape of `x`, in the promoted dtype of `x` and `weight`.
    """
    return _launch(x, None, weight, eps)  # type: ignore[return-value]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> RMSNormOutput:
    """RMSNorm of `x + residual`, returning the sum too (the next layer's residual).

    Args:
        x: `[..., hidden_size]`, float32 / float16 / bfloat16.
        residual: Same shape and dtype as `x`.
        weight: `[hidden_size]`.
        eps: Added to the mean square before the square root.
    """
    return _launch(x, residual, weight, eps)  # type: ignore[return-value]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` in plain PyTorch."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> RMSNormOutput:
    """`fused_add_rms_norm` in plain PyTorch."""
    total = x + residual
    return RMSNormOutput(rms_norm_ref(total, weight, eps), total)
