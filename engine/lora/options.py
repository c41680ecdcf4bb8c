"""vLLM's LoRA options (`enable_lora`, `max_loras`, `max_lora_rank`, `max_cpu_loras`,
`lora_dtype`) → a validated `LoRAConfig`, or None when adapters are off."""

from __future__ import annotations

from typing import Any

import torch

from ..config import LoRAConfig
from ..errors import InvalidParamError

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks `max_lora_rank` may take (vLLM's)."""

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

DEFAULTS = {
    "max_loras": 1,
    "max_lora_rank": 16,
    "max_cpu_loras": None,
    "lora_dtype": "auto",
}
"""The options' defaults (besides `enable_lora=False`)."""


def parse_lora_options(
    enable_lora: Any,
    options: dict[str, Any],
    model_dtype: torch.dtype,
) -> LoRAConfig | None:
    """Check the LoRA options and build the engine's `LoRAConfig`.

    Args:
        enable_lora: `LLM(enable_lora=...)`.
        options: `max_loras`, `max_lora_rank`, `max_cpu_loras`, `lora_dtype` as given.
        model_dtype: The model's dtype (`lora_dtype="auto"` takes it).

    Returns:
        The config, or None when `enable_lora` is False.

    Raises:
        InvalidParamError: a bad value, or a LoRA option set while `enable_lora` is False.
    """
    if not isinstance(enable_lora, bool):
        raise InvalidParamError(f"enable_lora={enable_lora!r} must be True or False")
    if not enable_lora:
        changed = [f"{k}={v!r}" for k, v in options.items() if v != DEFAULTS[k]]
        if changed:
            raise InvalidParamError(
                f"{', '.join(changed)} configure LoRA adapters, which are off; pass "
                "enable_lora=True as well"
            )
        return None
    max_loras = options["max_loras"]
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise InvalidParamError(f"max_loras={max_loras!r} must be an integer >= 1")
    rank = options["max_lora_rank"]
    if isinstance(rank, bool) or rank not in MAX_LORA_RANKS:
        raise InvalidParamError(
            f"max_lora_rank={rank!r} must be one of {', '.join(map(str, MAX_LORA_RANKS))} "
            "(the largest rank of the adapters served)"
        )
    max_cpu_loras = options["max_cpu_loras"]
    if max_cpu_loras is None:
        max_cpu_loras = max_loras
    elif isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int):
        raise InvalidParamError(f"max_cpu_loras={max_cpu_loras!r} must be an integer or None")
    elif max_cpu_loras < max_loras:
        raise InvalidParamError(
            f"max_cpu_loras={max_cpu_loras} must be >= max_loras={max_loras} (every adapter "
            "in a device slot is also kept in host memory)"
        )
    return LoRAConfig(
        max_loras=max_loras,
        max_lora_rank=rank,
        max_cpu_loras=max_cpu_loras,
        lora_dtype=_lora_dtype(options["lora_dtype"], model_dtype),
    )


def _lora_dtype(lora_dtype: Any, model_dtype: torch.dtype) -> torch.dtype:
    if lora_dtype == "auto" or lora_dtype is None:
        return model_dtype
    if isinstance(lora_dtype, torch.dtype) and lora_dtype in _DTYPES.values():
        return lora_dtype
    if isinstance(lora_dtype, str) and lora_dtype in _DTYPES:
        return _DTYPES[lora_dtype]
    raise InvalidParamError(
        f"lora_dtype={lora_dtype!r} must be 'auto' (the model's dtype), "
        f"{', '.join(map(repr, _DTYPES))}"
    )
