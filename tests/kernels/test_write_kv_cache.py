"""Writing keys / values into the paged cache by slot, against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.write_kv_cache import write_kv_cache, write_kv_cache_ref

from .helpers import DTYPES, gpu_only


@pytest.mark.parametrize("num_tokens", [1, 13, gpu_only(4096)])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_matches_reference(num_tokens, dtype, head_dim, block_size, num_kv_heads, device):
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-num_tokens // block_size) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # key / value as strided views of a fused qkv projection, like the models pass them
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens are not written
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    key, value, slots = key.to(device), value.to(device), slots.to(device)
    caches = [c.to(device) for c in caches]
    write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_ref(key.cpu(), value.cpu(), expected[0], expected[1], slots.cpu())
    # A copy: bit-exact.
    assert torch.equal(caches[0].cpu(), expected[0])
    assert torch.equal(caches[1].cpu(), expected[1])


def test_write_converts_to_the_cache_dtype(device):
    key = torch.randn(4, 2, 64, device=device)
    caches = torch.zeros(2, 2, 16, 2, 64, dtype=torch.float16, device=device)
    slots = torch.tensor([0, 1, 16, 31], device=device)
    write_kv_cache(key, key * 2, caches[0], caches[1], slots)
    assert torch.equal(caches[0].view(-1, 2, 64)[slots], key.half())
    assert torch.equal(caches[1].view(-1, 2, 64)[slots], (key * 2).half())


def test_launcher_rejects_bad_arguments(device):
    key = torch.randn(4, 2, 64, device=device)
    cache = torch.zeros(2, 16, 2, 64, device=device)
    slots = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="slot_mapping has dtype torch.float32"):
        write_kv_cache(key, key, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="slot_mapping has size 3 in dimension 0"):
        write_kv_cache(key, key, cache, cache.clone(), slots[:3])
    with pytest.raises(ValueError, match="key_cache has size 2 in dimension 2"):
        write_kv_cache(key[:, :1], key[:, :1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="value_cache has dtype torch.float16"):
        write_kv_cache(key, key, cache, cache.half(), slots)
