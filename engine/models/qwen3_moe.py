"""Qwen3-MoE: Qwen3 attention (q / k norms, no biases) with routed experts in sparse
layers (no shared expert) and dense MLPs in `mlp_only_layers`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .layers.moe import FusedMoE
from .llama import LlamaMLP
from .qwen2_moe import is_sparse_layer, routed_experts_kwargs
from .qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(
        self, config: Any, layer_idx: int, bias: bool, tp: TPGroup | None, reduce_output: bool
    ) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, bias, tp, reduce_output)
        return FusedMoE(**routed_experts_kwargs(config), tp=tp, reduce_output=reduce_output)
