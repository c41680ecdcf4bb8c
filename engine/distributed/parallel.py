"""The tensor-parallel process group of one engine: rendezvous, all-reduce, all-gather.

Each engine builds its own group from its own TCP store (the driver hosts it on a free
port) instead of `torch.distributed.init_process_group`, so that several engines, or a
user's own default group, can live in one process. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import envs


@dataclass
class TPGroup:
    """One rank's view of the tensor-parallel group.

    Layers call `all_reduce` / `all_gather` on it; with `world_size == 1` models are built
    from plain layers and never call it.
    """

    rank: int
    world_size: int
    device: torch.device
    process_group: Any = None
    """The c10d backend object (`ProcessGroupGloo` / `ProcessGroupNCCL`)."""
    peer_all_reduce: Any = None
    """`PeerAllReduce` for small tensors on GPUs with peer access (None: NCCL only)."""
    fused_norm: bool = False
    """`all_reduce_add_rms_norm` runs the one-kernel path (BATCHLM_FUSED_ALL_REDUCE_NORM)."""
    sum_in_rank_order: bool = False
    """Every all-reduce adds the ranks' parts in rank order, in float32, whatever the
    tensor's size (the batch-invariant mode): the peer-memory kernel does so already;
    tensors it does not take are all-gathered and summed here, since NCCL's ring and tree
    algorithms order each element's sum by its offset in the buffer and by the buffer's
    size. The fused all-reduce + norm kernel is not used."""

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        peer = self.peer_all_reduce
        if peer is not None and peer.fits(x):
            return peer(x)
        if self.sum_in_rank_order:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x.contiguous(), group=self.process_group)
            return x.copy_(sum_in_rank_order(parts))
        dist.all_reduce(x, group=self.process_group)
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RMSNorm of `sum over ranks of x + residual`, and that sum, in one peer-memory
        kernel; None where the peer path does not take `x` (the caller then sums with
        `all_reduce` and normalises on its own)."""
        peer = self.peer_all_reduce
        if (
            self.fused_norm
            and not self.sum_in_rank_order
            and peer is not None
            and peer.fits_norm(x)
        ):
            return tuple(peer.add_rms_norm(x, residual, weight, eps))
        return None

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., n]` on every rank → `[..., world_size * n]`, rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.process_group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of rank `src` into `x` on every rank, in place; returns `x`. (Called on
        the backend itself: `dist.broadcast` maps `src` through a registered group.)"""
        peer = self.peer_all_reduce
        if peer is not None and peer.fits(x):
            # A sum with zeros from every other rank: one kernel, in stream order, where
            # NCCL's broadcast was seen to hold the host until the device caught up.
            if self.rank != src:
                x.zero_()
            return peer(x)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.process_group.broadcast([x], opts).wait()
        return x

    def abort(self) -> None:
        """Best effort: make collectives blocked on a dead peer return with an error (NCCL
        only; gloo notices closed connections by itself)."""
        if self.peer_all_reduce is not None:
            self.peer_all_reduce.abort_waits()
        abort = getattr(self.process_group, "abort", None) or getattr(
            self.process_group, "_abort", None
        )
        if callable(abort) and self.backend == "nccl":
            abort()


def sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' parts added in rank order in float32 (int64 for integers), rounded once to
    their dtype: what the peer-memory all-reduce computes, bit for bit."""
    acc_dtype = torch.float32 if parts[0].is_floating_point() else torch.int64
    acc = torch.zeros(parts[0].shape, dtype=acc_dtype, device=parts[0].device)
    for part in parts:
        acc += part.to(acc_dtype)
    return acc.to(parts[0].dtype)


def create_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, hosted by the driver (rank 0) on a free local port."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def connect_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def create_tp_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
    custom_all_reduce: bool = True,
) -> TPGroup:
    """Join the group (blocks until every rank has joined, or `timeout_s`).

    With `custom_all_reduce` on CUDA devices that all have peer access to each other, the
    group also sets up the peer-memory all-reduce (every rank decides the same way: the
    check covers every pair of devices)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    group = TPGroup(rank, world_size, device, pg)
    if device.type == "cuda" and world_size > 1 and custom_all_reduce:
        from .peer_all_reduce import MAX_BYTES, PeerAllReduce, peer_access_everywhere

        if peer_access_everywhere(world_size):
            group.peer_all_reduce = PeerAllReduce(store, rank, world_size, device, MAX_BYTES)
            group.fused_norm = envs.fused_all_reduce_norm()
    return group
