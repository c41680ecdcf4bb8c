"""The `quantization_config` of int4 checkpoints → a `QuantizationConfig` (method `int4`),
with every setting batchlm cannot run refused by name.

Read as vLLM reads them:

- GPTQ (`quant_method: gptq`, AutoGPTQ / GPTQModel): `bits` 4, `group_size` (-1: one
  group per output channel), `sym`, `desc_act`, `checkpoint_format` (or GPTQModel's
  `format`) `gptq` (zero points stored minus one) or `gptq_v2`;
- AWQ (`quant_method: awq`, AutoAWQ): `bits` / `w_bit` 4, `group_size` / `q_group_size`,
  `zero_point: true`, `version: gemm`, `modules_to_not_convert`;
- compressed-tensors (`quant_method: compressed-tensors`, llm-compressor's W4A16):
  `format: pack-quantized`, config groups of `type: int`, `num_bits: 4` weights with
  strategy `group` or `channel`, symmetric or not, `actorder` none / `weight` (groups in
  order) / `group` (a `weight_g_idx` per layer), no quantized activations; `ignore`.

Refused: other bit widths, 2:4 sparsity, quantized activations (W4A8), GPTQ's per-module
`dynamic` overrides and quantized LM heads, AWQ's other kernels' layouts, transforms
(rotations), config groups of different schemes.
"""

from __future__ import annotations

from typing import Any

from ..config import QuantizationConfig
from ..errors import UnsupportedModelError

__all__ = [
    "ACT_ORDER_GROUPS",
    "awq_config",
    "compressed_tensors_int4_config",
    "gptq_config",
    "has_int_weights",
]

GPTQ_FORMATS = ("gptq", "gptq_v2")
ACT_ORDER_GROUPS = ("group", "dynamic")
"""compressed-tensors `actorder` values whose layers carry a `weight_g_idx`."""
_ACT_ORDER_IN_ORDER = (None, False, "weight", "static")
_FIX = (
    "batchlm loads 4-bit GPTQ, AWQ (version gemm) and compressed-tensors pack-quantized "
    "W4A16 checkpoints"
)


