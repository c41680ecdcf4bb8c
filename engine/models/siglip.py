"""SigLIP's vision transformer, as Gemma 3 uses it: patches (no class token) plus learned
positions, CLIP's pre-norm encoder layers with bidirectional attention over one image at a
time, and the final `post_layernorm`. The attention-pooling head (`vision_use_head`) is not
built: vision-language models read the last hidden states."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .clip import CLIPEncoder


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, kernel_size=patch, stride=patch)
        self.num_positions = (config.image_size // patch) ** 2
        self.position_embedding = nn.Embedding(self.num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[n, channels, H, W]` → `[n, num_patches, hidden]`."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [n, num_patches, hidden]
        if patches.shape[1] != self.num_positions:
            raise ValueError(
                f"images of {tuple(pixel_values.shape[2:])} pixels give {patches.shape[1]} "
                f"patches; the tower's positions cover {self.num_positions}"
            )
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer (`SiglipVisionModel` of a `siglip_vision_model` config)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[n, channels, H, W]` → the last hidden states `[n, num_patches, hidden]`, after
        `post_layernorm`."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
