"""Reference attention over the paged KV cache in plain PyTorch (CPU and CUDA).

Queries and keys are gathered into padded `[num_seqs, max_len, ...]` batches once per
layer and fed to `scaled_dot_product_attention` with a mask that encodes causality, each
sequence's length and an optional sliding window. Simple and exact; the Triton backend is
checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backend import AttentionBackend, AttentionMetadata


@dataclass
class _TorchPlan:
    query_dest: torch.Tensor  # [num_tokens] index into the padded [num_seqs * max_query_len]
    query_pos: torch.Tensor  # [num_seqs, max_query_len] position of each padded query
    key_pos: torch.Tensor  # [max_seq_len] 0..max_seq_len-1
    valid: torch.Tensor  # [num_seqs, 1, max_query_len, max_seq_len] bool, causal & in range
    window_cache: dict[int, torch.Tensor]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, metadata: AttentionMetadata) -> None:
        device = metadata.query_start_loc.device
        qsl = metadata.query_start_loc.long()
        query_lens = qsl[1:] - qsl[:-1]  # [num_seqs]
        max_q, max_k = metadata.max_query_len, metadata.max_seq_len
        seq_of_token = torch.repeat_interleave(
            torch.arange(metadata.num_seqs, device=device), query_lens
        )  # [num_tokens]
        idx_in_seq = torch.arange(metadata.num_tokens, device=device) - qsl[seq_of_token]
        query_dest = seq_of_token * max_q + idx_in_seq
        seq_lens = metadata.seq_lens.long()
        j = torch.arange(max_q, device=device)
        query_pos = (seq_lens - query_lens)[:, None] + j[None, :]  # [num_seqs, max_q]
        key_pos = torch.arange(max_k, device=device)
        valid = (key_pos[None, None, :] <= query_pos[:, :, None]) & (
            key_pos[None, None, :] < seq_lens[:, None, None]
        )
        # Padding query rows attend to key 0 so softmax stays finite; their output is dropped.
        valid[:, :, 0] = True
        metadata.backend_data = _TorchPlan(query_dest, query_pos, key_pos, valid[:, None], {})

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        plan: _TorchPlan = metadata.backend_data  # type: ignore[assignment]
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        block_size = key_cache.shape[1]
        write_paged_kv_ref(key, value, key_cache, value_cache, metadata.slot_mapping)

        n, max_q, max_k = metadata.num_seqs, metadata.max_query_len, metadata.max_seq_len
        num_blocks_needed = -(-max_k // block_size)
        tables = metadata.block_tables[:, :num_blocks_needed].long()
        # [num_seqs, max_k, num_kv_heads, head_dim]
        k = key_cache[tables].reshape(n, -1, num_kv_heads, head_dim)[:, :max_k]
        v = value_cache[tables].reshape(n, -1, num_kv_heads, head_dim)[:, :max_k]
        q = query.new_zeros(n * max_q, num_heads, head_dim)
        q[plan.query_dest] = query
        q = q.view(n, max_q, num_heads, head_dim)

        mask = plan.valid
        if sliding_window is not None:
            mask = plan.window_cache.get(sliding_window)
            if mask is None:
                in_window = (plan.query_pos[:, :, None] - plan.key_pos[None, None, :]) < (
                    sliding_window
                )
                mask = plan.valid & in_window[:, None]
                mask[..., 0] |= ~mask.any(-1)  # keep padding rows finite
                plan.window_cache[sliding_window] = mask

        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [n, num_heads, max_q, head_dim]
            k.transpose(1, 2).to(q.dtype),  # [n, num_kv_heads, max_k, head_dim]
            v.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [n, num_heads, max_q, head_dim]
        out = out.transpose(1, 2).reshape(n * max_q, num_heads, head_dim)
        return out[plan.query_dest]


def write_paged_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store each token's key / value at its slot of the paged cache."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))
