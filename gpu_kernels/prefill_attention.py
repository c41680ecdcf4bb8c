"""Paged attention for prefill and mixed batches: variable-length queries over cached context.

Sequence `i` contributes query tokens `query_start_loc[i]:query_start_loc[i + 1]`, its last
`query_len` positions `[seq_len - query_len, seq_len)`; its keys and values, including the
new ones, are already in the paged cache. That covers fresh prefills (`query_len ==
seq_len`), prefix-cache hits and chunked prefills (a cached prefix before the queries) and
decode tokens (`query_len == 1`) in one launch.

Each program takes a tile of query tokens of one sequence and all the query heads of one kv
head: the tile's rows are (token, head-in-group) pairs, so keys and values are read once per
group (GQA). It streams the keys the tile can see (causal, optionally windowed) in tiles of
`BLOCK_N` with an online softmax (FlashAttention-2 style). Scores may be soft-capped
(`softcap * tanh(score / softcap)`, Gemma 2) before the mask.

Spans that attend both ways (Gemma 3's images): with `key_end`, each query token sees the
keys below its own key end (the end of its span, else its position + 1) instead of those up
to its position, still bounded by the window from below; a tile streams keys up to the
largest key end of its rows. Without `key_end` the kernel compiles to the causal one.

Key tiles start at multiples of `BLOCK_N` (a windowed tile's first one is aligned down),
and a key a row cannot see adds exact zeros to its sums: so each token's arithmetic
depends on its own position and keys, never on which tile, chunk or batch it came in. The
tiles depend on the model's shapes alone. That makes the kernel batch-invariant, which
the engine's `batch_invariant` mode runs every step on.

Fixed key splits (`fixed_split_size`, the batch-invariant mode's): the keys are cut at
multiples of the split size, counted from position 0. Each split's partial softmax (row
maxima, sums, unnormalised outputs) starts from scratch, and the partials are folded in
split order by one function (`merge_split`, explicit fma, a split without keys for a row
leaves the row unchanged). A split that a row sees no key of gives it an empty partial, so
a row's result is its own splits folded in order, whoever computed them. Two launches give
those bits: each query tile's program folds its splits as it goes (prefills, large
batches), or one program per (query tile, kv head, split) stores its raw float32 partial
and `merge_fixed_splits` folds them (few programs otherwise: decode at small
batches, long contexts). The split programs' grid depends on `max_seq_len`, a bound that a
CUDA graph fixes at `max_model_len`; programs of splits past a sequence's context exit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import (
    INDEX_DTYPES,
    NO_WINDOW,
    cdiv,
    check_num_stages,
    check_paged_attention,
    check_power_of_2,
    check_same_device,
    check_softcap,
    check_tensor,
    dot_dtype,
    next_power_of_2,
)
from .merge_fixed_splits import merge_fixed_splits
from .paged_tile import (
    NEG_BIG,
    load_paged_tile,
    merge_split,
    online_softmax_tile,
    scale_scores,
)
from .pdl import launch_options, wait_for_previous_kernel
from .prefill_splits import choose_split_programs

__all__ = [
    "FIXED_SPLIT_SIZE",
    "batch_invariant_tile",
    "prefill_attention",
    "prefill_attention_ref",
]

# Default tile: (token, head) rows and keys. 16-bit heads of 128 with a GQA group of 8 or
# less take taller, shorter tiles: faster for them, slower for heads of 64 (sweeps in
# docs/performance.md). float32 or wider heads halve the key tile (shared memory).
_BLOCK_M, _BLOCK_N = 64, 64
_TALL_BLOCK_M, _TALL_BLOCK_N = 128, 32
# The batch-invariant launch's pipeline depth (`batch_invariant_tile`).
_BI_NUM_STAGES = 2
FIXED_SPLIT_SIZE = 512
"""Keys per split of the batch-invariant mode (`fixed_split_size`): a multiple of every key
tile, fixed so that no row's arithmetic depends on its batch."""


