"""One-shot all-reduce over peer memory, for the small tensors of tensor-parallel decode.

NCCL's ring all-reduce costs several microseconds even for one 8 KiB row; a decode step at
batch 1 runs 65 of them. Here every rank's GPU can address every other rank's buffers (CUDA
IPC over NVLink), so one kernel does the whole exchange:

1. each program writes its chunk of `x` into this rank's slot of every rank's data buffer
   (stores to a peer are posted over NVLink: nothing waits for a round trip);
2. it raises its flag in every peer's flag array (a release at system scope, after a barrier
   of the program's threads) and waits for every peer's flag in its own (acquire), so all
   ranks' chunks are in its own buffer;
3. it sums the chunk over the slots, in rank order and in float32 (int64 for integer
   tensors), reading local memory only, and writes it into `x`.

Every rank adds the same values in the same order, so all ranks hold bit-identical sums
(the ranks' hidden states must never drift apart).

Flags carry a per-program call count (`epochs`, kept on the device, so a CUDA graph replays
correctly), and data alternates between two halves of each buffer by its parity: a rank
writes a peer's half again two calls later, when that peer has entered the call in between
and so has finished reading it (kernels on one stream run one after another). The grid is the
same for every call, so every program's count advances with every call.

`one_shot_all_reduce_rms_norm` does the same exchange for the row-parallel layer's output
that an RMSNorm follows: each program owns whole rows (`program, program + GRID, ...`), and
after summing a row it adds the residual and normalises it in the same kernel, rounding
as `all_reduce` followed by `rms_norm.fused_add_rms_norm` would. Both kernels share the
buffers, flags and call counts: a step may mix them in any order.

A peer that never arrives (a dead rank) must not hang the device: a waiting program gives
up when the host raises the abort flag (page-locked host memory, polled every
`ABORT_POLL_SPINS` polls of the peer's flag) or after `max_spins` polls; either way it
counts the failure in `errors`, for the host to report, and returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2
from .pdl import launch_options, wait_for_previous_kernel
from .rms_norm import (
    RMSNormOutput,
    as_rows,
    check_norm_args,
    fused_add_rms_norm_ref,
    rms_norm_row,
    row_warps,
)

__all__ = [
    "DTYPES",
    "GRID",
    "MAX_NORM_HIDDEN",
    "all_reduce_ref",
    "all_reduce_rms_norm_ref",
    "one_shot_all_reduce",
    "one_shot_all_reduce_rms_norm",
]

DTYPES = (*FLOAT_DTYPES, torch.int32, torch.int64)
GRID = 16
"""Programs per call: each owns one chunk of the tensor and one flag per rank."""
BLOCK = 1024
"""Elements one program moves per loop iteration."""
MAX_SPINS = 1 << 30
"""Polls of a peer's flag before a program gives up unasked (minutes, not a hang)."""
ABORT_POLL_SPINS = 1024
MAX_NORM_HIDDEN = 16384
"""Widest row `one_shot_all_reduce_rms_norm` takes (one program holds a whole row)."""


@triton.jit
def _signal_and_wait(
    flag_addrs_ptr, errors_ptr, abort_addr, pid, epoch, max_spins,
    RANK: tl.constexpr, WORLD: tl.constexpr, ABORT_POLL: tl.constexpr,
):  # fmt: skip
    """Raise program `pid`'s flag in every peer's flags, then wait until every peer's
    program `pid` has raised its own in ours for call `epoch` (or give up: see above)."""
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = tl.load(flag_addrs_ptr + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + pid * WORLD + RANK, epoch, sem="release", scope="sys")
    my_flags = tl.load(flag_addrs_ptr + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = my_flags + pid * WORLD + r
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            spins = 0
            stop = 0
            while (seen < epoch) & (stop == 0):
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                spins += 1
                if spins % ABORT_POLL == 0:
                    aborted = tl.load(abort_addr.to(tl.pointer_type(tl.int32)), volatile=True)
                    stop = ((aborted != 0) | (spins >= max_spins)).to(tl.int32)
            if seen < epoch:
                tl.atomic_add(errors_ptr, 1)


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr,  # [n], this rank's part; the sum on return
    data_addrs_ptr,  # int64 [WORLD]: each rank's data buffer, [2, WORLD, slot] elements
    flag_addrs_ptr,  # int64 [WORLD]: each rank's int32 flags, [GRID, WORLD]
    epochs_ptr,  # int32 [GRID]: calls made so far, per program
    errors_ptr,  # int32 [1]: programs that gave up waiting
    abort_addr,  # int64: address of the int32 abort flag (host memory the device can read)
    n,
    chunk,  # elements per program, a multiple of BLOCK
    slot,  # elements of one rank's part in a data buffer
    max_spins,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    ABORT_POLL: tl.constexpr,
    ACC: tl.constexpr,  # float32, or int64 for integer tensors
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(epochs_ptr + pid) + 1
    base = (epoch % 2).to(tl.int64) * WORLD * slot
    lo = pid.to(tl.int64) * chunk
    mine = tl.load(data_addrs_ptr + RANK).to(tl.pointer_type(dtype))
    for i in range(0, chunk, BLOCK):
        offs = lo + i + tl.arange(0, BLOCK)
        mask = offs < n
        part = tl.load(x_ptr + offs, mask=mask)
        for r in tl.static_range(WORLD):
            dst = tl.load(data_addrs_ptr + r).to(tl.pointer_type(dtype))
            tl.store(dst + base + RANK * slot + offs, part, mask=mask)
    tl.debug_barrier()  # the whole chunk is written before the flag says so
    _signal_and_wait(
        flag_addrs_ptr, errors_ptr, abort_addr, pid, epoch, max_spins, RANK, WORLD, ABORT_POLL
    )
    tl.debug_barrier()  # every thread reads the slots after the peers' flags were seen
    for i in range(0, chunk, BLOCK):
        offs = lo + i + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=ACC)
        for r in tl.static_range(WORLD):
            got = tl.load(mine + base + r * slot + offs, mask=mask, other=0, volatile=True)
            acc += got.to(ACC)
        tl.store(x_ptr + offs, acc.to(dtype), mask=mask)
    tl.store(epochs_ptr + pid, epoch)


