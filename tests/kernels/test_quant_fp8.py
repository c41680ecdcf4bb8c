"""Per-token fp8 quantisation: the Triton kernel against its PyTorch reference and the engine's.

What is compared, everywhere: the fp8 values byte for byte (viewed as uint8, so -0 and +0
differ and no tolerance hides a rounding step) and the float32 scales with `torch.equal`.
The references are `quantize_fp8_per_token_ref` and the engine's
`quant.quantize_fp8_per_token` (the fallback `Fp8LinearMethod` keeps off CUDA).
"""

from __future__ import annotations

import pytest
import torch

from batchlm.engine.models.layers import quant
from batchlm.kernels.quant_fp8 import (
    Fp8PerTokenOutput,
    quantize_fp8_per_token,
    quantize_fp8_per_token_ref,
)

from .helpers import DTYPES, ON_GPU, gpu_only

FP8 = torch.float8_e4m3fn


@pytest.fixture
def device() -> torch.device:
    """CUDA where the GPU converts to fp8 (capability >= 8.9, Triton's float8e4nv), else the
    CPU interpreter."""
    if not ON_GPU:
        return torch.device("cpu")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's float8e4nv needs CUDA capability >= 8.9")
    return torch.device("cuda")


def _assert_same(got: Fp8PerTokenOutput, want: Fp8PerTokenOutput | quant.QuantizedTensor):
    assert got.values.dtype == FP8 and got.scale.dtype == torch.float32
    assert got.values.shape == want.values.shape and got.scale.shape == want.scale.shape
    assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)


def _activations(num_rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows with assorted ranges (so scales and subnormal fp8 values vary), a row of
    zeros and a row of negative zeros and tiny values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, cols, generator=gen)
    x *= torch.logspace(-3, 3, max(num_rows, 1))[:num_rows, None]
    if num_rows > 1:
        x[1] = 0.0
    if num_rows > 2:
        x[2] = -0.0
        x[2, ::7] = 1e-30  # below bfloat16 / float16 precision: rounds to 0 or subnormal
    return x.to(dtype)


