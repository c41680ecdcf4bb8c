"""Jobs: read → task → write, with local, Ray and Spark runners and resume.

Example:
    >>> from batchlm.pipelines import load_job, run_job
    >>> print(run_job(load_job("conf/generate_demo.yaml")).format())
"""

from __future__ import annotations

import importlib
from typing import Any

# Exports load on first use, so that `batchlm --help` answers without importing torch.
_EXPORTS = {
    "JobSpec": "spec",
    "InputSpec": "spec",
    "OutputSpec": "spec",
    "JobSpecError": "spec",
    "load_job": "spec",
    "JobPlan": "job",
    "plan_job": "job",
    "run_job": "job",
    "JobSummary": "progress",
    "OutputConflictError": "output",
    "run_batch": "run_batch",
    "BatchSummary": "run_batch",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchlm.pipelines' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = list(_EXPORTS)
