"""int4 checkpoints written the way their quantizers write them, for the loader tests.

Written from the formats' own packing code (AutoGPTQ's `QuantLinear.pack`, AutoAWQ's
`WQLinear_GEMM.from_linear`, compressed-tensors' `pack_to_int32`), not from batchlm's
loader: plain loops over words and nibbles in numpy. A projection is first quantized round
to nearest (`rtn`), then packed by each format; `unpack_*` undo the packing just as
independently, and `dequantize` gives the float32 weight the checkpoint stands for
(scales rounded to the dtype the checkpoint stores them in), the reference model's weight.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# Projections that read the same input share an activation order, as GPTQ computes it from
# that input's statistics (Phi-3 stores q|k|v and gate|up fused).
_SAME_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "qkv_proj": "attn",
               "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp", "o_proj": "o",
               "down_proj": "down"}  # fmt: skip
PROJECTIONS = tuple(_SAME_INPUT)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class Quantized(NamedTuple):
    """A projection `[N, K]` quantized round to nearest."""

    q: np.ndarray  # [N, K] int 0..15 (unsigned)
    zeros: np.ndarray  # [N, G] int 0..15 (8 when symmetric)
    scales: torch.Tensor  # [N, G] in the checkpoint's scale dtype
    g_idx: np.ndarray  # [K] group of each input


def rtn(
    weight: torch.Tensor,
    group_size: int | None,
    symmetric: bool,
    order: np.ndarray | None,
    scale_dtype: torch.dtype,
    min_zero: int = 0,
) -> Quantized:
    """Round-to-nearest 4-bit quantization as GPTQ's quantizer sets its grid (`maxq` 15;
    symmetric: zero 8, scale `2 max|w| / 15`; asymmetric: scale `(max - min) / 15`, zero
    `round(-min / scale)`), groups of `group_size` inputs taken in `order` (activation
    order) or in input order. `min_zero`: the smallest zero point (GPTQ's `gptq` format
    stores zeros minus one and cannot hold 0)."""
    w = weight.detach().float()
    num_n, num_k = w.shape
    size = group_size or num_k
    order = np.arange(num_k) if order is None else order
    g_idx = np.empty(num_k, dtype=np.int64)
    g_idx[order] = np.arange(num_k) // size
    blocks = w[:, torch.from_numpy(order)].reshape(num_n, num_k // size, size)  # [N, G, size]
    if symmetric:
        scale = 2 * blocks.abs().amax(dim=2).clamp(min=1e-8) / 15
        zero = torch.full(scale.shape, 8.0)
    else:
        lo = blocks.amin(dim=2).clamp(max=0)
        hi = blocks.amax(dim=2).clamp(min=0)
        scale = (hi - lo).clamp(min=1e-8) / 15
        zero = torch.round(-lo / scale).clamp(min_zero, 15)
    # The checkpoint stores the scale rounded to its dtype: quantize against that.
    scale = scale.to(scale_dtype)
    values = (torch.round(blocks / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
    q = np.empty((num_n, num_k), dtype=np.int64)
    q[:, order] = values.reshape(num_n, num_k).to(torch.int64).numpy()
    return Quantized(q, zero.to(torch.int64).numpy(), scale, g_idx)


def dequantize(qz: Quantized) -> torch.Tensor:
    """`[N, K]` float32: `(q - zero) * scale` of each input's group."""
    scales = qz.scales.float().numpy()
    w = (qz.q - qz.zeros[:, qz.g_idx]) * scales[:, qz.g_idx]
    return torch.tensor(w, dtype=torch.float32)


# ---- packing, as each format's own code does it -------------------------------------


def _words(values: np.ndarray) -> np.ndarray:
    """uint32 words as int32, the way the packers hand them to torch."""
    return values.astype(np.uint32).view(np.int32)


