"""Linear layers whose output concatenates several checkpoint tensors (q|k|v, gate|up)."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One matmul for several projections that read the same input.

    Args:
        in_features: Input width.
        output_sizes: Width of each merged projection, in checkpoint order.
        bias: Whether the projections have biases.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_slice(self, shard: int) -> slice:
        """Rows of the weight that hold projection number `shard`."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.output_sizes, dim=-1))
