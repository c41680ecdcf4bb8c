"""Store a step's new keys and values into the paged KV cache, by slot.

The cache layout is the model runner's: `[num_blocks, block_size, num_kv_heads, head_dim]`
per tensor (keys and values are `kv_cache[0]` and `kv_cache[1]`), and token `t` goes to
slot `slot_mapping[t] = block * block_size + offset`. A negative slot means "padding, do not
write" (padded batches, e.g. for CUDA graphs).

An fp8 (e4m3) cache has scale 1.0, as vLLM's when a checkpoint carries no KV scales: values
are clamped to ±448 (so overflow saturates instead of turning into NaN) and rounded to
nearest even, in the hardware's conversion on the GPU and in integer arithmetic under
Triton's CPU interpreter, whose own fp8 cast rounds differently (`quant_fp8._e4m3fn_bits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    INDEX_DTYPES,
    check_cache_dtype_supported,
    check_same_device,
    check_tensor,
    is_interpreted,
    next_power_of_2,
)
from .pdl import launch_options, wait_for_previous_kernel
from .quant_fp8 import _e4m3fn_bits

__all__ = ["to_cache_dtype", "write_kv_cache", "write_kv_cache_ref"]


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32 / int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    SOFTWARE_FP8_CAST: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    store_heads(
        key_ptr + token * stride_kt,
        key_cache_ptr + block * stride_kcb + offset * stride_kcs,
        stride_kh,
        stride_kch,
        NUM_KV_HEADS,
        HEAD_DIM,
        BLOCK_H,
        BLOCK_D,
        IS_FP8,
        SOFTWARE_FP8_CAST,
    )
    store_heads(
        value_ptr + token * stride_vt,
        value_cache_ptr + block * stride_vcb + offset * stride_vcs,
        stride_vh,
        stride_vch,
        NUM_KV_HEADS,
        HEAD_DIM,
        BLOCK_H,
        BLOCK_D,
        IS_FP8,
        SOFTWARE_FP8_CAST,
    )


@triton.jit
def store_heads(
    src_ptr,  # one token's [num_heads, head_dim] rows, heads `stride_sh` apart
    dst_ptr,  # its slot in a cache, heads `stride_dh` apart
    stride_sh,
    stride_dh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    SOFTWARE_FP8_CAST: tl.constexpr,
):
    """Copy one token's heads into a cache slot, in the cache's dtype (`_to_cache`)."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HEAD_DIM)
    x = tl.load(src_ptr + offs_h * stride_sh + offs_d, mask=mask)
    x = _to_cache(x, dst_ptr.dtype.element_ty, IS_FP8, SOFTWARE_FP8_CAST)
    tl.store(dst_ptr + offs_h * stride_dh + offs_d, x, mask=mask)


@triton.jit
def _to_cache(x, CACHE_DTYPE: tl.constexpr, IS_FP8: tl.constexpr, SOFTWARE_FP8_CAST: tl.constexpr):
    """`x` in the cache's dtype; fp8: clamped to ±448 (NaN kept), then rounded."""
    if IS_FP8:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        if SOFTWARE_FP8_CAST:
            x = _e4m3fn_bits(x).to(tl.uint8).to(CACHE_DTYPE, bitcast=True)
    return x.to(CACHE_DTYPE)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key[t]` / `value[t]` to slot `slot_mapping[t]` of the caches, in place.

    Args:
        key: `[num_tokens, num_kv_heads, head_dim]`, any float dtype (cast to the cache's).
        value: Same shape as `key`.
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, a float dtype or
            float8_e4m3fn (values clamped to ±448, scale 1.0).
        value_cache: Same shape and dtype as `key_cache`.
        slot_mapping: `[num_tokens]` int32 / int64; negative entries are skipped.
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, shape=dict(enumerate(key.shape)))
    check_tensor(
        "key_cache", key_cache, ndim=4, dtypes=CACHE_DTYPES, shape={2: num_kv_heads, 3: head_dim}
    )
    check_cache_dtype_supported(key_cache)
    check_tensor("value_cache", value_cache, ndim=4, shape=dict(enumerate(key_cache.shape)))
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache has dtype {value_cache.dtype}, key_cache {key_cache.dtype}; "
            "they must match"
        )
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, shape={0: num_tokens})
    check_same_device(
        _write_kv_cache_kernel,
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
    )
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        IS_FP8=key_cache.dtype == FP8_KV_DTYPE,
        SOFTWARE_FP8_CAST=is_interpreted(_write_kv_cache_kernel),
        **launch_options(_write_kv_cache_kernel, key.device),
    )


def write_kv_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """`write_kv_cache` in plain PyTorch."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = to_cache_dtype(key[keep], key_cache.dtype)
    value_cache[blocks, offsets] = to_cache_dtype(value[keep], value_cache.dtype)


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache stores it: a plain cast, or for fp8 clamped to ±448 first (NaN kept)."""
    if cache_dtype == FP8_KV_DTYPE:
        x = x.float().clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return x.to(cache_dtype)
