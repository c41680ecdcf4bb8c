"""Phi-3 / Phi-3.5 / Phi-4-mini decoders: Llama layers over checkpoints that store q|k|v and
gate|up fused (`qkv_proj`, `gate_up_proj`: loaded into the merged layers as they are, each
tensor-parallel rank reading its rows of every part), with LongRoPE (`longrope`: short and
long factors, picked per sequence by its length, see `layers/rotary.py`), partial rotary
(`partial_rotary_factor`) and the config's sliding window on every layer."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules = {}  # the checkpoint's projections are already merged
