"""RMSNorm and fused residual-add + RMSNorm against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

from .helpers import DTYPES, ELEMENTWISE_TOLERANCE, assert_close, gpu_only


@pytest.mark.parametrize(
    ("shape", "hidden"),
    [((5,), 64), ((3, 4), 128), ((7,), 96), gpu_only((4096,), 4096), gpu_only((33,), 8192)],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_reference(shape, hidden, dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, hidden, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(*shape, hidden, generator=gen).to(dtype).to(device)
    weight = torch.randn(hidden, generator=gen).to(dtype).to(device)
    x_before, residual_before = x.clone(), residual.clone()

    assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), ELEMENTWISE_TOLERANCE)
    out = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert_close(out.out, ref.out, ELEMENTWISE_TOLERANCE)
    assert_close(out.residual, ref.residual, ELEMENTWISE_TOLERANCE)
    # Pure: the inputs are untouched.
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("num_tokens", [1, 6, 37])
def test_rms_norm_of_strided_heads(num_tokens, device):
    """Per-head q / k norms (Qwen3) see `[tokens, heads, head_dim]` views of a wider row,
    read in place (several rows per program, the last program's partly masked)."""
    qkv = torch.randn(num_tokens, 3 * 4 * 32, device=device)
    q = qkv[:, : 4 * 32].view(num_tokens, 4, 32)
    k = qkv[:, 4 * 32 : 5 * 32].view(num_tokens, 1, 32)
    weight = torch.randn(32, device=device)
    for heads in (q, k):
        out = rms_norm(heads, weight, 1e-6)
        assert out.shape == heads.shape and out.is_contiguous()
        assert_close(out, rms_norm_ref(heads, weight, 1e-6), ELEMENTWISE_TOLERANCE)


def test_float32_weight_promotes_the_output(device):
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    weight = torch.randn(64, device=device)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    # The normalised value is rounded to float16 before the float32 weight scales it.
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=2e-3, rtol=2e-3)


def test_launcher_rejects_bad_arguments(device):
    x = torch.randn(3, 64, device=device)
    weight = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="weight has size 32 in dimension 0"):
        rms_norm(x, weight[:32], 1e-6)
    with pytest.raises(ValueError, match="residual has shape"):
        fused_add_rms_norm(x, x[:2], weight, 1e-6)
    with pytest.raises(ValueError, match="residual has dtype torch.float16"):
        fused_add_rms_norm(x, x.half(), weight, 1e-6)
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        rms_norm(x.long(), weight, 1e-6)


@pytest.mark.parametrize("hidden", [64, 96, 128, gpu_only(2048), gpu_only(4096)])
def test_a_row_gets_the_same_bits_in_any_batch(hidden, device):
    """Rows per program and launch chosen by the hidden size alone: a row's output does not
    depend on how many rows come with it, nor on where in a program it lands (the
    batch-invariant mode relies on it)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, hidden, generator=gen).to(torch.bfloat16).to(device)
    residual = torch.randn(37, hidden, generator=gen).to(torch.bfloat16).to(device)
    weight = torch.randn(hidden, generator=gen).to(torch.bfloat16).to(device)
    full = fused_add_rms_norm(x, residual, weight, 1e-6)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 7), slice(36, 37)):
        part = fused_add_rms_norm(x[rows], residual[rows], weight, 1e-6)
        assert torch.equal(part.out, full.out[rows]) and torch.equal(
            part.residual, full.residual[rows]
        )
    flipped = rms_norm(x.flip(0), weight, 1e-6)
    assert torch.equal(flipped.flip(0), rms_norm(x, weight, 1e-6))
    heads = torch.cat([x, x], dim=1).view(37, 2, hidden)  # heads of a wider row, in place
    both = rms_norm(heads, weight, 1e-6)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
        assert torch.equal(rms_norm(heads[rows], weight, 1e-6), both[rows])
        assert torch.equal(both[rows, 1], rms_norm(x[rows], weight, 1e-6))