@triton.jit
def _one_shot_all_reduce_rms_norm_kernel(
    x_ptr,  # [num_rows, HIDDEN] contiguous, this rank's part (left as it is)
    residual_ptr,  # [num_rows, HIDDEN], rows `stride_r` apart
    weight_ptr,  # [HIDDEN]
    out_ptr,  # [num_rows, HIDDEN]: RMSNorm(sum + residual) * weight
    residual_out_ptr,  # [num_rows, HIDDEN]: sum + residual
    data_addrs_ptr,
    flag_addrs_ptr,
    epochs_ptr,
    errors_ptr,
    abort_addr,
    num_rows,
    stride_r,
    slot,
    eps,
    max_spins,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    GRID: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ABORT_POLL: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(epochs_ptr + pid) + 1
    base = (epoch % 2).to(tl.int64) * WORLD * slot
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    mine = tl.load(data_addrs_ptr + RANK).to(tl.pointer_type(dtype))
    for row in range(pid, num_rows, GRID):
        at = row * HIDDEN + offs  # < slot elements: int32 holds it
        part = tl.load(x_ptr + at, mask=mask)
        for r in tl.static_range(WORLD):
            dst = tl.load(data_addrs_ptr + r).to(tl.pointer_type(dtype))
            tl.store(dst + base + RANK * slot + at, part, mask=mask)
    tl.debug_barrier()  # every row is written before the flag says so
    _signal_and_wait(
        flag_addrs_ptr, errors_ptr, abort_addr, pid, epoch, max_spins, RANK, WORLD, ABORT_POLL
    )
    tl.debug_barrier()
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # once, not per row
    for row in range(pid, num_rows, GRID):
        at = row * HIDDEN + offs  # < slot elements: int32 holds it
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            got = tl.load(mine + base + r * slot + at, mask=mask, other=0, volatile=True)
            acc += got.to(tl.float32)
        # The steps of `all_reduce` then `fused_add_rms_norm`, each rounding where they do.
        res = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + at, h, mask=mask)
        out = rms_norm_row(h, w, eps, HIDDEN)
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(epochs_ptr + pid, epoch)


def one_shot_all_reduce(
    x: torch.Tensor,
    rank: int,
    data_addrs: torch.Tensor,
    flag_addrs: torch.Tensor,
    epochs: torch.Tensor,
    errors: torch.Tensor,
    abort: torch.Tensor,
    slot: int,
    max_spins: int = MAX_SPINS,
) -> torch.Tensor:
    """Sum `x` over the ranks in place (every rank calls this with its own part); returns x.

    Args:
        x: Contiguous, at most `slot` elements.
        rank: This rank.
        data_addrs: int64 `[world]`, the address of each rank's data buffer as mapped in
            this process (`[2, world, slot]` elements of `x.dtype` each).
        flag_addrs: int64 `[world]`, each rank's int32 flags (`GRID * world`, zeroed once).
        epochs: int32 `[GRID]`, this rank's call counts (zeroed once; advanced here).
        errors: int32 `[1]`, incremented by each program that gave up on a peer.
        abort: int32 `[1]` that the device can read while the kernel runs (page-locked
            host memory on CUDA); nonzero makes waiting programs give up.
        slot: Elements of one rank's part in a data buffer.
        max_spins: Polls of a peer's flag before giving up.
    """
    check_tensor("x", x, dtypes=DTYPES, last_dim_contiguous=False)
    world = _check_exchange(x, rank, data_addrs, flag_addrs, epochs, abort, slot)
    check_same_device(
        _one_shot_all_reduce_kernel,
        x=x, data_addrs=data_addrs, flag_addrs=flag_addrs, epochs=epochs, errors=errors,
    )  # fmt: skip
    n = x.numel()
    chunk = max(BLOCK, triton.cdiv(triton.cdiv(n, GRID), BLOCK) * BLOCK)
    _one_shot_all_reduce_kernel[(GRID,)](
        x, data_addrs, flag_addrs, epochs, errors, abort.data_ptr(), n, chunk, slot,
        max_spins, RANK=rank, WORLD=world, BLOCK=BLOCK, ABORT_POLL=ABORT_POLL_SPINS,
        ACC=tl.float32 if x.is_floating_point() else tl.int64,
        **launch_options(_one_shot_all_reduce_kernel, x.device),
    )  # fmt: skip
    return x