@triton.jit
def _attend_key_range(
    q,  # [BLOCK_M, BLOCK_D] the tile's queries, DOT_DTYPE
    q_pos,  # [BLOCK_M] each row's position
    lo,  # first key, a multiple of BLOCK_N
    hi,  # one past the last key
    table_ptr,  # the sequence's row of the block table
    k_head_ptr,  # the key cache at this kv head
    v_head_ptr,  # the value cache at this kv head
    offs_d,
    d_mask,
    scale_log2,
    softcap_log2,
    sliding_window,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    q_key_end,  # [BLOCK_M] HAS_KEY_END: each row sees keys below this
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_END: tl.constexpr,
):
    """Online softmax of the tile's rows over keys `[lo, hi)`, from scratch: returns the
    base-2 row maxima `[BLOCK_M]` (`NEG_BIG` for a row that sees none of them), row sums
    `[BLOCK_M]` and unnormalised outputs `[BLOCK_M, BLOCK_D]`, all float32."""
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        blocks = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_paged_tile(
            k_head_ptr, blocks, in_block, offs_d, stride_kb, stride_ks, kv_mask
        )  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee")
        s = scale_scores(s, scale_log2, softcap_log2, HAS_SOFTCAP)
        distance = q_pos[:, None] - offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        if HAS_KEY_END:
            visible = offs_n[None, :] < q_key_end[:, None]
        else:
            visible = distance >= 0
        visible = visible & (distance < sliding_window) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        v = load_paged_tile(
            v_head_ptr, blocks, in_block, offs_d, stride_vb, stride_vs, kv_mask
        )  # [BLOCK_N, BLOCK_D]
        m_i, l_i, acc = online_softmax_tile(s, v, m_i, l_i, acc, DOT_DTYPE)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["sliding_window", "num_splits"])
