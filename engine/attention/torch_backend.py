"""Reference attention over the paged KV cache in plain PyTorch (CPU and CUDA).

Two paths, chosen per sequence once per step:
- a sequence whose whole context is new this step (a fresh prefill) attends over its own
  keys with a causal `scaled_dot_product_attention`, without reading the cache;
- every other sequence (decode, chunked prefill, prefix-cache hits) has its keys gathered
  from the paged cache into a padded `[num_seqs, max_seq_len, ...]` batch and attends under
  a mask that encodes causality, sequence length and the optional sliding window.
Spans whose tokens attend both ways (`AttentionMetadata.bidirectional`, Gemma 3's images)
widen each of their query tokens' keys to the span's end, in the mask of either path; a
step without them builds exactly the masks above.
GQA is handled without copying keys: the query heads that share a key head are folded into
extra query rows. Simple and exact; the Triton backend is checked against it. Soft-capped
scores (Gemma 2), which SDPA cannot take, are computed as Hugging Face's eager attention
computes them.

Batch-invariant (`batch_invariant=True`): every query token attends on its own, over its
keys read back from the cache, with products whose shapes depend on its position alone; so
its output does not depend on the other tokens of the step, on how its prompt was chunked,
or on whether its prefix came from the cache (the padded groups and whole-prompt SDPA
calls above change shape with all of these, and CPU matmuls sum in another order at
another shape). One token at a time: slow, for the CPU and for checking.

An fp8 cache (`float8_e4m3fn`, scale 1.0) holds keys and values clamped to ±448 and rounded;
fresh prefills attend over those same rounded values, so both paths (and the Triton
backend, which reads everything from the cache) see the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .backend import AttentionBackend, AttentionMetadata


@dataclass
class _PagedPlan:
    """Padded layout of the sequences that read the cache."""

    token_index: torch.Tensor  # [num_paged_tokens] rows of the step's tokens in this group
    query_dest: torch.Tensor  # [num_paged_tokens] index into the padded [n * max_q]
    block_tables: torch.Tensor  # [n, num_blocks] int64
    num_seqs: int
    max_q: int
    max_k: int
    query_pos: torch.Tensor  # [n, max_q] position of each padded query
    key_pos: torch.Tensor  # [max_k]
    valid: torch.Tensor  # [n, 1, max_q, max_k] bool: causal and within the sequence
    masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None, group: int) -> torch.Tensor:
        """`[n, 1, group * max_q, max_k]` mask for query rows folded as (group, query)."""
        key = (sliding_window, group)
        mask = self.masks.get(key)
        if mask is None:
            mask = self.valid
            if sliding_window is not None:
                distance = self.query_pos[:, :, None] - self.key_pos[None, None, :]
                mask = mask & (distance < sliding_window)[:, None]
            mask = mask.clone()
            mask[..., 0] |= ~mask.any(-1)  # padding rows attend to key 0 to stay finite
            n, _, q, k = mask.shape
            mask = mask[:, :, None].expand(n, 1, group, q, k).reshape(n, 1, group * q, k)
            self.masks[key] = mask
        return mask


@dataclass
class _TorchPlan:
    fresh: list[tuple[int, int]]  # token ranges of fresh prefills
    paged: list[_PagedPlan]  # groups of similar length, to limit padding
    fresh_key_end: dict[int, torch.Tensor] = field(default_factory=dict)
    """First token of a fresh prefill with bidirectional spans → its tokens' key ends."""
    fresh_masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def fresh_mask(self, start: int, sliding_window: int | None) -> torch.Tensor | None:
        """`[len, len]` mask of the fresh prefill starting at token `start` (None: causal
        without spans, the plain path)."""
        key_end = self.fresh_key_end.get(start)
        if key_end is None:
            return None
        mask = self.fresh_masks.get((start, sliding_window))
        if mask is None:
            pos = torch.arange(len(key_end), device=key_end.device)
            mask = pos[None, :] < key_end[:, None]
            if sliding_window is not None:
                mask &= pos[:, None] - pos[None, :] < sliding_window
            self.fresh_masks[(start, sliding_window)] = mask
        return mask


# fp8 KV cache (scale 1.0): the largest e4m3 magnitude; larger keys / values saturate to it.
_FP8_KV_MAX = 448.0
# A paged group is split when a sequence is shorter than this fraction of the group's longest.
_GROUP_LENGTH_RATIO = 0.6
_MAX_GROUPS = 4


