"""Matrix-vector products for one-token steps: `y = x W^T (+ b)` with `x` of one row.

A decode step at batch 1 reads every weight once for one row of activations, so its
linear layers are bound by memory bandwidth alone. Each program owns `BLOCK_N` output
features: it streams their weight rows through `BLOCK_K`-wide tiles, multiplies them with
the matching slice of `x` into a `[BLOCK_N, BLOCK_K]` float32 accumulator (no reduction
inside the loop), and reduces it once at the end. Programs never share an output, so
there is no split-K reduction and no second kernel; `BLOCK_N` is small enough that every
program of the usual shapes is resident at once.

`gemv_ref` is the plain PyTorch product (the reference, and the CPU path).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import (
    FLOAT_DTYPES,
    cdiv,
    check_num_stages,
    check_power_of_2,
    check_same_device,
    check_tensor,
)
from .pdl import launch_options, wait_for_previous_kernel

__all__ = ["GemvLaunch", "choose_gemv_launch", "gemv", "gemv_ref"]

# Defaults by output features, from a launch sweep over Llama-3.1-8B's shapes in bf16
# (docs/performance.md): wide layers (gate|up, the LM head) stream short tiles deeply
# pipelined; narrow ones (o_proj, down_proj) take long tiles over more warps; in between
# (q|k|v), eight features per program keep enough programs in flight.
_WIDE_N = 16384
_NARROW_N = 4096
_WIDE = (16, 256, 4, 4)  # block_n, block_k, num_warps, num_stages
_NARROW = (16, 1024, 8, 2)
_MIDDLE = (8, 512, 4, 2)
# Exact shapes (N, K) whose sweep beat the defaults above: one rank's layers of
# Llama-3.1-8B at tensor_parallel_size=2, where the narrower weights want fewer features per
# program (timings in docs/performance.md).
_TUNED = {
    (3072, 4096): (8, 1024, 8, 3),  # q|k|v
    (4096, 2048): (8, 1024, 4, 4),  # o_proj
    (4096, 7168): (4, 1024, 4, 4),  # down_proj
    (64128, 4096): (8, 1024, 4, 4),  # LM head
}


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], rows `stride_wn` apart
    b_ptr,  # [N] (read when HAS_BIAS)
    y_ptr,  # [N]
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # The weights are no kernel's output: the first tile streams in while the previous
    # kernel of the step still runs (under PDL), before the wait for its `x`.
    w = _load_weight_tile(rows, offs_k, offs_n, N, K, EVEN_N, EVEN_K)
    wait_for_previous_kernel(PDL)
    acc = w.to(tl.float32) * _load_x_tile(x_ptr, offs_k, K, EVEN_K).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        w = _load_weight_tile(rows, ks, offs_n, N, K, EVEN_N, EVEN_K)
        acc += w.to(tl.float32) * _load_x_tile(x_ptr, ks, K, EVEN_K).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _load_weight_tile(rows, ks, offs_n, N, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """`[BLOCK_N, BLOCK_K]` weights at columns `ks` (0 past N or K)."""
    if EVEN_K:
        if EVEN_N:
            return tl.load(rows + ks[None, :])
        return tl.load(rows + ks[None, :], mask=(offs_n < N)[:, None], other=0.0)
    return tl.load(rows + ks[None, :], mask=(offs_n < N)[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def _load_x_tile(x_ptr, ks, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + ks)
    return tl.load(x_ptr + ks, mask=ks < K, other=0.0)


class GemvLaunch(NamedTuple):
    block_n: int
    """Output features per program."""
    block_k: int
    """Input features per loaded tile."""
    num_warps: int
    num_stages: int


def choose_gemv_launch(
    num_n: int,
    num_k: int,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> GemvLaunch:
    """The launch `gemv` makes for `num_n` outputs of `num_k` inputs: each None takes its
    default (a tuned shape's, else by `num_n`, the tile no wider than `num_k` needs); the
    rest are validated (`ValueError` naming the bad value)."""
    default = _TUNED.get((num_n, num_k)) or (
        _WIDE if num_n >= _WIDE_N else _NARROW if num_n <= _NARROW_N else _MIDDLE
    )
    launch = GemvLaunch(
        default[0] if block_n is None else block_n,
        min(default[1], max(16, triton.next_power_of_2(num_k))) if block_k is None else block_k,
        default[2] if num_warps is None else num_warps,
        default[3] if num_stages is None else num_stages,
    )
    check_power_of_2("block_n", launch.block_n, 1, 256, "output features per program")
    check_power_of_2("block_k", launch.block_k, 16, 4096, "input features per tile")
    check_power_of_2("num_warps", launch.num_warps, 1, 16, "warps per program")
    check_num_stages(launch.num_stages)
    return launch


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    **launch: int | None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for one row.

    Args:
        x: `[1, K]` (or `[K]`), with unit stride.
        weight: `[N, K]`, same dtype, unit stride along K. Under PDL its first tile is
            read before the wait for the previous kernel: it must not be that kernel's
            output (weights never are).
        bias: `[N]` or None.
        **launch: `block_n`, `block_k`, `num_warps`, `num_stages` overrides (see
            `choose_gemv_launch`).

    Returns:
        `[1, N]` (or `[N]`) in x's dtype, accumulated in float32.
    """
    squeeze = x.dim() == 1
    x2 = x[None] if squeeze else x
    check_tensor("x", x2, ndim=2, dtypes=FLOAT_DTYPES)
    if x2.shape[0] != 1:
        raise ValueError(f"gemv takes one row; x has shape {tuple(x.shape)} (use F.linear)")
    num_k = x2.shape[1]
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), shape={1: num_k})
    num_n = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, shape={0: num_n})
        check_same_device(_gemv_kernel, x=x, weight=weight, bias=bias)
    else:
        check_same_device(_gemv_kernel, x=x, weight=weight)
    cfg = choose_gemv_launch(num_n, num_k, **launch)
    y = torch.empty((1, num_n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(cdiv(num_n, cfg.block_n),)](
        x2,
        weight,
        bias if bias is not None else y,
        y,
        num_n,
        num_k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_N=num_n % cfg.block_n == 0,
        EVEN_K=num_k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(_gemv_kernel, x.device),
    )
    return y[0] if squeeze else y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The same product in float32, cast back to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