@pytest.mark.parametrize(
    ("num_rows", "cols"),
    [(0, 16), (1, 16), (3, 64), (17, 200), (3, 1100), (17, 64),
     gpu_only(256, 4096), gpu_only(1000, 14336), gpu_only(5, 20000)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_bit_for_bit(num_rows, cols, dtype, device):
    x = _activations(num_rows, cols, dtype).to(device)
    got = quantize_fp8_per_token(x)
    _assert_same(got, quantize_fp8_per_token_ref(x))
    _assert_same(got, quant.quantize_fp8_per_token(x))


@pytest.mark.parametrize(("cols", "block_k"), [(200, 64), (1100, 256), (64, 64), (17, 16)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_longer_than_a_block_are_read_in_chunks(cols, block_k, dtype, device):
    x = _activations(5, cols, dtype, seed=1).to(device)
    _assert_same(quantize_fp8_per_token(x, block_k=block_k), quantize_fp8_per_token_ref(x))


def test_rounds_every_tie_to_nearest_even(device):
    """A row whose maximum is 448 has scale 1.0 exactly, so each other value is cast as is:
    every e4m3 value, every midpoint between two (ties), and the floats just either side of
    each midpoint, subnormals included, with both signs."""
    grid = torch.arange(127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mid = (grid[:-1] + grid[1:]) / 2
    inf = torch.tensor(float("inf"))
    values = torch.cat([grid, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf)])
    values = torch.cat([values, torch.tensor([2.0**-10, 2.0**-11, 1e-30, 0.0])])
    x = torch.cat([torch.tensor([448.0]), values, -values])[None].to(device)
    got = quantize_fp8_per_token(x)
    assert got.scale.item() == 1.0
    _assert_same(got, quantize_fp8_per_token_ref(x))
    _assert_same(got, quant.quantize_fp8_per_token(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows_and_given_outputs(dtype, device):
    """Rows of a wider tensor (row stride > cols) read in place; `out` and `scale_out` are
    filled and returned."""
    wide = _activations(9, 300, dtype, seed=2).to(device)
    x = wide[:, 40:240]  # [9, 200], row stride 300
    out_wide = torch.zeros(9, 256, dtype=FP8, device=device)
    out = out_wide[:, :200]
    scale_out = torch.zeros(9, 2, device=device)[:, 0]  # stride 2
    got = quantize_fp8_per_token(x, out=out, scale_out=scale_out)
    assert got.values is out and got.scale is scale_out
    want = quantize_fp8_per_token_ref(x.contiguous())
    _assert_same(got, want)
    assert torch.all(out_wide[:, 200:].view(torch.uint8) == 0)  # nothing past the columns


def test_min_amax_bounds_the_scale_of_zero_rows(device):
    x = torch.zeros(2, 32, device=device)
    x[1, 3] = 1e-13
    got = quantize_fp8_per_token(x, min_amax=1e-6)
    _assert_same(got, quantize_fp8_per_token_ref(x, min_amax=1e-6))
    want = torch.tensor(1e-6, dtype=torch.float32) * (1 / 448)  # float32 product
    assert torch.equal(got.scale, want.expand(2).to(device))


def test_launcher_rejects_bad_arguments(device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        quantize_fp8_per_token(x[None])
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        quantize_fp8_per_token(x.long())
    with pytest.raises(ValueError, match="x must have stride 1 in its last dimension"):
        quantize_fp8_per_token(x.t())
    with pytest.raises(ValueError, match="out has size 32 in dimension 1"):
        quantize_fp8_per_token(x, out=torch.empty(4, 32, dtype=FP8, device=device))
    with pytest.raises(ValueError, match="out has dtype torch.bfloat16"):
        quantize_fp8_per_token(x, out=torch.empty(4, 64, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="scale_out has size 3 in dimension 0"):
        quantize_fp8_per_token(x, scale_out=torch.empty(3, device=device))
    with pytest.raises(ValueError, match="scale_out must have 1 dimensions"):
        quantize_fp8_per_token(x, scale_out=torch.empty(4, 1, device=device))
    with pytest.raises(ValueError, match="x has 0 columns"):
        quantize_fp8_per_token(x[:, :0])
    with pytest.raises(ValueError, match="min_amax=0.0 must be > 0"):
        quantize_fp8_per_token(x, min_amax=0.0)
    with pytest.raises(ValueError, match="block_k=48 must be a power of two"):
        quantize_fp8_per_token(x, block_k=48)


@pytest.mark.gpu
def test_rejects_tensors_on_two_devices():
    if not ON_GPU:
        pytest.skip("needs CUDA")
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        quantize_fp8_per_token(x, scale_out=torch.empty(4))


@pytest.mark.gpu
def test_fp8_linear_layer_runs_the_kernel(device, monkeypatch):
    """The layer quantises its input with the kernel, and its output equals the one with the
    PyTorch quantisation."""
    if device.type != "cuda":
        pytest.skip("the kernel is used on CUDA only")
    from batchlm.engine.models.layers.linear import Linear
    from batchlm.kernels import quant_fp8

    calls = []

    def spy(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return quantize_fp8_per_token(x, *args, **kwargs)

    monkeypatch.setattr(quant_fp8, "quantize_fp8_per_token", spy)

    torch.manual_seed(0)
    layer = Linear(256, 512, bias=False).to(device, torch.bfloat16)
    method = quant.Fp8LinearMethod(device, torch.bfloat16)
    method.quantize_weights(layer)
    method.process_weights(layer)
    assert layer.fp8_scaled_mm
    x = torch.randn(3, 33, 256, device=device, dtype=torch.bfloat16)
    xq = quant.quantize_fp8_per_token(x.reshape(-1, 256))
    want = torch._scaled_mm(
        xq.values,
        layer.weight.t(),
        scale_a=xq.scale[:, None],
        scale_b=layer.weight_scale[None, :],
        out_dtype=torch.bfloat16,
    ).reshape(3, 33, 512)
    assert torch.equal(layer(x), want)
    assert calls == [(99, 256)]
