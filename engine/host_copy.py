"""Host data to the device without the host waiting for the device.

A copy from pageable host memory that is not `non_blocking` makes PyTorch wait for the
device's stream to finish everything queued before it; with async scheduling that is the
step launched ahead, so the host would sit idle and then leave the device idle while it
prepares the rest of the step. Through page-locked memory the copy is queued like a kernel
and the host goes on (the caching host allocator keeps the block until the copy is done).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array (or CPU tensor) on `device`: through page-locked memory and a
    non-blocking copy on CUDA, as is elsewhere."""
    tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
