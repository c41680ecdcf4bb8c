"""The attention layer: heads, scale, window and soft-cap around the chosen backend."""

from __future__ import annotations

import torch
from torch import nn

from ...attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged causal self-attention for one layer (no weights: projections live in the model).

    Args:
        num_heads: Query heads.
        num_kv_heads: Key / value heads (GQA when fewer than num_heads).
        head_dim: Channels per head.
        scale: Softmax scale, usually head_dim ** -0.5.
        backend: Computes attention and writes the cache.
        sliding_window: Keys further back than this many positions are not attended.
        softcap: Caps the scaled scores at ±softcap (`softcap * tanh(score / softcap)`,
            Gemma 2's `attn_logit_softcapping`); None: no cap.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.softcap = softcap

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Key and value None: `rotate_into_cache` stored them."""
        out = self.backend.forward(
            query, key, value, kv_cache, metadata, self.scale, self.sliding_window, self.softcap
        )
        return out.reshape(out.shape[0], -1)

    def rotate_into_cache(
        self,
        rotary: nn.Module,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """`rotary` applied and the keys and values stored in one pass where the backend can
        (the rotated queries; then call `forward` with no key and value), else None.
        Multimodal `[3, num_tokens]` positions (M-RoPE) rotate by the step's table of each
        token's angles (`MRotaryEmbedding.token_table`)."""
        if positions.dim() == 1:
            cos_sin = rotary.cos_sin.float()
        else:
            positions, cos_sin = rotary.token_table(positions)
        return self.backend.rotate_into_cache(
            positions, query, key, value, cos_sin, kv_cache, metadata
        )

    def project_rotate_into_cache(
        self,
        qkv_proj: nn.Module,
        rotary: nn.Module,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """A one-token step's `qkv_proj`, then `rotate_into_cache`, in one pass where the
        backend can (the rotated queries; then call `forward` with no key and value), else
        None. Only a plain projection qualifies, or an int4 one whose method gives its
        operands (`Int4LinearMethod.operands`): no other quantization, LoRA or
        batch-invariant product, since the backend multiplies by its weight itself."""
        method = getattr(qkv_proj, "quant_method", None)
        if (
            hidden_states.shape[0] != 1
            or positions.dim() != 1
            or (method is not None and not hasattr(method, "operands"))
            or getattr(qkv_proj, "lora", None) is not None
            or getattr(qkv_proj, "batch_invariant", False)
        ):
            return None
        weight = qkv_proj.weight if method is None else method.operands(qkv_proj)
        if weight is None:
            return None
        return self.backend.project_rotate_into_cache(
            hidden_states,
            weight,
            qkv_proj.bias,
            self.num_heads,
            positions,
            rotary.cos_sin.float(),
            kv_cache,
            metadata,
        )
