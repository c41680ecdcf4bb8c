"""Variable-length paged prefill / mixed attention against its PyTorch reference."""

from __future__ import annotations

import random

import pytest
import torch

from batchlm.kernels.prefill_attention import (
    FIXED_SPLIT_SIZE,
    batch_invariant_tile,
    prefill_attention,
    prefill_attention_ref,
)

from .helpers import ATTENTION_TOLERANCE, DTYPES, assert_close, gpu_only, make_paged_cache

NUM_KV_HEADS = 2

# Each sequence as (query_len, seq_len): the queries are its last query_len positions.
SMALL_BATCH = [
    (1, 1),  # a one-token prompt
    (20, 20),  # a fresh prefill
    (7, 40),  # a chunk after a cached prefix (prefix-cache hit / chunked prefill)
    (1, 33),  # a decode token in a mixed batch
]


def _random_batch(n: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    batch = []
    for _ in range(n):
        seq_len = rng.randint(1, max_len)
        batch.append((rng.choice([1, seq_len, rng.randint(1, seq_len)]), seq_len))
    return batch


def _run(
    batch,
    dtype,
    head_dim,
    block_size,
    group,
    device,
    sliding_window=None,
    softcap=None,
    query_scale=1.0,
    **launch,
):
    seq_lens = [s for _, s in batch]
    key_cache, value_cache, block_tables = make_paged_cache(
        seq_lens, block_size, NUM_KV_HEADS, head_dim, dtype, device
    )
    q_lens = [q for q, _ in batch]
    qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    query = query_scale * query
    query, qsl = query.to(dtype).to(device), qsl.to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    args = (query, key_cache, value_cache, block_tables, lens, qsl, scale)
    out = prefill_attention(*args, max(q_lens), sliding_window, softcap=softcap, **launch)
    ref = prefill_attention_ref(*args, sliding_window, softcap)
    assert_close(out, ref, ATTENTION_TOLERANCE)
    return ref


@pytest.mark.parametrize(
    "batch",
    [
        SMALL_BATCH,
        gpu_only([(2048, 2048), (1, 4096), (500, 3000), (129, 129), (64, 4000)]),
        gpu_only(_random_batch(48, 2500, seed=0)),
    ],
    ids=["small", "long", "batch48"],
)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(batch, dtype, head_dim, block_size, group, device):
    _run(batch, dtype, head_dim, block_size, group, device)


@pytest.mark.parametrize(
    "batch",
    [
        [(30, 30), (5, 50), (1, 9)],
        gpu_only([(3000, 3000), (700, 4000), (1, 4096)]),
    ],
    ids=["small", "long"],
)
@pytest.mark.parametrize("sliding_window", [1, 8, 1000])
def test_sliding_window_matches_reference(batch, sliding_window, device):
    _run(batch, torch.float32, 64, 16, 4, device, sliding_window)


@pytest.mark.parametrize("sliding_window", [None, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softcap_matches_reference(sliding_window, dtype, device):
    """Gemma 2's attention-logit soft-cap on every kind of sequence of a mixed batch."""
    # Scores of several units against a cap of 2: the cap changes the result.
    capped = _run(SMALL_BATCH, dtype, 64, 16, 2, device, sliding_window, 2.0, query_scale=4.0)
    uncapped = _run(SMALL_BATCH, dtype, 64, 16, 2, device, sliding_window, query_scale=4.0)
    assert not torch.allclose(capped.float(), uncapped.float(), atol=0.1)


@pytest.mark.parametrize("group", [3, 7])  # groups that do not divide the tile's rows
def test_odd_gqa_groups_and_head_dim(group, device):
    _run([(9, 12), (1, 5)], torch.float32, 80, 16, group, device)


@pytest.mark.parametrize(
    "launch",
    [
        {"block_m": 16, "block_n": 16},
        {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 2},
        {"block_m": 32, "block_n": 128, "num_warps": 4, "num_stages": 4},
    ],
    ids=str,
)
def test_launch_overrides_match_reference(launch, device):
    # More tiles per sequence than the default, and keys spread over several blocks per tile.
    batch = [(40, 40), (9, 70), (1, 33), (65, 100)]
    _run(batch, torch.float16, 64, 16, 4, device, 48, **launch)


def test_launcher_rejects_bad_arguments(device):
    key_cache, value_cache, block_tables = make_paged_cache([5], 16, 2, 64, torch.float32, device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=device)
    query = torch.randn(5, 4, 64, device=device)
    args = (key_cache, value_cache, block_tables, lens)
    with pytest.raises(ValueError, match="query_start_loc has size 3 in dimension 0"):
        prefill_attention(query, *args, torch.tensor([0, 2, 5], device=device), 1.0, 5)
    with pytest.raises(ValueError, match="query_start_loc has dtype torch.float32"):
        prefill_attention(query, *args, qsl.float(), 1.0, 5)
    with pytest.raises(ValueError, match="sliding_window=0 must be >= 1"):
        prefill_attention(query, *args, qsl, 1.0, 5, sliding_window=0)
    with pytest.raises(ValueError, match="must have stride 1 in its last dimension"):
        prefill_attention(query.transpose(1, 2), *args, qsl, 1.0, 5)
    for bad, message in [
        ({"block_m": 48}, "block_m=48 must be a power of two in"),
        ({"block_m": 1}, r"block_m=1 must be a power of two in \[16, 512\]"),
        ({"block_n": 8}, "block_n=8 must be a power of two in"),
        ({"num_warps": 3}, "num_warps=3 must be a power of two"),
        ({"num_stages": 0}, "num_stages=0 must be an integer in"),
        ({"softcap": 0.0}, "softcap=0.0 must be a finite number > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            prefill_attention(query, *args, qsl, 1.0, 5, **bad)


@pytest.mark.parametrize("sliding_window", [None, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_token_gets_the_same_bits_in_any_batch_or_chunk(sliding_window, dtype, device):
    """The batch-invariant mode's property: a token's output is bitwise the same whether
    its prompt runs whole, in chunks after its cached prefix, one token at a time (decode),
    or beside other sequences in either order. With a window, the key tiles must start at
    multiples of the key tile, not at the tile's first visible key."""
    group, head_dim, length = 2, 32, 50
    others = [(5, 5), (1, 40), (9, 30)]
    seq_lens = [length] + [s for _, s in others]
    key_cache, value_cache, tables = make_paged_cache(
        seq_lens, 4, NUM_KV_HEADS, head_dim, dtype, device, seed=3
    )
    gen = torch.Generator().manual_seed(4)
    queries = torch.randn(length, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    other_q = [
        torch.randn(q, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype) for q, _ in others
    ]
    launch = {"block_m": 16, "block_n": 16}

    def attend(parts):
        """parts: (sequence index, first query position, end position) per sequence."""
        q = [queries[a:b] if s == 0 else other_q[s - 1] for s, a, b in parts]
        q_lens = [len(x) for x in q]
        qsl = torch.zeros(len(parts) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(q_lens).cumsum(0)
        out = prefill_attention(
            torch.cat(q).to(device),
            key_cache,
            value_cache,
            tables[[s for s, _, _ in parts]],
            torch.tensor([b for _, _, b in parts], dtype=torch.int32, device=device),
            qsl.to(device),
            head_dim**-0.5,
            max(q_lens),
            sliding_window,
            **launch,
        )
        return out.split(q_lens)

    whole = attend([(0, 0, length)])[0]
    chunks = [(0, 13), (13, 29), (29, length)]
    chunked = torch.cat([attend([(0, a, b)])[0] for a, b in chunks])
    assert torch.equal(chunked, whole), "chunked after the cached prefix"
    for pos in (0, 16, 31, length - 1):
        assert torch.equal(attend([(0, pos, pos + 1)])[0], whole[pos : pos + 1]), f"decode {pos}"
    mixed = [(1, 0, 5), (0, 13, 29), (2, 39, 40), (3, 21, 30)]
    assert torch.equal(attend(mixed)[1], whole[13:29]), "beside other sequences"
    assert torch.equal(attend(mixed[::-1])[2], whole[13:29]), "in reversed order"


def _fixed_split_bits(dtype, device, *, sliding_window, length, head_dim, group, block_size,
                      num_kv_heads, split_size, bound, launch):  # fmt: skip
    """Asserts the fixed-split property: a token's output is bitwise the same whole, chunked,
    as a decode row alone or in a batch of decode rows (in either order, in split programs
    or not, for any grid bound), and beside prefills in a mixed step; and close to the
    reference."""
    others = [(1, 2 * split_size + 7), (1, 3), (9, split_size + 5), (1, 4 * split_size)]
    seq_lens = [length] + [s for _, s in others]
    key_cache, value_cache, tables = make_paged_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, device, seed=5
    )
    gen = torch.Generator().manual_seed(6)
    num_heads = num_kv_heads * group
    queries = torch.randn(length, num_heads, head_dim, generator=gen).to(dtype)
    other_q = [torch.randn(q, num_heads, head_dim, generator=gen).to(dtype) for q, _ in others]
    scale = head_dim**-0.5

    def attend(parts, split_programs=False, max_seq_len=bound):
        """parts: (sequence index, first query position, end position) per sequence."""
        q = [queries[a:b] if s == 0 else other_q[s - 1] for s, a, b in parts]
        q_lens = [len(x) for x in q]
        qsl = torch.zeros(len(parts) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(q_lens).cumsum(0)
        args = (
            torch.cat(q).to(device),
            key_cache,
            value_cache,
            tables[[s for s, _, _ in parts]],
            torch.tensor([b for _, _, b in parts], dtype=torch.int32, device=device),
            qsl.to(device),
            scale,
        )
        out = prefill_attention(
            *args, max(q_lens), sliding_window, fixed_split_size=split_size,
            max_seq_len=max_seq_len, split_programs=split_programs, **launch,
        )  # fmt: skip
        assert_close(out, prefill_attention_ref(*args, sliding_window), ATTENTION_TOLERANCE)
        return out.split(q_lens)

    whole = attend([(0, 0, length)])[0]
    assert torch.equal(attend([(0, 0, length)], True)[0], whole), "whole, split programs"
    chunks = [(0, split_size - 3), (split_size - 3, split_size + 11), (split_size + 11, length)]
    chunked = torch.cat([attend([(0, a, b)])[0] for a, b in chunks])
    assert torch.equal(chunked, whole), "chunked after the cached prefix"
    decodes = [(i + 1, s - 1, s) for i, (q, s) in enumerate(others) if q == 1]
    for pos in (0, split_size - 1, split_size, length - 1):
        row = whole[pos : pos + 1]
        for programs in (False, True):
            alone = attend([(0, pos, pos + 1)], programs)[0]
            assert torch.equal(alone, row), f"decode {pos} alone, split programs {programs}"
        batch = [decodes[0], (0, pos, pos + 1), *decodes[1:]]
        assert torch.equal(attend(batch, True)[1], row), f"decode {pos} in a batch"
        assert torch.equal(attend(batch[::-1], True)[-2], row), f"decode {pos} reversed"
        graph = attend(batch, True, 2 * bound)[1]  # a grid sized for a larger bound
        assert torch.equal(graph, row), f"decode {pos} under a larger bound"
        mixed = [(3, split_size - 4, split_size + 5), (0, pos, pos + 1), decodes[-1]]
        assert torch.equal(attend(mixed)[1], row), f"decode {pos} beside a prefill"


@pytest.mark.parametrize("sliding_window", [None, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fixed_splits_give_a_token_the_same_bits_in_any_batch_or_chunk(
    sliding_window, dtype, device
):
    """The batch-invariant mode's key splits: the same bits whichever launch folds them."""
    _fixed_split_bits(
        dtype, device, sliding_window=sliding_window, length=80, head_dim=32, group=2,
        block_size=8, num_kv_heads=NUM_KV_HEADS, split_size=32, bound=128,
        launch={"block_m": 16, "block_n": 16},
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["default", "batch_invariant"])
@pytest.mark.parametrize("sliding_window", [None, 1000])
def test_fixed_splits_bitwise_at_llama_8b_shape(sliding_window, tile, device):
    """The same on the GPU at Llama-3.1-8B's attention shape and the mode's splits, on the
    default tile and on the one the mode launches (`batch_invariant_tile`)."""
    launch = batch_invariant_tile(torch.bfloat16, 128, 4) if tile == "batch_invariant" else {}
    _fixed_split_bits(
        torch.bfloat16, device, sliding_window=sliding_window, length=2100, head_dim=128,
        group=4, block_size=16, num_kv_heads=8, split_size=FIXED_SPLIT_SIZE, bound=4096,
        launch=launch,
    )  # fmt: skip


def test_fixed_splits_bitwise_on_the_batch_invariant_tile(device):
    """The tile the mode launches (one decode token's GQA group padded to 16 rows, the
    decode kernel's key tile) keeps the fixed-split property, with odd groups too."""
    for group in (3, 16):
        launch = batch_invariant_tile(torch.bfloat16, 32, group)
        assert launch["block_m"] >= max(16, group), launch
        _fixed_split_bits(
            torch.bfloat16, device, sliding_window=None, length=80, head_dim=32, group=group,
            block_size=8, num_kv_heads=1, split_size=launch["block_n"], bound=128, launch=launch,
        )  # fmt: skip


@pytest.mark.parametrize("split_programs", [False, True])
def test_fixed_splits_match_reference(split_programs, device):
    # Contexts of one to four splits, a window across a split boundary, odd GQA groups.
    batch = [(1, 70), (1, 5), (30, 100), (1, 33)]
    launch = {"block_m": 16, "block_n": 16, "fixed_split_size": 32, "max_seq_len": 100}
    _run(batch, torch.float16, 64, 16, 3, device, split_programs=split_programs, **launch)
    _run(batch, torch.float32, 32, 8, 1, device, 40, split_programs=split_programs, **launch)


def test_fixed_split_arguments_are_checked(device):
    key_cache, value_cache, block_tables = make_paged_cache([5], 16, 2, 64, torch.float32, device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=device)
    query = torch.randn(5, 4, 64, device=device)
    args = (query, key_cache, value_cache, block_tables, lens, qsl, 1.0, 5)
    for bad, message in [
        ({"fixed_split_size": 24, "block_n": 16}, "fixed_split_size=24 must be a positive"),
        ({"fixed_split_size": 0}, "fixed_split_size=0 must be a positive multiple"),
        ({"split_programs": True}, "split_programs=True needs a fixed_split_size"),
        ({"fixed_split_size": 64, "split_programs": True}, "needs max_seq_len >= 1"),
        (
            {"fixed_split_size": 64, "max_seq_len": 1 << 26, "split_programs": True},
            "past the grid's 65535",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            prefill_attention(*args, **bad)


def _key_ends(batch, spans) -> torch.Tensor:
    """Each query token's key end: its position + 1, or the end of its span (spans as
    `(sequence, first position, end position)`)."""
    ends = []
    for i, (q_len, seq_len) in enumerate(batch):
        for pos in range(seq_len - q_len, seq_len):
            end = pos + 1
            for seq, lo, hi in spans:
                if seq == i and lo <= pos < hi:
                    end = hi
            ends.append(end)
    return torch.tensor(ends, dtype=torch.int32)


# Spans (images) in a fresh prefill, in a chunk after a cached prefix (the span's first
# part cached), across a query tile, next to each other, and a sequence without any.
SPAN_BATCH = [(40, 40), (30, 70), (1, 33), (50, 50)]
SPANS = [(0, 3, 19), (0, 25, 40), (1, 45, 66), (3, 2, 4), (3, 4, 47)]


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("fixed_split_size", [None, 32])
def test_bidirectional_spans_match_reference(sliding_window, fixed_split_size, device):
    key_end = _key_ends(SPAN_BATCH, SPANS).to(device)
    launch = {"block_m": 16, "block_n": 16}
    if fixed_split_size:
        launch |= {"fixed_split_size": fixed_split_size, "max_seq_len": 70}
    seq_lens = [s for _, s in SPAN_BATCH]
    key_cache, value_cache, block_tables = make_paged_cache(
        seq_lens, 8, NUM_KV_HEADS, 32, torch.float32, device
    )
    q_lens = [q for q, _ in SPAN_BATCH]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(sum(q_lens), NUM_KV_HEADS * 2, 32, generator=gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (query, key_cache, value_cache, block_tables, lens, qsl.to(device), 32**-0.5)
    out = prefill_attention(*args, max(q_lens), sliding_window, key_end=key_end, **launch)
    ref = prefill_attention_ref(*args, sliding_window, key_end=key_end)
    assert_close(out, ref, ATTENTION_TOLERANCE)
    causal = prefill_attention_ref(*args, sliding_window)
    assert not torch.allclose(ref, causal)  # the spans change the image tokens
    text = (key_end.cpu() == _key_ends(SPAN_BATCH, [])).nonzero()[:, 0]
    assert_close(ref[text], causal[text], ATTENTION_TOLERANCE)  # and nothing else


def test_bidirectional_spans_arguments_are_checked(device):
    key_cache, value_cache, block_tables = make_paged_cache([5], 16, 2, 64, torch.float32, device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=device)
    query = torch.randn(5, 4, 64, device=device)
    args = (query, key_cache, value_cache, block_tables, lens, qsl, 1.0, 5)
    with pytest.raises(ValueError, match="key_end"):
        prefill_attention(*args, key_end=torch.full((4,), 5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="split_programs=True cannot take key_end"):
        prefill_attention(
            *args,
            key_end=torch.full((5,), 5, dtype=torch.int32, device=device),
            fixed_split_size=64,
            max_seq_len=5,
            split_programs=True,
        )
