"""BERT encoders: `BertModel` (embeddings) and `BertForSequenceClassification` (cross-encoders).

Sequences arrive packed back to back without padding; every layer attends bidirectionally
within each sequence through `varlen_attention`. Module names equal the Hugging Face
checkpoint names (`encoder.layer.0.attention.self.query` is loaded into the merged
`qkv_proj` that sits in its place). XLM-RoBERTa reuses these layers (`xlm_roberta.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.varlen import VarlenPlan, varlen_attention
from ..errors import UnsupportedModelError
from .layers.linear import MergedLinear
from .layers.pooler import PoolingType

__all__ = ["BertForSequenceClassification", "BertModel", "encoder_activation"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def encoder_activation(
    name: Any, setting: str = "hidden_act"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of a Hugging Face activation name (`ACT2FN`'s spelling) that the encoder
    layers support; `setting` is the config key it came from, for the error."""
    if not isinstance(name, str) or name not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"{setting}={name!r} is not supported by the encoder layers; supported: "
            f"{', '.join(sorted(_ACTIVATIONS))}"
        )
    return _ACTIVATIONS[name]


def _activation(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    return encoder_activation(getattr(config, "hidden_act", "gelu"))


def _check_supported(config: Any) -> None:
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise UnsupportedModelError(
            f"position_embedding_type={kind!r} is not supported; only 'absolute' position "
            "embeddings are"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(
            "BERT configured as a decoder (is_decoder / add_cross_attention) is not supported; "
            "batchlm runs BERT-family models as bidirectional encoders"
        )


class BertEmbeddings(nn.Module):
    """Word + position + token type embeddings, then LayerNorm.

    Args:
        config: The Hugging Face config.
        position_offset: Added to the 0-based positions before the lookup (XLM-R counts
            from `pad_token_id + 1`).
    """

    def __init__(self, config: Any, position_offset: int = 0) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], 0-based within each sequence
        token_type_ids: torch.Tensor | None,  # [num_tokens]; None means all 0
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        size = self.num_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [size, size, size], bias=True)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        plan: VarlenPlan,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        shape = (-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        out = varlen_attention(
            q.view(shape), k.view(shape), v.view(shape), plan, self.scale, causal=False
        )
        return out.reshape(out.shape[0], -1)


class BertAddNorm(nn.Module):
    """`LayerNorm(dense(x) + residual)`: HF's `BertSelfOutput` and `BertOutput`."""

    def __init__(self, in_features: int, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertAddNorm(config.hidden_size, config)

    def forward(self, hidden_states: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        return self.output(self.self(hidden_states, plan), hidden_states)


def _fused_linear_gelu(x: torch.Tensor, dense: nn.Linear) -> torch.Tensor | None:
    """oneDNN's matmul with bias and exact GELU as post-ops (CPU, float32): one pass over the
    wide intermediate instead of three. None where the op is unavailable."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or dense.bias is None:
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise(x, dense.weight, dense.bias, "gelu", [], "none")
    except (AttributeError, RuntimeError):
        return None


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is F.gelu:
            fused = _fused_linear_gelu(x, self.dense)
            if fused is not None:
                return fused
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    """Post-LayerNorm encoder layer: attention, then the feed-forward block."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertAddNorm(config.intermediate_size, config)

    def forward(self, hidden_states: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        attended = self.attention(hidden_states, plan)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states, plan)
        return hidden_states


class BertPooler(nn.Module):
    """`tanh(dense(cls_state))`: BERT's pooled output, the input of its classifier."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:  # [B, hidden] → [B, hidden]
        return torch.tanh(self.dense(cls_states))


class BertModel(nn.Module):
    """The BERT encoder: packed token ids → final hidden states.

    Args:
        config: The Hugging Face config.
        add_pooling_layer: Build `pooler` (dense + tanh). Embedding models do not use it, so
            by default it is left out and a checkpoint's `pooler.*` tensors are skipped (a
            checkpoint may or may not carry them); the classifier builds it.
    """

    packed_modules: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["query", "key", "value"]}
    default_pooling_type = PoolingType.CLS
    # Old checkpoints carry the position / token type id buffers; they are recomputed here.
    _IGNORED_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")

    def __init__(self, config: Any, add_pooling_layer: bool = False, **unused: Any) -> None:
        super().__init__()
        _check_supported(config)
        self.config = config
        position_offset = self.position_offset_of(config)
        self.embeddings = BertEmbeddings(config, position_offset)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        # Longest sequence the position table covers (the runner must not exceed it).
        self.max_positions = config.max_position_embeddings - position_offset
        ignored = (
            self._IGNORED_BUFFERS if add_pooling_layer else (*self._IGNORED_BUFFERS, "pooler.")
        )
        self.ignored_checkpoint_prefixes: tuple[str, ...] = ignored

    @staticmethod
    def position_offset_of(config: Any) -> int:
        """What is added to 0-based positions before the position-embedding lookup."""
        return 0

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64, 0-based within each sequence
        token_type_ids: torch.Tensor | None,  # [num_tokens] int64; None means all 0
        cu_seqlens: Sequence[int] | VarlenPlan,  # [num_seqs + 1], or a plan built from it
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Final hidden states of packed sequences `cu_seqlens[i]:cu_seqlens[i + 1]`."""
        plan = (
            cu_seqlens
            if isinstance(cu_seqlens, VarlenPlan)
            else VarlenPlan.build(cu_seqlens, input_ids.device)
        )
        hidden_states = self.embeddings(input_ids, positions, token_type_ids)
        return self.encoder(hidden_states, plan)


class BertForSequenceClassification(nn.Module):
    """A BERT encoder with HF's sequence-classification head (pooler, then `classifier`).

    `forward` returns hidden states like `BertModel`; the runner pools the CLS token and calls
    `classify`, which returns logits without activation.
    """

    packed_modules: ClassVar[dict[str, list[str]]] = BertModel.packed_modules
    default_pooling_type = PoolingType.CLS

    def __init__(self, config: Any, **unused: Any) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=True)
        self.num_labels = int(config.num_labels)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.max_positions = self.bert.max_positions
        self.ignored_checkpoint_prefixes = tuple(
            f"bert.{p}" for p in self.bert.ignored_checkpoint_prefixes
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        cu_seqlens: Sequence[int] | VarlenPlan,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.bert(input_ids, positions, token_type_ids, cu_seqlens)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[B, hidden]` CLS states → `[B, num_labels]` logits."""
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(pooled))
