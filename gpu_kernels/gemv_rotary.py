"""The q|k|v projection of one token, its rotary embedding and the cache write, in one kernel.

At batch 1 an attention layer starts with the q|k|v matrix-vector product and then a short
kernel that rotates the query and key heads and stores the keys and values into the paged
cache (`rotary.rotary_embedding_into_cache`). Here the product's programs do that second
step on their own outputs: each program owns `BLOCK_N / 2` channel pairs `(c, c + D / 2)`
of one head (query, key or value), streams their weight rows as `gemv` does, rounds each
output to the activations' dtype (as `gemv` stores it), then rotates the pair in float32
(query and key heads) and stores it: queries to the returned tensor, keys and values into
the cache at the token's slot (none for a negative slot). So the outputs are those of
`gemv` followed by `rotary_embedding_into_cache`, without the second launch and without
the q|k|v tensor in between.

`gemv_rotary_into_cache_ref` is the two steps' plain-PyTorch references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import _load_weight_tile, _load_x_tile, choose_gemv_launch
from .launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_same_device,
    check_tensor,
)
from .pdl import launch_options, wait_for_previous_kernel
from .rotary import rotate_pair

__all__ = [
    "check_token_rotary",
    "gemv_rotary_into_cache",
    "gemv_rotary_into_cache_ref",
    "split_heads",
]


@triton.jit
def _gemv_rotary_kernel(
    x_ptr,  # [K]
    w_ptr,  # [(NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, K]
    b_ptr,  # [(NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM] (read when HAS_BIAS)
    positions_ptr,  # [1]
    slot_mapping_ptr,  # [1]
    cos_sin_ptr,  # [2, max_position, HEAD_DIM] float32
    query_out_ptr,  # [NUM_HEADS * HEAD_DIM]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    K,
    stride_wn,
    stride_cs,
    stride_cp,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    N: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    pid = tl.program_id(0)
    head = pid // (HALF // PAIRS)  # over the query, then key, then value heads
    c0 = (pid % (HALF // PAIRS)) * PAIRS
    # Row j of the tile: channel c0 + j // 2 of the head, in its first half for even j and
    # its second for odd j, so that each pair's two outputs come out side by side.
    offs_j = tl.arange(0, BLOCK_N)
    offs_n = head * HEAD_DIM + c0 + offs_j // 2 + (offs_j % 2) * HALF
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # The weights are no kernel's output: the first tile streams in before the wait. Every
    # row exists (the grid covers whole heads): EVEN_N.
    w = _load_weight_tile(rows, offs_k, offs_n, N, K, True, EVEN_K)
    wait_for_previous_kernel(PDL)
    acc = w.to(tl.float32) * _load_x_tile(x_ptr, offs_k, K, EVEN_K).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        w = _load_weight_tile(rows, ks, offs_n, N, K, True, EVEN_K)
        acc += w.to(tl.float32) * _load_x_tile(x_ptr, ks, K, EVEN_K).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n).to(tl.float32)
    out_ty = x_ptr.dtype.element_ty
    y = y.to(out_ty).to(tl.float32)  # the product as gemv stores it
    x1, x2 = tl.split(tl.reshape(y, (PAIRS, 2)))
    offs_c = c0 + tl.arange(0, PAIRS)
    if head < NUM_HEADS + NUM_KV_HEADS:  # a query or key head: rotate
        pos = tl.load(positions_ptr).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cp + offs_c)
        sin = tl.load(cos_sin_ptr + stride_cs + pos * stride_cp + offs_c)
        x1, x2 = rotate_pair(x1, x2, cos, sin)
    if head < NUM_HEADS:
        dst = query_out_ptr + head * HEAD_DIM + offs_c
        tl.store(dst, x1.to(out_ty))
        tl.store(dst + HALF, x2.to(out_ty))
    else:
        slot = tl.load(slot_mapping_ptr).to(tl.int64)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            if head < NUM_HEADS + NUM_KV_HEADS:
                kv_head = head - NUM_HEADS
                dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs
                dst += kv_head * stride_kch + offs_c
            else:
                kv_head = head - NUM_HEADS - NUM_KV_HEADS
                dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs
                dst += kv_head * stride_vch + offs_c
            cache_ty = dst.dtype.element_ty
            tl.store(dst, x1.to(cache_ty))
            tl.store(dst + HALF, x2.to(cache_ty))


def gemv_rotary_into_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    **launch: int | None,
) -> torch.Tensor:
    """`gemv(x, weight, bias)` split into query, key and value heads, then
    `rotary_embedding_into_cache` on them, in one launch.

    Args:
        x: `[1, K]` half-precision activations of one token, unit stride.
        weight: `[(num_heads + 2 * num_kv_heads) * head_dim, K]` q|k|v rows, same dtype,
            unit stride along K (read before the PDL wait, as in `gemv`).
        bias: `[rows]` or None.
        positions: `[1]` int32 / int64 position of the token.
        cos_sin: `[2, max_position, head_dim]` float32, as for `rotary_embedding` (the
            whole head rotates).
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` in x's dtype.
        value_cache: Same shape and dtype as `key_cache`.
        slot_mapping: `[1]` int32 / int64 slot; negative: keys and values not written.
        num_heads: Query heads (the key and value heads are the cache's).
        **launch: `block_n` (an even number of rows, at most `head_dim`), `block_k`,
            `num_warps`, `num_stages` overrides; None takes `gemv`'s default for the shape.

    Returns:
        The rotated queries, a new `[1, num_heads, head_dim]` tensor.
    """
    check_token_rotary(x, positions, cos_sin, key_cache, value_cache, slot_mapping)
    num_k = x.shape[1]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_rows = (num_heads + 2 * num_kv_heads) * head_dim
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), shape={0: num_rows, 1: num_k})
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, shape={0: num_rows})
    check_same_device(
        _gemv_rotary_kernel,
        x=x, weight=weight, positions=positions, cos_sin=cos_sin, key_cache=key_cache,
        value_cache=value_cache, slot_mapping=slot_mapping,
    )  # fmt: skip
    cfg = choose_gemv_launch(num_rows, num_k, **launch)
    if cfg.block_n < 2 or (head_dim // 2) % (cfg.block_n // 2):
        raise ValueError(
            f"block_n={cfg.block_n} must be an even number of rows whose half divides "
            f"head_dim / 2 = {head_dim // 2}"
        )
    query = torch.empty((1, num_heads, head_dim), dtype=x.dtype, device=x.device)
    _gemv_rotary_kernel[(cdiv(num_rows, cfg.block_n),)](
        x,
        weight,
        bias if bias is not None else query,
        positions,
        slot_mapping,
        cos_sin,
        query,
        key_cache,
        value_cache,
        num_k,
        weight.stride(0),
        cos_sin.stride(0),
        cos_sin.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HAS_BIAS=bias is not None,
        EVEN_K=num_k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(_gemv_rotary_kernel, x.device),
    )
    return query


def check_token_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`ValueError` naming the argument of a one-token projection + rotary + cache write
    (`gemv_rotary_into_cache`, `w4a16_fused.w4a16_rotary_into_cache`) that does not fit:
    `x` `[1, K]` in half precision, the caches in its dtype, one position and slot, a
    table rotating whole heads."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float16, torch.bfloat16), shape={0: 1})
    check_tensor("key_cache", key_cache, ndim=4, dtypes=(x.dtype,))
    check_tensor(
        "value_cache", value_cache, ndim=4, dtypes=(x.dtype,),
        shape=dict(enumerate(key_cache.shape)),
    )  # fmt: skip
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, shape={0: 1})
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, shape={0: 1})
    head_dim = key_cache.shape[3]
    check_tensor("cos_sin", cos_sin, ndim=3, dtypes=(torch.float32,), shape={0: 2, 2: head_dim})


def gemv_rotary_into_cache_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """`gemv_rotary_into_cache` as `gemv_ref`, then `rotary_embedding_into_cache_ref`."""
    from .gemv import gemv_ref
    from .rotary import rotary_embedding_into_cache_ref

    q, k, v = split_heads(gemv_ref(x, weight, bias), num_heads, *key_cache.shape[2:])
    return rotary_embedding_into_cache_ref(
        positions, q, k, v, cos_sin, key_cache, value_cache, slot_mapping
    )


def split_heads(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A `[num_tokens, rows]` q|k|v product as `[num_tokens, heads, head_dim]` views of its
    query, key and value heads."""
    kv_width = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_width, kv_width], dim=-1)
    num_tokens = qkv.shape[0]
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )
