"""Device functions the paged attention kernels share (inlined into them by Triton): the
load of one tile of keys or values from the paged cache, the scaling (and optional
soft-capping) of one tile of scores, and the online-softmax update of one tile of scores.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
