"""Paged attention for decode steps: one new query token per sequence.

Each program takes one (sequence, kv head, context split) and reads that split's keys and
values from the paged cache once for all the query heads that share the kv head (GQA: the
group's heads are the rows of one `tl.dot`). Long contexts are cut into `num_splits`
partitions processed in parallel (split-K / flash-decoding); each writes an unnormalised
partial result with its log-sum-exp, and a second kernel merges the partitions. With one
split the first kernel writes the output directly. Scores may be soft-capped
(`softcap * tanh(score / softcap)`, Gemma 2).

Partitions are sized from the host's `max_seq_len` by default; with `split_each_seq` each
sequence cuts its own context into `num_splits` parts instead (read from `seq_lens` on the
device), so that a launch sized for a bound (a CUDA graph captured for `max_model_len`)
still spreads short contexts over its programs.

The launch configuration (keys per tile, warps, pipeline stages, splits) has heuristic
defaults (`choose_launch`) that every call may override; docs/performance.md has the sweeps
behind them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import (
    NO_WINDOW,
    cdiv,
    check_num_stages,
    check_paged_attention,
    check_power_of_2,
    check_same_device,
    check_softcap,
    dot_dtype,
    next_power_of_2,
    num_sms,
)
from .paged_tile import load_paged_tile, online_softmax_tile, scale_scores
from .pdl import launch_options, wait_for_previous_kernel

__all__ = [
    "DecodeLaunch",
    "choose_launch",
    "choose_num_splits",
    "decode_attention",
    "decode_attention_ref",
]

# Keys per inner-loop tile by default (and the unit of a split). Independent of the cache
# block size: each key's block is looked up on its own, so any block size works.
_BLOCK_N = 64
# Triton's own defaults for CUDA, stated so that a launch names its whole configuration.
_NUM_WARPS = 4
_NUM_STAGES = 3
# A split shorter than this costs more in the merge than it saves.
_MIN_PARTITION = 256
_MAX_SPLITS = 64


@triton.jit(do_not_specialize=["sliding_window"])
def _decode_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks]
    seq_lens_ptr,  # [num_seqs]
    out_ptr,  # NUM_SPLITS == 1: [num_seqs, num_heads, head_dim], query dtype;
    # else [num_seqs, num_heads, NUM_SPLITS, head_dim] float32 (normalised per split)
    lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2-sum-exp2 of each split
    scale_log2,  # softmax scale * log2(e)
    softcap_log2,  # soft-cap * log2(e) (unused without HAS_SOFTCAP)
    sliding_window,  # keys at distance >= this are skipped (NO_WINDOW: none)
    partition_size,  # keys per split, a multiple of BLOCK_N (unused with PER_SEQ_SPLITS)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IDS_PER_TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PER_SEQ_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """IDS_PER_TILE == 0: each key looks its cache block up in the block table. Else tiles
    start on a multiple of `BLOCK_N // IDS_PER_TILE` keys (a power-of-two BLOCK_SIZE, or
    BLOCK_N when smaller), so that each tile is IDS_PER_TILE runs of keys that share one
    block: one table load per run."""
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The query sits at position seq_len - 1; a window keeps keys > seq_len - 1 - window.
    first_key = tl.maximum(seq_len - sliding_window, 0)
    if PER_SEQ_SPLITS:
        # This sequence's own context in NUM_SPLITS tile-aligned parts (the last ones may
        # be empty).
        per_split = tl.cdiv(seq_len - first_key, NUM_SPLITS)
        partition_size = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    start = first_key + split * partition_size
    # The last split takes whatever remains, so a sequence longer than the host's
    # max_seq_len (e.g. a replayed CUDA graph) is still attended in full, only less evenly.
    end = tl.where(split == NUM_SPLITS - 1, seq_len, tl.minimum(start + partition_size, seq_len))

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]
    table_ptr = block_tables_ptr + seq * stride_bt
    k_head_ptr = key_cache_ptr + kv_head * stride_kh
    v_head_ptr = value_cache_ptr + kv_head * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    KEYS_PER_ID: tl.constexpr = BLOCK_N // IDS_PER_TILE if IDS_PER_TILE else 1
    if IDS_PER_TILE:
        # Align down (keys before `start` are masked); an empty split stays empty, so every
        # tile still holds at least one valid key.
        loop_start = tl.where(start < end, start - start % KEYS_PER_ID, end)
    else:
        loop_start = start
    for n0 in range(loop_start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if IDS_PER_TILE:
            n_mask = (offs_n >= start) & (offs_n < end)
            run_starts = n0 + tl.arange(0, IDS_PER_TILE) * KEYS_PER_ID
            ids = tl.load(table_ptr + run_starts // BLOCK_SIZE, mask=run_starts < end, other=0)
            blocks = tl.reshape(
                tl.broadcast_to(ids[:, None], (IDS_PER_TILE, KEYS_PER_ID)), (BLOCK_N,)
            ).to(tl.int64)
        else:
            n_mask = offs_n < end
            blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_paged_tile(
            k_head_ptr, blocks, in_block, offs_d, stride_kb, stride_ks, kv_mask
        )  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee")
        s = scale_scores(s, scale_log2, softcap_log2, HAS_SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        v = load_paged_tile(
            v_head_ptr, blocks, in_block, offs_d, stride_vb, stride_vs, kv_mask
        )  # [BLOCK_N, BLOCK_D]
        # Every tile holds at least one valid key, so the new maxima are finite.
        m_i, l_i, acc = online_softmax_tile(s, v, m_i, l_i, acc, DOT_DTYPE)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # An empty split (past the end of a shorter sequence) stores l = 0: lse = -inf.
        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(
            out_ptr
            + seq * stride_ot
            + heads[:, None] * stride_oh
            + split * stride_os
            + offs_d[None, :],
            out,
            mask=out_mask,
        )
        tl.store(lse_ptr + seq * stride_lt + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32
    lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(
        lse_ptr + seq * stride_lt + head * stride_lh + offs_s, mask=s_mask, other=float("-inf")
    )  # [BLOCK_S]
    # Split 0 always holds keys (every sequence has at least one), so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    partial = tl.load(
        partial_ptr
        + seq * stride_pt
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(partial * weights[:, None], 0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """How many context partitions keep the device busy: enough programs to fill every SM
    twice, but no partition shorter than `_MIN_PARTITION` keys."""
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms(device)
    if programs >= target:
        return 1
    by_length = max_context_len // _MIN_PARTITION
    return max(1, min(cdiv(target, programs), by_length, _MAX_SPLITS))


class DecodeLaunch(NamedTuple):
    """The launch configuration of one `decode_attention` call."""

    block_n: int
    """Keys per inner-loop tile."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software-pipeline stages of the key loop."""
    num_splits: int
    """Context partitions: programs per (sequence, kv head)."""
    partition_size: int
    """Keys per partition, a multiple of `block_n` (the kernel sizes its own partitions
    from each sequence's length with `split_each_seq`)."""
    ids_per_tile: int
    """Block-table loads per key tile; 0: one per key."""


