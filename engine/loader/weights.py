"""Builds a model and fills it from a folder of safetensors files.

Checkpoint quirks live here, not in the models: tensors are renamed or skipped as the model
asks (`checkpoint_prefix_renames`, `ignored_checkpoint_prefixes`), projections that the
model merges (`q_proj`/`k_proj`/`v_proj` → `qkv_proj`) are copied into their slice of the
merged weight, projections the checkpoint already merged (Phi-3's `qkv_proj`,
`gate_up_proj`) are read part by part into the same slices, tied LM heads are skipped, and
rotary buffers that some checkpoints carry are ignored.

Tensor parallelism: a layer built for one rank of several (see `models/layers/linear.py`)
receives only its part of each checkpoint tensor, read straight from the file (safetensors
slices), so no rank ever holds the whole model.

Quantization (`loader/quantization.py`): a quantized checkpoint's projections get quantized
weights and `weight_scale`s before loading; a full-precision one is quantised after loading,
so each rank quantises only its shard. int4 projections are found by the checkpoint's
tensor names before loading, and their tensors go through an `Int4Loader`
(`loader/int4_weights.py`), which repacks them; with `load_format="dummy"` they get seeded
random int4 tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..config import QuantizationConfig
from ..errors import UnsupportedModelError
from ..models.layers.linear import MergedLinear, RowParallelLinear, _VocabShard
from ..models.layers.moe import ExpertWeights
from ..models.layers.norm import Float32ScaledRMSNorm
from .int4_weights import Int4Loader
from .moe_weights import expert_parts, missing_expert_parts
from .quantization import (
    SCALE_LEAF,
    checkpoint_param_name,
    create_quantized_weights,
    finish_quantization,
    make_linear_method,
    read_scale,
)

_IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
    "embeddings.position_ids",  # a buffer older BERT checkpoints saved
)


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shards, via the index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(
            f"no *.safetensors files in {folder}; batchlm reads safetensors checkpoints or "
            "GGUF files (convert .bin checkpoints with transformers' save_pretrained)"
        )
    return files


class CheckpointTensor:
    """One tensor of an open safetensors file, read whole or in part when asked."""

    def __init__(self, handle: Any, name: str, path: Path) -> None:
        self.handle, self.name, self.path = handle, name, path

    def read(self, rows: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or with `rows=(dim, start, length)` only that range along `dim`."""
        try:
            if rows is None:
                return self.handle.get_tensor(self.name)
            dim, start, length = rows
            index = (slice(None),) * dim + (slice(start, start + length),)
            return self.handle.get_slice(self.name)[index]
        except Exception as e:  # corrupt or truncated files surface here
            raise UnsupportedModelError(f"cannot read checkpoint file {self.path}: {e}") from e


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, tensor handle) for every tensor of every shard; the data is read on demand."""
    for path in safetensors_files(folder):
        try:
            f = safe_open(str(path), framework="pt")
        except Exception as e:
            raise UnsupportedModelError(f"cannot read checkpoint file {path}: {e}") from e
        with f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, CheckpointTensor(f, name, path)


def checkpoint_tensor_names(folder: Path) -> list[str]:
    """Every tensor name of the checkpoint (from the index, or the files' headers)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    names = []
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                names.extend(f.keys())
        except Exception as e:
            raise UnsupportedModelError(f"cannot read checkpoint file {path}: {e}") from e
    return names


def model_tensor_name(model: nn.Module, checkpoint_name: str) -> str | None:
    """What `model` calls a checkpoint tensor (scale names unified, the model's prefix
    renames and name replacements applied), or None for tensors it reads past."""
    name = checkpoint_param_name(checkpoint_name)
    if name is None:
        return None
    for old, new in getattr(model, "checkpoint_prefix_renames", ()):
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    for old, new in getattr(model, "checkpoint_name_replacements", ()):
        name = name.replace(old, new)
    return name


def _read(src: torch.Tensor | CheckpointTensor, rows: tuple[int, int, int] | None):
    if isinstance(src, CheckpointTensor):
        return src.read(rows)
    return src if rows is None else src.narrow(*rows)


def _destination(
    module: nn.Module, leaf: str, shard: int | None, param: torch.Tensor, name: str
) -> tuple[torch.Tensor, tuple[int, int, int] | None]:
    """Where a checkpoint tensor goes in `param`, and which `(dim, start, length)` range of
    it this rank reads (None: all of it)."""
    tp_size = getattr(module, "tp_size", 1)
    if shard is not None:
        assert isinstance(module, MergedLinear)
        dest = param.data[module.shard_slice(shard)]
        if tp_size == 1:
            return dest, None
        rows = module.checkpoint_rows(shard)
        return dest, (0, rows.start, rows.stop - rows.start)
    if tp_size == 1:
        return param.data, None
    if isinstance(module, RowParallelLinear):
        if leaf == "weight":  # [out, in]: this rank's input columns; the bias is whole
            n = param.shape[1]
            return param.data, (1, module.tp_rank * n, n)
        return param.data, None
    if isinstance(module, _VocabShard):
        n = module.num_checkpoint_rows
        param.data[n:].zero_()  # padding rows past the vocabulary
        return param.data[:n], (0, module.vocab_start, n)
    if isinstance(module, Float32ScaledRMSNorm):  # a norm over a vector split by heads
        n = param.shape[0]
        return param.data, (0, module.tp_rank * n, n)
    return param.data, None


def _merged_parts(
    module: MergedLinear, param: torch.Tensor
) -> list[tuple[int, torch.Tensor, tuple[int, int, int] | None]]:
    """For a checkpoint tensor that holds a merged layer's projections already concatenated
    (whole-model rows, in order): `(part, destination, rows to read)` for each part."""
    parts, offset = [], 0
    for shard, local in enumerate(module.output_sizes):
        rows = module.checkpoint_rows(shard)
        parts.append(
            (shard, param.data[module.shard_slice(shard)], (0, offset + rows.start, local))
        )
        offset += local * module.tp_size
    return parts


def load_weights(
    model: nn.Module,
    weights: Iterator[tuple[str, torch.Tensor | CheckpointTensor]],
    packed_modules: dict[str, list[str]],
    int4: Int4Loader | None = None,
) -> None:
    """Copy checkpoint tensors (or this rank's part of them) into `model`'s parameters;
    every parameter must be filled. The tensors of int4 layers go to `int4`."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    shard_of = {src: (dst, i) for dst, srcs in packed_modules.items() for i, src in enumerate(srcs)}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    ignored_prefixes = tuple(getattr(model, "ignored_checkpoint_prefixes", ()))
    filled: set[str] = set()
    for checkpoint_name, tensor in weights:
        name = model_tensor_name(model, checkpoint_name)
        if (
            name is None
            or name.endswith(_IGNORED_SUFFIXES)
            or (tied and name == "lm_head.weight")
            or (ignored_prefixes and name.startswith(ignored_prefixes))
        ):
            continue
        experts_path, found, rest = name.partition(".experts.")
        experts = modules.get(experts_path + ".experts") if found else None
        if isinstance(experts, ExpertWeights):
            for part in expert_parts(experts, rest, name):
                _copy_tensor(name, tensor, part.dest, part.rows, "weight")
                filled.add(f"{experts_path}.experts.{part.key}")
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        target, shard = name, None
        if module_name in shard_of:
            merged, shard = shard_of[module_name]
            module_path = f"{parent}.{merged}" if parent else merged
            target = f"{module_path}.{leaf}"
        if int4 is not None and int4.owns(module_path, leaf):
            int4.add(module_path, shard, leaf, name, tensor)
            continue
        param = params.get(target)
        if param is None:
            raise UnsupportedModelError(
                f"checkpoint tensor {name!r} has no place in {type(model).__name__}; "
                "the checkpoint does not match its config.json architecture"
            )
        module = modules[module_path]
        if shard is None and isinstance(module, MergedLinear):
            parts = _merged_parts(module, param)
        else:
            parts = [(shard, *_destination(module, leaf, shard, param, name))]
        for part, dest, rows in parts:
            _copy_tensor(name, tensor, dest, rows, leaf)
            filled.add(target if part is None else f"{target}#{part}")
    missing = []
    for pname in params:
        module_path, _, leaf = pname.rpartition(".")
        module = modules.get(module_path)
        if isinstance(module, ExpertWeights):
            if leaf == "w13":  # both parameters are checked together, once
                missing.extend(missing_expert_parts(module_path, module, filled))
        elif isinstance(module, MergedLinear) and leaf in ("weight", "bias", SCALE_LEAF):
            for i in range(len(module.output_sizes)):
                if f"{pname}#{i}" not in filled:
                    missing.append(f"{pname}[shard {i}]")
        elif pname not in filled:
            missing.append(pname)
    if missing:
        raise UnsupportedModelError(
            f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}; "
            "the files are incomplete or belong to another architecture"
        )
    if int4 is not None:
        int4.finish()


def _copy_tensor(
    name: str,
    tensor: torch.Tensor | CheckpointTensor,
    dest: torch.Tensor,
    rows: tuple[int, int, int] | None,
    leaf: str,
) -> None:
    """Read `rows` of a checkpoint tensor (all of it: None) into `dest`, checking its dtype
    and shape."""
    if leaf == SCALE_LEAF:  # small: read whole, then this rank's rows
        tensor = read_scale(_read(tensor, None), rows, dest.shape)
    else:
        tensor = _read(tensor, rows)
    if _is_quantized(tensor.dtype) and tensor.dtype != dest.dtype:
        raise UnsupportedModelError(
            f"checkpoint tensor {name!r} is {tensor.dtype}, but config.json declares no "
            "quantization_config that batchlm reads; add it, or load a full-precision "
            "checkpoint (with quantization='fp8' / 'int8' to quantise it at load)"
        )
    if dest.shape != tensor.shape:
        raise UnsupportedModelError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(dest.shape)}; config.json and weights disagree"
        )
    dest.copy_(tensor)


def _is_quantized(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype not in (torch.uint8, torch.bool)


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter with seeded random numbers: normal with `std`, norm weights 1
    and biases 0 (so activations keep a usual scale). They are drawn where the parameter
    lives (a 30B model's weights take seconds on a GPU, minutes through the CPU), from one
    generator per device seeded with `seed`, in parameter order: every load gives the same
    model, and so does every tensor-parallel rank for the parameters they share."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if not param.dtype.is_floating_point or param.dtype.itemsize == 1:
            continue  # quantized weights: left as created (a checkpoint would fill them)
        leaf = name.rpartition(".")[2]
        if leaf == "bias":
            param.data.zero_()
        elif "norm" in name:
            param.data.fill_(1.0)
        else:
            device = param.device
            if device not in gens:
                gens[device] = torch.Generator(device=device).manual_seed(seed)
            param.data.normal_(0.0, std, generator=gens[device])


def build_model(
    model_cls: type[nn.Module],
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    quantization: QuantizationConfig | None = None,
    load_format: str = "auto",
    **kwargs,
) -> nn.Module:
    """Instantiate without initialising memory, then load the checkpoint into it (and
    quantize its projections when `quantization` says so). With `load_format="dummy"` the
    weights are seeded random numbers instead and no file of `folder` is read."""
    with torch.device("meta"):
        model = model_cls(**kwargs)
    method = make_linear_method(quantization, device, dtype) if quantization else None
    int4 = None
    if method is not None and quantization.method == "int4":
        # Before materialising: an int4 layer's full-precision weight is never allocated.
        names = None
        if load_format != "dummy":
            found = map(partial(model_tensor_name, model), checkpoint_tensor_names(folder))
            names = {n for n in found if n}
        int4 = Int4Loader(model, method, quantization, names)
    model = model.to_empty(device=device).to(dtype)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):  # materialising from meta may have untied shared parameters
        tie()
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    if method is not None and quantization.from_checkpoint and int4 is None:
        create_quantized_weights(model, method, quantization)
    with torch.no_grad():
        packed = getattr(model, "packed_modules", getattr(model_cls, "packed_modules", {}))
        if load_format == "dummy":
            init_dummy_weights(model)
            if int4 is not None:
                int4.fill_random()
        else:
            load_weights(model, iter_checkpoint(folder), packed, int4)
        if method is not None:
            finish_quantization(model, method, quantization)
        for module in model.modules():  # layouts chosen for speed once the weights are in
            after = getattr(module, "after_loading", None)
            if callable(after):
                after()
    # An inference engine's weights never need gradients; as in vLLM, a tensor read from
    # the model (say through collective_rpc) is then plain data, free to cross processes.
    model.requires_grad_(False)
    return model.eval()