def _refuse(what: str, detail: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{what} checkpoint not supported: {detail}; {_FIX}")


def _group_size(value: Any, what: str, key: str) -> int | None:
    if value in (None, -1):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 8:
        raise _refuse(what, f"{key}={value!r} (expected -1 or a positive multiple of 8)")
    return value


def gptq_config(qc: dict) -> QuantizationConfig:
    """A GPTQ checkpoint's settings, or `UnsupportedModelError` naming the one that is not
    supported."""
    bits = qc.get("bits")
    if bits != 4:
        raise _refuse("GPTQ", f"bits={bits!r} (only 4-bit weights)")
    fmt = qc.get("checkpoint_format", qc.get("format")) or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise _refuse("GPTQ", f"checkpoint_format={fmt!r} (expected one of {GPTQ_FORMATS})")
    if qc.get("is_marlin_format"):
        raise _refuse("GPTQ", "is_marlin_format=True (a Marlin-repacked layout)")
    if qc.get("lm_head"):
        raise _refuse("GPTQ", "lm_head=True (a quantized LM head)")
    if qc.get("dynamic"):
        raise _refuse("GPTQ", f"dynamic={qc['dynamic']!r} (per-module overrides)")
    pack_dtype = qc.get("pack_dtype", "int32")
    if pack_dtype not in ("int32", "torch.int32"):
        raise _refuse("GPTQ", f"pack_dtype={pack_dtype!r} (words of int32 only)")
    sym, desc_act = qc.get("sym", True), qc.get("desc_act", False)
    for key, value in (("sym", sym), ("desc_act", desc_act)):
        if not isinstance(value, bool):
            raise _refuse("GPTQ", f"{key}={value!r} (expected true or false)")
    group_size = _group_size(qc.get("group_size", -1), "GPTQ", "group_size")
    return QuantizationConfig(
        method="int4",
        from_checkpoint=True,
        checkpoint_method="gptq",
        ignored_modules=tuple(qc.get("modules_to_not_convert") or ()),
        weight_format=fmt,
        group_size=group_size,
        symmetric=sym,
        act_order=desc_act and group_size is not None,
    )


def awq_config(qc: dict) -> QuantizationConfig:
    """An AWQ checkpoint's settings, or `UnsupportedModelError` naming the one that is not
    supported."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse("AWQ", f"bits={bits!r} (only 4-bit weights)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("AWQ", f"version={qc.get('version')!r} (only the gemm layout)")
    backend = str(qc.get("backend", "autoawq")).lower()
    if backend not in ("autoawq", "auto_awq"):
        raise _refuse("AWQ", f"backend={qc.get('backend')!r} (only AutoAWQ's layout)")
    if qc.get("zero_point", True) is not True:
        raise _refuse("AWQ", f"zero_point={qc.get('zero_point')!r} (AWQ's gemm layout has zeros)")
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    return QuantizationConfig(
        method="int4",
        from_checkpoint=True,
        checkpoint_method="awq",
        ignored_modules=tuple(qc.get("modules_to_not_convert") or ()),
        weight_format="awq",
        group_size=_group_size(group_size, "AWQ", "group_size"),
        symmetric=False,
    )


def has_int_weights(qc: dict) -> bool:
    """Whether a compressed-tensors config quantizes weights to integers (the int4 path;
    float weights are the fp8 path)."""
    if qc.get("format") == "pack-quantized":
        return True
    for group in (qc.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") == "int" or group.get("format") == "pack-quantized":
            return True
    return False


def compressed_tensors_int4_config(qc: dict) -> QuantizationConfig:
    """A compressed-tensors W4A16 checkpoint's settings, or `UnsupportedModelError`
    naming what is not supported."""
    what = "compressed-tensors"
    sparsity = qc.get("sparsity_config") or {}
    structure = sparsity.get("sparsity_structure")
    if sparsity.get("format") not in (None, "dense") or structure not in (None, "unstructured"):
        raise _refuse(
            what,
            f"sparsity_config format={sparsity.get('format')!r} "
            f"sparsity_structure={structure!r} (2:4 and other sparse layouts)",
        )
    if qc.get("transform_config"):
        raise _refuse(what, "transform_config (rotated weights)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse(what, "no config_groups")
    schemes, targets = {}, []
    for name, group in groups.items():
        group = group or {}
        fmt = group.get("format") or qc.get("format")
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("int", 4):
            raise _refuse(
                what, f"{name}: weights type={kind[0]!r} num_bits={kind[1]!r} (only int 4-bit)"
            )
        if fmt != "pack-quantized":
            raise _refuse(what, f"{name}: format={fmt!r} (int4 weights load as pack-quantized)")
        if kind[2] not in ("group", "channel"):
            raise _refuse(what, f"{name}: weights strategy={kind[2]!r} (group or channel)")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise _refuse(what, f"{name}: {key}={group[key]!r} (weight-only W4A16 only)")
        if weights.get("dynamic"):
            raise _refuse(what, f"{name}: dynamic weights")
        actorder = weights.get("actorder")
        if actorder not in _ACT_ORDER_IN_ORDER and actorder not in ACT_ORDER_GROUPS:
            raise _refuse(what, f"{name}: actorder={actorder!r}")
        group_size = None
        if kind[2] == "group":
            group_size = _group_size(weights.get("group_size"), what, f"{name}: group_size")
            if group_size is None:
                raise _refuse(what, f"{name}: strategy 'group' without a group_size")
        schemes[name] = (
            group_size,
            weights.get("symmetric", True) is not False,
            actorder in ACT_ORDER_GROUPS and group_size is not None,
        )
        targets.extend(group.get("targets") or ["Linear"])
    if len(set(schemes.values())) > 1:
        raise _refuse(
            what,
            "config groups with different schemes "
            + "; ".join(
                f"{n}: group_size={g}, symmetric={s}, act_order={a}"
                for n, (g, s, a) in schemes.items()
            ),
        )
    group_size, symmetric, act_order = next(iter(schemes.values()))
    return QuantizationConfig(
        method="int4",
        from_checkpoint=True,
        checkpoint_method="compressed-tensors",
        ignored_modules=tuple(qc.get("ignore") or ()),
        weight_format="pack-quantized",
        group_size=group_size,
        symmetric=symmetric,
        act_order=act_order,
        quantized_modules=() if "Linear" in targets else tuple(targets),
    )