def pack_gptq(qz: Quantized, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: `qweight` `[K / 8, N]` (8 inputs per word, input `8r + j` at
    bits `4j`), `qzeros` `[G, N / 8]` (8 outputs per word, stored minus one in `v1`),
    `scales` `[G, N]`, `g_idx` `[K]`."""
    intweight = qz.q.T.astype(np.uint64)  # [K, N]
    num_k, num_n = intweight.shape
    qweight = np.zeros((num_k // 8, num_n), dtype=np.uint64)
    for j in range(8):  # word row r holds input rows 8r .. 8r + 7
        qweight |= intweight[j::8] << np.uint64(4 * j)
    zeros = qz.zeros.T.astype(np.int64) - (1 if v1 else 0)  # [G, N]
    assert zeros.min() >= 0, "the gptq format cannot store a zero point of 0"
    qzeros = np.zeros((zeros.shape[0], num_n // 8), dtype=np.uint64)
    for j in range(8):  # word column c holds output columns 8c .. 8c + 7
        qzeros |= zeros[:, j::8].astype(np.uint64) << np.uint64(4 * j)
    return {
        "qweight": torch.from_numpy(_words(qweight)),
        "qzeros": torch.from_numpy(_words(qzeros)),
        "scales": qz.scales.T.contiguous(),
        "g_idx": torch.from_numpy(qz.g_idx.astype(np.int32)),
    }


def pack_awq(qz: Quantized) -> dict[str, torch.Tensor]:
    """AutoAWQ's gemm layout: `qweight` `[K, N / 8]` and `qzeros` `[G, N / 8]`, output
    `8c + AWQ_ORDER[i]` at bits `4i` of word `c`; `scales` `[G, N]`."""

    def pack_columns(values: np.ndarray) -> np.ndarray:  # [R, N] → [R, N / 8]
        out = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint64)
        for i in range(8):  # nibble i of word c: output 8c + AWQ_ORDER[i]
            out |= values[:, AWQ_ORDER[i] :: 8].astype(np.uint64) << np.uint64(4 * i)
        return out

    return {
        "qweight": torch.from_numpy(_words(pack_columns(qz.q.T))),
        "qzeros": torch.from_numpy(_words(pack_columns(qz.zeros.T))),
        "scales": qz.scales.T.contiguous(),
    }


def pack_compressed_tensors(qz: Quantized, symmetric: bool, g_idx: bool) -> dict:
    """compressed-tensors' pack-quantized layout: signed values plus 8, element `i` of a
    row at bit `4i` of the row's bit stream (`weight_packed` `[N, K / 8]`); zero points
    packed the same way down the outputs (`[N / 8, G]`); `weight_scale` `[N, G]`."""

    def pack_rows(values: np.ndarray) -> np.ndarray:  # [R, C] 0..15 → [R, C / 8]
        padded = np.zeros((values.shape[0], -(-values.shape[1] // 8) * 8), dtype=np.uint64)
        padded[:, : values.shape[1]] = values
        out = np.zeros((values.shape[0], padded.shape[1] // 8), dtype=np.uint64)
        for j in range(8):  # element 8w + j of the row's stream at bits 4j of word w
            out |= padded[:, j::8] << np.uint64(4 * j)
        return out

    tensors = {
        "weight_packed": torch.from_numpy(_words(pack_rows(qz.q))),
        "weight_scale": qz.scales.contiguous(),
        "weight_shape": torch.tensor(qz.q.shape),
    }
    if not symmetric:
        tensors["weight_zero_point"] = torch.from_numpy(_words(pack_rows(qz.zeros.T)).T.copy())
    if g_idx:
        tensors["weight_g_idx"] = torch.from_numpy(qz.g_idx.astype(np.int32))
    return tensors


# ---- unpacking, independently -------------------------------------------------------


def _nibble(words: torch.Tensor, j: int) -> np.ndarray:
    return (words.numpy().view(np.uint32).astype(np.int64) >> (4 * j)) & 0xF


def unpack_gptq(t: dict[str, torch.Tensor], v1: bool) -> tuple[np.ndarray, np.ndarray]:
    """`(q [N, K], zeros [N, G])` from AutoGPTQ's tensors."""
    qweight, qzeros = t["qweight"], t["qzeros"]
    num_k, num_n = qweight.shape[0] * 8, qweight.shape[1]
    q = np.zeros((num_k, num_n), dtype=np.int64)
    for j in range(8):
        q[j::8] = _nibble(qweight, j)
    zeros = np.zeros((qzeros.shape[0], num_n), dtype=np.int64)
    for j in range(8):
        zeros[:, j::8] = _nibble(qzeros, j) + (1 if v1 else 0)
    return q.T, zeros.T


def unpack_awq(t: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    def columns(words: torch.Tensor) -> np.ndarray:
        out = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
        for i in range(8):
            out[:, AWQ_ORDER[i] :: 8] = _nibble(words, i)
        return out

    return columns(t["qweight"]).T, columns(t["qzeros"]).T


def unpack_compressed_tensors(t: dict[str, torch.Tensor], num_k: int):
    packed = t["weight_packed"]
    q = np.zeros((packed.shape[0], packed.shape[1] * 8), dtype=np.int64)
    for j in range(8):
        q[:, j::8] = _nibble(packed, j)
    zeros = None
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        zeros = np.zeros((zp.shape[0] * 8, zp.shape[1]), dtype=np.int64)
        for j in range(8):
            zeros[j::8] = _nibble(zp, j)
        zeros = zeros[: packed.shape[0]]
    return q[:, :num_k], zeros


# ---- checkpoints --------------------------------------------------------------------


class Int4Spec(NamedTuple):
    """How to quantize a checkpoint."""

    fmt: str  # gptq | gptq_v2 | awq | compressed-tensors
    group_size: int | None = 32
    symmetric: bool = True
    act_order: bool = False

    @property
    def name(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        order = "-actorder" if self.act_order else ""
        return f"{self.fmt}-g{self.group_size or 'channel'}-{kind}{order}"


def quantization_config(spec: Int4Spec) -> dict:
    """The `quantization_config` the format's quantizer writes."""
    group = spec.group_size or -1
    if spec.fmt in ("gptq", "gptq_v2"):
        return {
            "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": spec.act_order,
            "sym": spec.symmetric, "checkpoint_format": spec.fmt, "damp_percent": 0.01,
            "true_sequential": True, "static_groups": False, "lm_head": False,
        }  # fmt: skip
    if spec.fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    weights = {
        "num_bits": 4, "type": "int", "symmetric": spec.symmetric, "dynamic": False,
        "strategy": "group" if spec.group_size else "channel", "group_size": spec.group_size,
        "actorder": "group" if spec.act_order else None, "observer": "minmax",
    }  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


def quantize_checkpoint(
    source: Path, quantized: Path, dequantized: Path, spec: Int4Spec, seed: int = 0
) -> None:
    """Write `source` (a float32 HF folder) as an int4 checkpoint of `spec` in `quantized`,
    and the same model with each projection's dequantized weight in `dequantized` (the
    reference). Projections not named in `PROJECTIONS` (experts, routers, heads) stay."""
    state = load_file(source / "model.safetensors")
    rng = np.random.default_rng(seed)
    orders: dict[tuple[str, str], np.ndarray] = {}
    q_state, deq_state = {}, {}
    scale_dtype = torch.bfloat16 if spec.fmt == "compressed-tensors" else torch.float16
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if leaf != "weight" or proj not in PROJECTIONS or ".experts." in name:
            q_state[name] = deq_state[name] = tensor
            continue
        order = None
        if spec.act_order:
            key = (parent, _SAME_INPUT[proj])
            if key not in orders:
                orders[key] = rng.permutation(tensor.shape[1])
            order = orders[key]
        qz = rtn(tensor, spec.group_size, spec.symmetric, order, scale_dtype,
                 min_zero=1 if spec.fmt == "gptq" else 0)  # fmt: skip
        deq_state[name] = dequantize(qz)
        if spec.fmt in ("gptq", "gptq_v2"):
            packed = pack_gptq(qz, v1=spec.fmt == "gptq")
        elif spec.fmt == "awq":
            packed = pack_awq(qz)
        else:
            packed = pack_compressed_tensors(qz, spec.symmetric, spec.act_order)
        for leaf_name, value in packed.items():
            q_state[f"{module}.{leaf_name}"] = value
    config = json.loads((source / "config.json").read_text())
    for folder, tensors in ((quantized, q_state), (dequantized, deq_state)):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    config["quantization_config"] = quantization_config(spec)
    (quantized / "config.json").write_text(json.dumps(config))


def edit_checkpoint(folder: Path, **changes: torch.Tensor | None) -> None:
    """Replace (a tensor) or drop (None) tensors of a checkpoint folder, by name."""
    state = load_file(folder / "model.safetensors")
    for name, value in changes.items():
        if value is None:
            state.pop(name)
        else:
            state[name] = value
    save_file(state, folder / "model.safetensors")


def edit_config(folder: Path, **changes) -> None:
    """Replace keys of the checkpoint's `quantization_config`."""
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))
