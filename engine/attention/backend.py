"""The attention backend interface and the per-step metadata every backend receives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


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
        """Write this step's keys / values into the cache, then attend causally over it.
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
