"""All-reduce through peer GPU memory for small tensors (see `gpu_kernels/all_reduce.py`).

Each rank allocates one device buffer (two halves of data, one slot per rank in each, then
its flags) with the CUDA driver, exports it as a CUDA IPC handle through the group's store,
and maps every peer's buffer into its own address space. The kernel then writes its part
into every rank's buffer over NVLink directly: one launch per all-reduce instead of NCCL's
ring protocol, and it can be captured in CUDA graphs like any other kernel.

Only used where every pair of the group's GPUs has peer access; tensors larger than
`max_bytes` go to NCCL.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from batchlm.kernels.all_reduce import (
    DTYPES,
    GRID,
    MAX_NORM_HIDDEN,
    one_shot_all_reduce,
    one_shot_all_reduce_rms_norm,
)
from batchlm.kernels.rms_norm import RMSNormOutput

MAX_BYTES = 512 * 1024
"""Largest tensor (bytes) reduced through peer memory; larger ones go to NCCL."""
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.POINTER(ctypes.c_uint64)
    lib.cuMemAlloc_v2.argtypes = [ptr, ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ptr, _IpcHandle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    lib.cuCtxSynchronize.argtypes = []
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(text))
        name = text.value.decode() if text.value else "unknown error"
        raise RuntimeError(f"{what} failed: CUDA driver error {status} ({name})")


def peer_access_everywhere(world_size: int) -> bool:
    """Whether every pair of the devices 0..world_size-1 can address each other."""
    return all(
        torch.cuda.can_device_access_peer(a, b)
        for a in range(world_size)
        for b in range(world_size)
        if a != b
    )


class PeerAllReduce:
    """One rank's side of the peer-memory all-reduce.

    Every rank of the group must construct it at the same point (it exchanges handles
    through `store` and waits for every peer's).

    Args:
        store: The group's rendezvous store.
        rank: This rank.
        world_size: Ranks in the group.
        device: This rank's CUDA device (current while constructing).
        max_bytes: Largest tensor reduced here.
    """

    def __init__(
        self, store: Any, rank: int, world_size: int, device: torch.device, max_bytes: int
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.max_bytes = max_bytes
        lib = _driver()
        data_bytes = 2 * world_size * max_bytes  # [parity, rank, max_bytes]
        flag_bytes = GRID * world_size * 4
        # Make the device's primary context current in this thread (the driver calls use it).
        torch.cuda.set_device(device)
        torch.empty(1, device=device)
        base = ctypes.c_uint64()
        _check(lib.cuMemAlloc_v2(ctypes.byref(base), data_bytes + flag_bytes), "cuMemAlloc")
        self._own = base.value
        self._opened: list[int] = []
        try:
            _check(lib.cuMemsetD8_v2(self._own, 0, data_bytes + flag_bytes), "cuMemsetD8")
            _check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
            handle = _IpcHandle()
            _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), self._own), "cuIpcGetMemHandle")
            key = "batchlm/peer_all_reduce/{}"
            store.set(key.format(rank), bytes(handle))  # all 64 bytes (`.reserved` stops at a NUL)
            bases = []
            for r in range(world_size):
                if r == rank:
                    bases.append(self._own)
                    continue
                peer = _IpcHandle.from_buffer_copy(store.get(key.format(r)))
                mapped = ctypes.c_uint64()
                _check(
                    lib.cuIpcOpenMemHandle_v2(
                        ctypes.byref(mapped), peer, _IPC_LAZY_ENABLE_PEER_ACCESS
                    ),
                    f"cuIpcOpenMemHandle (rank {r}'s buffer)",
                )
                self._opened.append(mapped.value)
                bases.append(mapped.value)
        except BaseException:
            self.close()
            raise
        self.data_addrs = torch.tensor(bases, dtype=torch.int64, device=device)
        self.flag_addrs = torch.tensor(
            [b + data_bytes for b in bases], dtype=torch.int64, device=device
        )
        self.epochs = torch.zeros(GRID, dtype=torch.int32, device=device)
        self.errors = torch.zeros(1, dtype=torch.int32, device=device)
        """Programs that gave up waiting for a peer (a dead or stuck rank), cumulative."""
        self.abort = torch.zeros(1, dtype=torch.int32).pin_memory()
        """Read by waiting kernels: nonzero makes them give up (`abort_waits`)."""

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` is reduced here (else by NCCL). Only its device, dtype and size
        decide, which every rank's part shares: all ranks choose alike."""
        return (
            x.device == self.device
            and x.dtype in DTYPES
            and x.numel() * x.element_size() <= self.max_bytes
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        if not x.is_contiguous():
            return x.copy_(self(x.contiguous()))
        return one_shot_all_reduce(x, *self._exchange(x))

    def _exchange(self, x: torch.Tensor) -> tuple:
        """The kernels' arguments after the tensors: rank, buffers, counters, slot size."""
        return (
            self.rank,
            self.data_addrs,
            self.flag_addrs,
            self.epochs,
            self.errors,
            self.abort,
            self.max_bytes // x.element_size(),
        )

    def fits_norm(self, x: torch.Tensor) -> bool:
        """Whether `add_rms_norm` takes `x` (device, dtype and shape decide, as in `fits`)."""
        return (
            x.is_floating_point()
            and self.fits(x)
            and x.dim() >= 1
            and 0 < x.shape[-1] <= MAX_NORM_HIDDEN
        )

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> RMSNormOutput:
        """RMSNorm of `sum over ranks of x + residual`, with that sum: one kernel."""
        return one_shot_all_reduce_rms_norm(
            x.contiguous(), residual, weight, eps, *self._exchange(x)
        )

    def abort_waits(self) -> None:
        """Make every kernel waiting for a peer (now or later) give up: a rank is dead."""
        self.abort.fill_(1)

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (idempotent)."""
        lib = _driver()
        for addr in self._opened:
            lib.cuIpcCloseMemHandle(addr)
        self._opened = []
        if self._own:
            lib.cuMemFree_v2(self._own)
            self._own = 0
