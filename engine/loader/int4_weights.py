"""Which projections of a model are int4, and how their checkpoint tensors become each
layer's int4 tensors (`models/layers/int4.py`).

Before loading (`Int4Loader(...)`): a projection is int4 where the checkpoint holds its
format's packed weight (`qweight`, `weight_packed`), full precision where it holds a
`weight`; merged layers (q|k|v, gate|up) must be one or the other for all their parts.
Without a checkpoint (`load_format="dummy"`) the config decides: every linear layer its
`ignore` / `modules_to_not_convert` patterns leave out (and, for compressed-tensors, its
`targets` name). Mixture-of-experts experts in int4 are refused by name (the fused-MoE
kernels read experts in the model dtype or fp8); their attention loads in int4.

While loading (`add`): a projection's tensors are gathered as they arrive, unpacked by
its format (`int4_formats.py`) once all are there, cut to this rank's part, and once
every part of a layer is in, packed into the layer (`pack_int4`).

Tensor parallelism: column-parallel layers (q|k|v, gate|up) keep their rank's outputs,
any split; row-parallel layers (o, down) keep their rank's inputs, which must hold whole
groups, so the sizes that work are those that divide each such layer's input features
into a multiple of `group_size` (any size with one group per output channel). With
activation order a rank's inputs hold members of every group: it keeps every group's
scales and each input's group (the kernel's `g_idx`), so any size whose split is a
multiple of 8 inputs works.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..config import QuantizationConfig
from ..errors import InvalidParamError, UnsupportedModelError
from ..models.layers.int4 import MIDPOINT, Int4LinearMethod, Int4Part, pack_int4, random_int4
from ..models.layers.linear import Linear, MergedLinear, RowParallelLinear
from ..models.layers.moe import ExpertWeights
from .int4_formats import FORMATS, ProjectionShape
from .quantization import is_ignored, matches, quantizable_layers

__all__ = ["Int4Loader", "check_groups", "check_tensor_parallel"]

_MAX_TP = 16


class _Plan(NamedTuple):
    """One int4 layer and the checkpoint projections that fill it."""

    layer: Linear
    parts: tuple[str, ...]
    """Checkpoint module names, in the layer's shard order; the layer's own name alone for
    a checkpoint that stores the merged projection whole (shard None)."""
    fused: bool
    leaves: dict[str, tuple[str, ...]]
    """Part → the tensors of it the checkpoint holds (and the loader waits for)."""


class Int4Loader:
    """The int4 layers of `model`, made int4 (`create_weights`), and their loading.

    Args:
        model: The model, built (not yet loaded).
        method: The int4 linear method.
        qc: The checkpoint's quantization (`method` `int4`).
        names: The checkpoint's tensor names as the model names them (after the model's
            renames), or None with no checkpoint (`load_format="dummy"`).

    Raises:
        UnsupportedModelError: int4 experts, int4 tensors of layers batchlm keeps in full
            precision, merged projections partly int4, missing tensors.
        InvalidParamError: a tensor-parallel size that splits a group.
    """

    def __init__(
        self,
        model: nn.Module,
        method: Int4LinearMethod,
        qc: QuantizationConfig,
        names: set[str] | None,
    ) -> None:
        self.method, self.qc = method, qc
        self.format = FORMATS[qc.weight_format or ""]
        packed = getattr(model, "packed_modules", {})
        marked = None
        if names is not None:
            marked = {
                n.rpartition(".")[0] for n in names if n.endswith("." + self.format.weight_leaf)
            }
        self.plans: dict[str, _Plan] = {}
        for path, layer in quantizable_layers(model):
            parent, _, leaf = path.rpartition(".")
            parts = (path,)
            if isinstance(layer, MergedLinear) and leaf in packed:
                parts = tuple(f"{parent}.{p}" if parent else p for p in packed[leaf])
            if marked is None:
                quantized = not is_ignored(path, layer, packed, qc.ignored_modules) and (
                    not qc.quantized_modules
                    or any(matches(p, t) for p in parts for t in qc.quantized_modules)
                )
            else:
                hits = [p for p in parts if p in marked]
                if hits and len(hits) != len(parts):
                    raise UnsupportedModelError(
                        f"the checkpoint quantizes only some of {list(parts)} (int4: {hits}); "
                        "batchlm runs them as one merged projection, which must be all int4 "
                        "or none"
                    )
                if not hits and path in marked:  # the checkpoint stores it merged
                    hits, parts = [path], (path,)
                quantized = bool(hits)
            # One checkpoint tensor for all the parts of a merged layer (Phi-3's qkv_proj).
            fused = isinstance(layer, MergedLinear) and len(layer.output_sizes) > 1
            fused = fused and parts == (path,)
            if not quantized:
                continue
            check_groups(path, layer, qc)
            check_tensor_parallel(path, layer, qc)
            method.create_weights(layer)
            self.plans[path] = _Plan(layer, parts, fused, self._leaves(parts, names))
        self._refuse_leftovers(model, marked)
        self.pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
        """Part → the tensors of it read so far (leaf → (checkpoint name, tensor))."""
        self.unpacked: dict[str, dict[str, Int4Part]] = {}
        """Layer → its parts unpacked so far (this rank's share)."""
        self.done: set[str] = set()

    def _leaves(self, parts: tuple[str, ...], names: set[str] | None) -> dict:
        required = self.format.required_leaves(self.qc.symmetric, self.qc.act_order)
        if names is None:
            return {p: required for p in parts}
        leaves = {}
        for part in parts:
            missing = [f"{part}.{leaf}" for leaf in required if f"{part}.{leaf}" not in names]
            if missing:
                raise UnsupportedModelError(
                    f"the {self.format.name} checkpoint is missing {missing} (an int4 "
                    f"projection needs {list(required)} under its quantization_config)"
                )
            leaves[part] = tuple(leaf for leaf in self.format.leaves() if f"{part}.{leaf}" in names)
        return leaves

    def _refuse_leftovers(self, model: nn.Module, marked: set[str] | None) -> None:
        """Refuse int4 experts, and int4 tensors of layers no plan covers."""
        planned = {p for plan in self.plans.values() for p in plan.parts}
        experts = [path for path, m in model.named_modules() if isinstance(m, ExpertWeights)]
        if marked is None:  # dummy: the config's patterns decide for the experts too
            for path in experts:
                probe = f"{path}.0.gate_proj"
                if not any(matches(probe, p) for p in self.qc.ignored_modules):
                    raise _int4_experts(path)
            return
        for name in sorted(marked - planned):
            for path in experts:
                if name.startswith(path + "."):
                    raise _int4_experts(path)
            raise UnsupportedModelError(
                f"checkpoint tensor {name}.{self.format.weight_leaf!s} is int4, but batchlm "
                "keeps that layer in full precision (embeddings, LM heads and routers are "
                "never quantized); the checkpoint does not match the model"
            )

    def owns(self, module_path: str, leaf: str) -> bool:
        """Whether the checkpoint tensor `<module_path>.<leaf>` goes through this loader."""
        return module_path in self.plans and leaf in self.format.leaves()

    def add(self, module_path: str, shard: int | None, leaf: str, name: str, tensor) -> None:
        """Take one checkpoint tensor of an int4 layer (`tensor`: a tensor, or anything
        with `read()`); the layer is packed once its last part arrives.

        Args:
            module_path: The model's layer (the merged one for a part of it).
            shard: Which part of a merged layer (None: the layer's own tensor).
            leaf: `qweight`, `scales`, ...
            name: The checkpoint name, for errors.
        """
        plan = self.plans[module_path]
        part = plan.parts[0] if shard is None else plan.parts[shard]
        if leaf not in plan.leaves[part]:
            return  # a tensor the checkpoint holds but the settings do not use
        value = tensor.read() if hasattr(tensor, "read") else tensor
        bucket = self.pending.setdefault(part, {})
        bucket[leaf] = (name, value.to(plan.layer.int4_device))
        if set(bucket) != set(plan.leaves[part]):
            return
        del self.pending[part]
        shape = self._shape(plan, part)
        whole = self.format.unpack(bucket, shape)
        self.unpacked.setdefault(module_path, {})[part] = self._rank_part(plan, part, whole, shape)
        if len(self.unpacked[module_path]) == len(plan.parts):
            self._pack(module_path, plan)

    def _shape(self, plan: _Plan, part: str) -> ProjectionShape:
        layer = plan.layer
        tp = getattr(layer, "tp_size", 1)
        num_k = layer.in_features * (tp if isinstance(layer, RowParallelLinear) else 1)
        num_n = layer.out_features * (1 if isinstance(layer, RowParallelLinear) else tp)
        if isinstance(layer, MergedLinear) and not plan.fused:
            num_n = layer.output_sizes[plan.parts.index(part)] * tp
        return ProjectionShape(num_n, num_k, self.qc.group_size or num_k)

    def _rank_part(
        self, plan: _Plan, part: str, whole: Int4Part, shape: ProjectionShape
    ) -> Int4Part:
        """This rank's outputs (column-parallel) or inputs (row-parallel) of `whole`."""
        layer = plan.layer
        if getattr(layer, "tp_size", 1) == 1:
            return whole
        if isinstance(layer, RowParallelLinear):
            k0 = layer.tp_rank * layer.in_features
            k1 = k0 + layer.in_features
            scales, zeros, g_idx = whole.scales, whole.zeros, whole.g_idx
            if g_idx is not None:
                g_idx = g_idx[k0:k1]
            elif self.qc.group_size is not None:  # whole groups (checked at start)
                rows = slice(k0 // shape.group_size, k1 // shape.group_size)
                scales = scales[rows]
                zeros = None if zeros is None else zeros[rows]
            return Int4Part(whole.q[k0:k1], scales, zeros, g_idx)
        assert isinstance(layer, MergedLinear)
        if plan.fused:  # every part's rows of this rank, from the checkpoint's whole tensor
            columns, offset = [], 0
            for i, local in enumerate(layer.output_sizes):
                rows = layer.checkpoint_rows(i)
                columns.append(torch.arange(offset + rows.start, offset + rows.stop))
                offset += local * layer.tp_size
            cols = torch.cat(columns).to(whole.q.device)
        else:
            rows = layer.checkpoint_rows(plan.parts.index(part))
            cols = torch.arange(rows.start, rows.stop, device=whole.q.device)
        zeros = None if whole.zeros is None else whole.zeros[:, cols]
        return Int4Part(whole.q[:, cols], whole.scales[:, cols], zeros, whole.g_idx)

    def _pack(self, module_path: str, plan: _Plan) -> None:
        parts = [self.unpacked[module_path][p] for p in plan.parts]
        del self.unpacked[module_path]
        first = parts[0].g_idx
        for p, part in zip(plan.parts[1:], parts[1:], strict=True):
            same = (first is None and part.g_idx is None) or (
                first is not None and part.g_idx is not None and torch.equal(first, part.g_idx)
            )
            if not same:
                raise UnsupportedModelError(
                    f"{plan.parts[0]} and {p} have different activation orders (g_idx); "
                    f"batchlm runs them as one merged projection ({module_path}), which "
                    "reads its inputs in one order"
                )
        zeros = None
        if any(part.zeros is not None for part in parts):
            zeros = torch.cat(
                [
                    part.zeros
                    if part.zeros is not None
                    else torch.full_like(part.q[: part.scales.shape[0]], MIDPOINT)
                    for part in parts
                ],
                dim=1,
            )
        merged = Int4Part(
            torch.cat([p.q for p in parts], dim=1),
            torch.cat([p.scales for p in parts], dim=1),
            zeros,
            first,
        )
        layer = plan.layer
        pack_int4(layer, merged, self.method.layer_group_size(layer), self.method.dtype)
        self.done.add(module_path)

    def finish(self) -> None:
        """Raise for int4 layers some of whose tensors never came."""
        missing = [p for p in self.plans if p not in self.done]
        if missing:
            waiting = {part: sorted(b) for part, b in self.pending.items()}
            raise UnsupportedModelError(
                f"{len(missing)} int4 layers were not filled, e.g. {missing[:3]} (tensors "
                f"read so far: {dict(list(waiting.items())[:3])}); the checkpoint files are "
                "incomplete"
            )

    def fill_random(self, seed: int = 0) -> None:
        """Seeded random int4 tensors in every int4 layer (`load_format="dummy"`)."""
        gens: dict[torch.device, torch.Generator] = {}
        for path, plan in self.plans.items():
            device = plan.layer.int4_device
            if device not in gens:
                gens[device] = torch.Generator(device=device).manual_seed(seed)
            random_int4(
                plan.layer,
                self.method.layer_group_size(plan.layer),
                self.qc.symmetric,
                self.qc.act_order,
                self.method.dtype,
                gens[device],
            )
            self.done.add(path)


def _int4_experts(path: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"mixture-of-experts layer {path} is int4 in this checkpoint; batchlm runs experts "
        "in the model dtype or fp8 (the fused-MoE kernels read no int4), and loads int4 "
        "only for the attention and dense projections of MoE models. Use a checkpoint that "
        "keeps the experts in full precision (modules_to_not_convert / ignore)"
    )


def check_groups(path: str, layer: Linear, qc: QuantizationConfig) -> None:
    """Refuse a projection whose inputs do not divide into whole groups (or words)."""
    num_k = layer.in_features * (layer.tp_size if isinstance(layer, RowParallelLinear) else 1)
    unit = qc.group_size or 8
    if num_k % unit or num_k % 8:
        raise UnsupportedModelError(
            f"{path} has {num_k} input features, not a multiple of "
            f"{'group_size=' + str(qc.group_size) if qc.group_size else '8'}: batchlm's int4 "
            "layers hold whole groups of whole 8-value words"
        )


def check_tensor_parallel(path: str, layer: Linear, qc: QuantizationConfig) -> None:
    """Refuse a tensor-parallel size whose split of a row-parallel layer's inputs cuts a
    group (or the 8 inputs of a packed word)."""
    if not isinstance(layer, RowParallelLinear):
        return
    num_k = layer.in_features * layer.tp_size

    def works(size: int) -> bool:
        if num_k % size or (num_k // size) % 8:
            return False
        return qc.group_size is None or qc.act_order or (num_k // size) % qc.group_size == 0

    if not works(layer.tp_size):
        sizes = [t for t in range(1, _MAX_TP + 1) if works(t)]
        unit = "8" if qc.group_size is None or qc.act_order else f"group_size={qc.group_size}"
        raise InvalidParamError(
            f"tensor_parallel_size={layer.tp_size} gives each rank {num_k // layer.tp_size} of "
            f"{path}'s {num_k} input features, not a multiple of {unit}: the int4 "
            f"checkpoint splits along whole groups; sizes that split it: {sizes}"
        )
