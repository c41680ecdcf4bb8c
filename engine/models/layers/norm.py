"""RMSNorm, optionally fused with the residual add that precedes it (a Triton kernel on CUDA)
and, under tensor parallelism, with the all-reduce before that."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batchlm.kernels import use_triton_kernels

from .linear import batch_invariant_linear

if TYPE_CHECKING:
    from ...distributed.parallel import TPGroup


def sum_square(h: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """`[..., n]` float32 → `[..., 1]` sums of squares; with `batch_invariant`, a product
    with a ones vector through `batch_invariant_linear`, one fixed order per row (PyTorch's
    CUDA reductions split a row across more threads and blocks when the rows are few)."""
    if not batch_invariant:
        return h.pow(2).sum(-1, keepdim=True)
    ones = torch.ones(1, h.shape[-1], dtype=torch.float32, device=h.device)
    return batch_invariant_linear(h * h, ones)


def mean_square(h: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """`[..., n]` float32 → `[..., 1]` means of squares (see `sum_square`)."""
    if not batch_invariant:
        return h.pow(2).mean(-1, keepdim=True)
    return sum_square(h, True) / h.shape[-1]


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`, computed in float32 like the reference implementations.

    Args:
        hidden_size: Width of the normalised dimension.
        eps: Added to the mean square before the square root.
        sum_over: A tensor-parallel group whose ranks each pass a partial sum as `x`
            whenever a residual comes with it (the output of a row-parallel layer that left
            its all-reduce to the norm): `x` is summed over the ranks first, in one kernel
            with the add and the norm where the peer-memory all-reduce takes it.
    """

    batch_invariant: bool = False
    """On the PyTorch path, sum each row's squares in one fixed order whatever the number
    of rows (`sum_square`); the Triton kernel is invariant as it is (rows per program and
    launch chosen by the hidden size alone)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, sum_over: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.sum_over = sum_over

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x` (or `x + residual`, also returning that sum as the new residual)."""
        if self.sum_over is not None and residual is not None:
            fused = self.sum_over.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = self.sum_over.all_reduce(x)
        if use_triton_kernels(x):
            from batchlm.kernels.rms_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(mean_square(h, self.batch_invariant) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class Float32ScaledRMSNorm(nn.Module):
    """`x / rms(x) * (weight_offset + weight)`, the weight applied in float32 before the
    result is rounded to x's dtype (the order of Gemma and OLMo 2; `RMSNorm` rounds first,
    as Llama does). Plain PyTorch.

    Args:
        hidden_size: Width of the normalised dimension (the whole vector's, split or not).
        eps: Added to the mean square before the square root.
        weight_offset: Added to the weight: Gemma stores it as an offset from 1.
        tp: A tensor-parallel group over which the normalised vector is split (OLMo 2's
            q / k norms over the whole projection): each rank holds `hidden_size / tp_size`
            channels of `x` and of the weight, and the mean square is summed over the ranks.
    """

    batch_invariant: bool = False
    """Sum each row's squares in one fixed order whatever the number of rows
    (`sum_square`)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        weight_offset: float = 0.0,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank = tp.rank if tp is not None else 0
        self.tp_size = tp.world_size if tp is not None else 1
        if hidden_size % self.tp_size:
            raise ValueError(
                f"a norm over {hidden_size} channels cannot be split over "
                f"tensor_parallel_size={self.tp_size} ranks"
            )
        self.tp = tp if self.tp_size > 1 else None
        self.hidden_size = hidden_size
        # Filled from the checkpoint; the identity until then.
        self.weight = nn.Parameter(torch.full((hidden_size // self.tp_size,), 1.0 - weight_offset))
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x` (or `x + residual`, also returning that sum as the new residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        if self.tp is None:
            mean_sq = mean_square(h, self.batch_invariant)
        else:
            mean_sq = self.tp.all_reduce(sum_square(h, self.batch_invariant)) / self.hidden_size
        h = h * torch.rsqrt(mean_sq + self.eps)
        weight = self.weight.float()
        if self.weight_offset:
            weight = self.weight_offset + weight
        out = (h * weight).to(x.dtype)
        return out if residual is None else (out, residual)
