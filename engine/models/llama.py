"""Llama-family decoders: Llama 2/3, Mistral (and the Qwen families, which subclass it).

Differences between families are declared as class attributes (`qkv_bias`, `o_bias`,
`qk_norm`), never decided from checkpoint contents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..attention.backend import AttentionBackend, AttentionMetadata
from .base import CausalLM
from .layers.activation import SiluAndMul
from .layers.attention import Attention
from .layers.linear import MergedLinear, lm_head, row_parallel_linear, vocab_embedding
from .layers.norm import RMSNorm
from .layers.rotary import RotaryEmbedding, rope_spec_from_config

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def check_tensor_parallel(config: Any, tp_size: int) -> None:
    """Raise when the model's heads or MLP width cannot be split over `tp_size` ranks."""
    heads, kv_heads = config.num_attention_heads, kv_heads_of(config)
    # MLP widths: the dense one and, for mixture-of-experts families, an expert's and the
    # shared expert's.
    widths = {
        key: value
        for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
        if (value := getattr(config, key, None))
    }
    if heads % tp_size or kv_heads % tp_size or any(w % tp_size for w in widths.values()):
        import math

        common = math.gcd(heads, kv_heads, *widths.values())
        sizes = [n for n in range(1, min(common, 16) + 1) if common % n == 0]
        named = " and ".join(f"{key}={value}" for key, value in widths.items())
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's attention heads "
            f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}) and "
            f"{named}; sizes that do: {sizes}"
        )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
        tp: TPGroup | None = None,
        reduce_output: bool = True,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        qk_norm_cls: Callable[[int, float], nn.Module] = RMSNorm,
    ) -> None:
        """`scale` (None: head_dim ** -0.5), `softcap` (attention-score cap, None: none) and
        `qk_norm_cls` (the per-head q / k norm's class, built as `(head_dim, eps)`) serve the
        families built from these layers (Gemma)."""
        super().__init__()
        tp_size = tp.world_size if tp is not None else 1
        self.num_heads = config.num_attention_heads // tp_size  # on this rank
        self.num_kv_heads = kv_heads_of(config) // tp_size
        self.head_dim = head_dim_of(config)
        q_size = config.num_attention_heads * self.head_dim
        kv_size = kv_heads_of(config) * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], qkv_bias, tp)
        self.o_proj = row_parallel_linear(q_size, config.hidden_size, o_bias, tp, reduce_output)
        self.rotary = rotary
        if qk_norm:
            self.q_norm = qk_norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm_cls(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            backend,
            sliding_window,
            softcap,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if not self.qk_norm:
            rotated = self.attn.project_rotate_into_cache(
                self.qkv_proj, self.rotary, positions, hidden_states, kv_cache, metadata
            )
            if rotated is not None:
                return self.o_proj(self.attn(rotated, None, None, kv_cache, metadata))
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rotated = self.attn.rotate_into_cache(self.rotary, positions, q, k, v, kv_cache, metadata)
        if rotated is not None:
            return self.o_proj(self.attn(rotated, None, None, kv_cache, metadata))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: Any,
        bias: bool = False,
        tp: TPGroup | None = None,
        reduce_output: bool = True,
        intermediate_size: int | None = None,
    ) -> None:
        """`intermediate_size`: the MLP's width (None: the config's `intermediate_size`)."""
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias, tp)
        self.down_proj = row_parallel_linear(inter, config.hidden_size, bias, tp, reduce_output)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if isinstance(self.act, SiluAndMul):  # (GeGLU subclasses set their own)
            out = self.down_proj.forward_silu_mul(gate_up)  # int4 at one row: one kernel
            if out is not None:
                return out
        return self.down_proj(self.act(gate_up))


