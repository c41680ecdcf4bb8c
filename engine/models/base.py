"""What every generative model offers the model runner."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ..attention.backend import AttentionMetadata
from ..errors import UnsupportedModelError


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over the paged KV cache.

    `packed_modules` maps a merged parameter's module name to the checkpoint module names it
    concatenates, in order (the loader fills the slices).
    """

    packed_modules: ClassVar[dict[str, list[str]]] = {}
    long_context_len: int | None = None
    """Sequences longer than this many tokens run with other rotary frequencies at every
    position (LongRoPE's long factors): the runner passes their positions plus
    `long_context_len` (where the model's rotary table holds the long rows), and the
    scheduler recomputes a sequence whose KV was computed before it grew past it. None:
    one set of frequencies for every length."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Run the decoder over a flattened batch, writing this step's KV into the cache."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """`[num_rows, hidden_size]` → `[num_rows, vocab_size]` logits: float32, or the
        model's dtype with `upcast=False` (enough for an argmax: the upcast is exact)."""

    @abstractmethod
    def kv_cache_shape(self) -> tuple[int, int, int]:
        """`(num_layers, num_kv_heads, head_dim)` of the cache this model needs."""


class VisionLanguageModel(CausalLM):
    """A decoder that also takes images: the runner encodes a step's images
    (`encode_images`), scatters their rows into the input embeddings of the step's tokens
    (`embed_input_ids`) at the images' placeholder tokens, and passes those to `forward`.
    Built with `multimodal_config=` (the checkpoint's whole transformers config); its
    language model, `language_model` (a family's `CausalLM`), does all but the images."""

    has_bidirectional_images: ClassVar[bool] = False
    """The placeholder tokens of one image attend to each other both ways (Gemma 3): the
    runner passes each image's span in the attention metadata, the scheduler computes an
    image's placeholders in one step, and a cached prefix never ends inside them."""
    language_model: Any

    @staticmethod
    def check_built_whole(name: str, multimodal_config: Any) -> Any:
        """The checkpoint's whole config, or `UnsupportedModelError`: a vision-language
        model is built from its whole config. Under tensor parallelism its language model
        is split over the ranks and its vision tower is whole on each (every rank encodes
        the step's images: the same rows, no collective)."""
        if multimodal_config is None:
            raise UnsupportedModelError(f"{name} needs its whole config")
        return multimodal_config

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens] ([3, num_tokens] for M-RoPE in image steps)
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """As `CausalLM.forward`; with `inputs_embeds`, those are the decoder's inputs
        (`input_ids` is then not read)."""
        return self.language_model.model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[num_tokens]` → the text embeddings `[num_tokens, hidden_size]`."""
        return self.language_model.model.embed_tokens(input_ids)

    def tie_weights(self) -> None:
        self.language_model.tie_weights()

    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states, upcast)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        return self.language_model.kv_cache_shape()

    @abstractmethod
    def encode_images(self, data: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The processor's tensors of n images, concatenated along dim 0 (for LLaVA
        `pixel_values` `[n, 3, H, W]`) → one `[num_placeholder_tokens_i, hidden_size]`
        tensor per image: row j is the input embedding of its j-th placeholder token.
        Floating-point tensors (pixels) come on the model's device, integer ones (patch
        grids, sizes) on the host, where a model reads them without waiting for the
        device."""
