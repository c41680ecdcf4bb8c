"""Mixture-of-experts MLP: a router picks `top_k` experts per token, whose gated MLPs run
over stacked weights (`gpu_kernels/fused_moe.py` on CUDA, its PyTorch reference elsewhere).

With `quantization="fp8"` the stacked expert weights are stored in float8_e4m3fn with
per-channel scales (`ExpertWeights.quantize_fp8`) and run through the same kernels; the
router stays in the model dtype.

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
from batchlm.kernels.fused_moe import fused_moe_ref
from batchlm.kernels.moe_routing import route_ref

from .linear import _divide
from .quant import FP8_DTYPE, quantize_per_row

if TYPE_CHECKING:
    from ...distributed.parallel import TPGroup


def quantize_experts_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[num_experts, rows, cols]` stacked weights as float8_e4m3fn values and `[num_experts,
    rows]` float32 scales, each expert by `quantize_per_row` in turn (so the float32 copy is
    one expert's)."""
    values = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
    for e in range(weight.shape[0]):
        values[e], scale[e] = quantize_per_row(weight[e], FP8_DTYPE)
    return values, scale


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
        # float32 [num_experts, 2 * inter] / [num_experts, hidden] once quantized to fp8.
        self.w13_scale: nn.Parameter | None
        self.w2_scale: nn.Parameter | None
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)

    def quantize_fp8(self) -> None:
        """Store `w13` and `w2` in float8_e4m3fn with one float32 scale per expert and
        output channel (`w13_scale`, `w2_scale`), as the dense fp8 layers are quantized
        (`quantize_per_row`: each row's largest magnitude maps to 448).

        Per output channel rather than per expert: an expert's rows differ in range, and a
        per-expert scale would leave the small rows only a few of e4m3's levels; the scales
        cost the kernels nothing measurable (one float per output column of a tile,
        applied to the accumulator after the K loop). Quantized one expert at a time, so
        the float32 copy is one expert's. Under tensor parallelism each rank quantizes its
        own slice, so `w2`'s scales cover this rank's partial sums.
        """
        for name in ("w13", "w2"):
            values, scale = quantize_experts_fp8(getattr(self, name).data)
            setattr(self, name, nn.Parameter(values, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))


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
        experts = self.experts
        w13, w2 = experts.w13, experts.w2
        scales = dict(w13_scale=experts.w13_scale, w2_scale=experts.w2_scale)
        if use_triton_kernels(x):
            from batchlm.kernels.fused_moe import fused_moe
            from batchlm.kernels.moe_routing import route

            weights, ids = route(router_logits, self.top_k, self.renormalize)
            return fused_moe(x, w13, w2, weights, ids, **scales)
        weights, ids = route_ref(router_logits, self.top_k, self.renormalize)
        return fused_moe_ref(x, w13, w2, weights, ids, **scales)

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """Sum a partial output over the ranks when this layer owns that sum."""
        if self.tp is not None and self.reduce_output:
            return self.tp.all_reduce(out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] → [n, hidden]
        return self.reduce(self.expert_sum(x))
