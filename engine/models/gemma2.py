"""Gemma 2 decoders: Llama's projections with Gemma's norms, scaling and soft-caps.

What differs from Llama: the embeddings are multiplied by sqrt(hidden_size) (rounded to the
model's dtype first, as Hugging Face does); every RMSNorm scales by `1 + weight` in float32;
each layer normalises before and after both attention and MLP; the MLP is GeGLU (GELU's
tanh approximation); the attention scale is `query_pre_attn_scalar ** -0.5`; attention
scores and final logits are soft-capped (`cap * tanh(x / cap)`); sliding-window layers
alternate with global ones (`layer_types`).

Under tensor parallelism every row-parallel layer sums its own output: the norm after it
needs the whole sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..attention.backend import AttentionBackend, AttentionMetadata
from ..errors import UnsupportedModelError
from .layers.activation import GeluTanhAndMul
from .layers.linear import lm_head, vocab_embedding
from .layers.norm import Float32ScaledRMSNorm
from .layers.rotary import RotaryEmbedding, rope_spec_from_config
from .llama import DecoderForCausalLM, LlamaAttention, LlamaMLP, head_dim_of

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup

SLIDING = "sliding_attention"
FULL = "full_attention"


def gemma_norm(hidden_size: int, eps: float) -> Float32ScaledRMSNorm:
    """Gemma's RMSNorm: the weight is stored as an offset from 1."""
    return Float32ScaledRMSNorm(hidden_size, eps, weight_offset=1.0)


def layer_types_of(config: Any, default_pattern: int) -> list[str]:
    """Each layer's `sliding_attention` / `full_attention`: the config's `layer_types`, or
    (configs written before it existed) every `sliding_window_pattern`-th layer global."""
    types = getattr(config, "layer_types", None)
    if types:
        unknown = sorted(set(types) - {SLIDING, FULL})
        if unknown:
            raise UnsupportedModelError(
                f"layer_types {unknown} are not supported; Gemma layers are {SLIDING!r} or {FULL!r}"
            )
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", None) or default_pattern)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


class GemmaMLP(LlamaMLP):
    """GeGLU: `down(gelu_tanh(gate) * up)`."""

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__(config, False, tp)
        activation = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise UnsupportedModelError(
                f"hidden_activation={activation!r} is not supported for Gemma; batchlm runs "
                "'gelu_pytorch_tanh' (every released Gemma 2 / 3 checkpoint's)"
            )
        self.act = GeluTanhAndMul()


class GemmaDecoderLayer(nn.Module):
    """Norms before and after attention and MLP; the residual stream is added after each
    post-norm (fused with the next pre-norm)."""

    def __init__(self, self_attn: LlamaAttention, mlp: GemmaMLP, config: Any) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = gemma_norm(hidden, eps)
        self.post_attention_layernorm = gemma_norm(hidden, eps)
        self.pre_feedforward_layernorm = gemma_norm(hidden, eps)
        self.post_feedforward_layernorm = gemma_norm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, metadata)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class GemmaModel(nn.Module):
    """Scaled embeddings, the layers and the final norm."""

    def __init__(
        self, config: Any, layers: list[GemmaDecoderLayer], tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = gemma_norm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.hidden_size**0.5
        self._embed_scales: dict[torch.dtype, float] = {}

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """`inputs_embeds` (a vision-language model's scaled text embeddings with its image
        rows, see `embed`) replaces the embedding of `input_ids`."""
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[num_tokens]` → the scaled embeddings `[num_tokens, hidden_size]`."""
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        return hidden_states * self._embed_scale(hidden_states.dtype)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) as a float32 scalar rounded to `dtype` (55.4256 → 55.5 in
        bfloat16), as Hugging Face scales; a Python number, so CUDA graphs capture it."""
        scale = self._embed_scales.get(dtype)
        if scale is None:
            scale = self._embed_scales[dtype] = float(torch.tensor(self.embed_scale).to(dtype))
        return scale


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2 decoder with the LM head tied to the embedding (unless the config unties it).

    Args:
        config: The Hugging Face config.
        backend: Attention backend shared by all layers.
        max_position: Longest sequence the engine will run (rotary table size).
        tp: Tensor-parallel group; None (or one rank) builds the plain single-device model.
    """

    qk_norm = False
    default_sliding_window_pattern = 2
    """Every other layer is global when the config predates `layer_types`."""

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        max_position: int,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(
                "use_bidirectional_attention=True (EmbeddingGemma) is not supported: batchlm "
                "runs Gemma as a causal decoder; load a checkpoint with causal attention"
            )
        self.set_config(config, tp)
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        rotaries = self.rotary_embeddings(config, head_dim, max_position)
        layers = []
        for layer_type in layer_types_of(config, self.default_sliding_window_pattern):
            attn = LlamaAttention(
                config,
                rotaries[layer_type],
                backend,
                qkv_bias=bias,
                o_bias=bias,
                qk_norm=self.qk_norm,
                sliding_window=config.sliding_window if layer_type == SLIDING else None,
                tp=tp,
                scale=float(config.query_pre_attn_scalar) ** -0.5,
                softcap=self.attention_softcap(config),
                qk_norm_cls=gemma_norm,
            )
            layers.append(GemmaDecoderLayer(attn, GemmaMLP(config, tp), config))
        self.model = GemmaModel(config, layers, tp)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)
        self.tie_weights()

    @staticmethod
    def rotary_embeddings(
        config: Any, head_dim: int, max_position: int
    ) -> dict[str, RotaryEmbedding]:
        """The rotary embedding of each layer type (Gemma 2: one for both)."""
        rotary = RotaryEmbedding(rope_spec_from_config(config, head_dim), head_dim, max_position)
        return {SLIDING: rotary, FULL: rotary}

    @staticmethod
    def attention_softcap(config: Any) -> float | None:
        return getattr(config, "attn_logit_softcapping", None) or None

    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        cap = self.final_logit_softcap
        if cap:  # in the logits' dtype, as Hugging Face caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if upcast else logits
