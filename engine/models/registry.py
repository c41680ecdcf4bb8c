"""Maps a Hugging Face `architectures[0]` string to a model class, importing lazily."""

from __future__ import annotations

import copy
import importlib
from typing import Any

from ..errors import UnsupportedModelError
from .base import CausalLM

# architecture → (module under batchlm.engine.models, class name)
_GENERATIVE: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    # Vision-language models: images in prompts (`multimodal/`), the vision tower in the model.
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
}
_TEXT_ONLY: set[str] = set()
"""Multimodal checkpoints whose language model runs on text prompts alone."""
_VISION_LANGUAGE = {
    "LlavaForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
}
_LANGUAGE_MODEL_ALONE = {
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3LanguageModelOnly"),
}
"""Vision-language checkpoints whose language model also runs alone, on text: for pooling,
and for generation where images cannot be served (tensor parallelism, LoRA adapters).
Architecture → (module, class) of the language model alone."""


def is_vision_language(architecture: str) -> bool:
    """Whether the architecture takes images in prompts (its model has a vision tower)."""
    return architecture in _VISION_LANGUAGE


def language_model_alone(architecture: str) -> type[CausalLM] | None:
    """The class of a vision-language architecture's language model alone (text prompts,
    the tower not loaded), or None when batchlm has none for it."""
    entry = _LANGUAGE_MODEL_ALONE.get(architecture)
    if entry is None:
        return None
    return getattr(importlib.import_module(f"{__package__}.{entry[0]}"), entry[1])


def runs_language_model_only(architecture: str) -> bool:
    """Whether the architecture is a multimodal checkpoint served on text alone (its vision
    tower not loaded)."""
    return architecture in _TEXT_ONLY


def text_config_of(hf_config: Any) -> Any:
    """The config the engine runs: for a multimodal checkpoint (`_TEXT_ONLY`, or a vision-
    language model, whose whole config is `MultiModalConfig.hf_config`), its language
    model's config, keeping the architecture name and the dtype; any other config as it
    is."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in _TEXT_ONLY | _VISION_LANGUAGE:
        return hf_config
    text = copy.deepcopy(hf_config.get_text_config())
    text.architectures = [archs[0]]
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(hf_config, "dtype", None)
    return text


def supported_architectures() -> list[str]:
    return sorted(_GENERATIVE)


def generation_model_class(architecture: str, with_images: bool) -> type[CausalLM]:
    """`get_model_class`; for a vision-language architecture served without images (see
    `multimodal/options.py`), its language model alone where batchlm has one."""
    if not with_images and is_vision_language(architecture):
        return language_model_alone(architecture) or get_model_class(architecture)
    return get_model_class(architecture)


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class for `architecture`, or an error listing what is supported."""
    entry = _GENERATIVE.get(architecture)
    if entry is None:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported for generation; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module = importlib.import_module(f"{__package__}.{entry[0]}")
    return getattr(module, entry[1])


