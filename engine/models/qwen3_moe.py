"""Qwen3-MoE: Qwen3 attention (q / k norms, no biases) with routed experts in sparse
layers (no shared expert) and dense MLPs in `mlp_only_layers`."""

from __future__ import annotations

from .qwen2_moe import qwen_moe_mlp
from .qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    make_mlp = staticmethod(qwen_moe_mlp)