class TorchAttentionBackend(AttentionBackend):
    """Args:
    batch_invariant: Attend one query token at a time (see the module docstring)."""

    name = "torch"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def prepare(self, metadata: AttentionMetadata) -> None:
        if self.batch_invariant:
            return  # forward reads the host lists of the metadata itself
        qsl, seq_lens = metadata.query_start_loc_host, metadata.seq_lens_host
        fresh, paged = [], []
        for i in range(metadata.num_seqs):
            q_len = qsl[i + 1] - qsl[i]
            if q_len == seq_lens[i]:
                fresh.append((qsl[i], qsl[i + 1]))
            else:
                paged.append(i)
        groups: list[list[int]] = []
        if paged:
            paged.sort(key=lambda i: seq_lens[i], reverse=True)
            groups.append([])
            for i in paged:
                group = groups[-1]
                if (
                    group
                    and seq_lens[i] < _GROUP_LENGTH_RATIO * seq_lens[group[0]]
                    and len(groups) < _MAX_GROUPS
                ):
                    group = []
                    groups.append(group)
                group.append(i)
        plans = [self._paged_plan(metadata, g, qsl, seq_lens) for g in groups]
        plan = _TorchPlan(fresh, plans)
        spans = metadata.bidirectional
        if spans is not None:
            with_spans = {seq for seq, _, _ in spans.spans_host}
            for i in with_spans:
                if qsl[i + 1] - qsl[i] == seq_lens[i]:  # a fresh prefill
                    plan.fresh_key_end[qsl[i]] = spans.key_end[qsl[i] : qsl[i + 1]]
        metadata.backend_data = plan

    @staticmethod
    def _paged_plan(
        metadata: AttentionMetadata, seqs: list[int], qsl: list[int], seq_lens: list[int]
    ) -> _PagedPlan:
        device = metadata.query_start_loc.device
        q_lens = [qsl[i + 1] - qsl[i] for i in seqs]
        lens = [seq_lens[i] for i in seqs]
        max_q, max_k = max(q_lens), max(lens)
        token_index, query_dest = [], []
        for row, (i, q_len) in enumerate(zip(seqs, q_lens, strict=True)):
            token_index.extend(range(qsl[i], qsl[i] + q_len))
            query_dest.extend(range(row * max_q, row * max_q + q_len))
        n = len(seqs)
        lens_t = torch.tensor(lens, device=device)
        q_lens_t = torch.tensor(q_lens, device=device)
        query_pos = (lens_t - q_lens_t)[:, None] + torch.arange(max_q, device=device)[None, :]
        key_pos = torch.arange(max_k, device=device)
        token_index_t = torch.tensor(token_index, device=device)
        query_dest_t = torch.tensor(query_dest, device=device)
        key_end = query_pos + 1  # [n, max_q]
        if metadata.bidirectional is not None:  # wider within the spans
            key_end = (
                key_end.view(-1)
                .index_copy(0, query_dest_t, metadata.bidirectional.key_end.long()[token_index_t])
                .view(n, max_q)
            )
        valid = (key_pos[None, None, :] < key_end[:, :, None]) & (
            key_pos[None, None, :] < lens_t[:, None, None]
        )
        seq_index = torch.tensor(seqs, device=device)
        tables = metadata.block_tables.index_select(0, seq_index).long()
        return _PagedPlan(
            token_index=token_index_t,
            query_dest=query_dest_t,
            block_tables=tables,
            num_seqs=n,
            max_q=max_q,
            max_k=max_k,
            query_pos=query_pos,
            key_pos=key_pos,
            valid=valid[:, None],
        )

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
        plan: _TorchPlan = metadata.backend_data  # type: ignore[assignment]
        out = torch.empty_like(query)
        if kv_cache is None:  # cache-less forward (pooling): every sequence is fresh
            for start, end in plan.fresh:
                out[start:end] = _causal_attention(
                    query[start:end],
                    key[start:end],
                    value[start:end],
                    scale,
                    sliding_window,
                    softcap,
                )
            return out
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if key_cache.dtype == torch.float8_e4m3fn:  # attend over the values the cache holds
            key = _to_cache_dtype(key, key_cache.dtype)
            value = _to_cache_dtype(value, key_cache.dtype)
        write_paged_kv_ref(key, value, key_cache, value_cache, metadata.slot_mapping)
        if self.batch_invariant:
            return _token_by_token_attention(
                query, key_cache, value_cache, metadata, scale, sliding_window, softcap
            )
        key, value = key.to(query.dtype), value.to(query.dtype)
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        for start, end in plan.fresh:
            out[start:end] = _causal_attention(
                query[start:end],
                key[start:end],
                value[start:end],
                scale,
                sliding_window,
                softcap,
                plan.fresh_mask(start, sliding_window),
            )
        group = num_heads // num_kv_heads
        for paged in plan.paged:
            q = query.index_select(0, paged.token_index)
            out[paged.token_index] = _paged_attention(
                q, key_cache, value_cache, paged, scale, sliding_window, group, softcap
            )
        return out


