"""Which quantization a model loads with, and the loader's side of it.

`quantization=` accepts `"fp8"` or `"int8"` (see `models/layers/quant.py`): full-precision
weights are quantised at load, after tensor-parallel sharding. A checkpoint whose
config.json has a `quantization_config` is loaded as it is quantized, without being told:

- `quant_method: "fp8"` (transformers' fine-grained fp8 with `weight_block_size: null`, and
  the older AutoFP8 / vLLM layout): float8_e4m3fn weights with a per-tensor scale,
  `weight_scale_inv` (transformers) or `weight_scale`;
- `quant_method: "compressed-tensors"` with 8-bit float weights (`strategy` `tensor` or
  `channel`, symmetric; activations quantised statically or dynamically alike):
  float8_e4m3fn weights with `weight_scale` of shape `[1]` or `[out, 1]`;
- int4 weight-only checkpoints (method `int4`): `quant_method` `gptq`, `awq`, or
  `compressed-tensors` with `format: pack-quantized` (settings in `int4_config.py`,
  tensors in `int4_formats.py`, loading in `int4_weights.py`). `quantization=` may name
  them as vLLM does (`gptq`, `gptq_marlin`, `awq`, `awq_marlin`, `compressed-tensors`).

Per-tensor scales become per-channel ones (the same value on every row of the projection),
so merged projections (q|k|v, gate|up) keep each part's scale. Static activation scales
(`input_scale`, `activation_scale`) and KV-cache scales are read past: activations are
always quantised per token at run time, and the KV cache keeps the model dtype.

Mixture-of-experts layers: with `quantization="fp8"` the stacked expert weights are
quantised at load too (`ExpertWeights.quantize_fp8`), on CPU and on CUDA devices of
capability 8.9 or more (older GPUs keep them in the model dtype: Triton cannot convert
e4m3 there); with `"int8"` they stay in the model dtype. The routers always do. fp8
checkpoints of MoE models are refused (their per-expert scales are not read); int4 ones
load their attention in int4 and are refused where the experts are int4.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from ..config import QuantizationConfig
from ..errors import InvalidParamError, UnsupportedModelError
from ..models.layers.linear import Linear, LinearMethod, MergedLinear
from ..models.layers.moe import ExpertWeights
from ..models.layers.quant import LINEAR_METHODS, supports_fp8_matmul
from .int4_config import awq_config, compressed_tensors_int4_config, gptq_config, has_int_weights

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = tuple(LINEAR_METHODS)
"""Values `quantization=` accepts (besides a quantized checkpoint's own `quant_method`)."""
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
"""`quant_method`s of checkpoints that load without `quantization=`."""
CHECKPOINT_ALIASES = {"gptq": ("gptq_marlin",), "awq": ("awq_marlin",)}
"""Other names `quantization=` may give a checkpoint's `quant_method` (vLLM's kernels)."""

SCALE_LEAF = "weight_scale"
"""The per-channel scale parameter of a quantized layer."""
_RENAMED_LEAVES = {"weight_scale_inv": SCALE_LEAF}
_SKIPPED_LEAVES = ("input_scale", "activation_scale", "k_scale", "v_scale", "kv_scale")


def resolve_quantization(
    requested: str | None, hf_config: Any, device: torch.device
) -> QuantizationConfig | None:
    """The quantization a model runs with: the checkpoint's own, else `quantization=`.

    Raises:
        InvalidParamError: an unknown method, a method the device cannot run, or one that
            contradicts how the checkpoint is quantized.
        UnsupportedModelError: the checkpoint is quantized in a way batchlm cannot load.
    """
    if requested is not None:
        if not isinstance(requested, str):
            raise InvalidParamError(
                f"quantization={requested!r} must be a string; supported: {_supported_text()}"
            )
        aliases = [a for names in CHECKPOINT_ALIASES.values() for a in names]
        if requested not in (*QUANTIZATION_METHODS, *CHECKPOINT_METHODS, *aliases):
            raise InvalidParamError(
                f"quantization={requested!r} is not supported; supported: {_supported_text()}"
            )
    checkpoint = checkpoint_quantization(hf_config)
    if checkpoint is not None:
        accepted = (
            None,
            checkpoint.method,
            checkpoint.checkpoint_method,
            *CHECKPOINT_ALIASES.get(checkpoint.checkpoint_method or "", ()),
        )
        if requested in accepted:
            _check_device(checkpoint.method, device)
            return checkpoint
        raise InvalidParamError(
            f"quantization={requested!r}, but the checkpoint is already quantized "
            f"(quant_method={checkpoint.checkpoint_method!r}, {checkpoint.method} weights); "
            f"drop quantization= or pass quantization={_name_of(checkpoint)!r}"
        )
    if requested is None:
        return None
    if requested not in QUANTIZATION_METHODS:
        raise InvalidParamError(
            f"quantization={requested!r} loads checkpoints quantized that way, but this "
            f"checkpoint's config.json has no quantization_config; to quantise at load use "
            f"one of {', '.join(map(repr, QUANTIZATION_METHODS))}"
        )
    _check_device(requested, device)
    return QuantizationConfig(method=requested)


def _name_of(qc: QuantizationConfig) -> str:
    """The `quantization=` value that names a checkpoint's quantization (vLLM's name)."""
    return qc.checkpoint_method if qc.method == "int4" and qc.checkpoint_method else qc.method


def _supported_text() -> str:
    return (
        f"{', '.join(map(repr, QUANTIZATION_METHODS))} (quantised at load) or None; "
        "checkpoints quantized to fp8 (quant_method 'fp8' or 'compressed-tensors') or int4 "
        "('gptq', 'awq', 'compressed-tensors') load without quantization="
    )


def _check_device(method: str, device: torch.device) -> None:
    if method == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise InvalidParamError(
            f"quantization='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
            "lacks; upgrade torch or use quantization='int8'"
        )
    if device.type not in ("cpu", "cuda"):
        raise InvalidParamError(
            f"quantization={method!r} runs on 'cpu' or 'cuda', not {device.type!r}; "
            "use one of those devices or drop quantization="
        )
    if method == "fp8" and device.type == "cuda" and not supports_fp8_matmul(device):
        logger.warning(
            "quantization='fp8': %s has no fp8 matmul (needs CUDA capability >= 8.9); the "
            "fp8 weights are dequantised per matmul (less memory, not faster). "
            "quantization='int8' is the other choice.",
            torch.cuda.get_device_name(device),
        )


def checkpoint_quantization(hf_config: Any) -> QuantizationConfig | None:
    """What a checkpoint's `quantization_config` declares, or None when it has none."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise UnsupportedModelError(
                f"the checkpoint is fp8 with block-wise scales (weight_block_size="
                f"{qc['weight_block_size']}); batchlm loads fp8 checkpoints with per-tensor or "
                "per-channel scales. Load the original full-precision checkpoint with "
                "quantization='fp8' instead"
            )
        ignored = list(qc.get("ignored_layers") or []) + list(
            qc.get("modules_to_not_convert") or []
        )
        return QuantizationConfig("fp8", True, "fp8", tuple(ignored))
    if method == "gptq":
        return gptq_config(qc)
    if method == "awq":
        return awq_config(qc)
    if method == "compressed-tensors":
        if has_int_weights(qc):
            return compressed_tensors_int4_config(qc)
        _check_compressed_tensors(qc)
        return QuantizationConfig("fp8", True, method, tuple(qc.get("ignore") or []))
    raise UnsupportedModelError(
        f"the checkpoint is quantized with quant_method={method!r}, which batchlm cannot load; "
        "it loads fp8 ('fp8', 'compressed-tensors') and int4 ('gptq', 'awq', "
        "'compressed-tensors' pack-quantized) checkpoints, or a full-precision checkpoint "
        f"quantised at load (quantization={QUANTIZATION_METHODS})"
    )


def _check_compressed_tensors(qc: dict) -> None:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    problems = []
    if fmt not in (None, "float-quantized", "naive-quantized"):
        problems.append(f"format={fmt!r}")
    if not groups:
        problems.append("no config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel"):
            problems.append(
                f"{name}: weights type={kind[0]!r} num_bits={kind[1]!r} strategy={kind[2]!r}"
            )
        if weights.get("symmetric") is False:
            problems.append(f"{name}: asymmetric weights")
    if problems:
        raise UnsupportedModelError(
            f"compressed-tensors checkpoint not supported ({'; '.join(problems)}); batchlm "
            "loads 8-bit float weights with per-tensor or per-channel symmetric scales "
            "(format 'float-quantized')"
        )


# ---- the model's side ----------------------------------------------------------------


def make_linear_method(
    qc: QuantizationConfig, device: torch.device, dtype: torch.dtype
) -> LinearMethod:
    if qc.method == "int4":
        from ..models.layers.int4 import Int4LinearMethod

        return Int4LinearMethod(device, dtype, qc.group_size, qc.symmetric, qc.act_order)
    return LINEAR_METHODS[qc.method](device, dtype)


def quantizable_layers(model: nn.Module) -> list[tuple[str, Linear]]:
    """The decoder projections (`Linear` layers): not embeddings, the LM head or norms."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]


def create_quantized_weights(model: nn.Module, method: LinearMethod, qc: QuantizationConfig):
    """Before an fp8 checkpoint is loaded: quantized weights and scales in every projection
    the checkpoint quantized (int4 checkpoints: `int4_weights.Int4Loader`)."""
    if any(isinstance(m, ExpertWeights) for m in model.modules()):
        raise UnsupportedModelError(
            f"{type(model).__name__}: batchlm does not load mixture-of-experts checkpoints "
            f"quantized to fp8 (quant_method={qc.checkpoint_method!r}); load the "
            "full-precision checkpoint with quantization='fp8' to quantise it at load, "
            "experts included"
        )
    packed = getattr(model, "packed_modules", {})
    for name, layer in quantizable_layers(model):
        if not is_ignored(name, layer, packed, qc.ignored_modules):
            method.create_weights(layer)


def finish_quantization(model: nn.Module, method: LinearMethod, qc: QuantizationConfig):
    """After loading: quantise full-precision projections (or take the checkpoint's), and
    hand them to the method."""
    for _, layer in quantizable_layers(model):
        if qc.method == "int4":
            if hasattr(layer, "int4_device"):
                method.process_weights(layer)
            continue
        if qc.from_checkpoint:
            if layer.weight.dtype != method.weight_dtype:
                continue  # a projection the checkpoint keeps in full precision
        else:
            method.quantize_weights(layer)
        method.process_weights(layer)
    if qc.method == "fp8" and not qc.from_checkpoint:
        quantize_experts_fp8(model, method.device)


def quantize_experts_fp8(model: nn.Module, device: torch.device) -> None:
    """Every `ExpertWeights` of `model` in fp8, where the kernels can read it."""
    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    if not experts:
        return
    if device.type == "cuda" and not supports_fp8_matmul(device):
        logger.warning(
            "quantization='fp8': the expert weights stay in the model dtype on %s (fp8 "
            "conversions need CUDA capability >= 8.9)",
            torch.cuda.get_device_name(device),
        )
        return
    for module in experts:
        module.quantize_fp8()


def is_ignored(
    name: str, layer: nn.Module, packed: dict[str, list[str]], ignored: tuple[str, ...]
) -> bool:
    """Whether the projection `name` (every part of a merged one) matches `ignored`."""
    if not ignored:
        return False
    parent, _, leaf = name.rpartition(".")
    names = [name]
    if isinstance(layer, MergedLinear) and leaf in packed:
        names = [f"{parent}.{part}" if parent else part for part in packed[leaf]]
    hits = [n for n in names if any(matches(n, pattern) for pattern in ignored)]
    if hits and len(hits) != len(names):
        raise UnsupportedModelError(
            f"the checkpoint quantizes only some of {names} (it ignores {hits}); batchlm runs "
            "them as one merged projection, which must be all quantized or none"
        )
    return bool(hits)


def matches(name: str, pattern: str) -> bool:
    """Whether module `name` matches a config's pattern: a name, a suffix of dotted
    components, `re:` + a regular expression, or `Linear` (every linear layer)."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


# ---- the loader's side ---------------------------------------------------------------


def checkpoint_param_name(name: str) -> str | None:
    """The parameter a checkpoint tensor fills (scale names unified), or None for tensors
    that are read past (static activation and KV-cache scales)."""
    module, _, leaf = name.rpartition(".")
    if leaf in _SKIPPED_LEAVES:
        return None
    renamed = _RENAMED_LEAVES.get(leaf)
    return f"{module}.{renamed}" if renamed else name


def read_scale(
    scale: torch.Tensor, rows: tuple[int, int, int] | None, dest_shape: torch.Size
) -> torch.Tensor:
    """A checkpoint's weight scale as this rank's `[rows]` per-channel scale.

    Args:
        scale: The whole checkpoint tensor: per-tensor (`[]` or `[1]`) or per-channel
            (`[out]` or `[out, 1]`).
        rows: `(0, start, length)`: this rank's output rows of the projection (None: all).
        dest_shape: Shape of the destination slice of the layer's scale.
    """
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(()).expand(dest_shape)
    scale = scale.reshape(-1)
    if rows is not None:
        _, start, length = rows
        scale = scale[start : start + length]
    return scale
