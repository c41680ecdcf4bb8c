"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): Qwen2-VL's design (`qwen2_vl.py`)
with another vision tower and the same Qwen2 decoder with M-RoPE.

The tower normalises with RMSNorm, its MLPs are gated (SiLU), and most of its layers
attend within windows of `window_size` pixels square (`window_size / patch_size /
spatial_merge_size` merged tokens a side) instead of within the whole image; the layers of
`fullatt_block_indexes` attend within the whole image. The patches are reordered window
by window before the first layer (by whole 2×2 merge blocks, so the merger still sees each
block as consecutive rows), and the merged rows are put back in the image's order after
the merger.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..host_copy import to_device
from .clip import activation_of
from .layers.activation import SiluAndMul
from .layers.linear import MergedLinear
from .layers.norm import RMSNorm
from .qwen2_vl import (
    PatchEmbed,
    PatchMerger,
    Qwen2VLForConditionalGeneration,
    VisionAttention,
    VisionBlock,
    VisionRotary,
    attention_plan,
    frame_seqlens,
    patch_positions,
)


def window_layout(
    grid_thw: list[list[int]], merge: int, window: int
) -> tuple[np.ndarray, list[int]]:
    """The window order of the merge blocks of images with patch grids `grid_thw`, and the
    windows' cumulative patch counts.

    Args:
        grid_thw: Each image's patch grid `(t, h, w)`.
        merge: Patches a side of a merge block.
        window: Merge blocks a side of a window (windows at the right and bottom edges are
            cut short).

    Returns:
        `[num_blocks]` the merge blocks (indices in image order) in window order, and the
        cumulative patch counts of the windows in that order, starting with 0.
    """
    order: list[np.ndarray] = []
    cu = [0]
    first = 0  # first block of the image
    unit = merge * merge
    for t, h, w in grid_thw:
        rows, cols = h // merge, w // merge
        blocks = first + np.arange(t * rows * cols).reshape(t, rows, cols)
        for frame in blocks:
            for top in range(0, rows, window):
                for left in range(0, cols, window):
                    ids = frame[top : top + window, left : left + window].reshape(-1)
                    order.append(ids)
                    cu.append(cu[-1] + len(ids) * unit)
        first += t * rows * cols
    return np.concatenate(order), cu


HIDDEN_MULTIPLE = 8
"""The tower MLP's hidden width is padded to a multiple of this many units after loading:
Qwen2.5-VL-7B's 3,420 makes rows of 6,840 bytes in bfloat16, not the multiple of 16 that
Hopper's TMA matrix kernels need, and cuBLAS then takes an Ampere kernel for the down
projection, at about a third of the speed."""


class GatedVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(dim, [hidden, hidden], bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        # SiLU (Qwen2.5-VL's) in the decoders' fused kernel; another activation as it is.
        self.act_and_mul = SiluAndMul() if act == "silu" else None
        self.act = activation_of(act)

    @torch.no_grad()
    def after_loading(self) -> None:
        """Pad the hidden width with zero units to a multiple of `HIDDEN_MULTIPLE`: zero
        gate and up rows and biases, zero down-projection columns. Exact: a padded unit's
        activation times its up value is act(0) × 0 = 0, and its column adds 0 to every
        output. The weights read back from the model have the padded shapes."""
        hidden = self.down_proj.in_features
        padded = -(-hidden // HIDDEN_MULTIPLE) * HIDDEN_MULTIPLE
        gate_up, down = self.gate_up_proj, self.down_proj
        if padded == hidden or gate_up.quant_method is not None:
            return  # a quantized layout is the method's to keep
        weight = gate_up.weight.new_zeros(2, padded, gate_up.in_features)
        weight[:, :hidden] = gate_up.weight.view(2, hidden, -1)
        bias = gate_up.bias.new_zeros(2, padded)
        bias[:, :hidden] = gate_up.bias.view(2, hidden)
        gate_up.weight = nn.Parameter(weight.view(2 * padded, -1), requires_grad=False)
        gate_up.bias = nn.Parameter(bias.view(-1), requires_grad=False)
        gate_up.out_features, gate_up.output_sizes = 2 * padded, [padded, padded]
        wide = down.weight.new_zeros(down.out_features, padded)
        wide[:, :hidden] = down.weight
        down.weight = nn.Parameter(wide, requires_grad=False)
        down.in_features = padded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(gate_up))
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate) * up)


class Qwen2_5_VisionTower(nn.Module):
    """Qwen2.5-VL's vision transformer (`qwen2_5_vl` vision config)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, heads = config.hidden_size, config.num_heads
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.patch_size // self.merge
        self.full_attention_layers = set(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(
            config.in_channels, config.temporal_patch_size, config.patch_size, dim
        )
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(dim // heads, theta)
        self.blocks = nn.ModuleList(
            VisionBlock(
                RMSNorm(dim, 1e-6),
                RMSNorm(dim, 1e-6),
                VisionAttention(dim, heads),
                GatedVisionMLP(dim, config.intermediate_size, config.hidden_act),
            )
            for _ in range(config.depth)
        )
        self.merger = PatchMerger(RMSNorm(dim, 1e-6), dim, config.out_hidden_size, self.merge)

    def forward(self, pixels: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """`[num_patches, patch_dim]` of images with patch grids `grid_thw` → `[num_patches
        / merge², out_hidden_size]`, image after image."""
        x = self.patch_embed(pixels)  # [num_patches, dim]
        n, unit = x.shape[0], self.merge**2
        order, cu_windows = window_layout(grid_thw, self.merge, self.window)
        order_t = to_device(order, x.device)
        x = x.view(n // unit, unit, -1)[order_t].view(n, -1)  # window after window
        positions = to_device(patch_positions(grid_thw, self.merge), x.device)
        positions = positions.view(n // unit, unit, 2)[order_t].view(n, 2)
        cos_sin = self.rotary(positions)
        frames = attention_plan(frame_seqlens(grid_thw), x.device)
        windows = attention_plan(cu_windows, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, frames if i in self.full_attention_layers else windows)
        merged = self.merger(x)  # [num_blocks, out_hidden_size], window order
        return merged[torch.argsort(order_t)]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the windowed vision tower → merged patch rows → the Qwen2 decoder with
    M-RoPE (arguments as `Qwen2VLForConditionalGeneration`'s)."""

    vision_tower_cls = Qwen2_5_VisionTower
