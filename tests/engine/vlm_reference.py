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


@torch.inference_mode()
def teacher_forced_logprobs(
    model, inputs: dict, out, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`model`'s log-softmax at each position batchlm generated (`out`, a `RequestOutput`):
    the processor's `inputs` for the prompt (images included) followed by batchlm's
    tokens, one forward. The prompt's ids must be batchlm's (the same placeholders)."""
    inputs = dict(inputs)
    prompt_ids = inputs["input_ids"][0].tolist()
    assert prompt_ids == list(out.prompt_token_ids)
    completion = torch.tensor([list(out.outputs[0].token_ids)])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], completion], dim=1)
    if "attention_mask" in inputs:
        inputs["attention_mask"] = torch.cat(
            [inputs["attention_mask"], torch.ones_like(completion)], dim=1
        )
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in inputs:
            inputs[key] = torch.cat([inputs[key], torch.zeros_like(completion)], dim=1)
    moved = {
        k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()
    }
    logits = model(**moved).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1].cpu()