# Encoder architectures served by the pooling runner: architecture → (module, class, task).
_POOLING: dict[str, tuple[str, str, str]] = {
    "BertModel": ("bert", "BertModel", "embed"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification", "classify"),
    "XLMRobertaModel": ("xlm_roberta", "XLMRobertaModel", "embed"),
    "XLMRobertaForSequenceClassification": (
        "xlm_roberta",
        "XLMRobertaForSequenceClassification",
        "classify",
    ),
    "ModernBertModel": ("modernbert", "ModernBertModel", "embed"),
    "ModernBertForSequenceClassification": (
        "modernbert",
        "ModernBertForSequenceClassification",
        "classify",
    ),
    # Late interaction: one projected vector per token (`loader/pooling_heads.py`).
    "HF_ColBERT": ("colbert", "ColBertModel", "token_embed"),
}
# Decoder classifiers: `<Family>ForSequenceClassification` → the family's generative class
# (Gemma 3's text classifier is `Gemma3TextForSequenceClassification`; its
# `Gemma3ForSequenceClassification` is the multimodal one).
_DECODER_CLASSIFIERS = {
    arch.replace("ForCausalLM", "ForSequenceClassification"): arch
    for arch in _GENERATIVE
    if arch.endswith("ForCausalLM") and arch != "Gemma3ForCausalLM"
}
_DECODER_CLASSIFIERS["Gemma3TextForSequenceClassification"] = "Gemma3ForCausalLM"


def is_generative(architecture: str) -> bool:
    return architecture in _GENERATIVE


def check_supported(architecture: str) -> None:
    """Raise `UnsupportedModelError` listing what each runner takes if `architecture` can
    neither generate nor pool."""
    if architecture in {**_GENERATIVE, **_POOLING, **_DECODER_CLASSIFIERS}:
        return
    hint = ""
    if "colbert" in architecture.lower():
        hint = (
            ". Late-interaction models load as HF_ColBERT checkpoints (BERT + linear.weight) or "
            "as sentence-transformers folders whose Dense modules follow the Transformer "
            "without a Pooling module (PyLate), with their body's own architecture in "
            "config.json."
        )
    raise UnsupportedModelError(
        f"architecture {architecture or '(none in config.json)'!r} is not supported. "
        + what_is_supported()
        + hint
    )


def what_is_supported() -> str:
    """The architectures of each runner, as one sentence for error messages."""
    pooling = sorted([*_POOLING, *_DECODER_CLASSIFIERS, *_GENERATIVE])
    return (
        f"Generation takes {', '.join(supported_architectures())}; embed / classify / "
        f"score take {', '.join(pooling)}"
    )


def pooling_task_of(architecture: str, convert: str) -> str:
    """`embed`, `classify` or `token_embed` (late interaction): what a pooling model of
    `architecture` does. (A sentence-transformers folder can make an embedding body a
    late-interaction model; the pooling runner decides that from its modules.)

    Raises:
        UnsupportedModelError: the architecture cannot pool, or `convert` asks for a task it
            cannot do; the message says how to load it instead.
    """
    if architecture in _POOLING:
        task = _POOLING[architecture][2]
        if convert not in ("auto", "none", task):
            raise UnsupportedModelError(
                f"convert={convert!r} does not apply to {architecture}, which is a {task} model; "
                "use convert='auto'"
            )
        return task
    if architecture in _DECODER_CLASSIFIERS:
        return "classify"
    if architecture in _VISION_LANGUAGE and architecture not in _LANGUAGE_MODEL_ALONE:
        raise UnsupportedModelError(
            f"{architecture} (a vision-language model) cannot be used for pooling; load it "
            "with runner='generate' (or 'auto')"
        )
    if architecture in _GENERATIVE:
        if convert in ("auto", "embed"):
            return "embed"
        raise UnsupportedModelError(
            f"{architecture} has no classification head, so convert={convert!r} cannot be "
            "served; use convert='embed' (last-token embeddings) or a "
            f"{architecture.replace('ForCausalLM', 'ForSequenceClassification')} checkpoint"
        )
    supported = sorted([*_POOLING, *_DECODER_CLASSIFIERS, *_GENERATIVE])
    raise UnsupportedModelError(
        f"architecture {architecture!r} cannot be used for pooling; supported: "
        f"{', '.join(supported)}"
    )


def build_pooling_model_kwargs(
    architecture: str, config, backend, max_position: int
) -> tuple[type, dict]:
    """The class to build for a pooling model and its constructor arguments."""
    if architecture in _POOLING:
        module_name, cls_name, _ = _POOLING[architecture]
        module = importlib.import_module(f"{__package__}.{module_name}")
        return getattr(module, cls_name), {"config": config}
    from .decoder_pooling import DecoderForPooling

    generative = _DECODER_CLASSIFIERS.get(architecture, architecture)
    num_labels = None
    if architecture in _DECODER_CLASSIFIERS:
        num_labels = int(getattr(config, "num_labels", 2))
    if architecture in _LANGUAGE_MODEL_ALONE:
        module_name, cls_name = _LANGUAGE_MODEL_ALONE[architecture]
        causal_lm_cls = getattr(importlib.import_module(f"{__package__}.{module_name}"), cls_name)
    else:
        causal_lm_cls = get_model_class(generative)
    return DecoderForPooling, {
        "config": config,
        "causal_lm_cls": causal_lm_cls,
        "backend": backend,
        "max_position": max_position,
        "num_labels": num_labels,
    }
