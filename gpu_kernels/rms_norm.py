"""RMSNorm, optionally fused with the residual add before it, a few rows per program.

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
    x_ptr,  # [num_tokens, heads, hidden_size] (heads 1: [num_rows, hidden_size])
    residual_ptr,  # [num_rows, hidden_size] (unused without HAS_RESIDUAL)
    weight_ptr,  # [hidden_size]
    out_ptr,  # [num_rows, hidden_size], num_rows = num_tokens * heads
    residual_out_ptr,  # [num_rows, hidden_size] (unused without HAS_RESIDUAL)
    num_rows,
    heads,
    stride_x,
    stride_xh,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """`ROWS` rows per program (a function of the hidden size alone, so a row's arithmetic
    does not depend on the number of rows); row `r` of `x` is head `r % heads` of token
    `r // heads`, so the heads of a fused projection's output normalise in place."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (offs < HIDDEN)[None, :]
    x_rows = (rows // heads) * stride_x + (rows % heads) * stride_xh
    x = tl.load(x_ptr + x_rows[:, None] + offs[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_r + offs[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows[:, None] * stride_ro + offs[None, :], x, mask=mask)
    w = tl.load(weight_ptr + offs, mask=offs < HIDDEN, other=0.0)
    out = rms_norm_row(x, w, eps, HIDDEN)
    tl.store(
        out_ptr + rows[:, None] * stride_o + offs[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def rms_norm_row(x, w, eps, HIDDEN: tl.constexpr):
    """A row `x` (`[BLOCK]`), or rows (`[ROWS, BLOCK]`), in the activation dtype with zeros
    past HIDDEN, normalised along the last axis and scaled by `w` (`[BLOCK]`), in float32:
    the mean square in float32, the normalised row rounded to x's dtype, then the weight,
    as the PyTorch layer rounds."""
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=len(h.shape) - 1, keep_dims=True) / HIDDEN
    normed = (h * tl.rsqrt(mean_square + eps)).to(x.dtype)
    return normed.to(tl.float32) * w.to(tl.float32)


def row_warps(block: int) -> int:
    """Warps for a program that holds `block` elements (one row or several)."""
    return min(max(block // 256, 1), 16)


ROW_ELEMENTS = 2048
"""Narrow rows (q / k norms over one head) go several to a program, up to this many
elements: one program per 128-element row left a 16K-token prefill chunk of Qwen3 with
half a million one-warp programs per norm."""


def rows_per_program(block: int) -> int:
    """Rows per program for rows of `block` (a power of two) elements."""
    return max(1, min(32, ROW_ELEMENTS // block))


def head_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """`(x, heads, token stride, head stride)` for `[num_tokens, heads, hidden]` with unit
    stride along hidden (a view of a fused projection's output, whatever its token stride);
    otherwise `as_rows(x)` with one head."""
    if x.dim() == 3 and (x.stride(-1) == 1 or x.shape[-1] == 1):
        return x, x.shape[1], x.stride(0), x.stride(1)
    rows = as_rows(x)
    return rows, 1, rows.stride(0), 0


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
    if residual is None:
        x_rows, heads, stride_x, stride_xh = head_rows(x)
    else:
        x_rows = as_rows(x)
        heads, stride_x, stride_xh = 1, x_rows.stride(0), 0
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out_rows = out.view(-1, hidden)
    if residual is not None:
        r_rows = as_rows(residual)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ro_rows = residual_out.view(-1, hidden)
    else:
        r_rows, ro_rows, residual_out = out_rows, out_rows, None
    num_rows = out_rows.shape[0]
    if num_rows and hidden:
        block = next_power_of_2(hidden)
        rows = rows_per_program(block)
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x_rows,
            r_rows,
            weight,
            out_rows,
            ro_rows,
            num_rows,
            heads,
            stride_x,
            stride_xh,
            r_rows.stride(0),
            out_rows.stride(0),
            ro_rows.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            ROWS=rows,
            HAS_RESIDUAL=residual is not None,
            num_warps=row_warps(block * rows),
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
