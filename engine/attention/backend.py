"""The attention backend interface and the per-step metadata every backend receives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class BidirectionalSpans:
    """Spans of a step's sequences whose tokens attend to each other both ways (the
    placeholder tokens of one image, in Gemma 3): a query token inside a span also sees the
    span's later keys. Everything else stays causal; a sliding window still bounds how far
    back a token sees (Hugging Face's `sliding AND (causal OR same span)`).

    Each span holds query tokens of the step and lies within its sequence's keys after the
    step (`seq_lens`): a span is computed whole by the step that computes any of it, or
    its earlier part was computed whole before (its keys then come from the cache).
    """

    spans_host: list[tuple[int, int, int]]
    """`(sequence, first position, end position)` of each span holding query tokens of
    the step, on the host."""
    key_end: torch.Tensor  # [num_tokens] int32
    """Each query token sees keys at positions below this: the end of its span, or its
    own position + 1 outside every span."""
    key_end_host: list[int]
    """`key_end` on the host."""


@dataclass
class AttentionMetadata:
    """Describes one step's batch of variable-length query chunks over the paged cache.

    Sequences are laid out back to back: the queries of sequence `i` are tokens
    `query_start_loc[i]:query_start_loc[i + 1]` of the flattened batch, and they are its
    last `query_len` positions, so query `j` of sequence `i` sits at position
    `seq_lens[i] - query_len + j` and attends to keys `0 ..` that position.
    """

    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, keys per sequence after this step's writes
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot (block * block_size + offset)
    query_start_loc_host: list[int]
    """`query_start_loc` on the host, so backends plan without a device sync."""
    seq_lens_host: list[int]
    backend_data: object | None = None
    """Whatever the backend precomputed once per step in `prepare` (masks, gather indices)."""
    max_seq_len_is_bound: bool = False
    """`max_seq_len` only bounds the contexts and the host lists are not this step's: static
    metadata that a CUDA graph replays for every batch it holds. Kernels then size their
    work from the device tensors alone."""
    bidirectional: BidirectionalSpans | None = None
    """Spans whose tokens attend both ways (a step with image tokens of a model that asks
    for it); None: every sequence is causal."""


class AttentionBackend(ABC):
    """Computes attention for all layers; stateless apart from what `prepare` caches per step."""

    name: str

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Precompute per-step data shared by all layers; stores it in `metadata.backend_data`."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's keys / values into the cache, then attend causally over it
        (both ways within `metadata.bidirectional`'s spans).
        `key` and `value` are None after `rotate_into_cache` stored them. `softcap` caps the
        scaled scores (`softcap * tanh(score / softcap)`) before the mask and softmax."""

    def rotate_into_cache(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos_sin: torch.Tensor,  # [2, max_position, rotary_dim] float32
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Rotary embedding and the cache write in one pass, where the backend has one: the
        rotated queries, the rotated keys and the values already in the cache (`forward`
        then takes `key=None, value=None`). None (the default) when it has not: rotate,
        then call `forward` with the keys and values."""
        return None

    def project_rotate_into_cache(
        self,
        hidden_states: torch.Tensor,  # [1, hidden_size]
        weight: Any,  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden_size], or int4
        bias: torch.Tensor | None,
        num_heads: int,
        positions: torch.Tensor,  # [1]
        cos_sin: torch.Tensor,  # [2, max_position, rotary_dim] float32
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """For one token: the q|k|v projection, then `rotate_into_cache`, in one pass where
        the backend has one (the rotated queries, `[1, num_heads, head_dim]`). None (the
        default) when it has not: project, then `rotate_into_cache`. `weight` is the dense
        weight, or an int4 layer's operands (`w4a16_fused.W4a16Weight`)."""
        return None
