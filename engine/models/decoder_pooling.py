"""Decoder families (Llama, Mistral, Qwen2 / 3, Gemma 2 / 3, Phi-3, OLMo 2) as pooling
models.

As embedding models they pool the last token's final hidden state (vLLM's LAST pooling);
as `*ForSequenceClassification` a bias-free `score` head maps that state to label logits.
The decoder runs without a KV cache: every sequence attends causally over itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention.backend import AttentionBackend, AttentionMetadata
from ..attention.varlen import VarlenPlan
from .layers.pooler import PoolingType


class DecoderForPooling(nn.Module):
    """A decoder body with an optional classification head.

    Args:
        config: The Hugging Face config.
        causal_lm_cls: The generative class whose `.model` body is reused.
        backend: Attention backend (its cache-less path is used).
        max_position: Longest input (rotary table size).
        num_labels: Labels of the `score` head; None for embedding models.
    """

    # A generative checkpoint converted to an embedding model still carries its LM head.
    ignored_checkpoint_prefixes = ("lm_head.",)
    default_pooling_type = PoolingType.LAST

    def __init__(
        self,
        config: Any,
        causal_lm_cls: type[nn.Module],
        backend: AttentionBackend,
        max_position: int,
        num_labels: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.packed_modules = causal_lm_cls.packed_modules
        self.checkpoint_prefix_renames = getattr(causal_lm_cls, "checkpoint_prefix_renames", ())
        self.ignored_checkpoint_prefixes = (
            *self.ignored_checkpoint_prefixes,
            *getattr(causal_lm_cls, "ignored_checkpoint_prefixes", ()),
        )
        causal = causal_lm_cls(config, backend, max_position)
        self.model = causal.model
        self.long_context_len = getattr(causal, "long_context_len", None)
        self.num_layers = config.num_hidden_layers
        self.num_labels = num_labels
        if num_labels is not None:
            self.score = nn.Linear(config.hidden_size, num_labels, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        token_type_ids: torch.Tensor | None,
        cu_seqlens: list[int] | VarlenPlan,
    ) -> torch.Tensor:  # [T, hidden]
        device = input_ids.device
        if isinstance(cu_seqlens, VarlenPlan):
            cu_seqlens = cu_seqlens.cu_seqlens
        seq_lens = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
        qsl = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
        metadata = AttentionMetadata(
            num_seqs=len(seq_lens),
            num_tokens=int(input_ids.shape[0]),
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.zeros((len(seq_lens), 1), dtype=torch.int32, device=device),
            slot_mapping=torch.zeros_like(input_ids),
            query_start_loc_host=list(cu_seqlens),
            seq_lens_host=seq_lens,
        )
        long = self.long_context_len
        if long is not None and max(seq_lens) > long:  # LongRoPE: the long-context rows
            is_long = torch.tensor([n > long for n in seq_lens], device=device)
            positions = positions + long * is_long.repeat_interleave(metadata.seq_lens)
        backend = self.model.layers[0].self_attn.attn.backend
        backend.prepare(metadata)
        return self.model(input_ids, positions, [None] * self.num_layers, metadata)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[B, hidden]` → `[B, num_labels]` logits."""
        return self.score(pooled)
