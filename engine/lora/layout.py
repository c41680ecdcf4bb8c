"""Where an adapter's weights go in a model: its adaptable projections, each projection's
slices, and their place in one flat buffer per adapter slot.

Every decoder projection is a `Linear` (`models/layers/linear.py`): q|k|v and gate|up
merged, o and down plain or row-parallel. A merged layer built from separate checkpoint
projections (`packed_modules`) has one LoRA slice per projection, each with its own `A`; a
layer the checkpoint already fuses (Phi-3's `qkv_proj`) is one slice, as PEFT adapts it.
An adapter module is found the way the loader finds a checkpoint tensor: the model's name
renames, then its packed projections.

One slot's weights are one flat buffer: for each layer, `A` as `[slices, rank, in]` then
`B` as `[out, rank]` (the adapter's scaling folded into `B`), ranks below the slots' rank
zero-padded. Loading an adapter into a slot is then one copy of its packed buffer.

With tensor parallelism each rank packs its part, split as the layer is: a column-parallel
layer's `B` by its output rows (each slice's own rows), a row-parallel layer's `A` by its
input columns (the rank's partial shrink, expanded and added into its partial output before
the layer's all-reduce, sums to the whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.layers.linear import Linear, MergedLinear, RowParallelLinear
from ..models.layers.moe import FusedMoE
from .peft_folder import PeftAdapter

_ALIGN = 64
"""Elements each layer's `A` and `B` start at a multiple of (128-byte rows for 16-bit)."""


@dataclass(frozen=True)
class LoRATarget:
    """One adaptable projection of this rank."""

    path: str
    """The module's name in the model."""
    leaves: tuple[str, ...]
    """Each slice's checkpoint projection name (`q_proj`, ... or the layer's own)."""
    slice_widths: tuple[int, ...]
    """Each slice's output columns on this rank, in order."""
    b_rows: tuple[tuple[tuple[int, int], ...], ...]
    """Per slice, the `(start, length)` row ranges of the adapter's `lora_B` this rank holds
    (several for a fused checkpoint projection split over ranks)."""
    full_out: tuple[int, ...]
    """Per slice, the adapter's `lora_B` rows (the whole projection's output)."""
    in_features: int
    """Input columns on this rank."""
    a_cols: tuple[int, int]
    """`(start, length)` of the adapter's `lora_A` columns this rank holds."""
    full_in: int
    """The adapter's `lora_A` columns (the whole projection's input)."""
    a_offset: int
    b_offset: int

    @property
    def num_slices(self) -> int:
        return len(self.leaves)

    @property
    def out_features(self) -> int:
        return sum(self.slice_widths)

    @property
    def slice_starts(self) -> list[int]:
        starts = [0]
        for width in self.slice_widths:
            starts.append(starts[-1] + width)
        return starts


