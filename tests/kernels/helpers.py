"""Tolerances and paged-cache builders shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (atol, rtol). Attention rounds the softmax weights to the activation dtype before the
# value product; bfloat16 has 8 mantissa bits, and the interpreter truncates when it
# rounds to bfloat16.
ATTENTION_TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
ELEMENTWISE_TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

ON_GPU = torch.cuda.is_available()


def gpu_only(*values) -> pytest.param:  # type: ignore[valid-type]
    """A parametrization too large for the interpreter: run on CUDA only."""
    return pytest.param(*values, marks=pytest.mark.gpu)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: dict) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    atol, rtol = tolerance[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def make_paged_cache(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key / value caches with random content for each sequence's positions, NaN elsewhere
    (so a kernel that reads a slot it should not ends up with NaN), and block tables that
    point at shuffled, non-contiguous blocks.

    Returns:
        key_cache, value_cache `[num_blocks, block_size, num_kv_heads, head_dim]` and
        block_tables `[num_seqs, max_num_blocks]` int32.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few spare blocks never referenced
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 1  # a trailing unused column
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = order[used : used + nb]
        used += nb
        block_tables[i, :nb] = ids
        pos = torch.arange(n)
        slots = (ids[pos // block_size], pos % block_size)
        key_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        value_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    return key_cache.to(device), value_cache.to(device), block_tables.to(device)


def all_reduce_inputs(rank: int, calls: list, seed: int) -> list[tuple]:
    """For the all-reduce tests: this rank's part of every (kind, shape, dtype) call, with
    the residual and weight that every rank shares for a "norm" call (else None), on CPU."""
    own = torch.Generator().manual_seed(seed + rank)
    shared = torch.Generator().manual_seed(seed + 1000)
    out = []
    for kind, shape, dtype in calls:
        if dtype == torch.int64:  # sampled ids, broadcast as sums
            out.append((torch.randint(-(2**40), 2**40, shape, generator=own), None, None))
            continue
        part = (torch.randn(shape, generator=own) * 4).to(dtype)
        residual = torch.randn(shape, generator=shared).to(dtype)
        weight = torch.randn(shape[-1], generator=shared).to(dtype)
        out.append((part, residual, weight) if kind == "norm" else (part, None, None))
    return out
