"""Device functions the paged attention kernels share (inlined into them by Triton): the
load of one tile of keys or values from the paged cache, the scaling (and optional
soft-capping) of one tile of scores, the online-softmax update of one tile of scores, and
the fold of one key split's partial softmax into a running one.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_BIG = tl.constexpr(-1.0e30)
"""Below any real scaled score, yet finite: a row with no visible key in a tile keeps
m = NEG_BIG, and exp2(-inf - NEG_BIG) = 0 instead of exp2(-inf + inf) = nan."""


@triton.jit
def load_paged_tile(head_ptr, blocks, in_block, offs_d, stride_block, stride_slot, mask):
    """`[BLOCK_N, BLOCK_D]` keys (or values) of one kv head: key n of the tile sits in cache
    block `blocks[n]` at slot `in_block[n]`; masked entries read 0."""
    return tl.load(
        head_ptr
        + blocks[:, None] * stride_block
        + in_block[:, None] * stride_slot
        + offs_d[None, :],
        mask=mask,
        other=0.0,
    )


@triton.jit
def scale_scores(s, scale_log2, softcap_log2, HAS_SOFTCAP: tl.constexpr):
    """Raw dot products `s` → base-2 softmax scores: `s * scale * log2(e)`, or with
    soft-capping `softcap * tanh(s * scale / softcap) * log2(e)` (Gemma 2's attention-logit
    cap). `scale_log2` is `scale * log2(e)` and `softcap_log2` is `softcap * log2(e)`.
    tanh(x) is `2 * sigmoid(2x) - 1`: exact in float32 to a few ulps of 1, and it saturates
    to ±1 without overflow."""
    if HAS_SOFTCAP:
        return (2.0 * tl.sigmoid(s * (2.0 * scale_log2 / softcap_log2)) - 1.0) * softcap_log2
    return s * scale_log2


@triton.jit
def online_softmax_tile(s, v, m_i, l_i, acc, DOT_DTYPE: tl.constexpr):
    """Fold one tile into the running softmax: `s` `[rows, BLOCK_N]` base-2 scores (-inf
    where masked), `v` the tile's values `[BLOCK_N, BLOCK_D]`; returns the new row maxima,
    row sums and unnormalised outputs `(m_i, l_i, acc)`."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def merge_split(m_i, l_i, acc, m_s, l_s, acc_s):
    """Fold one key split's partial softmax into the running one, row by row: `(m_s, l_s,
    acc_s)` are the split's base-2 row maxima `[rows]`, row sums `[rows]` and unnormalised
    outputs `[rows, BLOCK_D]` (from `online_softmax_tile` over the split's keys, started
    from a row maximum below every score, a zero sum and zero outputs); returns the new
    `(m_i, l_i, acc)`.

    A row the split has no key for (`l_s == 0`) is left exactly as it was, so folding a
    row's splits gives the same bits whichever empty splits surround them. The
    multiply-adds are explicit `fma`s: the compiler has nothing left to contract, so every
    kernel that folds with this function rounds alike."""
    m_new = tl.maximum(m_i, m_s)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(m_s - m_new)
    has_keys = l_s > 0
    l_new = tl.where(has_keys, tl.fma(l_i, alpha, l_s * beta), l_i)
    acc_new = tl.fma(acc, alpha[:, None], acc_s * beta[:, None])
    acc_new = tl.where(has_keys[:, None], acc_new, acc)
    return tl.where(has_keys, m_new, m_i), l_new, acc_new
