"""Where a mixture-of-experts checkpoint tensor goes in an `ExpertWeights`' stacked `w13`
(`[num_experts, 2 * inter, hidden]`, gate rows then up rows) and `w2`
(`[num_experts, hidden, inter]`).

Two checkpoint forms:
- one tensor per expert and projection, as checkpoints on disk hold them:
  `experts.{e}.gate_proj` / `up_proj` / `down_proj` (Qwen MoE), `experts.{e}.w1` (gate) /
  `w3` (up) / `w2` (down) (Mixtral), each `.weight`;
- transformers' fused in-memory form: `experts.gate_up_proj` `[num_experts, 2 * inter,
  hidden]` and `experts.down_proj` `[num_experts, hidden, inter]`.

Under tensor parallelism each rank reads only its rows of every expert's intermediate
dimension, straight from the file.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import UnsupportedModelError
from ..models.layers.moe import ExpertWeights

_GATE, _UP, _DOWN = "gate", "up", "down"
_PER_EXPERT_LEAVES = {
    "gate_proj": _GATE,
    "w1": _GATE,
    "up_proj": _UP,
    "w3": _UP,
    "down_proj": _DOWN,
    "w2": _DOWN,
}


class ExpertPart(NamedTuple):
    """One copy from a checkpoint tensor into a stacked expert parameter."""

    param: str
    """`w13` or `w2`."""
    key: str
    """What this copy fills, for the check that every part was read (`w13#3.gate`)."""
    dest: torch.Tensor
    """The view of the parameter it fills."""
    rows: tuple[int, int, int] | None
    """`(dim, start, length)` of the checkpoint tensor to read (None: all of it)."""


def expert_parts(module: ExpertWeights, rest: str, name: str) -> list[ExpertPart]:
    """The copies that put checkpoint tensor `name` into `module`.

    Args:
        module: The layer's stacked experts.
        rest: The name after the module's path (`3.gate_proj.weight`, `gate_up_proj`).
        name: The whole checkpoint name, for errors.
    """
    inter = module.local_intermediate_size
    start = module.tp_rank * inter
    sharded = module.tp_size > 1
    fields = rest.split(".")
    if len(fields) == 3 and fields[0].isdigit() and fields[2] == "weight":
        expert, kind = int(fields[0]), _PER_EXPERT_LEAVES.get(fields[1])
        if kind is not None and expert < module.num_experts:
            key = f"#{expert}.{kind}"
            if kind == _DOWN:  # [hidden, inter]: this rank's columns
                rows = (1, start, inter) if sharded else None
                return [ExpertPart("w2", "w2" + key, module.w2.data[expert], rows)]
            half = (
                module.w13.data[expert, :inter]
                if kind == _GATE
                else module.w13.data[expert, inter:]
            )
            rows = (0, start, inter) if sharded else None
            return [ExpertPart("w13", "w13" + key, half, rows)]
    if rest == "gate_up_proj":  # [experts, 2 * inter, hidden]: gate rows, then up rows
        whole = module.intermediate_size
        return [
            ExpertPart(
                "w13",
                f"w13#fused.{kind}",
                module.w13.data[:, i * inter : (i + 1) * inter],
                (1, i * whole + start, inter),
            )
            for i, kind in enumerate((_GATE, _UP))
        ]
    if rest == "down_proj":  # [experts, hidden, inter]
        return [
            ExpertPart("w2", "w2#fused", module.w2.data, (2, start, inter) if sharded else None)
        ]
    raise UnsupportedModelError(
        f"checkpoint tensor {name!r} is not a mixture-of-experts tensor batchlm reads "
        "(experts.{e}.gate_proj / up_proj / down_proj / w1 / w3 / w2 .weight, or "
        f"experts.gate_up_proj / down_proj), or names an expert past num_experts="
        f"{module.num_experts}"
    )


def missing_expert_parts(path: str, module: ExpertWeights, filled: set[str]) -> list[str]:
    """Parts of `module` (at `path`) that no checkpoint tensor filled."""

    def done(param: str, expert: int, kind: str) -> bool:
        fused = f"{path}.{param}#fused" + ("" if kind == _DOWN else f".{kind}")
        return fused in filled or f"{path}.{param}#{expert}.{kind}" in filled

    missing = []
    for e in range(module.num_experts):
        for param, kind in (("w13", _GATE), ("w13", _UP), ("w2", _DOWN)):
            if not done(param, e, kind):
                missing.append(f"{path}.{param}[expert {e} {kind}]")
    return missing
