"""Mixture-of-experts MLP: a router picks `top_k` experts per token, whose gated MLPs run
over stacked weights (`kernels/fused_moe.py` on CUDA, its PyTorch reference elsewhere).

Tensor parallelism splits every expert's intermediate dimension over the ranks, as the
dense MLP's gate|up (column-parallel) and down (row-parallel) projections are split: each
rank computes a partial sum of every token's output, summed over the ranks like the dense
MLP's down projection (by the layer itself, or by the next norm: `reduce_output`). The
router is replicated, so every rank picks the same experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batchlm.kernels import use_triton_kernels
from batchlm.kernels.fused_moe import fused_moe_ref, route_ref

from .linear import _divide

if TYPE_CHECKING:
    from ...distributed.parallel import TPGroup


class ExpertWeights(nn.Module):
    """Every expert's gate|up and down projections, stacked (this rank's slice of each).

    Checkpoints hold one tensor per expert and projection (or transformers' fused
    `gate_up_proj` / `down_proj`); the loader copies each into its slice of `w13` / `w2`
    (`loader/moe_weights.py`).

    Args:
        num_experts: Experts in the layer.
        hidden_size: Model width.
        intermediate_size: One expert's MLP width (whole model).
        tp: The tensor-parallel group (None: one rank).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup | None
    ) -> None:
        super().__init__()
        self.tp_rank = tp.rank if tp is not None else 0
        self.tp_size = tp.world_size if tp is not None else 1
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        """One expert's MLP width in the checkpoint."""
        self.local_intermediate_size = _divide(
            intermediate_size, self.tp_size, "moe intermediate size"
        )
        """One expert's MLP width on this rank."""
        inter = self.local_intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))  # [gate | up]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))


class FusedMoE(nn.Module):
    """`sum_j w_j * expert_{e_j}(x)` over the `top_k` experts the router picks per token.

    Args:
        num_experts: Experts in the layer.
        top_k: Experts per token.
        hidden_size: Model width.
        intermediate_size: One expert's MLP width (whole model).
        renormalize: Divide the chosen routing weights by their sum (Mixtral; the Qwen
            MoE families' `norm_topk_prob`).
        tp: The tensor-parallel group (None: one rank).
        reduce_output: False under tensor parallelism: return this rank's partial sum and
            leave the all-reduce to the consumer (an `RMSNorm` with `sum_over`).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp: TPGroup | None = None,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router, replicated
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size, tp)
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.reduce_output = reduce_output

    def expert_sum(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] → [n, hidden]
        """The routed experts' weighted sum (this rank's partial sum under TP)."""
        router_logits = self.gate(x)  # [n, num_experts]
        w13, w2 = self.experts.w13, self.experts.w2
        if use_triton_kernels(x):
            from batchlm.kernels.fused_moe import fused_moe, route

            weights, ids = route(router_logits, self.top_k, self.renormalize)
            return fused_moe(x, w13, w2, weights, ids)
        weights, ids = route_ref(router_logits, self.top_k, self.renormalize)
        return fused_moe_ref(x, w13, w2, weights, ids)

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """Sum a partial output over the ranks when this layer owns that sum."""
        if self.tp is not None and self.reduce_output:
            return self.tp.all_reduce(out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] → [n, hidden]
        return self.reduce(self.expert_sum(x))
