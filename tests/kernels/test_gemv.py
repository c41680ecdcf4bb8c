"""The one-row matrix-vector kernel against the float32 product, and its launch checks."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.gemv import choose_gemv_launch, gemv, gemv_ref

from .helpers import DTYPES, ON_GPU, gpu_only

# The float32 reference rounded to the output dtype differs from the kernel's own float32
# sum (another order) by at most an ulp or so of the output.
TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-2, 2e-3),
    torch.bfloat16: (1.5e-1, 1e-2),
}


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    atol, rtol = TOLERANCE[ref.dtype]
    torch.testing.assert_close(y.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("num_n", "num_k", "launch"),
    [
        (48, 64, {"block_k": 32}),  # even in N and K, several tiles
        (50, 100, {"block_k": 32}),  # ragged N and K
        (7, 1000, {}),  # fewer outputs than a program's block
        (40, 48, {"block_n": 8, "block_k": 16, "num_warps": 2, "num_stages": 1}),
        gpu_only(6144, 4096, {}),
        gpu_only(4096, 14336, {}),
        gpu_only(28672, 4096, {}),
        gpu_only(151936, 896, {}),
        gpu_only(3072, 4096, {}),  # the tuned launches of one rank's shapes at TP=2
        gpu_only(4096, 2048, {}),
        gpu_only(4096, 7168, {}),
        gpu_only(64128, 4096, {}),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_matches_the_float32_product(num_n, num_k, launch, bias, dtype, device):
    gen = torch.Generator().manual_seed(num_n + num_k)
    x = torch.randn(1, num_k, generator=gen).to(dtype).to(device)
    w = (torch.randn(num_n, num_k, generator=gen) / num_k**0.5).to(dtype).to(device)
    b = torch.randn(num_n, generator=gen).to(dtype).to(device) if bias else None
    _check(gemv(x, w, b, **launch), gemv_ref(x, w, b))


def test_gemv_reads_rows_of_wider_tensors(device):
    """x a row of a larger batch, the weight a slice of rows of a merged matrix."""
    gen = torch.Generator().manual_seed(3)
    xs = torch.randn(3, 96, generator=gen).to(device)
    merged = torch.randn(80, 96, generator=gen).to(device)
    w = merged[16:56]
    _check(gemv(xs[1:2], w, block_k=32), gemv_ref(xs[1:2], w))
    _check(gemv(xs[2], w, block_k=32), gemv_ref(xs[2:3], w)[0])  # a 1-d row → 1-d output


def test_gemv_refuses_what_it_would_misread(device):
    x = torch.randn(1, 32, device=device)
    w = torch.randn(8, 32, device=device)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 32, device=device), w)
    with pytest.raises(ValueError, match="weight"):
        gemv(x, torch.randn(8, 16, device=device))
    with pytest.raises(ValueError, match="dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="stride"):
        gemv(x, torch.randn(32, 8, device=device).T)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.randn(9, device=device))


def test_launch_defaults_follow_the_width_and_overrides_are_checked():
    assert choose_gemv_launch(28672, 4096) == (16, 256, 4, 4)
    assert choose_gemv_launch(4096, 14336) == (16, 1024, 8, 2)
    assert choose_gemv_launch(6144, 4096) == (8, 512, 4, 2)
    assert choose_gemv_launch(896, 100).block_k == 128  # no wider than the row needs
    assert choose_gemv_launch(4096, 7168) == (4, 1024, 4, 4)  # a tuned shape (down_proj, TP=2)
    assert choose_gemv_launch(4096, 7168, num_warps=8) == (4, 1024, 8, 4)
    assert choose_gemv_launch(6144, 4096, block_n=32, num_stages=1) == (32, 512, 4, 1)
    for bad in ({"block_n": 12}, {"block_k": 8}, {"num_warps": 3}, {"num_stages": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            choose_gemv_launch(64, 64, **bad)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the layer routes to the kernel on CUDA only")
def test_linear_layers_take_the_kernel_for_one_half_precision_row():
    from batchlm.engine.models.layers.linear import Linear, LMHead

    for layer in (Linear(256, 384, bias=True), LMHead(256, 1000, bias=False)):
        layer = layer.to("cuda", torch.bfloat16)
        x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
        _check(layer(x), gemv_ref(x, layer.weight, layer.bias))
        batch = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        _check(layer(batch), gemv_ref(batch, layer.weight, layer.bias))
