"""Rotary position embedding (GPT-NeoX "rotate half" layout) from a cos / sin table.

Every rope scaling the models support (linear, dynamic NTK, llama3, yarn and its attention
factor) is folded into the table `RotaryEmbedding` builds, so the kernel only looks up each
token's row and rotates: for channel pairs `(i, i + rotary_dim / 2)`,
`x1' = x1 cos - x2 sin`, `x2' = x2 cos + x1 sin`. Channels past `rotary_dim` pass through.
Math is in float32 with one rounding. `rotary_embedding` is pure: it returns new query / key
tensors. `rotary_embedding_into_cache` is the attention layer's step in one kernel: it
returns the rotated queries and writes the rotated keys and the values into the paged KV
cache by slot (as `write_kv_cache` would), with no rotated key tensor in between.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor, next_power_of_2
from .pdl import launch_options, wait_for_previous_kernel
from .write_kv_cache import store_heads

__all__ = [
    "RotaryOutput",
    "rotary_embedding",
    "rotary_embedding_into_cache",
    "rotary_embedding_into_cache_ref",
    "rotary_embedding_ref",
]


class RotaryOutput(NamedTuple):
    query: torch.Tensor
    """`[num_tokens, num_heads, head_dim]`, rotated."""
    key: torch.Tensor
    """`[num_tokens, num_kv_heads, head_dim]`, rotated."""


@triton.jit
def _token_cos_sin(
    cos_sin_ptr, positions_ptr, token, stride_cs, stride_cp, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """`[1, BLOCK_HALF]` float32 cosines and sines at the token's position. The table
    repeats its first half (cat([freqs, freqs])): one half serves both."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + pos * stride_cp + offs_c
    cos = tl.load(row, mask=offs_c < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + stride_cs, mask=offs_c < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """Channel pairs `(x1, x2)` rotated in float32 as every kernel here rotates them: each
    cross product rounded once, then one fused multiply-add, so that two kernels rotating
    the same values give the same bits (a compiler left to contract `x1 * cos - x2 * sin`
    on its own may fuse either product)."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rotate_heads(
    src_ptr,  # this token's [num_heads, head_dim] rows
    dst_ptr,
    stride_sh,
    stride_dh,
    cos,  # [1, BLOCK_HALF] float32
    sin,  # [1, BLOCK_HALF] float32
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_c = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_c < HALF)
    src = src_ptr + offs_h * stride_sh + offs_c
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + offs_h * stride_dh + offs_c
    out_ty = dst_ptr.dtype.element_ty
    y1, y2 = rotate_pair(x1, x2, cos, sin)
    tl.store(dst, y1.to(out_ty), mask=mask)
    tl.store(dst + HALF, y2.to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # [2, max_position, rotary_dim] float32
    query_out_ptr,  # [num_tokens, num_heads, head_dim]
    key_out_ptr,  # [num_tokens, num_kv_heads, head_dim]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_oqt,
    stride_oqh,
    stride_okt,
    stride_okh,
    stride_cs,  # between the cos and the sin table
    stride_cp,  # between positions
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _token_cos_sin(
        cos_sin_ptr, positions_ptr, token, stride_cs, stride_cp, HALF, BLOCK_HALF
    )
    _rotate_heads(
        query_ptr + token * stride_qt,
        query_out_ptr + token * stride_oqt,
        stride_qh,
        stride_oqh,
        cos,
        sin,
        NUM_HEADS,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        key_ptr + token * stride_kt,
        key_out_ptr + token * stride_okt,
        stride_kh,
        stride_okh,
        cos,
        sin,
        NUM_KV_HEADS,
        HALF,
        BLOCK_KV_H,
        BLOCK_HALF,
    )


@triton.jit
def _rotary_into_cache_kernel(
    positions_ptr,  # [num_tokens]
    slot_mapping_ptr,  # [num_tokens]; < 0: not written
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # [2, max_position, head_dim] float32
    query_out_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_oqt,
    stride_oqh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_cs,
    stride_cp,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    cos, sin = _token_cos_sin(
        cos_sin_ptr, positions_ptr, token, stride_cs, stride_cp, HALF, BLOCK_HALF
    )
    _rotate_heads(
        query_ptr + token * stride_qt,
        query_out_ptr + token * stride_oqt,
        stride_qh,
        stride_oqh,
        cos,
        sin,
        NUM_HEADS,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        _rotate_heads(
            key_ptr + token * stride_kt,
            key_cache_ptr + block * stride_kcb + offset * stride_kcs,
            stride_kh,
            stride_kch,
            cos,
            sin,
            NUM_KV_HEADS,
            HALF,
            BLOCK_KV_H,
            BLOCK_HALF,
        )
        store_heads(
            value_ptr + token * stride_vt,
            value_cache_ptr + block * stride_vcb + offset * stride_vcs,
            stride_vh,
            stride_vch,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_KV_H,
            BLOCK_D,
            False,  # IS_FP8: an fp8 cache takes write_kv_cache
            False,
        )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
) -> RotaryOutput:
    """Rotate the first `rotary_dim` channels of every query and key head by position.

    Args:
        positions: `[num_tokens]` int32 / int64 positions, each < `max_position`.
        query: `[num_tokens, num_heads, head_dim]`.
        key: `[num_tokens, num_kv_heads, head_dim]`, same dtype as `query`.
        cos_sin: `[2, max_position, rotary_dim]` float32: `cos_sin[0]` the cosines,
            `cos_sin[1]` the sines, each with its second half equal to its first.

    Returns:
        New contiguous query and key tensors.
    """
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = query.shape
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), shape={0: num_tokens, 2: head_dim})
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, shape={0: num_tokens})
    check_tensor("cos_sin", cos_sin, ndim=3, dtypes=(torch.float32,), shape={0: 2})
    rotary_dim = cos_sin.shape[2]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos_sin has rotary_dim={rotary_dim}; it must be even and <= head_dim={head_dim}"
        )
    check_same_device(_rotary_kernel, positions=positions, query=query, key=key, cos_sin=cos_sin)
    query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    if rotary_dim < head_dim:
        query_out[..., rotary_dim:] = query[..., rotary_dim:]
        key_out[..., rotary_dim:] = key[..., rotary_dim:]
    if num_tokens == 0:
        return RotaryOutput(query_out, key_out)
    num_kv_heads = key.shape[1]
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin,
        query_out,
        key_out,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        query_out.stride(0),
        query_out.stride(1),
        key_out.stride(0),
        key_out.stride(1),
        cos_sin.stride(0),
        cos_sin.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=rotary_dim // 2,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_KV_H=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(rotary_dim // 2),
        **launch_options(_rotary_kernel, query.device),
    )
    return RotaryOutput(query_out, key_out)


def rotary_embedding_into_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate every query and key head by position; write the keys and values into the
    cache at their slots; return the rotated queries.

    Args:
        positions: `[num_tokens]` int32 / int64 positions, each < `max_position`.
        query: `[num_tokens, num_heads, head_dim]`.
        key: `[num_tokens, num_kv_heads, head_dim]`, same dtype as `query`.
        value: Same shape and dtype as `key`.
        cos_sin: `[2, max_position, head_dim]` float32, as for `rotary_embedding` (the whole
            head rotates; partial rotary takes `rotary_embedding` then `write_kv_cache`).
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` in the query's dtype
            (an fp8 cache takes `write_kv_cache`).
        value_cache: Same shape and dtype as `key_cache`.
        slot_mapping: `[num_tokens]` int32 / int64 slots; negative entries are not written.

    Returns:
        A new contiguous `[num_tokens, num_heads, head_dim]` query tensor.
    """
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = query.shape
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), shape={0: num_tokens, 2: head_dim})
    check_tensor("value", value, ndim=3, dtypes=(query.dtype,), shape=dict(enumerate(key.shape)))
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, shape={0: num_tokens})
    check_tensor("cos_sin", cos_sin, ndim=3, dtypes=(torch.float32,), shape={0: 2})
    if cos_sin.shape[2] != head_dim:
        raise ValueError(
            f"cos_sin rotates {cos_sin.shape[2]} channels of heads of {head_dim}; partial "
            "rotary takes rotary_embedding, then write_kv_cache"
        )
    num_kv_heads = key.shape[1]
    check_tensor(
        "key_cache", key_cache, ndim=4, dtypes=(query.dtype,), shape={2: num_kv_heads, 3: head_dim}
    )
    check_tensor(
        "value_cache", value_cache, ndim=4, dtypes=(query.dtype,),
        shape=dict(enumerate(key_cache.shape)),
    )  # fmt: skip
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, shape={0: num_tokens})
    check_same_device(
        _rotary_into_cache_kernel,
        positions=positions, query=query, key=key, value=value, cos_sin=cos_sin,
        key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
    )  # fmt: skip
    query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return query_out
    _rotary_into_cache_kernel[(num_tokens,)](
        positions,
        slot_mapping,
        query,
        key,
        value,
        cos_sin,
        query_out,
        key_cache,
        value_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        query_out.stride(0),
        query_out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        cos_sin.stride(0),
        cos_sin.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_KV_H=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        BLOCK_D=next_power_of_2(head_dim),
        **launch_options(_rotary_into_cache_kernel, query.device),
    )
    return query_out


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [2, max_position, rotary_dim]
) -> RotaryOutput:
    """`rotary_embedding` in plain PyTorch (float32 math)."""
    table = cos_sin[:, positions.long()]  # [2, num_tokens, rotary_dim]
    cos, sin = table[0][:, None], table[1][:, None]  # [num_tokens, 1, rotary_dim]
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot = x[..., :rotary_dim].float()
        turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = x.clone()
        out[..., :rotary_dim] = (rot * cos + turned * sin).to(x.dtype)
        return out

    return RotaryOutput(rotate(query), rotate(key))


def rotary_embedding_into_cache_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rotary_embedding_into_cache` in plain PyTorch."""
    from .write_kv_cache import write_kv_cache_ref

    rotated = rotary_embedding_ref(positions, query, key, cos_sin)
    write_kv_cache_ref(rotated.key, value, key_cache, value_cache, slot_mapping)
    return rotated.query
