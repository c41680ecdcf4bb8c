"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention, and in sparse layers routed
experts plus a shared expert gated per token by `sigmoid(shared_expert_gate(x))`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .layers.moe import FusedMoE
from .llama import LlamaMLP
from .qwen2 import Qwen2ForCausalLM

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts: not in `mlp_only_layers`, and every
    `decoder_sparse_step`-th layer (counting from 1)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


def routed_experts_kwargs(config: Any) -> dict[str, Any]:
    """`FusedMoE` arguments of a Qwen MoE layer's routed experts (`norm_topk_prob`
    renormalises)."""
    return dict(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
    )


class SharedExpertMoE(FusedMoE):
    """Routed experts plus a dense shared expert scaled by a per-token sigmoid gate.

    Under tensor parallelism the shared expert's output is a partial sum like the routed
    experts' (the gate, replicated, scales each rank's part), so one all-reduce sums both.
    """

    def __init__(self, config: Any, tp: TPGroup | None, reduce_output: bool) -> None:
        super().__init__(**routed_experts_kwargs(config), tp=tp, reduce_output=reduce_output)
        self.shared_expert = LlamaMLP(
            config,
            tp=tp,
            reduce_output=False,
            intermediate_size=config.shared_expert_intermediate_size,
        )
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] → [n, hidden]
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.reduce(self.expert_sum(x) + shared)


def qwen_moe_mlp(
    config: Any, layer_idx: int, bias: bool, tp: TPGroup | None, reduce_output: bool
) -> nn.Module:
    """The MLP of a Qwen MoE layer: dense off the sparse layers, else the routed experts
    (with the shared expert when the config has one: Qwen2-MoE)."""
    if not is_sparse_layer(config, layer_idx):
        return LlamaMLP(config, bias, tp, reduce_output)
    if getattr(config, "shared_expert_intermediate_size", 0):
        return SharedExpertMoE(config, tp, reduce_output)
    return FusedMoE(**routed_experts_kwargs(config), tp=tp, reduce_output=reduce_output)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    make_mlp = staticmethod(qwen_moe_mlp)

    @staticmethod
    def sliding_window_of(config: Any, layer_idx: int) -> int | None:
        # Qwen2-MoE declares its sliding layers in `layer_types` (when the window is enabled).
        if not getattr(config, "use_sliding_window", False):
            return None
        types = getattr(config, "layer_types", None)
        if types is None:
            return Qwen2ForCausalLM.sliding_window_of(config, layer_idx)
        sliding = types[layer_idx] == "sliding_attention"
        return (getattr(config, "sliding_window", None) or None) if sliding else None
