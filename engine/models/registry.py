"""Maps a Hugging Face `architectures[0]` string to a model class, importing lazily."""

from __future__ import annotations

import importlib

from ..errors import UnsupportedModelError
from .base import CausalLM

# architecture → (module under batchlm.engine.models, class name)
_GENERATIVE: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_GENERATIVE)


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
