"""The mma.sync W4A16 form's epilogue for q|k|v heads (`w4a16_fused.py` launches it):
the finished sums rounded as `w4a16` stores them, the query and key heads rotated as
`rotary.rotate_pair` rotates them, the queries stored and the keys and values written into
the paged cache. Gluon, as the form is: it cannot call the `triton.jit` helpers."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

try:  # as in w4a16_mma.py
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover
    gluon = None

__all__ = ["RotaryCache", "epilogue_layout", "rotary_args", "rotate_into_cache_epilogue"]


class RotaryCache(NamedTuple):
    """Where the epilogue writes: the token's position and slot, the cos / sin table and the
    paged cache (`rotary_embedding_into_cache`'s arguments), and the query heads' count."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    num_heads: int


if gluon is not None:

    @gluon.jit
    def rotate_into_cache_epilogue(
        acc, n0, M, q_ptr, stride_qm, pos_ptr, slot_ptr, cos_sin_ptr, key_cache_ptr,
        value_cache_ptr, stride_cs, stride_cp, stride_kcb, stride_kcs, stride_kch,
        stride_vcb, stride_vcs, stride_vch, dtype: gl.constexpr, W: gl.constexpr,
        NTW: gl.constexpr, BLOCK_M: gl.constexpr, NUM_HEADS: gl.constexpr,
        NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, CACHE_BLOCK: gl.constexpr,
        layout: gl.constexpr,
    ):  # fmt: skip
        """The program's finished sums `acc` (`[16 W NTW, BLOCK_M]` float32, operand row
        `v` standing for output `n0 + 16 NTW w + 2 NTW g + 2 nt + h`, `w4a16_mma`) rounded,
        rotated and stored: queries to `q_ptr`, keys and values into the cache."""
        BLOCK_N: gl.constexpr = 16 * W * NTW
        HALF: gl.constexpr = HEAD_DIM // 2
        HEADS: gl.constexpr = BLOCK_N // HEAD_DIM
        y = acc.to(dtype).to(gl.float32)  # the product as w4a16 stores it
        # Operand rows (nt, w, h, g) to outputs (w, g, nt, h), then [head, half, c, m] with
        # both halves of a pair in one thread.
        y = gl.reshape(y, [NTW, W, 2, 8, BLOCK_M])
        y = gl.reshape(gl.permute(y, (1, 3, 0, 2, 4)), [HEADS, 2, HALF, BLOCK_M])
        y = gl.convert_layout(y, layout)
        x1, x2 = gl.split(gl.permute(y, (0, 2, 3, 1)))  # [HEADS, HALF, BLOCK_M] each
        hl: gl.constexpr = x1.type.layout
        hh = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(2, hl)))
        cc = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(2, hl)))
        mm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, hl)))
        head = gl.expand_dims(gl.expand_dims(n0 // HEAD_DIM + hh, 1), 2)
        c = gl.expand_dims(gl.expand_dims(cc, 0), 2)
        m = gl.expand_dims(gl.expand_dims(mm, 0), 1)
        row = m < M
        pos = gl.load(pos_ptr + m, mask=row, other=0).to(gl.int64)
        cos = gl.load(cos_sin_ptr + pos * stride_cp + c, mask=row, other=0.0)
        sin = gl.load(cos_sin_ptr + stride_cs + pos * stride_cp + c, mask=row, other=0.0)
        # rotary.rotate_pair: each cross product rounded once, then one fused multiply-add.
        r1 = gl.fma(x1, cos, -(x2 * sin))
        r2 = gl.fma(x2, cos, x1 * sin)
        is_value = head >= NUM_HEADS + NUM_KV_HEADS
        x1 = gl.where(is_value, x1, r1).to(dtype)
        x2 = gl.where(is_value, x2, r2).to(dtype)
        q = q_ptr + m * stride_qm + head * HEAD_DIM + c
        is_query = row & (head < NUM_HEADS)
        gl.store(q, x1, mask=is_query)
        gl.store(q + HALF, x2, mask=is_query)
        slot = gl.load(slot_ptr + m, mask=row, other=-1).to(gl.int64)
        cached = row & (slot >= 0)
        block = slot // CACHE_BLOCK
        offset = slot % CACHE_BLOCK
        is_key = cached & (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
        k = key_cache_ptr + block * stride_kcb + offset * stride_kcs
        k += (head - NUM_HEADS) * stride_kch + c
        gl.store(k, x1, mask=is_key)
        gl.store(k + HALF, x2, mask=is_key)
        is_val = cached & is_value
        v = value_cache_ptr + block * stride_vcb + offset * stride_vcs
        v += (head - NUM_HEADS - NUM_KV_HEADS) * stride_vch + c
        gl.store(v, x1, mask=is_val)
        gl.store(v + HALF, x2, mask=is_val)


def rotary_args(rotary: RotaryCache | None, unused: torch.Tensor) -> tuple:
    """The kernel's rotary pointers and strides (`unused` and zeros without)."""
    if rotary is None:
        return (unused,) * 5 + (0,) * 8
    k, v, cs = rotary.key_cache, rotary.value_cache, rotary.cos_sin
    return (
        rotary.positions, rotary.slot_mapping, cs, k, v, cs.stride(0), cs.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
    )  # fmt: skip


@functools.cache
def epilogue_layout(block_m: int, num_warps: int):
    """The epilogue's `[heads, 2, head_dim / 2, rows]`: both halves of a pair in one
    thread, the lanes over the rows, then channels; the warps over channels."""
    return gl.BlockedLayout(
        [1, 2, 1, 1], [1, 1, 32 // block_m, block_m], [1, 1, num_warps, 1], [1, 3, 2, 0]
    )
