"""What the vision-language tests share: seeded random images, transformers' greedy tokens
for prompts with images (the reference), and batchlm's tokens for the same prompts."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from batchlm.engine import LLM, SamplingParams


def image(seed: int, height: int = 50, width: int = 60) -> Image.Image:
    """A seeded image of random RGB pixels."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@lru_cache(maxsize=4)
def hf_model(path: str):
    """The checkpoint in transformers, float32, fixed-length greedy outputs (as
    `ignore_eos`), and its processor."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0]).from_pretrained(
        path, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval(), transformers.AutoProcessor.from_pretrained(path)


@torch.inference_mode()
def hf_greedy(path: str, prompts: list, max_tokens: int) -> list[list[int]]:
    """Transformers' greedy tokens for each prompt: a string, or a dict with its
    `multi_modal_data` images, prepared by the checkpoint's processor."""
    model, processor = hf_model(path)
    out = []
    for p in prompts:
        if isinstance(p, str):
            inputs = processor.tokenizer(p, return_tensors="pt")
        else:
            images = p.get("multi_modal_data", {}).get("image")
            inputs = processor(text=p["prompt"], images=images, return_tensors="pt")
        gen = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        out.append(gen[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def run(llm: LLM, prompts: list, params: SamplingParams) -> list[list[int]]:
    """batchlm's tokens for each prompt."""
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
