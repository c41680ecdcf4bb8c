"""The fold of fixed key splits: the second kernel of `prefill_attention`'s split programs.

With `fixed_split_size`, `prefill_attention` may attend each split of the keys (positions
`[s * split_size, (s + 1) * split_size)`) in its own program, which stores the split's raw
partial softmax per (token, head): its base-2 row maximum, its row sum and its
unnormalised output, in float32. This kernel folds, for each query token, the partials of
the splits it sees keys in, in split order, with `paged_tile.merge_split`: the function
and order the query tile's own program uses when it folds its splits itself, so the two
launches give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INDEX_DTYPES, NO_WINDOW, check_same_device, check_tensor, next_power_of_2
from .paged_tile import NEG_BIG, merge_split
from .pdl import launch_options, wait_for_previous_kernel

__all__ = ["merge_fixed_splits", "merge_fixed_splits_ref"]

# Splits whose partials are loaded together (unrolled), ahead of their folds.
_MERGE_CHUNK = 4


@triton.jit(do_not_specialize=["sliding_window", "num_splits"])
def _merge_fixed_splits_kernel(
    partial_ptr,  # [num_tokens, num_heads, num_splits, head_dim] float32
    max_sum_ptr,  # [2, num_tokens, num_heads, num_splits] float32
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    sliding_window,
    num_splits,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mx,
    stride_mt,
    stride_mh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (sequence, kv head): for each query token, folds the partials of the
    splits it sees keys in, in split order, with the same `merge_split` as `_prefill_kernel`
    (loads of MERGE_CHUNK splits are unrolled together; splits past the token's last one
    load as empty and leave it unchanged)."""
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    for tok in range(0, q_len):
        pos = seq_len - q_len + tok
        first = tl.maximum(pos - sliding_window + 1, 0) // SPLIT_SIZE
        last = tl.minimum(pos // SPLIT_SIZE, num_splits - 1)
        row = (q_start + tok).to(tl.int64)
        m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for chunk in range(first, last + 1, MERGE_CHUNK):
            for j in tl.static_range(MERGE_CHUNK):
                split = chunk + j
                g_ok = g_mask & (split <= last)
                at = row * stride_mt + heads * stride_mh + split  # [BLOCK_G]
                m_s = tl.load(max_sum_ptr + at, mask=g_ok, other=NEG_BIG)
                l_s = tl.load(max_sum_ptr + stride_mx + at, mask=g_ok, other=0.0)
                acc_s = tl.load(
                    partial_ptr
                    + row * stride_pt
                    + heads[:, None] * stride_ph
                    + split * stride_ps
                    + offs_d[None, :],
                    mask=g_ok[:, None] & d_mask[None, :],
                    other=0.0,
                )  # [BLOCK_G, BLOCK_D]
                m_i, l_i, acc = merge_split(m_i, l_i, acc, m_s, l_s, acc_s)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


def merge_fixed_splits(
    partial: torch.Tensor,
    max_sum: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    split_size: int,
    num_kv_heads: int,
    out: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Fold each query token's split partials into its attention output.

    Args:
        partial: `[num_tokens, num_heads, num_splits, head_dim]` float32 unnormalised
            outputs per split.
        max_sum: `[2, num_tokens, num_heads, num_splits]` float32: per split, the base-2
            row maxima (`[0]`) and row sums (`[1]`). Only the splits a token sees keys in
            are read; the last split holds every key past the others.
        seq_lens: `[num_seqs]` int32 / int64 context lengths.
        query_start_loc: `[num_seqs + 1]` int32 / int64 cumulative query lengths.
        split_size: Keys per split.
        num_kv_heads: KV heads (the program's heads are one kv head's group).
        out: `[num_tokens, num_heads, head_dim]`, written in its dtype.
        sliding_window: Attend only to the last `sliding_window` positions (self included).

    Returns:
        `out`.
    """
    check_tensor("partial", partial, ndim=4, dtypes=(torch.float32,))
    num_tokens, num_heads, num_splits, head_dim = partial.shape
    check_tensor("max_sum", max_sum, ndim=4, dtypes=(torch.float32,))
    if tuple(max_sum.shape) != (2, num_tokens, num_heads, num_splits):
        raise ValueError(
            f"max_sum has shape {tuple(max_sum.shape)}; expected "
            f"{(2, num_tokens, num_heads, num_splits)} from partial's"
        )
    check_tensor("out", out, ndim=3, shape={0: num_tokens, 1: num_heads, 2: head_dim})
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() else 0
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(
        "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, shape={0: num_seqs + 1}
    )
    device = check_same_device(
        _merge_fixed_splits_kernel,
        partial=partial,
        max_sum=max_sum,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        out=out,
    )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    if split_size < 1:
        raise ValueError(f"split_size={split_size} must be >= 1")
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    _merge_fixed_splits_kernel[(num_seqs, num_kv_heads)](
        partial,
        max_sum,
        seq_lens,
        query_start_loc,
        out,
        sliding_window or NO_WINDOW,
        num_splits,
        *partial.stride()[:3],
        *max_sum.stride()[:3],
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=next_power_of_2(group),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        SPLIT_SIZE=split_size,
        MERGE_CHUNK=_MERGE_CHUNK,
        **launch_options(_merge_fixed_splits_kernel, device),
    )
    return out


def merge_fixed_splits_ref(
    partial: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_dim] float32
    max_sum: torch.Tensor,  # [2, num_tokens, num_heads, num_splits] float32
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    split_size: int,
    out_dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`merge_fixed_splits` in plain PyTorch (float64 softmax weights), one token at a
    time: each token's splits weighted by `exp2(max - overall max)`."""
    num_splits = partial.shape[2]
    out = torch.empty(partial.shape[0], partial.shape[1], partial.shape[3], dtype=out_dtype)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        for row in range(qsl[i], qsl[i + 1]):
            pos = seq_len - (qsl[i + 1] - qsl[i]) + row - qsl[i]
            first = max(pos - sliding_window + 1, 0) // split_size if sliding_window else 0
            splits = slice(first, min(pos // split_size, num_splits - 1) + 1)
            maxima = max_sum[0, row, :, splits].double()  # [num_heads, splits]
            weights = torch.exp2(maxima - maxima.amax(1, keepdim=True))
            total = (weights * max_sum[1, row, :, splits].double()).sum(1)  # [num_heads]
            acc = (weights[..., None] * partial[row, :, splits].double()).sum(1)
            out[row] = (acc / total[:, None]).to(out_dtype)
    return out
