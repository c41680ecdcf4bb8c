"""LLaVA (`LlavaForConditionalGeneration`, LLaVA-1.5 style): a CLIP vision tower, a
two-layer projector, and a Llama-family language model.

An image's features are the tower's hidden states at `vision_feature_layer` (one layer, or
several concatenated along the features), without the class token under the `default`
select strategy (`full` keeps it), projected to the language model's width: one row per
placeholder token of the image in the prompt. The runner scatters them into the language
model's input embeddings (`embed_input_ids`) at those tokens.

Checkpoints name the parts `language_model.model.*`, `language_model.lm_head.*`,
`vision_tower[.vision_model].*` and `multi_modal_projector.*` (as transformers saves them,
and as the released LLaVA-1.5 checkpoints do), or `model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*` and `lm_head.*` (transformers 5's
names in memory); the loader renames them to this module's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..attention.backend import AttentionBackend
from ..errors import UnsupportedModelError
from .base import VisionLanguageModel
from .clip import CLIPVisionTower, activation_of
from .llama import DecoderForCausalLM, LlamaForCausalLM, MistralForCausalLM

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup

_LANGUAGE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
}
_VISION_TOWERS = {"clip_vision_model": CLIPVisionTower}


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: Any, num_feature_layers: int) -> None:
        super().__init__()
        text_dim = config.text_config.hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        in_dim = config.vision_config.hidden_size * num_feature_layers
        self.linear_1 = nn.Linear(in_dim, text_dim, bias=bias)
        self.act = activation_of(config.projector_hidden_act)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """LLaVA-1.5: vision tower → projector → rows of the Llama decoder's input embeddings.

    Args:
        config: The language model's config (`text_config`).
        backend: Attention backend of the language model's layers.
        max_position: Longest sequence the engine will run.
        tp: The tensor-parallel group of the language model (the tower is whole on
            every rank).
        multimodal_config: The checkpoint's whole config (vision config, projector,
            feature layers, select strategy).
    """

    packed_modules = DecoderForCausalLM.packed_modules  # the CLIP tower's q|k|v merge too
    checkpoint_prefix_renames = (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "language_model.lm_head."),
    )
    checkpoint_name_replacements = (("vision_tower.vision_model.", "vision_tower."),)

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        max_position: int,
        tp: TPGroup | None = None,
        multimodal_config: Any = None,
    ) -> None:
        super().__init__()
        full = self.check_built_whole("LlavaForConditionalGeneration", multimodal_config)
        self.config = config
        text_type = getattr(config, "model_type", "llama")
        vision_type = getattr(full.vision_config, "model_type", "")
        if text_type not in _LANGUAGE_MODELS or vision_type not in _VISION_TOWERS:
            raise UnsupportedModelError(
                f"LlavaForConditionalGeneration with a {text_type!r} language model and a "
                f"{vision_type!r} vision tower is not supported; supported: language models "
                f"{sorted(_LANGUAGE_MODELS)}, vision towers {sorted(_VISION_TOWERS)}"
            )
        layers = full.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.keeps_class_token = full.vision_feature_select_strategy == "full"
        if full.vision_feature_select_strategy not in ("default", "full"):
            raise UnsupportedModelError(
                f"vision_feature_select_strategy={full.vision_feature_select_strategy!r} "
                "is not supported; LLaVA uses 'default' or 'full'"
            )
        self.language_model = _LANGUAGE_MODELS[text_type](config, backend, max_position, tp)
        self.long_context_len = self.language_model.long_context_len
        self.vision_tower = _VISION_TOWERS[vision_type](full.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(full, len(self.feature_layers))

    def encode_images(self, data: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        pixel_values = data["pixel_values"]  # [n, 3, H, W]
        states = self.vision_tower(pixel_values, self.feature_layers)
        if not self.keeps_class_token:
            states = [s[:, 1:] for s in states]
        features = torch.cat(states, dim=-1)  # [n, num_tokens, vision_hidden * num_layers]
        return list(self.multi_modal_projector(features))  # n × [num_tokens, hidden]
