"""Reading a weight into the L2 cache ahead of the kernel that multiplies by it.

At batch 1 a decode step alternates matrix-vector products, bound by memory bandwidth, with
short kernels (norms, the rotary embedding, attention and its merge) that read almost
nothing from memory: while those run, the memory bus idles. `prefetch_l2` reads the first
`nbytes` of a tensor through L2 (`.cg`: L2 only, not L1), meant for another stream during
that time, so that the product after it finds those bytes in L2 instead of memory. The L2
of an H100 / H200 holds 50 MB, so a weight of a few tens of MB can be read whole.

The grid is small (one program per SM, or `programs`) so that the kernels of the main
stream still find room on every SM: each program walks chunks of `ITERS * BLOCK` 32-bit
words, `programs` chunks apart, with the chunk's loads all in flight at once, and stores
the XOR of everything it read into its word of `sink`: the loads then have a use and are
kept, and the result is checkable against `prefetch_l2_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, check_same_device, num_sms

__all__ = ["CHUNK_WORDS", "prefetch_l2", "prefetch_l2_ref", "prefetch_words"]

_BLOCK = 1024  # words per load: 8 warps × 32 threads × 16 bytes
_ITERS = 16  # loads per chunk, in flight together: 64 KiB
CHUNK_WORDS = _BLOCK * _ITERS
_MAX_WORDS = 2**31 - 2 * CHUNK_WORDS  # chunk offsets are 32-bit


@triton.jit
def _prefetch_kernel(
    src_ptr,  # int32 words
    sink_ptr,  # [programs] int32
    n_words,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    EVEN: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for chunk in range(pid, tl.cdiv(n_words, BLOCK * ITERS), programs):
        offs = tl.arange(0, BLOCK).to(tl.int64) + chunk * (BLOCK * ITERS)
        for _ in tl.static_range(ITERS):
            if EVEN:
                acc ^= tl.load(src_ptr + offs, cache_modifier=".cg")
            else:
                acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0, cache_modifier=".cg")
            offs += BLOCK
    tl.store(sink_ptr + pid, tl.xor_sum(acc, axis=0))


def prefetch_words(t: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
    """The first `nbytes` (default all, rounded down to whole words) of contiguous `t` as
    a flat int32 view."""
    if not t.is_contiguous():
        raise ValueError(f"prefetch_l2 reads contiguous tensors; got strides {t.stride()}")
    flat = t.reshape(-1).view(torch.uint8)
    total = flat.numel()
    take = total if nbytes is None else min(int(nbytes), total)
    if take < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    take -= take % 4
    if take // 4 > _MAX_WORDS:
        raise ValueError(f"prefetch_l2 reads at most {_MAX_WORDS * 4} bytes a call; got {take}")
    return flat[:take].view(torch.int32)


def _programs(words: int, device: torch.device, programs: int | None) -> int:
    if programs is not None and programs < 1:
        raise ValueError(f"programs={programs} must be >= 1")
    return max(1, min(programs or num_sms(device), cdiv(words, CHUNK_WORDS)))


def prefetch_l2(
    t: torch.Tensor,
    nbytes: int | None = None,
    sink: torch.Tensor | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """Read the first `nbytes` of `t` (default all) through L2 on the current stream.

    Args:
        t: A contiguous tensor whose storage starts at a 4-byte boundary.
        nbytes: How many bytes from the start (whole 32-bit words are read).
        sink: int32, at least one element per program, reused between calls (None: new).
        programs: Programs of the grid (default: the device's SMs, at most one per chunk).

    Returns:
        `sink`: per program, the XOR of the words it read (`prefetch_l2_ref`).
    """
    words = prefetch_words(t, nbytes)
    grid = _programs(words.numel(), t.device, programs)
    if sink is None:
        sink = torch.empty(grid, dtype=torch.int32, device=t.device)
    elif sink.dtype != torch.int32 or sink.numel() < grid:
        raise ValueError(
            f"sink must be int32 with at least {grid} elements; got {sink.dtype} "
            f"with {sink.numel()}"
        )
    check_same_device(_prefetch_kernel, t=words, sink=sink)
    if words.numel() == 0:
        sink[:grid].zero_()
        return sink
    _prefetch_kernel[(grid,)](
        words,
        sink,
        words.numel(),
        BLOCK=_BLOCK,
        ITERS=_ITERS,
        EVEN=words.numel() % CHUNK_WORDS == 0,
        num_warps=8,
    )
    return sink


def prefetch_l2_ref(
    t: torch.Tensor, nbytes: int | None = None, programs: int | None = None
) -> torch.Tensor:
    """What `prefetch_l2` leaves in its sink: per program, the XOR of its chunks' words."""
    words = prefetch_words(t, nbytes).to(torch.int64)
    grid = _programs(words.numel(), t.device, programs)
    chunks = max(1, cdiv(words.numel(), CHUNK_WORDS))
    rounds = cdiv(chunks, grid)
    padded = torch.zeros(rounds * grid * CHUNK_WORDS, dtype=torch.int64, device=words.device)
    padded[: words.numel()] = words
    # [round, program, word]: program p reads chunks p, p + grid, ...
    blocks = padded.view(rounds, grid, CHUNK_WORDS).permute(1, 0, 2).reshape(grid, -1)
    while blocks.shape[1] > 1:
        half = blocks.shape[1] // 2
        odd = blocks[:, 2 * half :]
        blocks = blocks[:, :half] ^ blocks[:, half : 2 * half]
        if odd.shape[1]:
            blocks[:, :1] ^= odd
    return blocks[:, 0].to(torch.int32)
