"""RMSNorm, optionally fused with the residual add that precedes it (a Triton kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from batchlm.kernels import use_triton_kernels


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`, computed in float32 like the reference implementations."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x` (or `x + residual`, also returning that sum as the new residual)."""
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
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
