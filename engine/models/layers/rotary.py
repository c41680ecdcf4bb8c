"""Rotary position embeddings and the scalings of the decoder families.

Frequencies are computed here from the config (default, linear, dynamic NTK, llama3,
yarn, longrope); cos / sin are tabulated once for `max_position` positions and looked up
per token. Rotation is the "rotate half" (GPT-NeoX) layout used by Hugging Face
checkpoints; on CUDA a Triton kernel applies it from the same table.

LongRoPE (Phi-3) has two sets of frequencies: a sequence of at most
`original_max_position_embeddings` tokens uses the short factors at every position, a longer
one the long factors at every position (as Hugging Face picks them by sequence length).
The table then holds the short rows, followed by the long rows from row
`long_context_len` on: a long sequence's positions are looked up offset by it.
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
    original_max_position_embeddings: int | None = None
    """The config's top-level value (Phi-3 keeps it there); it takes precedence over the
    one in `params` for LongRoPE, as in Hugging Face."""


def rope_spec_from_config(hf_config: Any, head_dim: int, layer_type: str | None = None) -> RopeSpec:
    """Reads both config spellings: `rope_parameters` (transformers 5) and `rope_theta` +
    `rope_scaling` (earlier). `layer_type` picks one entry of parameters nested by layer
    type (Gemma 3's `sliding_attention` / `full_attention`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
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
        original_max_position_embeddings=getattr(
            hf_config, "original_max_position_embeddings", None
        ),
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
    if kind == "longrope":
        return longrope_inv_freq(spec, long=False)
    raise ValueError(
        f"rope_type={kind!r} is not supported; supported: default, linear, dynamic, llama3, "
        "yarn, longrope"
    )


def longrope_original_len(spec: RopeSpec) -> int:
    """The context LongRoPE's short factors serve: longer sequences use the long ones."""
    orig = spec.original_max_position_embeddings or spec.params.get(
        "original_max_position_embeddings"
    )
    return int(orig or spec.max_position_embeddings)


def longrope_inv_freq(spec: RopeSpec, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE's frequencies, divided by the short or the long factors, and its factor on
    cos / sin: `sqrt(1 + ln(factor) / ln(original length))`, `factor` defaulting to
    `max_position_embeddings / original length` (Hugging Face's rule)."""
    p, dim = spec.params, spec.rotary_dim
    orig = longrope_original_len(spec)
    name = "long_factor" if long else "short_factor"
    ext = p.get(name)
    if not isinstance(ext, (list, tuple)) or len(ext) != dim // 2:
        raise ValueError(
            f"rope_scaling {name}={ext!r} must be a list of rotary_dim / 2 = {dim // 2} "
            "numbers (longrope); fix the checkpoint's config.json"
        )
    factor = p.get("factor") or spec.max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        )
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * spec.theta**exponent)
    return inv_freq, float(attention_factor)


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
        self.long_context_len: int | None = None
        """LongRoPE with sequences longer than its original context: a sequence longer than
        this uses the table's rows from this one on (its positions offset by it)."""
        if spec.rope_type == "longrope" and max_position > longrope_original_len(spec):
            self.long_context_len = longrope_original_len(spec)
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:  # [2, rows, rotary_dim]
        if self.long_context_len is None:
            inv_freq, attention_factor = compute_inv_freq(self.spec, self.max_position)
            return _cos_sin(inv_freq, attention_factor, self.max_position)
        short = _cos_sin(*longrope_inv_freq(self.spec, long=False), self.long_context_len)
        long = _cos_sin(*longrope_inv_freq(self.spec, long=True), self.max_position)
        return torch.cat([short, long], dim=1)

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


def rotate_per_token(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [2, num_tokens, head_dim] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding with each token's own angles (a vision tower's 2-D patch
    positions): row i of `cos_sin` (cosines, sines; each second half equal to its first)
    rotates token i. Float32 math, one rounding: the rotary kernel on CUDA, whose table's
    rows are then the tokens, PyTorch elsewhere."""
    if use_triton_kernels(query):
        from batchlm.kernels.rotary import rotary_embedding

        positions = torch.arange(query.shape[0], device=query.device)
        return tuple(rotary_embedding(positions, query, key, cos_sin))
    cos, sin = cos_sin[0][:, None], cos_sin[1][:, None]  # [num_tokens, 1, head_dim]
    half = cos_sin.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        turned = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + turned * sin).to(x.dtype)

    return rotate(query), rotate(key)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (M-RoPE, Qwen2-VL): a token has three positions
    (temporal, height, width), and the frequency pairs of `mrope_section` (sizes summing to
    `rotary_dim // 2`, in that order) rotate by one of them each.

    `[num_tokens]` positions are taken as three equal rows, which is the plain rotary
    embedding (text tokens, and every decode step: CUDA graphs and the fused kernels see
    1-D positions only); `[3, num_tokens]` positions (a step with image tokens) look each
    channel's row up in the same table.
    """

    def __init__(
        self, spec: RopeSpec, head_dim: int, max_position: int, mrope_section: list[int]
    ) -> None:
        super().__init__(spec, head_dim, max_position)
        if sum(mrope_section) * 2 != spec.rotary_dim:
            raise ValueError(
                f"mrope_section={mrope_section} must sum to rotary_dim / 2 = "
                f"{spec.rotary_dim // 2}; fix the checkpoint's rope_parameters"
            )
        self.mrope_section = list(mrope_section)
        # [rotary_dim]: which of the three position rows each channel reads
        self.register_buffer("channel_rows", self._channel_rows(), persistent=False)
        self._last_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _channel_rows(self) -> torch.Tensor:
        half = [torch.full((n,), i % 3) for i, n in enumerate(self.mrope_section)]
        return torch.cat(half + half)

    def reset_buffers(self) -> None:
        super().reset_buffers()
        self.channel_rows = self._channel_rows().to(self.cos_sin.device)

    def token_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[3, num_tokens]` positions → (`arange(num_tokens)`, `[2, num_tokens, rotary_dim]`
        float32): each token's own row of angles, a table the rotary kernels index by token.
        Built once per step: the layers share this module and the step's positions tensor,
        so the last table is kept for the same tensor."""
        last = self._last_table
        if last is not None and last[0] is positions:
            return last[1], last[2]
        rows = positions[self.channel_rows]  # [rotary_dim, num_tokens]
        channels = torch.arange(rows.shape[0], device=rows.device)[:, None]
        table = self.cos_sin[:, rows, channels].transpose(1, 2).contiguous()
        index = torch.arange(positions.shape[1], device=positions.device)
        self._last_table = (positions, index, table)
        return index, table

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] or [3, num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        index, cos_sin = self.token_table(positions)  # [2, num_tokens, rotary_dim]
        if use_triton_kernels(query):
            from batchlm.kernels.rotary import rotary_embedding

            return rotary_embedding(index, query, key, cos_sin)
        cos = cos_sin[0].unsqueeze(1).to(query.dtype)  # [num_tokens, 1, rotary_dim]
        sin = cos_sin[1].unsqueeze(1).to(query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _cos_sin(inv_freq: torch.Tensor, attention_factor: float, num_positions: int) -> torch.Tensor:
    t = torch.arange(num_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [num_positions, rotary_dim // 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos(), emb.sin()]) * attention_factor  # [2, num_positions, rot_dim]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat([out, x_pass], dim=-1)
