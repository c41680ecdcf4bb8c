"""Where the mma.sync W4A16 form (`w4a16_mma.py`) stages its activations: the rule that
decides, at one row, whether a program loads all of its activations into shared memory
before its first step (`staged_steps`) and which rows it stores there (`staged_rows`),
and the layouts of the staging, as the launcher passes them to the kernel
(`staging_layouts`)."""

from __future__ import annotations

import functools
import os

from .launch import next_power_of_2
from .w4a16_launch import W4a16Launch

try:  # as in w4a16_mma.py
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover
    gl = None

__all__ = ["staged_rows", "staged_steps", "staging_layouts"]

# At one row, a program whose activations take at most this many bytes of shared memory
# stages them there before its first step (measured on the H200 at the Llama-3.1-8B shapes,
# docs/performance.md: at 4 rows, and at gate|up's 32 KiB, staging lost). Storing the one row alone takes an eighth of that; its limit is
# not yet measured.
_STAGED_MAX_ROWS = 1
_STAGED_BYTES = 16 * 1024
_ROW_STAGED_BYTES = 8 * 1024
_STAGED_SWITCH = "BATCHLM_W4A16_MMA_STAGED"
_STAGE_ROW_SWITCH = "BATCHLM_W4A16_MMA_STAGE_ROW"


def staged_rows(launch: W4a16Launch) -> int:
    """The rows a staging program of `launch` stores: all its operand columns' (the one row
    and zeros), or with `BATCHLM_W4A16_MMA_STAGE_ROW=1` the one row, which each step reads
    back into every column (not yet measured on a GPU; `docs/performance.md`)."""
    return 1 if os.environ.get(_STAGE_ROW_SWITCH) == "1" else launch.block_m


def staged_steps(
    num_m: int, num_k: int, launch: W4a16Launch, itemsize: int, gathered: bool
) -> int:  # fmt: skip
    """How many steps' activations a program of `launch` stages in shared memory before its
    first step (its steps rounded up to a power of 2), or 0 where it loads each step's a
    step ahead instead: it stages one row within `_STAGED_BYTES` (a quarter of it where
    they are gathered through `perm`, whose indices the staging loads too), or the row
    alone (`staged_rows`) within `_ROW_STAGED_BYTES`, and not where
    `BATCHLM_W4A16_MMA_STAGED` is `0`."""
    steps = next_power_of_2(num_k // launch.split_k // launch.block_k)
    if num_m > _STAGED_MAX_ROWS or os.environ.get(_STAGED_SWITCH) == "0":
        return 0
    rows = staged_rows(launch)
    if rows == 1:
        limit = _ROW_STAGED_BYTES
    else:
        limit = _STAGED_BYTES // 4 if gathered else _STAGED_BYTES
    return steps if steps * rows * launch.block_k * itemsize <= limit else 0


def _staging_layout(rows: int, block_k: int, num_warps: int):
    """The activations `[step, row, feature]` as the program loads them to stage them:
    8 features a thread, the lanes over features, then rows, then steps."""
    lanes_k = block_k // 8
    lanes_m = min(rows, 32 // lanes_k)
    return gl.BlockedLayout(
        [1, 1, 8], [32 // (lanes_k * lanes_m), lanes_m, lanes_k], [num_warps, 1, 1], [2, 1, 0]
    )


def _staged_layout(rows: int, kt2: int, block_m: int, num_warps: int):
    """The activations `[M, 32 KT2]` read back from shared memory in the layout that
    `_activation_layout` gives `[KT2, T, J, M]`; from one staged row, a lane's 8 features in
    registers, the lanes over 4 of them (T), then over the 8 rows, which hold the same row."""
    if rows == 1:
        return gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4]] + [[0, 32 << i] for i in range(kt2.bit_length() - 1)],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0] for _ in range(num_warps.bit_length() - 1)],
        block_bases=[],
        shape=[block_m, 32 * kt2],
    )


def _staged_smem_layouts(rows: int) -> tuple:
    """The staged activations' shared layout `[step, row, feature]` as stored, and as the
    steps read it: 16-byte vectors swizzled over 8 rows, or one row unswizzled."""
    vec = 1 if rows == 1 else 8
    return (gl.SwizzledSharedLayout(vec, 1, vec, [2, 1, 0]),
            gl.SwizzledSharedLayout(vec, 1, vec, [1, 0]))  # fmt: skip


@functools.cache
def staging_layouts(rows: int, kt2: int, block_m: int, num_warps: int) -> tuple:
    """The kernel's `STAGED_SMEM_LAYOUT`, `STAGED_VIEW_LAYOUT`, `STAGING_LAYOUT` and
    `STAGED_LAYOUT` for `rows` staged rows (`staged_rows`) of steps of `32 kt2` features."""
    smem, view = _staged_smem_layouts(rows)
    return (smem, view, _staging_layout(rows, 32 * kt2, num_warps),
            _staged_layout(rows, kt2, block_m, num_warps))  # fmt: skip
