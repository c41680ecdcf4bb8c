"""Paged attention with the Triton kernels of `batchlm.kernels` (CUDA; CPU only under
Triton's interpreter, for tests).

Per layer: the step's keys and values are written into the paged cache by slot (in the
same kernel as the rotary embedding, for whole-head rotary and a cache in the model's
dtype), then a decode-only step (one query token per sequence) runs the split-K decode
kernel and every other step (prefills, chunked prefills, prefix-cache hits, mixed prefill
+ decode) runs the variable-length prefill kernel over the cache. Both read `AttentionMetadata`'s device
tensors directly; `prepare` only decides which kernel the step uses.

Batch-invariant (`batch_invariant=True`): every step runs the prefill kernel, decode-only
steps (and their CUDA graphs) included, on one tile sized for decode tokens
(`batch_invariant_tile`), with its keys split at fixed boundaries
(`FIXED_SPLIT_SIZE`): each split attended from scratch over key tiles that start at
multiples of the key tile from position 0, where keys a token cannot see add exact zeros,
and the splits folded in order. Its tiles depend on the model's shapes alone; so a
token's output depends on its own query and keys only: not on the other sequences of the
step, on the chunk it came in, or on whether its prefix was computed in this step or read
back from the cache. Steps whose query tiles would leave the GPU idle (decode at small
batches, long contexts) attend each split in its own program and fold them in a second
kernel, with the same bits. The decode kernel's split of the context, chosen by the batch
size, is never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchlm.kernels import use_triton_kernels
from batchlm.kernels.decode_attention import decode_attention
from batchlm.kernels.gemv_rotary import gemv_rotary_into_cache
from batchlm.kernels.prefill_attention import (
    FIXED_SPLIT_SIZE,
    batch_invariant_tile,
    prefill_attention,
)
from batchlm.kernels.rotary import rotary_embedding_into_cache
from batchlm.kernels.w4a16_fused import W4a16Weight, w4a16_rotary_into_cache
from batchlm.kernels.write_kv_cache import write_kv_cache

from .. import envs
from .backend import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class _TritonPlan:
    is_decode_only: bool
    """Every sequence has exactly one query token this step."""


def _rotates_into(kv_cache: torch.Tensor | None, dtype: torch.dtype, cos_sin: torch.Tensor) -> bool:
    """Whether the rotary kernels can write a step's keys into `kv_cache`: there is one (not
    a pooling forward), in the activations' dtype (not fp8), and the whole head rotates."""
    return (
        kv_cache is not None and kv_cache.dtype == dtype and cos_sin.shape[-1] == kv_cache.shape[-1]
    )


class TritonAttentionBackend(AttentionBackend):
    """Args:
    batch_invariant: Run every step on the prefill kernel, its keys split at fixed
        boundaries (see the module docstring)."""

    name = "triton"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        self.fused_qkv_rotary = envs.fused_qkv_rotary() and not batch_invariant
        """One-token steps project q|k|v, rotate and write the cache in one kernel."""

    def rotate_into_cache(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        if not _rotates_into(kv_cache, query.dtype, cos_sin):
            return None
        return rotary_embedding_into_cache(
            positions, query, key, value, cos_sin, kv_cache[0], kv_cache[1], metadata.slot_mapping
        )

    def project_rotate_into_cache(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | W4a16Weight,
        bias: torch.Tensor | None,
        num_heads: int,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        if (
            not self.fused_qkv_rotary
            or not use_triton_kernels(hidden_states)  # CPU steps: the torch product
            or hidden_states.dtype not in (torch.float16, torch.bfloat16)
            or not _rotates_into(kv_cache, hidden_states.dtype, cos_sin)
        ):
            return None
        cache = (positions, cos_sin, kv_cache[0], kv_cache[1], metadata.slot_mapping, num_heads)
        if isinstance(weight, W4a16Weight):  # int4: a bias would be added after the product
            if bias is not None:
                return None
            return w4a16_rotary_into_cache(hidden_states, weight, *cache)
        return gemv_rotary_into_cache(hidden_states, weight, bias, *cache)

    def prepare(self, metadata: AttentionMetadata) -> None:
        is_decode_only = (
            metadata.max_query_len == 1
            and not self.batch_invariant
            and metadata.bidirectional is None
        )
        metadata.backend_data = _TritonPlan(is_decode_only=is_decode_only)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise ValueError(
                "the triton attention backend reads keys from the paged KV cache; cache-less "
                "forwards (pooling) run on the torch backend"
            )
        plan = metadata.backend_data
        if not isinstance(plan, _TritonPlan):
            raise ValueError("TritonAttentionBackend.prepare(metadata) must run before forward")
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if key is not None:  # else rotate_into_cache stored them
            write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        if plan.is_decode_only:
            return decode_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                metadata.max_seq_len,
                sliding_window,
                split_each_seq=metadata.max_seq_len_is_bound,
                softcap=softcap,
            )
        tile = {}
        if self.batch_invariant:
            group = query.shape[1] // key_cache.shape[2]
            tile = batch_invariant_tile(query.dtype, query.shape[2], group)
        return prefill_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            metadata.max_query_len,
            sliding_window,
            softcap=softcap,
            fixed_split_size=FIXED_SPLIT_SIZE if self.batch_invariant else None,
            max_seq_len=metadata.max_seq_len,
            key_end=metadata.bidirectional.key_end if metadata.bidirectional else None,
            **tile,
        )
