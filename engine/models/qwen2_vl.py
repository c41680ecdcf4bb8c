"""Qwen2-VL (`Qwen2VLForConditionalGeneration`): a vision transformer over an image's
patches at its own resolution, a 2×2 patch merger, and the Qwen2 decoder with M-RoPE.

The processor cuts an image into `t × h × w` patches of `temporal_patch_size ×
patch_size²` pixels (a still image is repeated over the two temporal frames), ordered so
that each 2×2 block of neighbours is consecutive; `image_grid_thw` gives the grid. The tower
embeds the patches (a 3-D convolution, as a matrix product), rotates queries and keys by
the patches' (row, column) in half of each head each (2-D rotary), attends within each
frame of each image only, and merges each 2×2 block into one row of the language model's
width: one row per placeholder token. The language model is Qwen2's with the multimodal
rotary embedding (`layers/rotary.py: MRotaryEmbedding`), whose positions the runner
slices from each prompt's (`multimodal/mrope.py`).

Checkpoints name the parts `model.visual.*`, `model.language_model.*` and `lm_head.*`
(transformers 5), or `visual.*`, `model.*` and `lm_head.*` (the released checkpoints); the
loader renames them to this module's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..attention.backend import AttentionBackend
from ..attention.varlen import VarlenPlan, varlen_attention
from ..errors import UnsupportedModelError
from ..host_copy import to_device
from .base import VisionLanguageModel
from .clip import activation_of
from .layers.rotary import (
    MRotaryEmbedding,
    RotaryEmbedding,
    rope_spec_from_config,
    rotate_per_token,
)
from .llama import DecoderForCausalLM, head_dim_of
from .qwen2 import Qwen2ForCausalLM

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup


class Qwen2MRopeForCausalLM(Qwen2ForCausalLM):
    """The Qwen2 decoder with M-RoPE (`rope_parameters["mrope_section"]`)."""

    def rotary_embedding(self, config: Any, max_position: int) -> RotaryEmbedding:
        head_dim = head_dim_of(config)
        spec = rope_spec_from_config(config, head_dim)
        section = spec.params.get("mrope_section")
        if not section:
            raise UnsupportedModelError(
                "the language model's rope_parameters have no mrope_section; Qwen2-VL "
                "checkpoints carry one (e.g. [16, 24, 24])"
            )
        self.long_context_len = None
        return MRotaryEmbedding(spec, head_dim, max_position, list(section))


def attention_plan(cu_seqlens: list[int], device: torch.device) -> VarlenPlan:
    """The tower's attention runs (each frame, or each window), for every layer of one
    forward: on CUDA in half precision one flash-attention call per layer, elsewhere
    SDPA over length groups (`attention/varlen.py`)."""
    cu_device = None
    if device.type == "cuda":
        cu_device = to_device(np.asarray(cu_seqlens, dtype=np.int32), device)
    return VarlenPlan.build(cu_seqlens, device, cu_device)


def patch_positions(grid_thw: list[list[int]], merge: int) -> torch.Tensor:
    """`[num_patches, 2]` each patch's (row, column) in its image, in the processor's order
    (each `merge × merge` block consecutive, frames repeating the grid)."""
    out = []
    for t, h, w in grid_thw:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_seqlens(grid_thw: list[list[int]]) -> list[int]:
    """Cumulative patch counts of each frame of each image: attention stays within one."""
    cu = [0]
    for t, h, w in grid_thw:
        start = cu[-1]
        cu.extend(start + h * w * (i + 1) for i in range(t))
    return cu


class VisionRotary(nn.Module):
    """2-D rotary embedding of the tower: a head's first half rotates by the patch's row,
    its second half by its column (each half with the same `head_dim / 4` frequencies)."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """`[n, 2]` (row, column) → `[2, n, head_dim]` float32: the cosines, the sines."""
        quarter = self.head_dim // 2
        exponent = torch.arange(0, quarter, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponent / quarter))  # [head_dim / 4]
        freqs = (positions[..., None].float() * inv_freq).flatten(1)  # [n, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return torch.stack([emb.cos(), emb.sin()])


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """`[num_patches, channels * temporal * patch²]` → `[num_patches, dim]` (the
        convolution's single output per patch is a matrix product)."""
        weight = self.proj.weight.flatten(1)  # [dim, channels * temporal * patch²]
        return pixels.to(weight.dtype) @ weight.t()


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, plan: VarlenPlan
    ) -> torch.Tensor:  # [num_patches, dim]
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [n, heads, head_dim]
        q, k = rotate_per_token(q, k, cos_sin)
        out = varlen_attention(q, k, v.contiguous(), plan, q.shape[-1] ** -0.5, causal=False)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = activation_of(act)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """`merge²` neighbouring patches (consecutive rows) → one row of the language model's
    width, through a norm and a two-layer GELU MLP."""

    def __init__(self, norm: nn.Module, context_dim: int, out_dim: int, merge: int) -> None:
        super().__init__()
        self.width = context_dim * merge**2
        self.ln_q = norm
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL's vision transformer (`qwen2_vl` vision config)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, heads = config.embed_dim, config.num_heads
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(
            config.in_channels, config.temporal_patch_size, config.patch_size, dim
        )
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(dim // heads, theta)
        hidden = int(dim * config.mlp_ratio)
        self.blocks = nn.ModuleList(
            VisionBlock(
                nn.LayerNorm(dim, eps=1e-6),
                nn.LayerNorm(dim, eps=1e-6),
                VisionAttention(dim, heads),
                VisionMLP(dim, hidden, config.hidden_act),
            )
            for _ in range(config.depth)
        )
        self.merger = PatchMerger(nn.LayerNorm(dim, eps=1e-6), dim, config.hidden_size, self.merge)

    def forward(self, pixels: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """`[num_patches, patch_dim]` of images with patch grids `grid_thw` → `[num_patches
        / merge², hidden_size]`, image after image."""
        x = self.patch_embed(pixels)
        cos_sin = self.rotary(to_device(patch_positions(grid_thw, self.merge), x.device))
        plan = attention_plan(frame_seqlens(grid_thw), x.device)
        for block in self.blocks:
            x = block(x, cos_sin, plan)
        return self.merger(x)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2-VL: vision tower → merged patch rows → the Qwen2 decoder with M-RoPE.

    Args:
        config: The language model's config (`text_config`).
        backend: Attention backend of the language model's layers.
        max_position: Longest sequence the engine will run.
        tp: The tensor-parallel group of the language model (the tower is whole on
            every rank).
        multimodal_config: The checkpoint's whole config (vision config, token ids).
    """

    packed_modules = DecoderForCausalLM.packed_modules
    checkpoint_prefix_renames = (
        ("model.language_model.", "language_model.model."),
        ("model.visual.", "visual."),
        ("lm_head.", "language_model.lm_head."),
        ("model.", "language_model.model."),
    )
    vision_tower_cls: type[nn.Module] = Qwen2VisionTower

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        max_position: int,
        tp: TPGroup | None = None,
        multimodal_config: Any = None,
    ) -> None:
        super().__init__()
        full = self.check_built_whole(type(self).__name__, multimodal_config)
        self.config = config
        if getattr(config, "tie_word_embeddings", None) is None:
            config.tie_word_embeddings = bool(getattr(full, "tie_word_embeddings", False))
        self.language_model = Qwen2MRopeForCausalLM(config, backend, max_position, tp)
        self.long_context_len = None
        self.visual = self.vision_tower_cls(full.vision_config)

    def encode_images(self, data: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        pixels = data["pixel_values"]  # [num_patches, patch_dim], image after image
        grid_thw = data["image_grid_thw"].tolist()  # [n, 3]
        rows = self.visual(pixels, grid_thw)  # [num_patches / merge², hidden]
        merge = self.visual.merge
        return list(rows.split([t * h * w // merge**2 for t, h, w in grid_thw]))
