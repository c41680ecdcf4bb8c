"""A tile's `tl.dot` gives each row the same bits wherever the row sits in the tile, as a
GPU's MMA does (under the interpreter: `batchlm.kernels.interpret`'s row-by-row dot)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import batchlm.kernels.launch  # noqa: F401 - applies the interpreter's patches


@triton.jit
def _tile_dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rows, ks, cols = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
    # The weight tile read transposed, as the matmul kernels' TMA path reads it.
    b = tl.load(b_ptr + cols[:, None] * K + ks[None, :])
    acc = tl.dot(a, tl.trans(b), input_precision="ieee")
    acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")  # and with an accumulator
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)


def _tile_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[0], device=a.device)
    _tile_dot_kernel[(1,)](a, b, out, a.shape[0], a.shape[1], b.shape[0])
    return out


def test_a_row_gets_the_same_bits_at_every_place_in_the_tile(device):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=gen).to(device)
    b = torch.randn(32, 64, generator=gen).to(device)
    full = _tile_dot(a, b)
    torch.testing.assert_close(full, 2 * (a @ b.T), rtol=1e-5, atol=1e-4)
    for row in range(16):
        alone = torch.zeros_like(a)
        alone[0] = a[row]
        assert torch.equal(_tile_dot(alone, b)[0], full[row]), f"row {row}"
