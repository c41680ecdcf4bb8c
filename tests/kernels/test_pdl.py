"""When the kernels are launched with programmatic dependent launch (PDL), and the switch
that turns it off. That each kernel waits for its predecessor in the code PDL compiles to is
checked by `test_compile_sm90`; that results stay exact with PDL on, by the GPU kernel tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from batchlm.engine import envs
from batchlm.kernels import pdl
from batchlm.kernels.pdl import wait_for_previous_kernel


def _pdl_kernel(x_ptr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    tl.store(x_ptr, 1)


COMPILED = JITFunction(_pdl_kernel)
"""The kernel as `@triton.jit` makes it for a GPU, whatever TRITON_INTERPRET says."""
INTERPRETED = InterpretedFunction(_pdl_kernel)
"""The kernel as `@triton.jit` makes it under TRITON_INTERPRET=1 (runs on CPU tensors)."""
CUDA = torch.device("cuda", 0)
ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}

# Compute capabilities of NVIDIA's architectures (CUDA C++ Programming Guide, "Compute
# Capabilities"), and the ones PDL is for: Hopper and data-centre Blackwell, where PDL launches
# inside CUDA graphs are in wide use (consumer Blackwell has seen such graph captures fail).
ARCHITECTURES = {
    (7, 0): "Volta",
    (7, 5): "Turing",
    (8, 0): "Ampere (A100)",
    (8, 6): "Ampere (consumer)",
    (8, 7): "Ampere (Orin)",
    (8, 9): "Ada",
    (9, 0): "Hopper",
    (10, 0): "Blackwell (B200)",
    (10, 3): "Blackwell (B300)",
    (11, 0): "Blackwell (Thor)",
    (12, 0): "Blackwell (consumer)",
    (12, 1): "Blackwell (GB10)",
}
PDL_ARCHITECTURES = {"Hopper", "Blackwell (B200)", "Blackwell (B300)"}


@pytest.fixture
def restore_enabled():
    yield
    pdl.set_enabled(True)


def on_capability(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(pdl, "_capability", lambda device: capability)


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    on_capability(monkeypatch, (9, 0))
    assert pdl.launch_options(COMPILED, CUDA) == ON  # the same device, the kernel compiled
    assert pdl.launch_options(INTERPRETED, CUDA) == OFF
    assert pdl.launch_options(COMPILED, torch.device("cpu")) == OFF
    assert pdl.launch_options(INTERPRETED, torch.device("cpu")) == OFF


@pytest.mark.parametrize("capability", sorted(ARCHITECTURES), ids=ARCHITECTURES.get)
def test_on_for_hopper_and_datacentre_blackwell(monkeypatch, capability):
    on_capability(monkeypatch, capability)
    expected = ON if ARCHITECTURES[capability] in PDL_ARCHITECTURES else OFF
    assert pdl.launch_options(COMPILED, CUDA) == expected


def test_never_on_before_sm90(monkeypatch):
    """`griddepcontrol`, the instructions PDL compiles to, needs PTX for sm_90 or newer."""
    on = []
    for capability in [(major, minor) for major in range(5, 14) for minor in range(10)]:
        on_capability(monkeypatch, capability)
        if pdl.launch_options(COMPILED, CUDA)["PDL"]:
            on.append(capability)
    assert on and min(on) >= (9, 0)


def test_options_are_triton_launch_options_or_kernel_arguments(monkeypatch):
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    on_capability(monkeypatch, (9, 0))
    options = pdl.launch_options(COMPILED, CUDA)
    launch_fields = {f.name for f in dataclasses.fields(nvidia.CUDAOptions)}
    assert "launch_pdl" in options and "launch_pdl" in launch_fields
    assert set(options) - launch_fields <= set(COMPILED.arg_names)


def test_set_enabled_turns_it_off(monkeypatch, restore_enabled):
    on_capability(monkeypatch, (9, 0))
    pdl.set_enabled(False)
    assert pdl.launch_options(COMPILED, CUDA) == OFF
    pdl.set_enabled(True)
    assert pdl.launch_options(COMPILED, CUDA) == ON
    with pytest.raises(ValueError, match="must be True or False"):
        pdl.set_enabled("no")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, True), ("1", True), ("on", True), ("0", False), (" OFF ", False), ("false", False)],
)
def test_env_switch(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("BATCHLM_PDL", raising=False)
    else:
        monkeypatch.setenv("BATCHLM_PDL", value)
    assert envs.programmatic_launch() is expected


def test_env_switch_names_a_bad_value(monkeypatch):
    monkeypatch.setenv("BATCHLM_PDL", "maybe")
    with pytest.raises(ValueError, match="BATCHLM_PDL='maybe'.*1 .*0"):
        envs.programmatic_launch()
