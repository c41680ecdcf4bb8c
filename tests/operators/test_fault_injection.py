"""The fault-injection hooks: off by default, a plan survives its trip through the
environment, and no public docstring of another module mentions them."""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from batchlm.operators import fault_injection
from batchlm.operators.fault_injection import ActorFault, FaultPlan

REPO = Path(__file__).resolve().parents[2]
PRODUCTION_MODULES = [
    f"batchlm.{path.parent.name}.{path.stem}"
    for folder in ("operators", "pipelines")
    for path in sorted((REPO / folder).glob("*.py"))
    if path.stem not in ("__init__", "__main__", "fault_injection")  # __main__ runs the CLI
]


class Loop:
    """Stands for an `EngineLoop`: the hooks only need an object to key their state on."""


def test_no_plan_means_no_faults(monkeypatch):
    monkeypatch.delenv(fault_injection.ENV_VAR, raising=False)
    assert fault_injection.active_plan() is None
    fault_injection.before_engine_call(Loop())
    fault_injection.after_shard_commit(1)
    fault_injection.before_batch_write(0)


def test_a_plan_crosses_the_environment(monkeypatch):
    plan = FaultPlan(
        exit_after_batches=3, actor=ActorFault(on_call=2, kind="raise", marker="m", times=5)
    )
    env = plan.env()
    assert list(env) == [fault_injection.ENV_VAR]
    monkeypatch.setenv(fault_injection.ENV_VAR, env[fault_injection.ENV_VAR])
    assert fault_injection.active_plan() == plan


def test_a_bad_plan_names_the_key():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['exit_after'\]"):
        FaultPlan.from_json(json.dumps({"exit_after": 1}))
    with pytest.raises(ValueError, match="kind='crash' is unknown"):
        ActorFault(on_call=1, kind="crash", marker="m")


def test_armed_engine_failures_are_per_loop_and_counted():
    armed, other = Loop(), Loop()
    fault_injection.fail_engine_calls(armed, RuntimeError("device lost"), count=2)
    fault_injection.before_engine_call(other)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="device lost"):
            fault_injection.before_engine_call(armed)
    fault_injection.before_engine_call(armed)  # spent


@pytest.mark.parametrize("name", PRODUCTION_MODULES)
def test_public_docstrings_do_not_mention_fault_injection(name):
    if name == "batchlm.operators.lm_eval":
        pytest.importorskip("lm_eval")  # the optional `eval` extra
    module = importlib.import_module(name)
    docs = [module.__doc__ or ""]
    for public in getattr(module, "__all__", []):
        obj = getattr(module, public)
        if not callable(obj):  # a constant: its docstring is its type's
            continue
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            docs.extend(
                inspect.getdoc(member) or ""
                for member_name, member in inspect.getmembers(obj)
                if callable(member) and not member_name.startswith("_")
            )
    found = re.findall(r"\bfault|\binject|test hook|fail_once|trace_dir", "\n".join(docs), re.I)
    assert not found, f"{name}: a public docstring mentions {found}"
