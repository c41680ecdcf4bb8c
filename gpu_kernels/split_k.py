"""The end of a kernel whose output tiles are summed over K by several programs (split-K),
as a device function both W4A16 kernels (`w4a16.py`, `w4a16_gemv.py`) inline.

Each program of a tile stores its float32 partial sum to a workspace and bumps the tile's
counter (acquire-release); the last to arrive adds the partials in split order (the same sum
whichever finished last), stores the output and resets the counter, so the counters stay
zero between calls and the kernel stays one launch (CUDA graphs replay it as is).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["store_split_k"]


@triton.jit
def store_split_k(
    acc,  # this program's float32 sums of its outputs (any shape)
    y_ptrs,  # where those outputs go, same shape
    offs,  # int64 flat indices `m * N + n` of those outputs in an [M, N] matrix, same shape
    mask,  # which of them exist, same shape
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums (SPLIT_K > 1)
    lock_ptr,  # int32 counters, one per output tile, zero between calls (SPLIT_K > 1)
    tile,  # this program's output tile: its counter
    pid_k,  # this program's share of K, 0 .. SPLIT_K - 1
    M,
    N,
    SPLIT_K: tl.constexpr,
):
    """Store `acc` to the output, or, when K is split, the sum of the tile's partials in
    split order once every program of the tile has stored its own."""
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)
    else:
        split_stride = tl.cast(M, tl.int64) * N
        parts = part_ptr + offs  # split 0's partials of these outputs
        tl.store(parts + pid_k * split_stride, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the counter is bumped
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last program of the tile: add the partials in order
            total = tl.zeros_like(acc)
            for _ in tl.static_range(SPLIT_K):
                total += tl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
                parts += split_stride
            tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed")
