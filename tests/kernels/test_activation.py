"""SiLU-and-mul against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.activation import silu_and_mul, silu_and_mul_ref

from .helpers import DTYPES, ELEMENTWISE_TOLERANCE, assert_close, gpu_only


@pytest.mark.parametrize(
    "shape", [(5, 128), (2, 3, 200), (1, 2 * 1100), gpu_only((4096, 2 * 8192))]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_reference(shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype).to(device)
    before = x.clone()
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), ELEMENTWISE_TOLERANCE)
    assert torch.equal(x, before)


def test_launcher_rejects_bad_arguments(device):
    x = torch.randn(4, 10, device=device)
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(x[:, :9])
    with pytest.raises(ValueError, match="stride 1 in its last dimension"):
        silu_and_mul(x.t())
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        silu_and_mul(x.int())
