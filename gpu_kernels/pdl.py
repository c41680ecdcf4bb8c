"""Programmatic dependent launch (PDL) for the kernels of one step.

A decode step is a chain of short kernels, each waiting for the one before it. Launched the
usual way, a kernel's programs are only placed on the SMs once the previous kernel has
finished, so every link of the chain pays the launch and the previous kernel's tail. With
PDL (Hopper and newer), a kernel launched with the programmatic-serialization attribute is
placed as soon as every program of the kernel before it has signalled (or exited); it then
waits on the device, in `griddepcontrol.wait`, until that kernel has completed and its
writes are visible.

The contract every kernel here keeps, so that chains stay ordered:
- `wait_for_previous_kernel(PDL)` runs in every program before any global load or store
  that the previous kernels could write or read (weights may be read before it);
- the signal to the next kernel comes after that wait, so at most one kernel is ever
  waiting ahead of the running one, and completion still implies the predecessors'.

Kernels launched without the attribute (cuBLAS, PyTorch's own) wait for full completion as
always, and `griddepcontrol` does nothing in a kernel launched without it. Under Triton's
interpreter, before sm_90 and on sm_120, `launch_options` turns PDL off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import _capability, is_interpreted

__all__ = ["launch_options", "set_enabled", "wait_for_previous_kernel"]

_enabled = True
# Hopper (sm_90) and data-centre Blackwell (sm_100): where PDL inside CUDA graphs is in wide
# use. Consumer Blackwell (sm_120) has had graph captures fail with PDL launches elsewhere,
# so it launches the usual way.
_ARCHS = (9, 10)


def set_enabled(enabled: bool) -> None:
    """Use PDL (the default where the device has it) or not, for kernels launched from now
    on. CUDA graphs keep the launches they captured."""
    global _enabled
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r} must be True or False")
    _enabled = enabled


def launch_options(kernel: object, device: torch.device) -> dict[str, bool]:
    """The keyword arguments for one launch of a kernel that takes a `PDL` constexpr:
    PDL on for CUDA devices of compute capability 9.x and 10.x, off otherwise."""
    on = (
        _enabled
        and device.type == "cuda"
        and not is_interpreted(kernel)
        and _capability(device)[0] in _ARCHS
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Wait until the previous kernel of the stream has completed (its writes visible), then
    let the next one be placed. Nothing when `PDL` is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