class LoRALayout:
    """The adaptable projections of `model` and the flat slot layout of their weights.

    Args:
        model: The runner's model (this rank's shard).
        max_rank: The slots' rank.
    """

    def __init__(self, model: nn.Module, max_rank: int) -> None:
        self.max_rank = max_rank
        self.model = model
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules", {}))
        self.shard_of = {
            src: (dst, i) for dst, srcs in packed.items() for i, src in enumerate(srcs)
        }
        self.renames = tuple(getattr(model, "checkpoint_prefix_renames", ()))
        self.replacements = tuple(getattr(model, "checkpoint_name_replacements", ()))
        self.modules = dict(model.named_modules())
        self.targets: dict[str, LoRATarget] = {}
        offset = 0
        for path, module in self.modules.items():
            if not isinstance(module, Linear):
                continue
            target = _target(path, module, packed, offset, max_rank)
            self.targets[path] = target
            offset = _aligned(target.b_offset + target.out_features * max_rank)
        self.slot_numel = offset
        """Elements of one slot's flat buffer."""
        self.known_leaves = {p.rpartition(".")[2] for p in self.modules} | set(self.shard_of)

    def locate(self, adapter: PeftAdapter, name: str) -> tuple[LoRATarget, int]:
        """The projection and slice the adapter's module `name` (checkpoint naming) adapts.

        Raises:
            InvalidParamError: the base model has no such projection, or batchlm does not
                adapt it (an embedding, the LM head, a router, an expert).
        """
        path = self._model_path(name + ".")[:-1]
        parent, _, leaf = path.rpartition(".")
        if leaf in self.shard_of:
            merged, _ = self.shard_of[leaf]
            path = f"{parent}.{merged}" if parent else merged
        target = self.targets.get(path)
        if target is not None and leaf in target.leaves:
            return target, target.leaves.index(leaf)
        if ".experts." in path + "." or path.endswith(".experts"):
            what = "a mixture-of-experts expert (expert LoRA is not served)"
        elif path in self.modules and isinstance(self.modules.get(parent), FusedMoE):
            what = (
                f"the mixture-of-experts gate {path!r} (routers and expert gates are not "
                "adapted: list the attention and MLP projections in target_modules)"
            )
        elif path in self.modules:
            what = (
                f"the base model's {type(self.modules[path]).__name__} {path!r}, which is not "
                "a decoder projection (adapters apply to q/k/v/o and gate/up/down)"
            )
        else:
            what = f"{name!r}, a module the base model ({type(self.model).__name__}) lacks"
        raise adapter.error(f"its weights adapt {what}; use an adapter trained on this base model")

    def _model_path(self, name: str) -> str:
        for old, new in self.renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        for old, new in self.replacements:
            name = name.replace(old, new)
        return name

    def check_target_modules(self, adapter: PeftAdapter) -> None:
        """Refuse a `target_modules` list naming a module the base model lacks (names are
        matched by their last part, as PEFT matches them; a regex or `all-linear` is
        judged by the weights alone)."""
        targets = adapter.target_modules
        if isinstance(targets, str):
            return
        for entry in targets:
            leaf = str(entry).rpartition(".")[2]
            if leaf not in self.known_leaves:
                raise adapter.error(
                    f"target_modules names {entry!r}, a module the base model "
                    f"({type(self.model).__name__}) lacks; use an adapter trained on this "
                    "base model",
                )

    def pack(self, adapter: PeftAdapter, dtype: torch.dtype) -> torch.Tensor:
        """The adapter's weights in one slot's layout: `[slot_numel]` in `dtype`, on the CPU.

        Raises:
            InvalidParamError: a module the model lacks or does not adapt, a rank above the
                slots' rank, or shapes that are not the base model's.
        """
        self.check_target_modules(adapter)
        flat = torch.zeros(self.slot_numel, dtype=dtype)
        rank_limit = self.max_rank
        for name, weights in adapter.modules.items():
            target, s = self.locate(adapter, name)
            rank = weights.rank
            if rank > rank_limit:
                raise adapter.error(
                    f"module {name} has rank {rank}, above max_lora_rank={rank_limit}; build "
                    f"the LLM with max_lora_rank >= {rank}",
                )
            lora_a, lora_b = weights.lora_a, weights.lora_b
            expected = ((rank, target.full_in), (target.full_out[s], rank))
            if (tuple(lora_a.shape), tuple(lora_b.shape)) != expected:
                raise adapter.error(
                    f"module {name} has lora_A {tuple(lora_a.shape)} and lora_B "
                    f"{tuple(lora_b.shape)}, where the base model's projection needs "
                    f"{expected[0]} and {expected[1]}; the adapter belongs to another model",
                )
            a_view, b_view = self.views(target, flat.unsqueeze(0))
            start, length = target.a_cols
            a_view[0, s, :rank] = lora_a[:, start : start + length].to(dtype)
            rows = torch.cat([lora_b[a : a + n] for a, n in target.b_rows[s]])
            first = target.slice_starts[s]
            scaled = rows.float() * weights.scaling
            b_view[0, first : first + target.slice_widths[s], :rank] = scaled.to(dtype)
        return flat

    def views(self, target: LoRATarget, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`A` `[L, S, R, in]` and `B` `[L, out, R]` of `target`, views of `slots`
        (`[L, slot_numel]`)."""
        num = slots.shape[0]
        r, k = self.max_rank, target.in_features
        a_end = target.a_offset + target.num_slices * r * k
        a = slots[:, target.a_offset : a_end].view(num, target.num_slices, r, k)
        b_end = target.b_offset + target.out_features * r
        b = slots[:, target.b_offset : b_end].view(num, target.out_features, r)
        return a, b


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _target(
    path: str, module: Linear, packed: dict[str, list[str]], offset: int, max_rank: int
) -> LoRATarget:
    leaf = path.rpartition(".")[2]
    tp_rank = getattr(module, "tp_rank", 0)
    tp_size = getattr(module, "tp_size", 1)
    if isinstance(module, MergedLinear):
        widths = tuple(module.output_sizes)
        rows = [module.checkpoint_rows(i) for i in range(len(widths))]
        if leaf in packed:  # one checkpoint projection per slice
            leaves = tuple(packed[leaf])
            b_rows = tuple(((r.start, w),) for r, w in zip(rows, widths, strict=True))
            full_out = tuple(w * tp_size for w in widths)
        else:  # the checkpoint fuses them: one slice, this rank's rows of each part
            starts = [0]
            for w in widths[:-1]:
                starts.append(starts[-1] + w * tp_size)
            leaves = (leaf,)
            b_rows = (
                tuple((a + r.start, w) for a, r, w in zip(starts, rows, widths, strict=True)),
            )
            full_out = (sum(widths) * tp_size,)
            widths = (sum(widths),)
    else:
        leaves, widths = (leaf,), (module.out_features,)
        b_rows = (((0, module.out_features),),)
        full_out = widths
    in_features = module.in_features
    if isinstance(module, RowParallelLinear):
        a_cols, full_in = (tp_rank * in_features, in_features), in_features * tp_size
    else:
        a_cols, full_in = (0, in_features), in_features
    a_offset = _aligned(offset)
    b_offset = _aligned(a_offset + len(leaves) * max_rank * in_features)
    return LoRATarget(
        path=path,
        leaves=leaves,
        slice_widths=widths,
        b_rows=b_rows,
        full_out=full_out,
        in_features=in_features,
        a_cols=a_cols,
        full_in=full_in,
        a_offset=a_offset,
        b_offset=b_offset,
    )
