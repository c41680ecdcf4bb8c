"""Qwen3 decoders: Llama layers with per-head RMSNorm on queries and keys before rotary."""

from __future__ import annotations

from .qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    qkv_bias = False
    qk_norm = True
