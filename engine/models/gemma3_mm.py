"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP vision tower, Gemma 3's
multi-modal projector and the Gemma 3 language model.

An image's features are the tower's last hidden states (after `post_layernorm`), laid back
on their patch grid and average-pooled to `mm_tokens_per_image` rows, normalised (Gemma's
RMSNorm, `1 + weight`) and projected to the language model's width by a plain matrix: one
row per `<image_soft_token>` placeholder. The runner scatters them into the language
model's scaled text embeddings (`embed_input_ids`); the image rows themselves are not
scaled.

The tokens of one image attend to each other both ways, and never to a later image; text
stays causal (`has_bidirectional_images`: the runner passes each image's span in the
attention metadata, and the scheduler keeps each image's placeholders within one step).

Checkpoints name the parts `language_model.model.*`, `vision_tower[.vision_model].*` and
`multi_modal_projector.*` (as transformers saves them, and as the released checkpoints do),
or `model.language_model.*`, `model.vision_tower.vision_model.*`,
`model.multi_modal_projector.*` and `lm_head.*` (transformers 5's names in memory); the
loader renames them to this module's. The tower's attention-pooling head is not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..attention.backend import AttentionBackend
from ..errors import UnsupportedModelError
from .base import VisionLanguageModel
from .gemma2 import gemma_norm
from .gemma3 import Gemma3ForCausalLM
from .llama import DecoderForCausalLM
from .siglip import SiglipVisionTower

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup


class Gemma3MultiModalProjector(nn.Module):
    """Patch grid → `mm_tokens_per_image` pooled rows → RMSNorm → the text model's width."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text_dim = config.vision_config, config.text_config.hidden_size
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(round(config.mm_tokens_per_image**0.5))
        if (
            tokens_per_side**2 != config.mm_tokens_per_image
            or self.patches_per_side % tokens_per_side
        ):
            raise UnsupportedModelError(
                f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square whose "
                f"side divides the {self.patches_per_side} patches per side of the tower"
            )
        self.kernel_size = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text_dim))
        self.mm_soft_emb_norm = gemma_norm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """`[n, num_patches, vision_hidden]` → `[n, mm_tokens_per_image, text_hidden]`."""
        n, _, dim = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(n, dim, side, side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel_size, self.kernel_size)
        pooled = pooled.flatten(2).transpose(1, 2)  # [n, mm_tokens_per_image, vision_hidden]
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(features)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """Gemma 3: SigLIP tower → projector → rows of the Gemma 3 decoder's input embeddings.

    Args:
        config: The language model's config (`text_config`).
        backend: Attention backend of the language model's layers.
        max_position: Longest sequence the engine will run.
        tp: The tensor-parallel group of the language model (the tower is whole on
            every rank).
        multimodal_config: The checkpoint's whole config (vision config, projector).
    """

    has_bidirectional_images = True
    packed_modules = DecoderForCausalLM.packed_modules  # the SigLIP tower's q|k|v merge too
    checkpoint_prefix_renames = (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "language_model.lm_head."),
    )
    checkpoint_name_replacements = (("vision_tower.vision_model.", "vision_tower."),)
    ignored_checkpoint_prefixes = ("vision_tower.head.",)

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        max_position: int,
        tp: TPGroup | None = None,
        multimodal_config: Any = None,
    ) -> None:
        super().__init__()
        full = self.check_built_whole("Gemma3ForConditionalGeneration", multimodal_config)
        vision_type = getattr(full.vision_config, "model_type", "")
        if vision_type != "siglip_vision_model":
            raise UnsupportedModelError(
                f"Gemma3ForConditionalGeneration with a {vision_type!r} vision tower is not "
                "supported; Gemma 3's tower is 'siglip_vision_model'"
            )
        self.config = config
        self.language_model = Gemma3ForCausalLM(config, backend, max_position, tp)
        self.vision_tower = SiglipVisionTower(full.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(full)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Placeholder ids past the vocabulary (the released checkpoints' are not) embed as
        # id 0: their rows are the image's anyway.
        vocab_size = self.config.vocab_size
        input_ids = torch.where(input_ids < vocab_size, input_ids, 0)
        return self.language_model.model.embed(input_ids)

    def encode_images(self, data: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        states = self.vision_tower(data["pixel_values"])  # [n, num_patches, vision_hidden]
        return list(self.multi_modal_projector(states))  # n × [mm_tokens_per_image, hidden]
