"""The engine's image options (`limit_mm_per_prompt`, `mm_processor_kwargs`) read into a
`MultiModalConfig`: for a vision-language checkpoint that generates, without LoRA adapters
(under tensor parallelism too: the language model is split over the ranks, the tower whole
on each); where adapters are asked for and the family has its language model alone
(Gemma 3), that serves text and images are not served."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..config import MultiModalConfig
from ..errors import InvalidParamError

logger = logging.getLogger(__name__)


def multimodal_config(
    args: Any, path: Path, hf_config: Any, runner_type: str
) -> MultiModalConfig | None:
    """Images in prompts: for a vision-language checkpoint that generates; None (and the
    options checked only) otherwise. `args`: the `EngineArgs` (its `limit_mm_per_prompt`,
    `mm_processor_kwargs` and `enable_lora`).

    Raises:
        InvalidParamError: a bad option, or LoRA on a vision family without a language
            model alone.
    """
    from ..models.registry import is_vision_language, language_model_alone

    limit = _image_limit(args.limit_mm_per_prompt)
    kwargs = args.mm_processor_kwargs
    enable_lora = args.enable_lora
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidParamError(
            f"mm_processor_kwargs={kwargs!r:.80} must be a dict of the checkpoint "
            "processor's keyword arguments"
        )
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    if runner_type != "generate" or not is_vision_language(arch):
        return None
    if enable_lora and language_model_alone(arch) is not None:
        logger.info(
            "%s with LoRA adapters: its language model alone serves text prompts (images "
            "need enable_lora=False)",
            arch,
        )
        return None
    if enable_lora:
        raise InvalidParamError(
            f"enable_lora=True: LoRA adapters on {arch} (a vision-language model) are not "
            "supported; drop enable_lora"
        )
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(str(path), local_files_only=True)
    rope = getattr(full.get_text_config(), "rope_parameters", None) or {}
    return MultiModalConfig(
        hf_config=full,
        image_token_id=int(full.image_token_id),
        max_images_per_prompt=limit,
        processor_kwargs=dict(kwargs or {}),
        mrope_merge_size=int(full.vision_config.spatial_merge_size)
        if "mrope_section" in rope
        else None,
    )


def _image_limit(limits: Any) -> int | None:
    """`limit_mm_per_prompt`'s image count (None: no limit), as vLLM reads the dict; other
    modalities only at 0."""
    if limits is None:
        return None
    if not isinstance(limits, dict):
        raise InvalidParamError(
            f"limit_mm_per_prompt={limits!r:.80} must be a dict such as {{'image': 2}}"
        )
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidParamError(f"limit_mm_per_prompt[{key!r}]={value!r} must be an int >= 0")
        if key != "image" and value:
            raise InvalidParamError(
                f"limit_mm_per_prompt[{key!r}]={value}: only image inputs are supported; "
                f"set it to 0 or leave {key!r} out"
            )
    return limits.get("image")
