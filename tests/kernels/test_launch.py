"""The launchers' shared checks."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.launch import check_same_device, is_interpreted


def test_cpu_tensors_without_the_interpreter_get_a_clear_error():
    compiled_kernel = object()  # stands for a kernel compiled for a GPU
    assert not is_interpreted(compiled_kernel)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        check_same_device(compiled_kernel, x=torch.zeros(1))


def test_tensors_on_different_devices_are_rejected():
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        check_same_device(object(), x=torch.zeros(1), y=torch.zeros(1, device="meta"))
