"""The plan of weights read into L2 at batch 1 (BATCHLM_L2_PREFETCH), and that nothing is
read off CUDA or for more than one row."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine.models.layers import prefetch
from batchlm.engine.models.layers.linear import Linear

MB = 1 << 20


def test_plan_parses_names_and_sizes():
    assert prefetch.parse_plan("o") == {"o": None}
    assert prefetch.parse_plan(" o , gate_up=8,down=0.5, qkv=16 ") == {
        "o": None,
        "gate_up": 8 * MB,
        "down": MB // 2,
        "qkv": 16 * MB,
    }
    assert prefetch.parse_plan("0") == {} and prefetch.parse_plan("") == {}


@pytest.mark.parametrize(
    ("spec", "match"),
    [("o,lm_head", "unknown weight 'lm_head'"), ("gate_up=-1", "'gate_up=-1' needs"),
     ("down=x", "'down=x' needs"), ("qkv=0", "'qkv=0' needs")],
)  # fmt: skip
def test_plan_refuses_bad_entries(spec, match):
    with pytest.raises(ValueError, match=match):
        prefetch.parse_plan(spec)


def test_environment_sets_the_plan(monkeypatch):
    monkeypatch.setenv("BATCHLM_L2_PREFETCH", "o,down=2")
    prefetch.set_plan(None)
    try:
        assert prefetch.plan() == {"o": None, "down": 2 * MB}
    finally:
        monkeypatch.delenv("BATCHLM_L2_PREFETCH")
        prefetch.set_plan(None)


def test_nothing_is_read_on_cpu():
    prefetch.set_plan("o")
    try:
        layer = Linear(16, 8, bias=False).to(torch.bfloat16)
        x = torch.randn(1, 16, dtype=torch.bfloat16)
        assert prefetch.start("o", layer, x) is False
        prefetch.join(False, x)  # a no-op
    finally:
        prefetch.set_plan(None)