def _check_exchange(x, rank, data_addrs, flag_addrs, epochs, abort, slot: int) -> int:
    """Validate what both kernels ask of `x` (contiguous, at most `slot` elements) and the
    buffers and counters they share; returns the world size."""
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()}")
    if x.numel() > slot:
        raise ValueError(f"x has {x.numel()} elements; the peer buffers hold {slot}")
    world = data_addrs.numel()
    if not 0 <= rank < world or flag_addrs.numel() != world:
        raise ValueError(f"rank {rank} of {world} ranks, {flag_addrs.numel()} flag arrays")
    check_tensor("epochs", epochs, ndim=1, dtypes=(torch.int32,), shape={0: GRID})
    check_tensor("abort", abort, ndim=1, dtypes=(torch.int32,), shape={0: 1})
    if x.is_cuda and not abort.is_pinned():
        raise ValueError("abort must be in page-locked host memory (tensor.pin_memory())")
    return world


def one_shot_all_reduce_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rank: int,
    data_addrs: torch.Tensor,
    flag_addrs: torch.Tensor,
    epochs: torch.Tensor,
    errors: torch.Tensor,
    abort: torch.Tensor,
    slot: int,
    max_spins: int = MAX_SPINS,
) -> RMSNormOutput:
    """RMSNorm of `sum over ranks of x + residual`, and that sum (the next residual), with
    the all-reduce and the norm in one kernel. `x` is left as it is.

    Args:
        x: `[..., hidden]` floating, contiguous, at most `slot` elements, `hidden` at most
            `MAX_NORM_HIDDEN`: this rank's partial sums.
        residual: Same shape and dtype as `x` (rows may be strided).
        weight: `[hidden]`.
        eps: Added to the mean square before the square root (> 0).
        rank, data_addrs, flag_addrs, epochs, errors, abort, slot, max_spins: As in
            `one_shot_all_reduce`, whose buffers and counters this shares.

    Returns:
        `RMSNormOutput(out, residual)`: `out` in the promoted dtype of `x` and `weight`.
    """
    hidden = check_norm_args(x, residual, weight, eps)
    check_tensor("residual", residual)  # unit stride along hidden
    if not 0 < hidden <= MAX_NORM_HIDDEN:
        raise ValueError(f"hidden size {hidden} must be in 1..{MAX_NORM_HIDDEN}")
    world = _check_exchange(x, rank, data_addrs, flag_addrs, epochs, abort, slot)
    check_same_device(
        _one_shot_all_reduce_rms_norm_kernel, x=x, residual=residual, weight=weight,
        data_addrs=data_addrs, flag_addrs=flag_addrs, epochs=epochs, errors=errors,
    )  # fmt: skip
    rows = x.view(-1, hidden)
    res_rows = as_rows(residual)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(x)
    block = next_power_of_2(hidden)
    _one_shot_all_reduce_rms_norm_kernel[(GRID,)](
        rows, res_rows, weight, out, residual_out, data_addrs, flag_addrs, epochs, errors,
        abort.data_ptr(), rows.shape[0], res_rows.stride(0), slot, eps, max_spins,
        HIDDEN=hidden, BLOCK=block, GRID=GRID, RANK=rank, WORLD=world,
        ABORT_POLL=ABORT_POLL_SPINS, num_warps=row_warps(block),
        **launch_options(_one_shot_all_reduce_rms_norm_kernel, x.device),
    )  # fmt: skip
    return RMSNormOutput(out, residual_out)


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum every rank gets: float32 (int64) in rank order, rounded once."""
    acc_dtype = torch.float32 if parts[0].is_floating_point() else torch.int64
    acc = torch.zeros(parts[0].shape, dtype=acc_dtype, device=parts[0].device)
    for p in parts:
        acc += p.to(acc_dtype)
    return acc.to(parts[0].dtype)


def all_reduce_rms_norm_ref(
    parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> RMSNormOutput:
    """What `one_shot_all_reduce_rms_norm` returns on every rank, in plain PyTorch."""
    return fused_add_rms_norm_ref(all_reduce_ref(parts), residual, weight, eps)
