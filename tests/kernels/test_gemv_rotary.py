"""The fused q|k|v product + rotary + cache write against its two kernels and the references."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.gemv import gemv
from batchlm.kernels.gemv_rotary import (
    gemv_rotary_into_cache,
    gemv_rotary_into_cache_ref,
    split_heads,
)
from batchlm.kernels.rotary import rotary_embedding_into_cache

from .helpers import gpu_only

TOLERANCE = {torch.float16: (2e-2, 2e-3), torch.bfloat16: (1.5e-1, 1e-2)}


def _case(heads, kv_heads, head_dim, hidden, dtype, device, *, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(device)
    w = (torch.randn(rows, hidden, generator=gen) / hidden**0.5).to(dtype).to(device)
    b = torch.randn(rows, generator=gen).to(dtype).to(device) if bias else None
    max_position = 64
    angles = torch.rand(max_position, head_dim // 2, generator=gen) * 6.0
    angles = torch.cat([angles, angles], dim=-1)
    cos_sin = torch.stack([angles.cos(), angles.sin()]).to(device)
    num_blocks, block_size = 4, 4
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    cache = cache.to(dtype).to(device)
    positions = torch.tensor([37], device=device)
    slots = torch.tensor([9], device=device)
    return x, w, b, positions, cos_sin, cache, slots


def _two_kernels(x, w, b, positions, cos_sin, cache, slots, heads, launch):
    q, k, v = split_heads(gemv(x, w, b, **launch), heads, *cache.shape[3:])
    return rotary_embedding_into_cache(positions, q, k, v, cos_sin, cache[0], cache[1], slots)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "hidden", "launch"),
    [
        (4, 2, 16, 64, {"block_n": 8, "block_k": 32}),
        (4, 4, 32, 100, {"block_n": 4, "block_k": 32}),  # ragged K, MHA
        (6, 2, 16, 64, {"block_n": 16, "block_k": 64, "num_warps": 2, "num_stages": 1}),
        gpu_only(32, 8, 128, 4096, {}),  # Llama-3.1-8B
        gpu_only(14, 2, 64, 896, {}),  # Qwen2.5-0.5B
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_equals_gemv_then_rotary_into_cache(heads, kv_heads, head_dim, hidden, launch, bias,
                                             dtype, device):  # fmt: skip
    x, w, b, positions, cos_sin, cache, slots = _case(
        heads, kv_heads, head_dim, hidden, dtype, device, bias=bias
    )
    two_cache, ref_cache = cache.clone(), cache.clone()
    expected = _two_kernels(x, w, b, positions, cos_sin, two_cache, slots, heads, launch)
    query = gemv_rotary_into_cache(
        x, w, b, positions, cos_sin, cache[0], cache[1], slots, heads, **launch
    )
    # The same products in the same order, rounded where gemv stores them: the same bits.
    assert query.shape == (1, heads, head_dim) and query.dtype == dtype
    assert torch.equal(query, expected)
    assert torch.equal(cache, two_cache)

    ref_query = gemv_rotary_into_cache_ref(
        x, w, b, positions, cos_sin, ref_cache[0], ref_cache[1], slots, heads
    )
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(query.float(), ref_query.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=atol, rtol=rtol)


def test_negative_slot_leaves_the_cache(device):
    x, w, b, positions, cos_sin, cache, _ = _case(4, 2, 16, 64, torch.bfloat16, device)
    before = cache.clone()
    slots = torch.tensor([-1], device=device)
    query = gemv_rotary_into_cache(x, w, b, positions, cos_sin, cache[0], cache[1], slots, 4,
                                   block_n=8, block_k=32)  # fmt: skip
    assert torch.equal(cache, before)
    expected = _two_kernels(x, w, b, positions, cos_sin, cache.clone(), slots, 4,
                            {"block_n": 8, "block_k": 32})  # fmt: skip
    assert torch.equal(query, expected)


def test_rejects_bad_arguments(device):
    x, w, b, positions, cos_sin, cache, slots = _case(4, 2, 16, 64, torch.bfloat16, device)
    args = (positions, cos_sin, cache[0], cache[1], slots)
    with pytest.raises(ValueError, match="block_n=6"):
        gemv_rotary_into_cache(x, w, b, *args, 4, block_n=6, block_k=32)
    with pytest.raises(ValueError, match="block_n=1"):
        gemv_rotary_into_cache(x, w, b, *args, 4, block_n=1, block_k=32)
    with pytest.raises(ValueError, match="weight"):
        gemv_rotary_into_cache(x, w[:-16], b, *args, 4)  # rows for 3 query heads, not 4
    with pytest.raises(ValueError, match="x has dtype"):
        gemv_rotary_into_cache(x.float(), w, b, *args, 4)
    with pytest.raises(ValueError, match="cos_sin"):
        gemv_rotary_into_cache(x, w, b, positions, cos_sin[..., :8], cache[0], cache[1], slots, 4)
    with pytest.raises(ValueError, match="positions"):
        gemv_rotary_into_cache(x, w, b, positions.repeat(2), cos_sin, cache[0], cache[1], slots, 4)
