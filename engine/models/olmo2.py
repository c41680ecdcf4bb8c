"""OLMo 2 decoders: no norm before attention or MLP, an RMSNorm after each (before the
residual add), and q / k RMSNorms over the whole projection, before the head split. Every
norm scales in float32 before rounding (`Float32ScaledRMSNorm`).

Under tensor parallelism each rank holds its heads' channels of the q / k projections: the
q / k norms sum their mean squares over the ranks; the row-parallel layers sum their own
outputs (the post-norms need the whole sum).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..attention.backend import AttentionBackend, AttentionMetadata
from .layers.attention import Attention
from .layers.linear import MergedLinear, lm_head, row_parallel_linear, vocab_embedding
from .layers.norm import Float32ScaledRMSNorm
from .layers.rotary import RotaryEmbedding
from .llama import DecoderForCausalLM, LlamaMLP, head_dim_of, kv_heads_of

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup


class Olmo2Attention(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp_size = tp.world_size if tp is not None else 1
        self.num_heads = config.num_attention_heads // tp_size  # on this rank
        self.num_kv_heads = kv_heads_of(config) // tp_size
        self.head_dim = head_dim_of(config)
        q_size = config.num_attention_heads * self.head_dim
        kv_size = kv_heads_of(config) * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias, tp)
        self.o_proj = row_parallel_linear(q_size, config.hidden_size, bias, tp)
        eps = config.rms_norm_eps
        self.q_norm = Float32ScaledRMSNorm(q_size, eps, tp=tp)
        self.k_norm = Float32ScaledRMSNorm(kv_size, eps, tp=tp)
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, backend
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q, k = self.q_norm(q), self.k_norm(k)  # over all heads, before the split
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        rotated = self.attn.rotate_into_cache(self.rotary, positions, q, k, v, kv_cache, metadata)
        if rotated is not None:
            return self.o_proj(self.attn(rotated, None, None, kv_cache, metadata))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, self_attn: Olmo2Attention, mlp: LlamaMLP, config: Any) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = Float32ScaledRMSNorm(
            config.hidden_size, config.rms_norm_eps
        )
        self.post_feedforward_layernorm = Float32ScaledRMSNorm(
            config.hidden_size, config.rms_norm_eps
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        attn = self.self_attn(positions, hidden_states, kv_cache, metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(hidden_states)
        return hidden_states + self.post_feedforward_layernorm(mlp)


class Olmo2Model(nn.Module):
    def __init__(
        self, config: Any, layers: list[Olmo2DecoderLayer], tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = Float32ScaledRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(positions, hidden_states, kv_cache, metadata)
        return self.norm(hidden_states)


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2 decoder with an LM head (tied to the embedding when the config says so).

    Args:
        config: The Hugging Face config.
        backend: Attention backend shared by all layers.
        max_position: Longest sequence the engine will run (rotary table size).
        tp: Tensor-parallel group; None (or one rank) builds the plain single-device model.
    """

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        max_position: int,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.set_config(config, tp)
        rotary = self.rotary_embedding(config, max_position)
        layers = [
            Olmo2DecoderLayer(
                Olmo2Attention(config, rotary, backend, tp), LlamaMLP(config, tp=tp), config
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.model = Olmo2Model(config, layers, tp)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()
