"""Mixtral: Mistral attention with a mixture-of-experts MLP in every layer (softmax router,
the top `num_experts_per_tok` experts, their weights renormalised to sum to 1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .layers.moe import FusedMoE
from .llama import MistralForCausalLM

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup


class MixtralForCausalLM(MistralForCausalLM):
    # Checkpoints name the MoE block `block_sparse_moe` (router `gate`, experts `w1` / `w3`
    # / `w2`); the model holds it as every decoder layer's `mlp`.
    checkpoint_name_replacements = ((".block_sparse_moe.", ".mlp."),)

    def make_mlp(
        self, config: Any, layer_idx: int, bias: bool, tp: TPGroup | None, reduce_output: bool
    ) -> nn.Module:
        return FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            tp=tp,
            reduce_output=reduce_output,
        )
