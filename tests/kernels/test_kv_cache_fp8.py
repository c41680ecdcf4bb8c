"""The fp8 (e4m3, scale 1.0) paged KV cache: writing into it and attending over it.

Writes equal PyTorch's clamped cast bit for bit (the interpreter rounds in integer
arithmetic, as the GPU's conversion does); the attention kernels read the fp8 cache and
match their references applied to the same cache up-cast to the query's dtype.
"""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.decode_attention import decode_attention, decode_attention_ref
from batchlm.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from batchlm.kernels.write_kv_cache import write_kv_cache, write_kv_cache_ref

from .helpers import ATTENTION_TOLERANCE, DTYPES, assert_close, gpu_only, make_paged_cache

FP8 = torch.float8_e4m3fn
NUM_KV_HEADS = 2


def _fp8_paged_cache(seq_lens, block_size, head_dim, device):
    """`make_paged_cache` in float32 (NaN outside the sequences) cast to fp8, and its float32
    up-cast, the reference's input."""
    key_cache, value_cache, block_tables = make_paged_cache(
        seq_lens, block_size, NUM_KV_HEADS, head_dim, torch.float32, torch.device("cpu")
    )
    key_cache, value_cache = key_cache.to(FP8), value_cache.to(FP8)
    return key_cache.to(device), value_cache.to(device), block_tables.to(device)


@pytest.mark.parametrize("num_tokens", [13, gpu_only(4096)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_fp8_equals_clamped_cast(num_tokens, dtype, device):
    gen = torch.Generator().manual_seed(0)
    block_size, head_dim = 16, 64
    num_blocks = -(-num_tokens // block_size) + 4
    # Spread over e4m3's whole range: subnormals, normals, and values past 448.
    key = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen) * 10 ** (
        torch.rand(num_tokens, NUM_KV_HEADS, head_dim, generator=gen) * 6 - 3
    )
    value = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen) * 100
    key, value = key.to(dtype), value.to(dtype)
    key[1, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, -465.0]).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2::5] = -1  # padding tokens are not written (token 1 is)
    caches = torch.zeros(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype=FP8)
    expected = caches.clone()
    write_kv_cache_ref(key, value, expected[0], expected[1], slots)
    caches = caches.to(device)
    write_kv_cache(key.to(device), value.to(device), caches[0], caches[1], slots.to(device))
    caches = caches.cpu()
    # Bit for bit: on the GPU the hardware's cast, under the interpreter integer rounding.
    assert torch.equal(caches.view(torch.uint8), expected.view(torch.uint8))
    written = slots >= 0
    flat_k = caches[0].view(-1, NUM_KV_HEADS, head_dim)[slots[written]].float()
    assert torch.equal(flat_k, key[written].float().clamp(-448, 448).to(FP8).float())
    # Overflow saturates to ±448 instead of NaN.
    assert flat_k.isfinite().all()
    saturated = caches[0].view(-1, NUM_KV_HEADS, head_dim)[slots[1], 0, :4].float()
    assert saturated.tolist() == [448.0, -448.0, 448.0, -448.0]


def test_write_fp8_keeps_nan(device):
    key = torch.tensor([[[float("nan"), float("inf"), -float("inf"), 1.0]]], device=device)
    caches = torch.zeros(2, 1, 16, 1, 4, dtype=FP8, device=device)
    slots = torch.tensor([3], device=device)
    write_kv_cache(key, key, caches[0], caches[1], slots)
    row = caches[0, 0, 3, 0].float().cpu()
    assert row.isnan()[0] and row[1:].tolist() == [448.0, -448.0, 1.0]


@pytest.mark.parametrize(
    "seq_lens", [[1, 17, 45], gpu_only([1, 300, 4096, 2049, 64, 65])], ids=["small", "long"]
)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_over_fp8_cache(seq_lens, group, dtype, device):
    head_dim, block_size = 64, 16
    key_cache, value_cache, block_tables = _fp8_paged_cache(seq_lens, block_size, head_dim, device)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    query = query.to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = decode_attention(query, key_cache, value_cache, block_tables, lens, scale, max(seq_lens))
    ref = decode_attention_ref(
        query, key_cache.to(dtype), value_cache.to(dtype), block_tables, lens, scale
    )
    assert_close(out, ref, ATTENTION_TOLERANCE)


@pytest.mark.parametrize(
    "batch",
    [
        [(1, 1), (20, 20), (7, 40), (1, 33)],
        gpu_only([(2048, 2048), (1, 4096), (500, 3000), (129, 129)]),
    ],
    ids=["small", "long"],
)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_over_fp8_cache(batch, group, dtype, device):
    head_dim, block_size = 64, 16
    seq_lens = [s for _, s in batch]
    key_cache, value_cache, block_tables = _fp8_paged_cache(seq_lens, block_size, head_dim, device)
    q_lens = [q for q, _ in batch]
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    query, qsl = query.to(dtype).to(device), qsl.to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = prefill_attention(
        query, key_cache, value_cache, block_tables, lens, qsl, scale, max(q_lens)
    )
    ref = prefill_attention_ref(
        query, key_cache.to(dtype), value_cache.to(dtype), block_tables, lens, qsl, scale
    )
    assert_close(out, ref, ATTENTION_TOLERANCE)


def test_fp8_cache_dtypes_must_match(device):
    query = torch.randn(1, 2, 64, device=device)
    key_cache = torch.zeros(2, 16, 2, 64, dtype=FP8, device=device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="value_cache has dtype torch.float16"):
        decode_attention(query, key_cache, key_cache.half(), tables, lens, 0.125, 1)
    with pytest.raises(ValueError, match="key_cache has dtype torch.float8_e5m2"):
        decode_attention(query, key_cache.to(torch.float8_e5m2), key_cache, tables, lens, 0.1, 1)
