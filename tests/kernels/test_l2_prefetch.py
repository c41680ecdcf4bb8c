"""The L2 prefetch reads what it is asked to: each program's XOR of the words of its chunks,
against numpy's XOR over the same bytes and against the kernel's PyTorch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchlm.kernels.l2_prefetch import CHUNK_WORDS, prefetch_l2, prefetch_l2_ref


def _numpy_sinks(t: torch.Tensor, nbytes: int | None, programs: int) -> np.ndarray:
    raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    take = raw.size if nbytes is None else min(nbytes, raw.size)
    words = raw[: take - take % 4].view(np.int32)
    chunks = [words[c : c + CHUNK_WORDS] for c in range(0, words.size, CHUNK_WORDS)]
    grid = max(1, min(programs, len(chunks)))
    sinks = np.zeros(grid, dtype=np.int32)
    for c, chunk in enumerate(chunks):
        sinks[c % grid] ^= np.bitwise_xor.reduce(chunk, initial=np.int32(0))
    return sinks


def _tensor(shape, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int32:
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=dtype).to(device)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize(
    ("shape", "dtype", "nbytes", "programs"),
    [
        ((256, 512), torch.bfloat16, None, 2),  # 4 chunks, 2 rounds of 2 programs
        ((300, 700), torch.float16, None, 2),  # 7 chunks: a partial last one, uneven rounds
        ((300, 700), torch.float16, None, 3),
        ((384, 512), torch.bfloat16, 160_002, 4),  # a prefix, not whole words
        ((16, 64), torch.float32, 1 << 30, 4),  # more than the tensor: all of it, 1 program
        ((3, 5), torch.int32, 8, None),  # two words; the default grid
        ((3, 5), torch.int32, 3, None),  # no whole word: nothing read
    ],
)
def test_prefetch_sink_is_the_xor_of_the_words_read(shape, dtype, nbytes, programs, device):
    t = _tensor(shape, dtype, device)
    expected = _numpy_sinks(t, nbytes, programs or 1_000_000)
    sink = prefetch_l2(t, nbytes, programs=programs)
    assert sink.numel() == expected.size
    np.testing.assert_array_equal(sink.cpu().numpy(), expected)
    ref = prefetch_l2_ref(t, nbytes, programs=programs)
    np.testing.assert_array_equal(ref.cpu().numpy(), expected)


def test_prefetch_reuses_sink_and_rejects_bad_input(device):
    t = _tensor((256, 256), torch.float32, device)  # 4 chunks
    sink = torch.zeros(8, dtype=torch.int32, device=device)
    assert prefetch_l2(t, sink=sink, programs=3) is sink
    np.testing.assert_array_equal(sink.cpu().numpy()[:3], _numpy_sinks(t, None, 3))
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_l2(t.t())
    with pytest.raises(ValueError, match="at least 3 elements"):
        prefetch_l2(t, sink=torch.zeros(2, dtype=torch.int32, device=device), programs=3)
    with pytest.raises(ValueError, match="nbytes=-4"):
        prefetch_l2(t, -4)
    with pytest.raises(ValueError, match="programs=0"):
        prefetch_l2(t, programs=0)
