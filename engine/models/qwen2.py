"""Qwen2 / Qwen2.5 decoders: Llama layers with q/k/v biases and optional sliding window."""

from __future__ import annotations

from typing import Any

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True

    @staticmethod
    def sliding_window_of(config: Any, layer_idx: int) -> int | None:
        # Qwen2 applies the window only when enabled, and only from `max_window_layers` on.
        if not getattr(config, "use_sliding_window", False):
            return None
        window = getattr(config, "sliding_window", None)
        start = getattr(config, "max_window_layers", config.num_hidden_layers)
        return window if window and layer_idx >= start else None
