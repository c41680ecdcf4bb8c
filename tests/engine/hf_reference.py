"""Greedy generation with Hugging Face transformers: the reference for model outputs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # fixed-length outputs, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.inference_mode()
def hf_greedy(path: Path | str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Token ids generated greedily for each prompt, one prompt at a time (no padding)."""
    model = load_hf(str(path))
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        gen = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False
        )
        out.append(gen[0, len(ids) :].tolist())
    return out
