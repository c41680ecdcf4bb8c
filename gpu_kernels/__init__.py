"""Triton kernels: each file holds a kernel, its launcher and a plain-PyTorch reference.

Importing this package loads nothing heavy; the kernel modules import Triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["use_triton_kernels"]


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton_kernels(tensor: torch.Tensor) -> bool:
    """Whether the model layers should run their Triton kernel on `tensor`: CUDA tensors, with
    Triton installed. CPU tensors keep the PyTorch path."""
    return tensor.is_cuda and _has_triton()
