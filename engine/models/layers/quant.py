"""Quantized matmuls for the decoder's `Linear` layers (q|k|v, o, gate|up, down).

Weights are stored with one scale per output channel (`weight_scale`, float32 `[out]`), so
that `W ≈ weight.float() * weight_scale[:, None]`:

- `fp8`: e4m3 weights. On CUDA devices of capability 8.9 or more (Ada, Hopper) activations
  are quantised per token at run time (one Triton kernel, `gpu_kernels/quant_fp8.py`) and
  `torch._scaled_mm` multiplies the two in fp8 (row-wise scales, bfloat16 output).
  Elsewhere the weights are dequantised to the activation dtype: per matmul on CUDA (the
  weights stay fp8 in memory), once at load on CPU (the CPU matmul of the dequantised
  weights is the reference the tests run).
- `int8`: weight-only int8 (symmetric, round to nearest), dequantised inside each matmul
  (the weights stay int8 in memory).

With tensor parallelism a layer is quantised after it was sharded, so each rank's scales
belong to its own rows (column-parallel) or its own partial sums (row-parallel).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchlm.kernels import use_triton_kernels

from .linear import Linear, LinearMethod

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0
_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale


class QuantizedTensor(NamedTuple):
    values: torch.Tensor  # [rows, cols] fp8 or int8
    scale: torch.Tensor  # [rows] float32: values.float() * scale[:, None] ≈ the input


def quantize_per_row(x: torch.Tensor, dtype: torch.dtype) -> QuantizedTensor:
    """Symmetric quantisation with one scale per row (an output channel of a weight, or a
    token of an activation).

    The scale is the row's largest magnitude times `1 / qmax` (rounded to float32), not
    divided by `qmax`: PyTorch on CUDA divides a tensor by a Python number that way, so this
    gives the same scales on every device (they differ in the last bit for about half the
    rows otherwise), and the fp8 activation kernel follows the same rule.

    Args:
        x: `[rows, cols]` floating-point tensor.
        dtype: `torch.float8_e4m3fn` (scaled so the row's largest magnitude maps to 448) or
            `torch.int8` (to 127, rounded to nearest).
    """
    x32 = x.float()
    qmax = FP8_MAX if dtype == FP8_DTYPE else INT8_MAX
    scale = x32.abs().amax(dim=-1).clamp(min=_MIN_SCALE) * (1.0 / qmax)  # [rows]
    scaled = x32 / scale[:, None]
    if dtype == torch.int8:
        scaled = scaled.round()
    return QuantizedTensor(scaled.clamp(-qmax, qmax).to(dtype), scale)


def quantize_fp8_per_token(x: torch.Tensor) -> QuantizedTensor:
    """`quantize_per_row(x, FP8_DTYPE)` for activations: the same values, without a float32
    copy of `x` (the row maxima are exact in `x.dtype`, and the division promotes).

    On CUDA `Fp8LinearMethod` runs `batchlm.kernels.quant_fp8` instead, which computes the
    same values and scales bit for bit in one kernel.
    """
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) * (1.0 / FP8_MAX)
    scaled = x / scale  # [n, cols] float32
    return QuantizedTensor(scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.squeeze(-1))


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[rows, cols]` quantized values and `[rows]` scales → the weight in `dtype`."""
    return values.to(dtype) * scale.to(dtype)[:, None]


def _set_param(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(value, requires_grad=False))


class PerChannelLinearMethod(LinearMethod):
    """A quantized weight of `weight_dtype` with one float32 scale per output channel
    (`weight_scale`), as both methods below store it."""

    weight_dtype: torch.dtype

    def create_weights(self, layer: Linear) -> None:
        out_features, in_features = layer.weight.shape
        dev = layer.weight.device
        _set_param(
            layer,
            "weight",
            torch.empty(out_features, in_features, dtype=self.weight_dtype, device=dev),
        )
        _set_param(
            layer, "weight_scale", torch.empty(out_features, dtype=torch.float32, device=dev)
        )

    def quantize_weights(self, layer: Linear) -> None:
        q = quantize_per_row(layer.weight.data, self.weight_dtype)
        _set_param(layer, "weight", q.values)
        _set_param(layer, "weight_scale", q.scale)


class Fp8LinearMethod(PerChannelLinearMethod):
    """fp8 e4m3 weights; fp8 activations (per token) where `torch._scaled_mm` runs."""

    name = "fp8"
    weight_dtype = FP8_DTYPE

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.has_scaled_mm = supports_fp8_matmul(device)

    def process_weights(self, layer: Linear) -> None:
        if self.device.type == "cpu":
            # The reference path: the dequantised weights, in a plain matmul.
            weight = dequantize(layer.weight.data, layer.weight_scale.data, self.dtype)
            del layer.weight_scale
            _set_param(layer, "weight", weight)
            layer.quant_method = None
            return
        out_features, in_features = layer.weight.shape
        # cuBLASLt's fp8 matmul needs both weight dimensions to be multiples of 16.
        layer.fp8_scaled_mm = (
            self.has_scaled_mm and in_features % 16 == 0 and out_features % 16 == 0
        )
        layer.quant_method = self

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not getattr(layer, "fp8_scaled_mm", False):
            return F.linear(x, dequantize(layer.weight, layer.weight_scale, x.dtype))
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [n, in]
        if use_triton_kernels(x2):
            # One kernel (one read of x) instead of the reference's chain of element-wise ops.
            from batchlm.kernels.quant_fp8 import quantize_fp8_per_token as quantize_fp8_kernel

            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            xq = quantize_fp8_kernel(x2, min_amax=_MIN_SCALE)
        else:
            xq = quantize_fp8_per_token(x2)
        out = torch._scaled_mm(
            xq.values,
            layer.weight.t(),  # [in, out], column-major as cuBLASLt wants it
            scale_a=xq.scale[:, None],  # [n, 1]
            scale_b=layer.weight_scale[None, :],  # [1, out]
            out_dtype=torch.bfloat16,  # row-wise scaling produces bfloat16 only
        )
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])


class Int8LinearMethod(PerChannelLinearMethod):
    """Weight-only int8: the int8 weight is converted to the activation dtype inside each
    matmul and the output columns are scaled (`x (q s)^T = (x q^T) s`).

    `torch._weight_int8pack_mm` computes the same on CPU, but slower than this on the
    machines measured (docs/performance.md).
    """

    name = "int8"
    weight_dtype = torch.int8

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.to(x.dtype)


LINEAR_METHODS: dict[str, type[PerChannelLinearMethod]] = {
    "fp8": Fp8LinearMethod,
    "int8": Int8LinearMethod,
}
"""Quantization method name → its linear method."""


def supports_fp8_matmul(device: torch.device) -> bool:
    """Whether fp8 × fp8 matmuls run natively (`torch._scaled_mm` on capability >= 8.9)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
