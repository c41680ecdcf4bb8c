"""ModernBERT encoders: `ModernBertModel` (embeddings) and `ModernBertForSequenceClassification`.

A pre-norm encoder with rotary positions and no absolute position table. Layers alternate
between global attention and local attention (each token sees the keys within
`local_attention // 2` positions on either side), as `config.layer_types` lists them (older
configs: every `global_attn_every_n_layers`-th layer is global); each kind has its own rope
theta. The MLP is a GeGLU (`Wi` → `act(input) * gate` → `Wo`); the embeddings and the final
states are LayerNormed (no biases unless `norm_bias`). Sequences arrive packed back to back
without padding, as for BERT; module names equal the Hugging Face checkpoint names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..attention.varlen import VarlenPlan, varlen_attention
from ..errors import UnsupportedModelError
from .bert import encoder_activation
from .layers.pooler import PoolingType
from .layers.rotary import RopeSpec, RotaryEmbedding

__all__ = ["ModernBertForSequenceClassification", "ModernBertModel"]

_GLOBAL, _LOCAL = "full_attention", "sliding_attention"
# Rope thetas of configs written before `rope_parameters` (transformers < 5).
_DEFAULT_THETAS = {_GLOBAL: 160_000.0, _LOCAL: 10_000.0}
_LEGACY_THETA_KEYS = {_GLOBAL: "global_rope_theta", _LOCAL: "local_rope_theta"}


def layer_types_of(config: Any) -> list[str]:
    """`full_attention` / `sliding_attention` per layer."""
    types = getattr(config, "layer_types", None)
    if types is None:
        every = int(getattr(config, "global_attn_every_n_layers", 3))
        types = [_LOCAL if i % every else _GLOBAL for i in range(config.num_hidden_layers)]
    unknown = sorted(set(types) - {_GLOBAL, _LOCAL})
    if unknown or len(types) != config.num_hidden_layers:
        raise UnsupportedModelError(
            f"layer_types={list(types)!r} must name one of {_GLOBAL!r} / {_LOCAL!r} for each of "
            f"the {config.num_hidden_layers} layers"
        )
    return list(types)


def _rope_spec(config: Any, layer_type: str, head_dim: int) -> RopeSpec:
    params = dict((getattr(config, "rope_parameters", None) or {}).get(layer_type) or {})
    if "rope_theta" not in params:
        theta = getattr(config, _LEGACY_THETA_KEYS[layer_type], None)
        if theta is None and layer_type == _LOCAL:  # older configs: local falls back to global
            theta = getattr(config, _LEGACY_THETA_KEYS[_GLOBAL], None)
        params["rope_theta"] = theta if theta is not None else _DEFAULT_THETAS[layer_type]
    return RopeSpec(
        rope_type=params.get("rope_type", "default") or "default",
        theta=float(params["rope_theta"]),
        rotary_dim=head_dim,
        params=params,
        max_position_embeddings=int(config.max_position_embeddings),
    )


def _layer_norm(config: Any) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertEmbeddings(nn.Module):
    """Token embeddings, then LayerNorm (positions enter through rotary attention)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _layer_norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] → [T, hidden]
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    """Bidirectional self-attention with a fused `Wqkv`, rotary q / k, optionally local."""

    def __init__(self, config: Any, window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        bias = config.attention_bias
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=bias)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.scale = self.head_dim**-0.5
        self.window = window

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        plan: VarlenPlan,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:  # [T, hidden]
        qkv = self.Wqkv(hidden_states).view(-1, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each [T, num_heads, head_dim]
        q, k = rotary(positions, q, k)
        out = varlen_attention(q, k, v, plan, self.scale, causal=False, window=self.window)
        return self.Wo(out.reshape(out.shape[0], -1))


class ModernBertMLP(nn.Module):
    """GeGLU: `Wo(act(input) * gate)` where `Wi(x) = [input | gate]`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.intermediate_size = int(config.intermediate_size)
        bias = config.mlp_bias
        self.Wi = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.Wo = nn.Linear(self.intermediate_size, config.hidden_size, bias=bias)
        self.act = encoder_activation(config.hidden_activation, "hidden_activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] → [T, hidden]
        up = self.Wi(x)  # [T, 2 * intermediate]
        d = self.intermediate_size
        return self.Wo(self.act(up[:, :d]) * up[:, d:])


class ModernBertEncoderLayer(nn.Module):
    """Pre-norm layer; the first layer has no attention norm (the embeddings are normed)."""

    def __init__(self, config: Any, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if layer_idx == 0 else _layer_norm(config)
        window = config.local_attention // 2 if layer_type == _LOCAL else None
        self.attn = ModernBertAttention(config, window)
        self.mlp_norm = _layer_norm(config)
        self.mlp = ModernBertMLP(config)
        self.layer_type = layer_type

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,
        plan: VarlenPlan,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        h = hidden_states + self.attn(self.attn_norm(hidden_states), positions, plan, rotary)
        return h + self.mlp(self.mlp_norm(h))


class ModernBertModel(nn.Module):
    """The ModernBERT encoder: packed token ids → final (normed) hidden states."""

    packed_modules: ClassVar[dict[str, list[str]]] = {}
    default_pooling_type = PoolingType.CLS
    # A body saved from a wrapper (classifier, masked LM) names its tensors `model.*`.
    checkpoint_prefix_renames = (("model.", ""),)

    def __init__(self, config: Any, **unused: Any) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise UnsupportedModelError(
                f"hidden_size={config.hidden_size} is not a multiple of "
                f"num_attention_heads={config.num_attention_heads}"
            )
        self.config = config
        types = layer_types_of(config)
        head_dim = config.hidden_size // config.num_attention_heads
        self.max_positions = int(config.max_position_embeddings)
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    _rope_spec(config, kind, head_dim), head_dim, self.max_positions
                )
                for kind in sorted(set(types))
            }
        )
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(
            ModernBertEncoderLayer(config, i, kind) for i, kind in enumerate(types)
        )
        self.final_norm = _layer_norm(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64, 0-based within each sequence
        token_type_ids: torch.Tensor | None,  # unused: ModernBERT has no segment embeddings
        cu_seqlens: Sequence[int] | VarlenPlan,  # [num_seqs + 1], or a plan built from it
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Final hidden states of packed sequences `cu_seqlens[i]:cu_seqlens[i + 1]`."""
        plan = (
            cu_seqlens
            if isinstance(cu_seqlens, VarlenPlan)
            else VarlenPlan.build(cu_seqlens, input_ids.device)
        )
        hidden_states = self.embeddings(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, positions, plan, self.rotary[layer.layer_type])
        return self.final_norm(hidden_states)


class ModernBertPredictionHead(nn.Module):
    """`norm(act(dense(x)))`: the head between the pooled state and the classifier."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = encoder_activation(config.classifier_activation, "classifier_activation")
        self.norm = _layer_norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, hidden] → [B, hidden]
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(nn.Module):
    """A ModernBERT encoder with its classification head.

    `forward` returns hidden states; the runner pools them as `classifier_pooling` says (the
    first token for `cls`, the average for `mean`) and calls `classify`, which returns logits
    without activation.
    """

    packed_modules: ClassVar[dict[str, list[str]]] = {}

    def __init__(self, config: Any, **unused: Any) -> None:
        super().__init__()
        pooling = getattr(config, "classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise UnsupportedModelError(
                f"classifier_pooling={pooling!r} is not supported; use 'cls' or 'mean'"
            )
        self.default_pooling_type = PoolingType.MEAN if pooling == "mean" else PoolingType.CLS
        self.config = config
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)
        self.num_labels = int(config.num_labels)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.max_positions = self.model.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        cu_seqlens: Sequence[int] | VarlenPlan,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, token_type_ids, cu_seqlens)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[B, hidden]` pooled states → `[B, num_labels]` logits."""
        return self.classifier(self.head(pooled))
