"""When the kernels are launched with programmatic dependent launch (PDL), and the switch
that turns it off. That each kernel waits for its predecessor in the code PDL compiles to is
checked by `test_compile_sm90`; that results stay exact with PDL on, by the GPU kernel tests."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import envs
from batchlm.kernels import pdl


def _jit_function():
    """Something that is not Triton's interpreted function (a compiled kernel stands in)."""
    return lambda: None


@pytest.fixture
def restore_enabled():
    yield
    pdl.set_enabled(True)


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    from batchlm.kernels.rms_norm import _rms_norm_kernel

    assert pdl.launch_options(_jit_function(), torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "_capability", lambda device: (9, 0))
    if type(_rms_norm_kernel).__name__ == "InterpretedFunction":
        assert pdl.launch_options(_rms_norm_kernel, torch.device("cuda", 0)) == {"PDL": False}


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True), ((12, 0), False)],
)
def test_on_for_hopper_and_datacentre_blackwell(monkeypatch, capability, expected):
    monkeypatch.setattr(pdl, "_capability", lambda device: capability)
    options = pdl.launch_options(_jit_function(), torch.device("cuda", 0))
    assert options == ({"PDL": True, "launch_pdl": True} if expected else {"PDL": False})


def test_set_enabled_turns_it_off(monkeypatch, restore_enabled):
    monkeypatch.setattr(pdl, "_capability", lambda device: (9, 0))
    pdl.set_enabled(False)
    assert pdl.launch_options(_jit_function(), torch.device("cuda", 0)) == {"PDL": False}
    pdl.set_enabled(True)
    assert pdl.launch_options(_jit_function(), torch.device("cuda", 0))["PDL"] is True
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
