"""The fold of fixed key splits (batch-invariant attention's split programs) against its
PyTorch reference: every token reads only the splits it has keys in."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.merge_fixed_splits import merge_fixed_splits, merge_fixed_splits_ref

SPLIT = 16


def _partials(seq_lens, q_lens, num_heads, head_dim, num_splits, seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(q_lens)
    partial = torch.randn(num_tokens, num_heads, num_splits, head_dim, generator=gen)
    maxima = torch.randn(num_tokens, num_heads, num_splits, generator=gen) * 4
    sums = torch.rand(num_tokens, num_heads, num_splits, generator=gen) * 8 + 0.5
    max_sum = torch.stack([maxima, sums])
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    # Splits past a token's last key (or before its window) are never written by the split
    # programs: NaN there must not reach the output.
    for i, seq_len in enumerate(seq_lens):
        for row in range(int(qsl[i]), int(qsl[i + 1])):
            pos = seq_len - q_lens[i] + row - int(qsl[i])
            partial[row, :, pos // SPLIT + 1 :] = float("nan")
            max_sum[:, row, :, pos // SPLIT + 1 :] = float("nan")
    return partial, max_sum, torch.tensor(seq_lens), qsl


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merge_matches_reference(window, out_dtype, device):
    seq_lens, q_lens = [70, 9, 33], [3, 1, 5]
    num_splits = max(seq_lens) // SPLIT + 1
    partial, max_sum, lens, qsl = _partials(seq_lens, q_lens, 8, 32, num_splits, seed=3)
    if window is not None:  # splits wholly before a token's window are not written either
        for i, seq_len in enumerate(seq_lens):
            for row in range(int(qsl[i]), int(qsl[i + 1])):
                pos = seq_len - q_lens[i] + row - int(qsl[i])
                first = max(pos - window + 1, 0) // SPLIT
                partial[row, :, :first] = float("nan")
                max_sum[:, row, :, :first] = float("nan")
    expected = merge_fixed_splits_ref(partial, max_sum, lens, qsl, SPLIT, out_dtype, window)
    out = torch.empty(sum(q_lens), 8, 32, dtype=out_dtype, device=device)
    got = merge_fixed_splits(
        partial.to(device), max_sum.to(device), lens.to(device), qsl.to(device), SPLIT, 2, out,
        sliding_window=window,
    )  # fmt: skip
    assert torch.isfinite(got.float()).all()
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)


def test_merge_refuses_bad_arguments():
    partial, max_sum, lens, qsl = _partials([20], [2], 4, 16, 2, seed=0)
    out = torch.empty(2, 4, 16)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        merge_fixed_splits(partial, max_sum, lens, qsl, SPLIT, 3, out)
    with pytest.raises(ValueError, match="split_size=0"):
        merge_fixed_splits(partial, max_sum, lens, qsl, 0, 2, out)
    with pytest.raises(ValueError, match="max_sum has shape"):
        merge_fixed_splits(partial, max_sum[:, :1], lens, qsl, SPLIT, 2, out)
