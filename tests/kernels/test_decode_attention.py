"""Split-K paged decode attention against its PyTorch reference."""

from __future__ import annotations

import random

import pytest
import torch

from batchlm.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)

from .helpers import ATTENTION_TOLERANCE, DTYPES, assert_close, gpu_only, make_paged_cache

NUM_KV_HEADS = 2


def _random_lens(n: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, high) for _ in range(n)]


def _run(seq_lens, dtype, head_dim, block_size, group, device, sliding_window, num_splits):
    key_cache, value_cache, block_tables = make_paged_cache(
        seq_lens, block_size, NUM_KV_HEADS, head_dim, dtype, device
    )
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    query = query.to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        lens,
        scale,
        max(seq_lens),
        sliding_window,
        num_splits=num_splits,
    )
    ref = decode_attention_ref(
        query, key_cache, value_cache, block_tables, lens, scale, sliding_window
    )
    assert_close(out, ref, ATTENTION_TOLERANCE)


@pytest.mark.parametrize(
    "seq_lens",
    [
        [1, 17, 45],
        gpu_only([1, 300, 4096, 2049, 64, 65]),
        gpu_only(_random_lens(64, 2000, seed=0)),
    ],
    ids=["small", "long", "batch64"],
)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(seq_lens, dtype, head_dim, block_size, group, device):
    _run(seq_lens, dtype, head_dim, block_size, group, device, None, None)


@pytest.mark.parametrize(
    ("seq_lens", "num_splits"),
    [
        ([3, 130, 200], 3),  # the last splits of short sequences are empty
        ([70], 2),
        gpu_only([4096, 1, 3000], 16),
        gpu_only(_random_lens(8, 4096, seed=1), None),  # occupancy picks the splits
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_k_matches_reference(seq_lens, num_splits, sliding_window, dtype, device):
    _run(seq_lens, dtype, 64, 16, 4, device, sliding_window, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window", [1, 100, 4096])
def test_sliding_window_long_context(sliding_window, device):
    _run([4000, 50, 4097], torch.float16, 128, 16, 4, device, sliding_window, None)


def test_num_splits_follow_occupancy_and_length():
    cpu = torch.device("cpu")
    assert choose_num_splits(1000, 8, 8192, cpu) == 1  # enough programs already
    assert choose_num_splits(1, 1, 100, cpu) == 1  # too short to split
    assert choose_num_splits(1, 1, 8192, cpu) > 1


def test_launcher_rejects_bad_arguments(device):
    key_cache, value_cache, block_tables = make_paged_cache([5], 16, 2, 64, torch.float32, device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    query = torch.randn(1, 4, 64, device=device)
    with pytest.raises(ValueError, match="query has dtype torch.float64"):
        decode_attention(query.double(), key_cache, value_cache, block_tables, lens, 1.0, 5)
    with pytest.raises(ValueError, match="query must have 3 dimensions"):
        decode_attention(query[0], key_cache, value_cache, block_tables, lens, 1.0, 5)
    with pytest.raises(ValueError, match="not a multiple of the cache's 2 kv heads"):
        decode_attention(query[:, :3], key_cache, value_cache, block_tables, lens, 1.0, 5)
    with pytest.raises(ValueError, match="block_tables has dtype torch.float32"):
        decode_attention(query, key_cache, value_cache, block_tables.float(), lens, 1.0, 5)
    with pytest.raises(ValueError, match="key_cache has size 64 in dimension 3"):
        decode_attention(query[..., :32], key_cache, value_cache, block_tables, lens, 1.0, 5)
    with pytest.raises(ValueError, match="value_cache has dtype"):
        decode_attention(query, key_cache, value_cache.half(), block_tables, lens, 1.0, 5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_contexts_longer_than_max_seq_len_stay_exact(num_splits, device):
    """max_seq_len only sizes the splits (a captured graph may replay with longer contexts)."""
    seq_lens = [3, 300, 150]
    key_cache, value_cache, block_tables = make_paged_cache(
        seq_lens, 16, NUM_KV_HEADS, 64, torch.float32, device
    )
    query = torch.randn(3, 8, 64, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, key_cache, value_cache, block_tables, lens, 0.125)
    out = decode_attention(*args, max_seq_len=100, num_splits=num_splits)
    assert_close(out, decode_attention_ref(*args), ATTENTION_TOLERANCE)


@pytest.mark.parametrize(
    ("seq_lens", "num_splits"),
    [
        ([1, 3, 130, 200, 77], 5),  # short contexts: several splits each, the last ones empty
        ([64, 65], 3),
        gpu_only([4096, 1, 3000, 129], None),  # occupancy from the bound picks the splits
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_splits_per_sequence_match_reference(seq_lens, num_splits, sliding_window, dtype, device):
    """`split_each_seq`: `max_seq_len` is a bound (a CUDA graph's), each sequence splits its
    own context."""
    key_cache, value_cache, block_tables = make_paged_cache(
        seq_lens, 16, NUM_KV_HEADS, 64, dtype, device
    )
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * 4, 64, generator=gen).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, key_cache, value_cache, block_tables, lens, 0.125)
    out = decode_attention(
        *args,
        max_seq_len=8192,
        sliding_window=sliding_window,
        num_splits=num_splits,
        split_each_seq=True,
    )
    ref = decode_attention_ref(*args, sliding_window=sliding_window)
    assert_close(out, ref, ATTENTION_TOLERANCE)
