"""Kernel tests run on CUDA, or on CPU in Triton's interpreter (which `tests/conftest.py`
turns on, before any kernel module is imported, when there is no GPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
