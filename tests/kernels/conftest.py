"""Kernel tests run on CUDA, or on CPU in Triton's interpreter.

TRITON_INTERPRET must be set before any `batchlm.kernels` module decorates its kernels, so it
is set here, at collection, and only when there is no GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