def _token_by_token_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Each token over its own visible keys from the cache, in products shaped by its
    position alone (the batch-invariant path)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    qsl, seq_lens = metadata.query_start_loc_host, metadata.seq_lens_host
    spans = metadata.bidirectional
    key_end = spans.key_end_host if spans is not None else None
    out = torch.empty_like(query)
    for i in range(metadata.num_seqs):
        seq_len, start, end = seq_lens[i], qsl[i], qsl[i + 1]
        positions = torch.arange(seq_len, device=query.device)
        slots = metadata.block_tables[i].long()[positions // block_size] * block_size
        slots += positions % block_size
        keys = flat_k.index_select(0, slots).to(query.dtype)  # [seq_len, kv_heads, d]
        values = flat_v.index_select(0, slots).to(query.dtype)
        for token in range(start, end):
            pos = seq_len - (end - token)
            first = max(0, pos - sliding_window + 1) if sliding_window is not None else 0
            last = key_end[token] if key_end is not None else pos + 1
            k = keys[first:last].permute(1, 2, 0).contiguous()  # [kv_heads, d, n]
            v = values[first:last].transpose(0, 1).contiguous()  # [kv_heads, n, d]
            q = query[token].view(num_kv_heads, group, head_dim)
            scores = torch.bmm(q, k) * scale  # [kv_heads, group, n]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out[token] = torch.bmm(probs, v).view(-1, head_dim)
    return out


def _causal_attention(
    q: torch.Tensor,  # [len, num_heads, head_dim]
    k: torch.Tensor,  # [len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [len, num_kv_heads, head_dim]
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    span_mask: torch.Tensor | None = None,  # [len, len] bool, True: attend
) -> torch.Tensor:  # [len, num_heads, head_dim]
    """Causal (windowed) attention of one fresh sequence; `span_mask` replaces the causal
    mask where spans attend both ways."""
    length = q.shape[0]
    mask = span_mask
    if mask is None and sliding_window is not None and sliding_window < length:
        pos = torch.arange(length, device=q.device)
        distance = pos[:, None] - pos[None, :]
        mask = (distance >= 0) & (distance < sliding_window)
    group = q.shape[1] // k.shape[1]
    if group > 1:  # explicit copies keep SDPA on its fused path (enable_gqa falls back to math)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = _sdpa(
        q.transpose(0, 1)[None],  # [1, num_heads, len, head_dim]
        k.transpose(0, 1)[None].to(q.dtype),
        v.transpose(0, 1)[None].to(q.dtype),
        mask,
        scale,
        softcap,
    )  # [1, num_heads, len, head_dim]
    return out[0].transpose(0, 1)


def _paged_attention(
    q: torch.Tensor,  # [num_paged_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: _PagedPlan,
    scale: float,
    sliding_window: int | None,
    group: int,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_paged_tokens, num_heads, head_dim]
    n, max_q, max_k = plan.num_seqs, plan.max_q, plan.max_k
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_blocks = -(-max_k // block_size)
    flat_tables = plan.block_tables[:, :num_blocks].reshape(-1)
    # [n, kv_heads, max_k, head_dim]
    k = key_cache.index_select(0, flat_tables).view(n, -1, num_kv_heads, head_dim)[:, :max_k]
    v = value_cache.index_select(0, flat_tables).view(n, -1, num_kv_heads, head_dim)[:, :max_k]
    k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
    padded = q.new_zeros(n * max_q, num_kv_heads * group, head_dim)
    padded[plan.query_dest] = q
    # Fold the `group` query heads of each key head into query rows: [n, kv, group * max_q, d]
    folded = (
        padded.view(n, max_q, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(n, num_kv_heads, group * max_q, head_dim)
    )
    out = _sdpa(folded, k, v, plan.mask(sliding_window, group), scale, softcap)
    out = (
        out.view(n, num_kv_heads, group, max_q, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(n * max_q, num_kv_heads * group, head_dim)
    )
    return out[plan.query_dest]


def _sdpa(
    q: torch.Tensor,  # [batch, heads, q_len, head_dim]
    k: torch.Tensor,  # [batch, heads, k_len, head_dim]
    v: torch.Tensor,  # [batch, heads, k_len, head_dim]
    mask: torch.Tensor | None,  # [batch | 1, 1, q_len, k_len] bool, True: attend; None: causal
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [batch, heads, q_len, head_dim]
    """`scaled_dot_product_attention`; with `softcap`, the same attention written out with
    the scores capped, in Hugging Face's eager order (scores, cap and output in the query's
    dtype, the softmax in float32)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
        )
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [batch, heads, q_len, k_len]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:  # causal, the queries being the last q_len positions
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def write_paged_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store each token's key / value at its slot of the paged cache (cast to its dtype; fp8
    clamped to ±448 first)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    key, value = _to_cache_dtype(key, flat_k.dtype), _to_cache_dtype(value, flat_v.dtype)
    if flat_k.dtype == torch.float8_e4m3fn:  # CPU torch has no fp8 index_copy_: copy bytes
        flat_k, flat_v = flat_k.view(torch.uint8), flat_v.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def _to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache stores it (as `kernels.write_kv_cache` does): a cast, clamped to ±448
    first for fp8 (NaN kept). Local so that the CPU path does not import the Triton kernels."""
    if cache_dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-_FP8_KV_MAX, _FP8_KV_MAX)
    return x.to(cache_dtype)
