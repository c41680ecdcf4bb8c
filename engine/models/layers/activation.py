"""Gated activations (SiLU with a Triton kernel on CUDA; GELU in PyTorch)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchlm.kernels import use_triton_kernels


class SiluAndMul(nn.Module):
    """`silu(gate) * up` for an input laid out as `[..., 2 * d] = [gate | up]`."""

    fold: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    """The next projection's LoRA (`LinearLoRA.activation`, set when it has adapters): it
    may compute the activation with its own shrink on the way, and returns None when not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton_kernels(x):
            from batchlm.kernels.activation import silu_and_mul

            if self.fold is not None:
                folded = self.fold(x)
                if folded is not None:
                    return folded

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """`gelu(gate) * up` with GELU's tanh approximation (Hugging Face's `gelu_pytorch_tanh`,
    Gemma's GeGLU) for an input laid out as `[..., 2 * d] = [gate | up]`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
