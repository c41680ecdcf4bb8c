"""Split-K paged decode attention against its PyTorch reference."""

from __future__ import annotations

import random

import pytest
import torch

from batchlm.kernels.decode_attention import (
    DecodeLaunch,
    choose_launch,
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


@pytest.mark.parametrize(
    ("block_n", "num_warps", "num_stages", "num_splits", "split_each_seq", "sliding_window"),
    [
        (16, 2, 1, 1, False, None),
        (32, 8, 2, 2, False, 37),
        (128, 4, 4, 1, False, None),
        (16, 4, 3, 4, True, 37),
        (128, 8, 1, 3, True, None),
        (32, 2, 2, 3, True, 37),
    ],
)
@pytest.mark.parametrize("align_tiles_to_blocks", [False, True])
@pytest.mark.parametrize("block_size", [8, 32])
def test_launch_overrides_match_reference(
    block_n,
    num_warps,
    num_stages,
    num_splits,
    split_each_seq,
    align_tiles_to_blocks,
    block_size,
    sliding_window,
    device,
):
    """Every launch configuration computes the same attention (the interpreter ignores warps
    and stages; on CUDA they are compiled)."""
    seq_lens = [1, 30, 77, 200]
    key_cache, value_cache, block_tables = make_paged_cache(
        seq_lens, block_size, NUM_KV_HEADS, 64, torch.float32, device
    )
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * 4, 64, generator=gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, key_cache, value_cache, block_tables, lens, 0.125)
    out = decode_attention(
        *args,
        max_seq_len=4096 if split_each_seq else max(seq_lens),
        sliding_window=sliding_window,
        num_splits=num_splits,
        split_each_seq=split_each_seq,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        align_tiles_to_blocks=align_tiles_to_blocks,
    )
    ref = decode_attention_ref(*args, sliding_window=sliding_window)
    assert_close(out, ref, ATTENTION_TOLERANCE)


def test_default_launch_is_unchanged():
    cpu = torch.device("cpu")
    bf16 = choose_launch(torch.bfloat16, 128, 256, 8, 16, 768, cpu)
    assert bf16 == DecodeLaunch(
        block_n=64, num_warps=4, num_stages=3, num_splits=1, partition_size=768, ids_per_tile=0
    )
    assert choose_launch(torch.float32, 128, 256, 8, 16, 768, cpu).block_n == 32
    assert choose_launch(torch.bfloat16, 256, 256, 8, 16, 768, cpu).block_n == 32
    # A smaller tile keeps the default's partitions; a larger one rounds them up to itself.
    small = choose_launch(torch.bfloat16, 128, 1, 8, 16, 1000, cpu, num_splits=3, block_n=16)
    assert (small.num_splits, small.partition_size) == (3, 384)
    large = choose_launch(torch.bfloat16, 128, 1, 8, 16, 1000, cpu, num_splits=3, block_n=256)
    assert (large.num_splits, large.partition_size) == (2, 512)
    per_seq = choose_launch(
        torch.bfloat16, 128, 1, 8, 16, 4096, cpu, num_splits=64, split_each_seq=True
    )
    assert per_seq.num_splits == 64
    aligned = choose_launch(
        torch.bfloat16, 128, 1, 8, 32, 64, cpu, block_n=16, align_tiles_to_blocks=True
    )
    assert aligned.ids_per_tile == 1
    assert (
        choose_launch(
            torch.bfloat16, 128, 1, 8, 16, 64, cpu, block_n=128, align_tiles_to_blocks=True
        ).ids_per_tile
        == 8
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(block_n=8), r"block_n=8 must be a power of two in \[16, 256\]"),
        (dict(block_n=48), "block_n=48 must be a power of two"),
        (dict(block_n=512), "block_n=512 must be a power of two"),
        (dict(block_n=64.0), "block_n=64.0 must be a power of two"),
        (dict(block_n=True), "block_n=True must be a power of two"),
        (dict(num_warps=3), r"num_warps=3 must be a power of two in \[1, 16\]"),
        (dict(num_warps=0), "num_warps=0 must be a power of two"),
        (dict(num_warps=32), "num_warps=32 must be a power of two"),
        (dict(num_stages=0), r"num_stages=0 must be an integer in \[1, 8\]"),
        (dict(num_stages=9), "num_stages=9 must be an integer"),
        (dict(num_stages="2"), "num_stages='2' must be an integer"),
        (dict(num_splits=0), "num_splits=0 must be an integer >= 1"),
        (dict(num_splits=1.5), "num_splits=1.5 must be an integer >= 1"),
    ],
)
def test_launch_rejects_bad_overrides(overrides, message, device):
    key_cache, value_cache, block_tables = make_paged_cache([5], 16, 2, 64, torch.float32, device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    query = torch.randn(1, 4, 64, device=device)
    args = (query, key_cache, value_cache, block_tables, lens, 1.0, 5)
    with pytest.raises(ValueError, match=message):
        decode_attention(*args, **overrides)
    with pytest.raises(ValueError, match=message):  # checked for an empty batch too
        decode_attention(query[:0], key_cache, value_cache, block_tables[:0], lens[:0], 1.0, 5,
                         **overrides)  # fmt: skip


def test_aligned_tiles_need_a_power_of_two_block_size(device):
    key_cache, value_cache, block_tables = make_paged_cache([5], 24, 2, 64, torch.float32, device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    query = torch.randn(1, 4, 64, device=device)
    args = (query, key_cache, value_cache, block_tables, lens, 1.0, 5)
    with pytest.raises(ValueError, match="power-of-two cache block size, got block_size=24"):
        decode_attention(*args, align_tiles_to_blocks=True)
    assert_close(decode_attention(*args), decode_attention_ref(*args[:6]), ATTENTION_TOLERANCE)


@pytest.mark.parametrize(
    ("seq_lens", "num_splits", "sliding_window"),
    [
        ([1, 17, 45], 1, None),
        ([3, 130, 200], 3, None),  # split-K: capped partial softmaxes merged
        ([3, 130, 200], 3, 20),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softcap_matches_reference(seq_lens, num_splits, sliding_window, dtype, device):
    """Gemma 2's attention-logit soft-cap, tight enough (2.0 against scores of a few units)
    that it changes the result."""
    key_cache, value_cache, block_tables = make_paged_cache(
        seq_lens, 16, NUM_KV_HEADS, 64, dtype, device
    )
    gen = torch.Generator().manual_seed(4)
    query = (4 * torch.randn(len(seq_lens), NUM_KV_HEADS * 2, 64, generator=gen)).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query.to(device), key_cache, value_cache, block_tables, lens, 0.125)
    window = {"sliding_window": sliding_window}
    out = decode_attention(
        *args, max_seq_len=max(seq_lens), num_splits=num_splits, softcap=2.0, **window
    )
    ref = decode_attention_ref(*args, softcap=2.0, **window)
    assert_close(out, ref, ATTENTION_TOLERANCE)
    uncapped = decode_attention_ref(*args, **window)
    assert not torch.allclose(ref.float(), uncapped.float(), atol=0.1)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), True, "50"])
def test_softcap_must_be_positive(softcap, device):
    key_cache, value_cache, block_tables = make_paged_cache([5], 16, 2, 64, torch.float32, device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    query = torch.randn(1, 4, 64, device=device)
    with pytest.raises(ValueError, match=f"softcap={softcap!r} must be a finite number > 0"):
        decode_attention(query, key_cache, value_cache, block_tables, lens, 1.0, 5,
                         softcap=softcap)  # fmt: skip
