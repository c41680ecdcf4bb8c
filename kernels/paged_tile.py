"""Device functions the paged attention kernels share (inlined into them by Triton): the
load of one tile of keys or values from the paged cache, and the online-softmax update of
one tile of scores.
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
