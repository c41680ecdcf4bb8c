"""Weights read into L2 ahead of their product in a batch-1 decode step.

A decode step at batch 1 alternates matrix-vector products, which keep the memory bus busy,
with short kernels that leave it idle: the norms, the rotary embedding and the KV write,
attention and the merge of its splits, SiLU-and-mul. `gpu_kernels/l2_prefetch.py` reads a
weight through L2; here a layer starts that read on a side stream just before such short
kernels, so that it runs beside them, and the product after them finds the weight (or its
first bytes) in L2. The read is started after the kernel before it on the layer's stream
and joined back after the product that uses the weight, within the same module call, so
CUDA graph captures stay closed.

The plan (`BATCHLM_L2_PREFETCH`) names the weights read, each with a byte count (None: the
whole weight):

- `o`: o_proj's weight, read while the rotary embedding, attention and its merge run (the
  longest run of short kernels; o_proj's weight fits L2 in the usual shapes);
- `gate_up`: the first bytes of gate|up's, while the norm after attention runs;
- `down`: the first bytes of down_proj's, while SiLU-and-mul runs;
- `qkv`: the first bytes of q|k|v's, while the layer's input norm runs.

Only plain half-precision weights on CUDA are read (no quantization method, LoRA adapters
or batch invariance), for one-row inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from batchlm.kernels import use_triton_kernels

from ... import envs

_MB = 1 << 20
_NAMES = ("o", "gate_up", "down", "qkv")
# Default: none, until measured (docs/performance.md).
_DEFAULT_PLAN: dict[str, int | None] = {}


def parse_plan(spec: str | None) -> dict[str, int | None]:
    """`"o,gate_up=8"` → `{"o": None, "gate_up": 8 MiB}`; `"0"` or `""` → `{}`; None →
    the default plan. Raises `ValueError` naming a bad entry."""
    if spec is None:
        return dict(_DEFAULT_PLAN)
    plan: dict[str, int | None] = {}
    for entry in (e.strip() for e in spec.split(",")):
        if entry in ("", "0"):
            continue
        name, _, mb = entry.partition("=")
        name = name.strip()
        if name not in _NAMES:
            raise ValueError(
                f"BATCHLM_L2_PREFETCH: unknown weight {name!r} in {spec!r}; "
                f"expected {', '.join(_NAMES)} (each optionally =MB), or 0"
            )
        try:
            size = None if not mb.strip() else float(mb)
        except ValueError:
            size = -1.0
        if size is not None and size <= 0:
            raise ValueError(f"BATCHLM_L2_PREFETCH: {entry!r} needs a number of MB > 0")
        plan[name] = None if size is None else int(size * _MB)
    return plan


import os

def _trial_programs():
    return int(os.environ.get("BATCHLM_L2_TRIAL_PROGRAMS", "0") or 0)


def _trial_late():
    return os.environ.get("BATCHLM_L2_TRIAL_LATE_JOIN", "") == "1"


class _State:
    plan: dict[str, int | None] | None = None
    pending: set = set()
    streams: dict[torch.device, torch.cuda.Stream] = {}
    sinks: dict[torch.device, torch.Tensor] = {}


def plan() -> dict[str, int | None]:
    """The plan of this process (read from the environment once)."""
    if _State.plan is None:
        _State.plan = parse_plan(envs.l2_prefetch())
    return _State.plan


def set_plan(spec: str | None) -> None:
    """Replace the plan by `spec` (as `BATCHLM_L2_PREFETCH` takes it; None: read the
    environment again), for steps run and graphs captured from now on."""
    _State.plan = None if spec is None else parse_plan(spec)


def _plain_weight(layer: nn.Module | None) -> torch.Tensor | None:
    if layer is None or getattr(layer, "quant_method", None) is not None:
        return None
    if getattr(layer, "lora", None) is not None or getattr(layer, "batch_invariant", False):
        return None
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float16, torch.bfloat16):
        return None
    return weight if weight.is_contiguous() else None


def start(name: str, layer: nn.Module | None, x: torch.Tensor) -> bool:
    """Start reading `layer`'s weight into L2 on the side stream, after what the current
    stream has queued, if the plan names `name` and `x` (the step's activations) is one row
    on CUDA. Returns whether it did: the caller then `join`s after the product."""
    if name not in plan() or x.dim() != 2 or x.shape[0] != 1 or not use_triton_kernels(x):
        return False
    weight = _plain_weight(layer)
    if weight is None or weight.device != x.device:
        return False
    from batchlm.kernels.l2_prefetch import prefetch_l2
    from batchlm.kernels.launch import num_sms

    device = x.device
    side = _State.streams.get(device)
    if side is None:
        side = _State.streams[device] = torch.cuda.Stream(device)
    sink = _State.sinks.get(device)
    if sink is None:
        sink = _State.sinks[device] = torch.empty(1024, dtype=torch.int32, device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        prefetch_l2(weight, plan()[name], sink=sink, programs=min(sink.numel(), _trial_programs() or num_sms(device)))
    _State.pending.add(device)
    return not _trial_late()


def join(started: bool, x: torch.Tensor) -> None:
    """Make the current stream wait for the side stream's reads (after `start` returned
    True for `x`'s device)."""
    if started:
        torch.cuda.current_stream(x.device).wait_stream(_State.streams[x.device])
        _State.pending.discard(x.device)


def join_all(x: torch.Tensor) -> None:
    if x.device in _State.pending:
        join(True, x)