def choose_launch(
    dtype: torch.dtype,
    head_dim: int,
    num_seqs: int,
    num_kv_heads: int,
    block_size: int,
    context_len: int,
    device: torch.device,
    *,
    split_each_seq: bool = False,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    align_tiles_to_blocks: bool = False,
) -> DecodeLaunch:
    """The launch `decode_attention` makes: each None takes its heuristic default, the
    rest are validated (`ValueError` naming the bad value).

    Args:
        dtype: The query's dtype.
        head_dim: Channels per head.
        num_seqs: Sequences in the batch (>= 1).
        num_kv_heads: KV heads of the cache.
        block_size: Tokens per cache block.
        context_len: Longest context attended (`max_seq_len`, capped at the window).
        device: Where the kernel runs (its SM count sizes the default splits).
        split_each_seq: As in `decode_attention`.
        block_n: Keys per tile; None: 64, or 32 for float32 or heads wider than 128 (to
            keep the pipelined tiles in shared memory).
        num_warps: None: 4 (Triton's default).
        num_stages: None: 3 (Triton's default).
        num_splits: None: by occupancy (`choose_num_splits`).
        align_tiles_to_blocks: Start key tiles on cache-block boundaries and load each
            block's id once per tile instead of once per key (needs a power-of-two
            `block_size`).
    """
    if block_n is None:
        block_n = _BLOCK_N // 2 if dtype == torch.float32 or head_dim > 128 else _BLOCK_N
    check_power_of_2("block_n", block_n, 16, 256, "tl.dot needs at least 16 keys per tile")
    num_warps = check_power_of_2(
        "num_warps", _NUM_WARPS if num_warps is None else num_warps, 1, 16, "warps per program"
    )
    if num_stages is None:
        num_stages = _NUM_STAGES
    check_num_stages(num_stages)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, context_len, device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be an integer >= 1")
    ids_per_tile = 0
    if align_tiles_to_blocks:
        if block_size & (block_size - 1):
            raise ValueError(
                f"align_tiles_to_blocks needs a power-of-two cache block size, got "
                f"block_size={block_size}; pass align_tiles_to_blocks=False"
            )
        ids_per_tile = block_n // min(block_size, block_n)
    # Partitions stay multiples of the default tile too, so that a smaller tile splits the
    # context exactly as the default does.
    unit = max(_BLOCK_N, block_n)
    partition_size = cdiv(cdiv(context_len, num_splits), unit) * unit
    if not split_each_seq:  # else the launch keeps every split for the longest contexts
        num_splits = cdiv(context_len, partition_size)
    return DecodeLaunch(block_n, num_warps, num_stages, num_splits, partition_size, ids_per_tile)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    split_each_seq: bool = False,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    align_tiles_to_blocks: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    Args:
        query: `[num_seqs, num_heads, head_dim]`; row i is sequence i's token at position
            `seq_lens[i] - 1` (its key / value already written to the cache).
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.
        value_cache: Same shape and dtype as `key_cache`.
        block_tables: `[num_seqs, max_num_blocks]` int32 / int64 block ids per sequence.
        seq_lens: `[num_seqs]` int32 / int64 context lengths, each >= 1.
        scale: Softmax scale.
        max_seq_len: The longest context (from the host): sizes the splits. Longer
            sequences are still correct, with the excess all in the last split.
        sliding_window: Attend only to the last `sliding_window` positions.
        num_splits: Context partitions; None picks by occupancy (`choose_num_splits`).
        out: Optional `[num_seqs, num_heads, head_dim]` output buffer.
        split_each_seq: Cut each sequence's own context into the `num_splits` partitions
            instead of `max_seq_len`'s (for a `max_seq_len` that is only a bound, e.g. in a
            CUDA graph replayed for shorter contexts). Nothing else is read from the host.
        block_n: Keys per tile, a power of two in [16, 256]; None: the default
            (`choose_launch`).
        num_warps: Warps per program, a power of two in [1, 16]; None: 4.
        num_stages: Pipeline stages of the key loop, in [1, 8]; None: 3.
        align_tiles_to_blocks: See `choose_launch`.
        softcap: Soft-cap of the scaled scores (`softcap * tanh(score / softcap)`), > 0;
            None: none.

    Every launch configuration gives the same result up to float rounding.

    Returns:
        `[num_seqs, num_heads, head_dim]` in the query's dtype.
    """
    num_seqs = query.shape[0] if isinstance(query, torch.Tensor) and query.dim() else 0
    group = check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, num_seqs)
    num_heads, head_dim = query.shape[1], query.shape[2]
    device = check_same_device(
        _decode_kernel,
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
    )
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len} must be >= 1")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")
    check_softcap(softcap)
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {tuple(query.shape)} {query.dtype} with stride 1 in its last "
            f"dimension, got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    launch = choose_launch(
        query.dtype,
        head_dim,
        max(num_seqs, 1),  # an empty batch still has its arguments checked
        num_kv_heads,
        block_size,
        min(max_seq_len, sliding_window) if sliding_window else max_seq_len,
        device,
        split_each_seq=split_each_seq,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_splits=num_splits,
        align_tiles_to_blocks=align_tiles_to_blocks,
    )
    if num_seqs == 0:
        return out
    num_splits = launch.num_splits

    block_d = max(16, next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    if num_splits == 1:
        partial, lse = out, out  # lse is unused
        stride_p, stride_l = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        partial = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device
        )
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=device)
        stride_p, stride_l = partial.stride()[:3], lse.stride()[:2]
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        scale * math.log2(math.e),
        (softcap or 0.0) * math.log2(math.e),
        sliding_window or NO_WINDOW,
        launch.partition_size,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        *stride_p,
        *stride_l,
        GROUP=group,
        BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=launch.block_n,
        IDS_PER_TILE=launch.ids_per_tile,
        NUM_SPLITS=num_splits,
        PER_SEQ_SPLITS=split_each_seq,
        DOT_DTYPE=dot_dtype(query.dtype, _decode_kernel),
        HAS_SOFTCAP=softcap is not None,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **launch_options(_decode_kernel, device),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial,
            lse,
            out,
            *stride_p,
            *stride_l,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits),
            **launch_options(_merge_splits_kernel, device),
        )
    return out


def decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """`decode_attention` in plain PyTorch (float32 math), one sequence at a time."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i].long()[positions // block_size]
        slots = (blocks, positions % block_size)
        k = key_cache[slots].float().repeat_interleave(group, 1)  # [seq_len, num_heads, d]
        v = value_cache[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[i].float(), k) * scale  # [num_heads, seq_len]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if sliding_window is not None:
            scores[:, positions <= seq_len - 1 - sliding_window] = float("-inf")
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v).to(query.dtype)
    return out