class LlamaDecoderLayer(nn.Module):
    """One decoder layer. With `sum_over` (a tensor-parallel group), the attention and MLP
    return their ranks' partial sums and the norm after each sums them (see
    `RMSNorm.sum_over`): the layer's output is then a partial sum too, which the next
    layer's input norm, or the model's final norm, sums."""

    def __init__(
        self,
        self_attn: LlamaAttention,
        mlp: nn.Module,
        config: Any,
        sum_over: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, sum_over)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, sum_over)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
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
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        layers: list[LlamaDecoderLayer],
        tp: TPGroup | None = None,
        sum_over: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        # With `sum_over`, the last layer's output is a partial sum (see LlamaDecoderLayer).
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, sum_over)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` (`[num_tokens, hidden_size]`, a vision-language model's text and
        image rows) replaces the embedding of `input_ids`."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(CausalLM):
    """What the decoder families share: `self.model` (embedding, layers, final norm) under
    an LM head `self.lm_head`, tied to the embedding when the config says so, the KV cache
    of `config`'s heads split over the tensor-parallel ranks.

    A family's `__init__` calls `set_config`, builds `self.model` and `self.lm_head`, then
    `tie_weights()`.
    """

    packed_modules = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def set_config(self, config: Any, tp: TPGroup | None) -> None:
        """Keeps `config` and the group's size; checks the heads and widths divide by it."""
        self.config = config
        self.tp_size = tp.world_size if tp is not None else 1
        if self.tp_size > 1:
            check_tensor_parallel(config, self.tp_size)

    def rotary_embedding(self, config: Any, max_position: int) -> RotaryEmbedding:
        """The rotary embedding of `config`'s heads; sets `long_context_len` from it."""
        head_dim = head_dim_of(config)
        rotary = RotaryEmbedding(rope_spec_from_config(config, head_dim), head_dim, max_position)
        self.long_context_len = rotary.long_context_len
        return rotary

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, metadata):
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        return logits.float() if upcast else logits

    def kv_cache_shape(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, kv_heads_of(c) // self.tp_size, head_dim_of(c)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama / Mistral decoder with an LM head (tied to the embedding when the config says so).

    Args:
        config: The Hugging Face config.
        backend: Attention backend shared by all layers.
        max_position: Longest sequence the engine will run (rotary table size).
        tp: Tensor-parallel group; None (or one rank) builds the plain single-device model.
    """

    qkv_bias = False
    qk_norm = False

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
        attention_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        # Under tensor parallelism the norms sum the row-parallel outputs (one kernel with
        # the all-reduce); a bias would have to be added after that sum, so biased layers
        # reduce their own outputs.
        sum_over = tp if self.tp_size > 1 and not attention_bias and not mlp_bias else None
        reduce_output = sum_over is None
        layers = []
        for i in range(config.num_hidden_layers):
            attn = LlamaAttention(
                config,
                rotary,
                backend,
                qkv_bias=self.qkv_bias or attention_bias,
                o_bias=attention_bias,
                qk_norm=self.qk_norm,
                sliding_window=self.sliding_window_of(config, i),
                tp=tp,
                reduce_output=reduce_output,
            )
            mlp = self.make_mlp(config, i, mlp_bias, tp, reduce_output)
            layers.append(LlamaDecoderLayer(attn, mlp, config, sum_over))
        self.model = LlamaModel(config, layers, tp, sum_over)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()

    def make_mlp(
        self, config: Any, layer_idx: int, bias: bool, tp: TPGroup | None, reduce_output: bool
    ) -> nn.Module:
        """The MLP of layer `layer_idx` (`[n, hidden]` → `[n, hidden]`, a partial sum over
        the ranks when `reduce_output` is False); mixture-of-experts families override it."""
        return LlamaMLP(config, bias, tp, reduce_output)

    @staticmethod
    def sliding_window_of(config: Any, layer_idx: int) -> int | None:
        """Window of layer `layer_idx`, or None for full attention."""
        return getattr(config, "sliding_window", None) or None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layers with an optional sliding window on every layer."""
