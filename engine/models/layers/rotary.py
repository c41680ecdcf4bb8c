"""Rotary position embeddings and the scalings of the Llama / Mistral / Qwen families.

Frequencies are computed here from the config (default, linear, dynamic NTK, llama3,
yarn); cos / sin are tabulated once for `max_position` positions and looked up per token.
Rotation is the "rotate half" (GPT-NeoX) layout used by Hugging Face checkpoints; on CUDA a
Triton kernel applies it from the same table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchlm.kernels import use_triton_kernels


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    rotary_dim: int
    params: dict[str, Any]
    max_position_embeddings: int


def rope_spec_from_config(hf_config: Any, head_dim: int) -> RopeSpec:
    """Reads both config spellings: `rope_parameters` (transformers 5) and `rope_theta` +
    `rope_scaling` (earlier)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if not params:
        params = dict(scaling)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return RopeSpec(
        rope_type=rope_type,
        theta=float(theta),
        rotary_dim=int(head_dim * (partial or 1.0)),
        params=params,
        max_position_embeddings=int(hf_config.max_position_embeddings),
    )


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta**exponent)


def compute_inv_freq(spec: RopeSpec, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim // 2]` and the factor applied to cos / sin."""
    dim, theta, p = spec.rotary_dim, spec.theta, spec.params
    kind = spec.rope_type
    if kind == "default":
        return _default_inv_freq(theta, dim), 1.0
    if kind == "linear":
        return _default_inv_freq(theta, dim) / float(p["factor"]), 1.0
    if kind == "dynamic":
        # NTK-aware base stretch for the longest sequence the engine will hold; identical to
        # the default frequencies while that fits the trained context.
        factor = float(p["factor"])
        orig = spec.max_position_embeddings
        seq_len = max(max_position, orig)
        base = theta * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(spec), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(spec)
    raise ValueError(
        f"rope_type={kind!r} is not supported; supported: default, linear, dynamic, llama3, yarn"
    )


def _llama3_inv_freq(spec: RopeSpec) -> torch.Tensor:
    p = spec.params
    inv_freq = _default_inv_freq(spec.theta, spec.rotary_dim)
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    orig = float(p.get("original_max_position_embeddings", spec.max_position_embeddings))
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= orig / high) & (wavelen <= orig / low)
    return torch.where(is_mid, blended, out)


def _yarn_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    p, dim, theta = spec.params, spec.rotary_dim, spec.theta
    orig = float(p.get("original_max_position_embeddings") or spec.max_position_embeddings)
    factor = p.get("factor") or spec.max_position_embeddings / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the original frequency is kept (high frequencies)
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to query / key heads by position.

    Args:
        spec: Frequencies and scaling, from `rope_spec_from_config`.
        head_dim: Width of each head; the first `spec.rotary_dim` channels rotate.
        max_position: Positions to tabulate (the engine's max_model_len).
    """

    def __init__(self, spec: RopeSpec, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.spec = spec
        self.head_dim = head_dim
        self.max_position = max_position
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        inv_freq, attention_factor = compute_inv_freq(self.spec, self.max_position)
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return torch.stack([emb.cos(), emb.sin()]) * attention_factor  # [2, max_pos, rot_dim]

    def reset_buffers(self) -> None:
        """Recompute the table (after the module was materialised from the meta device)."""
        self.cos_sin = self._table().to(self.cos_sin.device)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton_kernels(query):
            from batchlm.kernels.rotary import rotary_embedding

            return rotary_embedding(positions, query, key, self.cos_sin.float())
        cos_sin = self.cos_sin[:, positions]  # [2, num_tokens, rotary_dim]
        cos = cos_sin[0].unsqueeze(1).to(query.dtype)  # [num_tokens, 1, rotary_dim]
        sin = cos_sin[1].unsqueeze(1).to(query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat([out, x_pass], dim=-1)
