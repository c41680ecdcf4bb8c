"""CLIP's vision transformer, as vision-language models use it: patches and a class token
through pre-norm encoder layers with bidirectional attention over one image at a time.

The tower returns the hidden states of the layers a model asks for (Hugging Face's
`hidden_states` numbering: 0 is the embeddings after `pre_layrnorm`, i the output of layer
i, negative indices from the end) and runs no layer past the deepest of them.
`post_layernorm` is loaded with the checkpoint but unused (the features are read before it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layers.linear import MergedLinear


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
"""Hugging Face's `hidden_act` names used by vision towers and projectors → the function."""


def activation_of(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, dim, kernel_size=patch, stride=patch, bias=False
        )
        self.num_positions = (config.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[n, channels, H, W]` → `[n, 1 + num_patches, hidden]` (class token first)."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [n, num_patches, hidden]
        if patches.shape[1] + 1 != self.num_positions:
            raise ValueError(
                f"images of {tuple(pixel_values.shape[2:])} pixels give {patches.shape[1]} "
                f"patches; the tower's positions cover {self.num_positions - 1}"
            )
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.qkv_proj = MergedLinear(dim, [dim, dim, dim], bias=True)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, seq, hidden]
        n, seq, _ = x.shape
        q, k, v = (
            t.view(n, seq, self.num_heads, self.head_dim).transpose(1, 2)  # [n, heads, seq, d]
            for t in self.qkv_proj.split(self.qkv_proj(x))
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, seq, -1))


class CLIPMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation_of(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer (`CLIPVisionModel` of a `clip_vision_model` config)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, pixel_values: torch.Tensor, feature_layers: Sequence[int]
    ) -> list[torch.Tensor]:
        """`[n, channels, H, W]` → the hidden states `[n, 1 + num_patches, hidden]` of each
        of `feature_layers`, in that order."""
        num_states = len(self.encoder.layers) + 1
        wanted = [layer % num_states for layer in feature_layers]
        states = {0: self.pre_layrnorm(self.embeddings(pixel_values))}
        x = states[0]
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            x = states[i] = layer(x)
        return [states[i] for i in wanted]
