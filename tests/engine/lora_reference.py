"""PEFT adapters for the tiny test models, and PEFT's greedy tokens: the reference for LoRA."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

B_SCALE = 4.0
"""PEFT's random B (init_lora_weights=False) is small next to a tiny model's weights:
scaled up so that every adapter changes the greedy tokens."""


def make_adapter(
    base: Path,
    out: Path,
    *,
    r: int,
    target_modules: list[str] | str = "all-linear",
    lora_alpha: int = 16,
    seed: int = 0,
    **config,
) -> Path:
    """A PEFT LoRA adapter for the model at `base`, of random (non-zero) weights, saved to
    `out` by PEFT."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    lora = peft.LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        init_lora_weights=False,
        **config,
    )
    wrapped = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.mul_(B_SCALE)
    wrapped.save_pretrained(out)
    return out


@lru_cache(maxsize=16)
def _peft_model(base: str, adapter: str | None, dtype: torch.dtype = torch.float32):
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.generation_config.eos_token_id = None  # fixed-length outputs, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


def peft_greedy(
    base: Path | str,
    adapter: Path | str | None,
    prompts: list[list[int]],
    max_new_tokens: int,
) -> list[list[int]]:
    """PEFT's greedy tokens for each prompt (one at a time, no padding): the base model with
    the adapter (None: the base model alone). Kept per prompt for the session."""
    adapter = None if adapter is None else str(adapter)
    return [list(_greedy(str(base), adapter, tuple(ids), max_new_tokens)) for ids in prompts]


@lru_cache(maxsize=512)
@torch.inference_mode()
def _greedy(base: str, adapter: str | None, ids: tuple[int, ...], max_new_tokens: int):
    model = _peft_model(base, adapter)
    x = torch.tensor([ids])
    gen = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return tuple(gen[0, len(ids) :].tolist())


@torch.inference_mode()
def peft_logprobs(base: Path | str, adapter: Path | str | None, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]` float32 log-probabilities of PEFT's model after each prefix."""
    model = _peft_model(str(base), None if adapter is None else str(adapter))
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