def _prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    key_end_ptr,  # HAS_KEY_END: [num_tokens] each query token's key end
    out_ptr,  # [num_tokens, num_heads, head_dim] (unused with SPLIT_PROGRAMS)
    partial_ptr,  # SPLIT_PROGRAMS: [num_tokens, num_heads, num_splits, head_dim] float32
    max_sum_ptr,  # SPLIT_PROGRAMS: [2, num_tokens, num_heads, num_splits] float32
    scale_log2,  # softmax scale * log2(e)
    softcap_log2,  # soft-cap * log2(e) (unused without HAS_SOFTCAP)
    sliding_window,  # keys at distance >= this are skipped (NO_WINDOW: none)
    num_splits,  # SPLIT_PROGRAMS: key splits per sequence, the last one unbounded
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
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mx,  # from the maxima to the sums
    stride_mt,
    stride_mh,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    SPLIT_PROGRAMS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KEY_END: tl.constexpr,
    PDL: tl.constexpr,
):
    """SPLIT_SIZE == 0: one online softmax over all the keys. Else the keys are split at
    multiples of SPLIT_SIZE (a multiple of BLOCK_N); each split's partial softmax starts
    from scratch and the partials are folded in split order (`merge_split`): by this
    program, or with SPLIT_PROGRAMS by one program per split (grid axis 2 holds
    `kv_head * num_splits + split`), which stores its raw partial for
    `merge_fixed_splits` to fold."""
    wait_for_previous_kernel(PDL)
    # The last tiles of a sequence see the most keys: they start first, for a shorter tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    if SPLIT_PROGRAMS:
        kv_head = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
    else:
        kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = tile * TOKENS_PER_TILE
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # position of the first query token

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP  # [BLOCK_M] token index within the sequence's queries
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_mask = (rows < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        query_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + tok  # [BLOCK_M]

    # Keys visible to some row of the tile: up to its last token, back to its first token's
    # window.
    end = context_len + tl.minimum(first_tok + TOKENS_PER_TILE, q_len)
    start = tl.maximum(context_len + first_tok - sliding_window + 1, 0)
    start -= start % BLOCK_N  # the same key tiles for every token (see the module docstring)
    if HAS_KEY_END:  # and past it, to the end of the tile's spans
        q_key_end = tl.load(key_end_ptr + q_rows, mask=row_mask, other=0)  # [BLOCK_M]
        end = tl.maximum(end, tl.max(q_key_end, 0))
    else:
        q_key_end = q_pos + 1
    table_ptr = block_tables_ptr + seq * stride_bt
    k_head_ptr = key_cache_ptr + kv_head * stride_kh
    v_head_ptr = value_cache_ptr + kv_head * stride_vh
    out_mask = row_mask[:, None] & d_mask[None, :]

    if SPLIT_PROGRAMS:
        lo = tl.maximum(start, split * SPLIT_SIZE)
        # The last split takes whatever lies past the bound the launch was sized for.
        hi = tl.where(split == num_splits - 1, end, tl.minimum(end, (split + 1) * SPLIT_SIZE))
        # Every split a row of the tile sees keys in is non-empty here; the merge reads no
        # other.
        if lo < hi:
            m_i, l_i, acc = _attend_key_range(
                q, q_pos, lo, hi, table_ptr, k_head_ptr, v_head_ptr, offs_d, d_mask,
                scale_log2, softcap_log2, sliding_window, stride_kb, stride_ks, stride_vb,
                stride_vs, q_key_end, BLOCK_M, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_DTYPE,
                HAS_SOFTCAP, HAS_KEY_END,
            )  # fmt: skip
            at = q_rows * stride_mt + heads * stride_mh + split  # [BLOCK_M]
            tl.store(max_sum_ptr + at, m_i, mask=row_mask)
            tl.store(max_sum_ptr + stride_mx + at, l_i, mask=row_mask)
            tl.store(
                partial_ptr
                + q_rows[:, None] * stride_pt
                + heads[:, None] * stride_ph
                + split * stride_ps
                + offs_d[None, :],
                acc,
                mask=out_mask,
            )
    else:
        if SPLIT_SIZE == 0:
            m_i, l_i, acc = _attend_key_range(
                q, q_pos, start, end, table_ptr, k_head_ptr, v_head_ptr, offs_d, d_mask,
                scale_log2, softcap_log2, sliding_window, stride_kb, stride_ks, stride_vb,
                stride_vs, q_key_end, BLOCK_M, BLOCK_D, BLOCK_SIZE, BLOCK_N, DOT_DTYPE,
                HAS_SOFTCAP, HAS_KEY_END,
            )  # fmt: skip
        else:
            m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for split_start in range(start - start % SPLIT_SIZE, end, SPLIT_SIZE):
                m_s, l_s, acc_s = _attend_key_range(
                    q, q_pos, tl.maximum(start, split_start),
                    tl.minimum(end, split_start + SPLIT_SIZE), table_ptr, k_head_ptr,
                    v_head_ptr, offs_d, d_mask, scale_log2, softcap_log2, sliding_window,
                    stride_kb, stride_ks, stride_vb, stride_vs, q_key_end, BLOCK_M, BLOCK_D,
                    BLOCK_SIZE, BLOCK_N, DOT_DTYPE, HAS_SOFTCAP, HAS_KEY_END,
                )  # fmt: skip
                m_i, l_i, acc = merge_split(m_i, l_i, acc, m_s, l_s, acc_s)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    fixed_split_size: int | None = None,
    max_seq_len: int | None = None,
    split_programs: bool | None = None,
    key_end: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context (both
    ways within spans, with `key_end`).

    Args:
        query: `[num_tokens, num_heads, head_dim]`, the sequences' query tokens back to back.
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, already holding this
            step's keys.
        value_cache: Same shape and dtype as `key_cache`.
        block_tables: `[num_seqs, max_num_blocks]` int32 / int64 block ids per sequence.
        seq_lens: `[num_seqs]` int32 / int64 context lengths after this step, each >= the
            sequence's query length.
        query_start_loc: `[num_seqs + 1]` int32 / int64 cumulative query lengths, starting
            at 0 and ending at `num_tokens`.
        scale: Softmax scale.
        max_query_len: An upper bound of the query lengths (from the host: sizes the grid).
        sliding_window: Attend only to the last `sliding_window` positions (self included).
        out: Optional `[num_tokens, num_heads, head_dim]` output buffer.
        softcap: Soft-cap of the scaled scores (`softcap * tanh(score / softcap)`), > 0;
            None: none.
        fixed_split_size: Split every context at multiples of this many keys (a multiple
            of the key tile; `FIXED_SPLIT_SIZE` in the batch-invariant mode), attend each
            split from scratch and fold the splits in order (see the module docstring).
            None: one pass over the keys.
        max_seq_len: An upper bound of `seq_lens` (from the host): sizes the grid of split
            programs. Longer contexts are still attended in full, their excess in the last
            split, without the bitwise guarantee. None: no split programs.
        split_programs: With `fixed_split_size`, attend each split in its own program
            and fold them in a second kernel (more programs for few, long contexts), or
            fold them in the program of the query tile: the same bits either way. None:
            split programs when the step's query tiles alone would leave most SMs idle
            (needs `max_seq_len`). Never with `key_end`.
        key_end: `[num_tokens]` int32 / int64: query token t sees the keys at positions
            below `key_end[t]` (>= its position + 1, <= its sequence's length), back to
            its window: the end of its span where tokens attend both ways. None: causal.
        block_m, block_n, num_warps, num_stages: Launch overrides (None: the defaults):
            (token, head) rows per tile (a power of two >= 16 and >= the GQA group), keys
            per tile (a power of two >= 16), warps, pipeline stages.

    Returns:
        `[num_tokens, num_heads, head_dim]` in the query's dtype.
    """
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() else 0
    group = check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, num_seqs)
    num_tokens, head_dim = query.shape[0], query.shape[2]
    check_tensor(
        "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, shape={0: num_seqs + 1}
    )
    check_same_device(
        _prefill_kernel,
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    if max_query_len < 1 and num_tokens:
        raise ValueError(f"max_query_len={max_query_len} must be >= 1")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")
    check_softcap(softcap)
    if key_end is not None:
        check_tensor("key_end", key_end, ndim=1, dtypes=INDEX_DTYPES, shape={0: num_tokens})
        check_same_device(_prefill_kernel, query=query, key_end=key_end)
        if split_programs:
            raise ValueError(
                "split_programs=True cannot take key_end (its merge assumes causal rows); "
                "pass split_programs=None"
            )
        split_programs = False
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {tuple(query.shape)} {query.dtype} with stride 1 in its last "
            f"dimension, got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_kv_heads = key_cache.shape[2]
    # Rows of a tile are (token, head) pairs: at least one token's heads.
    tall = query.dtype != torch.float32 and head_dim == 128 and group <= 8
    if block_m is None:
        block_m = max(_TALL_BLOCK_M if tall else _BLOCK_M, next_power_of_2(group))
    check_power_of_2("block_m", block_m, max(16, group), 512, "(token, head) rows per tile")
    tokens_per_tile = block_m // group
    if block_n is None:
        wide = query.dtype == torch.float32 or head_dim > 128
        block_n = _TALL_BLOCK_N if tall else _BLOCK_N // 2 if wide else _BLOCK_N
    check_power_of_2("block_n", block_n, 16, 256, "keys per tile")
    launch = {}
    if num_warps is not None:
        launch["num_warps"] = check_power_of_2("num_warps", num_warps, 1, 16, "warps per tile")
    if num_stages is not None:
        launch["num_stages"] = check_num_stages(num_stages)
    device = query.device
    num_tiles = cdiv(max_query_len, tokens_per_tile)
    num_splits = choose_split_programs(
        fixed_split_size, block_n, max_seq_len, split_programs, num_tiles * num_seqs * num_kv_heads,
        num_kv_heads, num_tokens * query.shape[1] * (head_dim + 2) * 4, device,
    )  # fmt: skip
    if num_splits:
        partial = torch.empty(
            num_tokens, query.shape[1], num_splits, head_dim, dtype=torch.float32, device=device
        )
        max_sum = torch.empty(
            2, num_tokens, query.shape[1], num_splits, dtype=torch.float32, device=device
        )
        split_strides = (*partial.stride()[:3], *max_sum.stride()[:3])
        grid = (num_tiles, num_seqs, num_kv_heads * num_splits)
    else:
        partial, max_sum, split_strides = out, out, (0,) * 6
        grid = (num_tiles, num_seqs, num_kv_heads)
    block_d = max(16, next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        key_end if key_end is not None else query_start_loc,
        out,
        partial,
        max_sum,
        scale * math.log2(math.e),
        (softcap or 0.0) * math.log2(math.e),
        sliding_window or NO_WINDOW,
        max(num_splits, 1),
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *split_strides,
        GROUP=group,
        TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_N=block_n,
        SPLIT_SIZE=fixed_split_size or 0,
        SPLIT_PROGRAMS=bool(num_splits),
        DOT_DTYPE=dot_dtype(query.dtype, _prefill_kernel),
        HAS_SOFTCAP=softcap is not None,
        HAS_KEY_END=key_end is not None,
        **launch,
        **launch_options(_prefill_kernel, device),
    )
    if num_splits:
        merge_fixed_splits(
            partial, max_sum, seq_lens, query_start_loc, fixed_split_size, num_kv_heads, out,
            sliding_window,
        )  # fmt: skip
    return out


def batch_invariant_tile(dtype: torch.dtype, head_dim: int, group: int) -> dict[str, int]:
    """The launch the batch-invariant mode runs every step with (`block_m`, `block_n`,
    `num_stages`): one token's GQA group padded to 16 rows or more, the decode kernel's
    key tile, a two-stage pipeline.

    Every step of that mode runs this kernel, decode steps included, so its query tile is
    sized for them: a decode token fills `group` of the tile's rows. The default tall tile
    (128 rows) would leave all but `group` of them idle on every decode step; prefill
    steps instead read each key tile for fewer query rows, which costs little beside their
    matmuls. Two stages rather than three: on the H200 (`tune_prefill_attention.py
    --batch-invariant`) 11 % faster at a W1 decode step and 27 % on a W1 prefill chunk, as
    fast at W3's. The launch depends on the model's shapes alone."""
    wide = dtype == torch.float32 or head_dim > 128
    return {
        "block_m": max(16, next_power_of_2(group)),
        "block_n": _BLOCK_N // 2 if wide else _BLOCK_N,
        "num_stages": _BI_NUM_STAGES,
    }


def prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    key_end: torch.Tensor | None = None,  # [num_tokens]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`prefill_attention` in plain PyTorch (float32 math), one sequence at a time."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i].long()[positions // block_size]
        slots = (blocks, positions % block_size)
        k = key_cache[slots].float().repeat_interleave(group, 1)  # [seq_len, num_heads, d]
        v = value_cache[slots].float().repeat_interleave(group, 1)
        q = query[start:end].float()  # [q_len, num_heads, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = positions[seq_len - (end - start) :]
        distance = q_pos[:, None] - positions[None, :]  # [q_len, seq_len]
        visible = distance >= 0
        if key_end is not None:
            visible = positions[None, :] < key_end[start:end, None].to(positions.device)
        if sliding_window is not None:
            visible &= distance < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
