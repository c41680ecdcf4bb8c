"""The matrix-vector form of the W4A16 GEMM (`w4a16.py`, whose docstring gives the weight
layout): one row of activations per program, the form of a batch-1 decode step, where the
int4 weight is read once and the instructions spent on each weight decide the speed.

The scale and zero of a group are applied after the products. For one row and a group `g`
of features,

    sum_k x[k] (q[k, n] - z[g, n]) s[g, n] = s[g, n] (sum_k x[k] q[k, n] - z[g, n] sum_k x[k]),

so a weight only becomes a float and meets its activation in an FMA, and the scale (and
the zero times the row's sum over the group) comes in once per word and step, for the
word's 8 products. Symmetric weights fold their zero, 8, into the conversion (`q - 8`)
and need no row sum. Accumulation stays in float32, and the nibbles become floats exactly.

A nibble becomes a float without a conversion instruction. Each word is OR-ed once with
the exponent bits of `2**23, 2**19, ..., 2**7` together; one AND then keeps nibble `p`
(bits `4p .. 4p + 3`, p < 5) and the exponent of `2**(23 - 4p)`, which read as the float
`2**(23 - 4p) + q`, and one subtraction leaves `q` (or `q - 8`). Nibbles 5..7 take the
same constants after one shift of the word by 20. Per word of 8 weights, in the compiled
loop (sm_90): 1 shift, 2 ORs, 8 ANDs, 8 subtractions, 8 FMAs (the first a multiply) and 1
FMA into the accumulator with the scale (2 with zero points): 28 instructions, 3.5 per
weight. The rest is shared by many weights: each thread holds one or two word rows of a
step and 16-32 columns, so an activation is loaded and converted once for 16-32 words and
a scale once for all of a thread's rows of its group; all told about 3.9 instructions per
weight at the untuned launch, where dequantizing each weight (shift, mask, exponent OR,
minus the zero, times the scale) before an FMA into a float32 `[BLOCK_K, BLOCK_N]` tile
compiled to 8.4 (`docs/performance.md`).

Each program owns `BLOCK_N` outputs of one row and walks its share of K in `BLOCK_K` steps,
each within one group or over `STEP_GROUPS` whole groups. A step's words are held as
`[GROUP_WORDS, STEP_GROUPS, BLOCK_N // SUB_N, SUB_N]`: a warp's threads cover `SUB_N`
consecutive columns (16-byte loads, whole 32-byte sectors) and the step's word rows
between them, and the warps split the rows further; the float32 accumulator has the same
shape and is reduced over the rows once, at the end. The step's scales (and zeros) are
loaded one per thread and reach the threads that use them through shared memory. With
`num_stages` 2 or more the next step's weights are loaded while a step is computed.
With `g_idx` (a group per feature) each nibble's scale and zero are gathered and applied
before its product.

Split-K, the counters and PDL are as in `w4a16.py` (`split_k.py` ends the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv
from .pdl import launch_options, wait_for_previous_kernel
from .split_k import store_split_k
from .w4a16_launch import W4a16Launch

__all__ = ["launch_w4a16_gemv"]


# The exponent bits of 2**(23 - 4p), p = 0..4, OR-ed together: a word OR-ed with them once
# holds every nibble's exponent, and one AND per nibble keeps the nibble and its own.
_EXPONENTS = tl.constexpr(0x4F000000)


@triton.jit
def _nibble(marked, p: tl.constexpr, bias: tl.constexpr):
    """`q - bias` in float32, exactly, for the nibble `q` at bits `4p .. 4p + 3` (p < 5) of
    each word of `marked` (words OR-ed with `_EXPONENTS`): its bits with those of the
    exponent of `2**(23 - 4p)` read as the float `2**(23 - 4p) + q`. One AND, one FADD."""
    MASK: tl.constexpr = (0xF << (4 * p)) | ((150 - 4 * p) << 23)
    OFFSET: tl.constexpr = 2.0 ** (23 - 4 * p) + bias
    return (marked & MASK).to(tl.float32, bitcast=True) - OFFSET


@triton.jit
def _weight(
    low,  # [GROUP_WORDS, STEP_GROUPS, COLS, SUB_N] int32: the words | _EXPONENTS
    high,  # (words >> 20) | _EXPONENTS: nibbles 5..7 at places 0..2
    j: tl.constexpr,
    feats,  # [GROUP_WORDS, STEP_GROUPS, 1, 1] feature of each word's nibble 0 (HAS_GIDX)
    offs_n,  # [1, 1, COLS, SUB_N]
    n_mask,
    s_ptr, z_ptr, gidx_ptr, stride_sg, stride_zg,
    HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
):  # fmt: skip
    """Nibble `j` of each word as a float: `q - 8` for symmetric weights, else `q`; with
    `g_idx`, the weight itself, `(q - zero) * scale` of the feature's own group."""
    bias: tl.constexpr = 0.0 if HAS_ZEROS else 8.0
    if j < 5:
        q = _nibble(low, j, bias)
    else:
        q = _nibble(high, j - 5, bias)
    if HAS_GIDX:
        g = tl.load(gidx_ptr + feats + j).to(tl.int64)
        if HAS_ZEROS:
            q -= tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask).to(tl.float32)
        q *= tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask).to(tl.float32)
    return q


@triton.jit
def _activation(x_ptrs, perm_ptrs, x_row, j: tl.constexpr, HAS_PERM: tl.constexpr):
    """The row's activations of the words' nibble `j` in float32, from `x_ptrs + j`, or
    from column `perm[...]` of `x_row` (`perm_ptrs + j`)."""
    if HAS_PERM:
        return tl.load(x_row + tl.load(perm_ptrs + j)).to(tl.float32)
    return tl.load(x_ptrs + j).to(tl.float32)


@triton.jit
def _load_step(
    word_ptrs,  # [GROUP_WORDS, STEP_GROUPS, COLS, SUB_N] pointers to the step's words
    k0, offs_n, n_mask, s_ptr, z_ptr, stride_sg, stride_zg, GROUP_SIZE: tl.constexpr,
    STEP_GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
):  # fmt: skip
    """What the step from feature `k0` reads of the weight: its words, and its groups' scales
    and zeros as float32 `[1, STEP_GROUPS, COLS, SUB_N]` (zeros 0 when symmetric; both
    unused with `g_idx`), those first."""
    if HAS_GIDX:
        scale = 1.0
        zero = 0.0
    else:
        groups = k0 // GROUP_SIZE + tl.arange(0, STEP_GROUPS)[None, :, None, None]
        scale = tl.load(s_ptr + groups * stride_sg + offs_n, mask=n_mask).to(tl.float32)
        zero = 0.0
        if HAS_ZEROS:
            zero = tl.load(z_ptr + groups * stride_zg + offs_n, mask=n_mask).to(tl.float32)
    return tl.load(word_ptrs, mask=n_mask), scale, zero


@triton.jit
def _step(
    acc,  # [GROUP_WORDS, STEP_GROUPS, COLS, SUB_N] float32
    words,  # same shape, int32: the step's words
    scale,  # [1, STEP_GROUPS, COLS, SUB_N] float32 (`_load_step`)
    zero,  # same
    k0,  # the step's first weight feature
    x_row, word_rows, offs_n, n_mask, s_ptr, z_ptr, perm_ptr, gidx_ptr, stride_sg, stride_zg,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_GIDX: tl.constexpr,
):  # fmt: skip
    """`acc` plus the step's products: per word, the sum over its 8 features of activation
    times `q` (or `q - 8`), folded into `acc` with the group's scale (and zero)."""
    feats = k0 + word_rows * 8  # [GROUP_WORDS, STEP_GROUPS, 1, 1]
    x_ptrs = x_row + feats
    perm_ptrs = perm_ptr + feats
    low = words | _EXPONENTS
    high = (words >> 20) | _EXPONENTS  # nibbles 5..7 at places 0..2
    x = _activation(x_ptrs, perm_ptrs, x_row, 0, HAS_PERM)
    dot = x * _weight(
        low, high, 0, feats, offs_n, n_mask, s_ptr, z_ptr, gidx_ptr, stride_sg, stride_zg,
        HAS_ZEROS, HAS_GIDX,
    )  # fmt: skip
    x_sum = x
    for j in tl.static_range(1, 8):
        x = _activation(x_ptrs, perm_ptrs, x_row, j, HAS_PERM)
        if HAS_ZEROS and not HAS_GIDX:
            x_sum += x
        dot += x * _weight(
            low, high, j, feats, offs_n, n_mask, s_ptr, z_ptr, gidx_ptr, stride_sg,
            stride_zg, HAS_ZEROS, HAS_GIDX,
        )  # fmt: skip
    if HAS_GIDX:
        return acc + dot
    if HAS_ZEROS:
        dot -= zero * x_sum
    return acc + scale * dot


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K] activations, rows `stride_xm` apart
    qw_ptr,  # [K // 8, N] int32 words, rows `stride_qk` apart
    s_ptr,  # [G, N] scales, rows `stride_sg` apart
    z_ptr,  # [G, N] uint8 zeros, rows `stride_zg` apart (read when HAS_ZEROS)
    perm_ptr,  # [K] int32: activation column of each weight feature (read when HAS_PERM)
    gidx_ptr,  # [K] int32: scale group of each weight feature (read when HAS_GIDX)
    y_ptr,  # [M, N] output, rows `stride_ym` apart
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums (SPLIT_K > 1)
    lock_ptr,  # [M * cdiv(N, BLOCK_N)] int32 counters, zero between calls (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_N: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Axis 0: (row, `BLOCK_N` outputs), rows outermost; axis 1: the split of K, program
    `pid_k` summing features `[pid_k * K / SPLIT_K, (pid_k + 1) * K / SPLIT_K)` (a multiple
    of BLOCK_K, which divides GROUP_SIZE or is a multiple of it unless HAS_GIDX)."""
    STEP_GROUPS: tl.constexpr = (
        BLOCK_K // GROUP_SIZE if BLOCK_K > GROUP_SIZE and not HAS_GIDX else 1
    )
    GROUP_WORDS: tl.constexpr = BLOCK_K // 8 // STEP_GROUPS
    COLS: tl.constexpr = BLOCK_N // SUB_N
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    cols = (pid % num_n) * BLOCK_N + tl.arange(0, COLS)[:, None] * SUB_N + tl.arange(0, SUB_N)
    offs_n = cols[None, None, :, :]  # [1, 1, COLS, SUB_N]
    # Columns past N (when BLOCK_N does not divide N) read nothing and are never stored.
    n_mask = None if EVEN_N else offs_n < N
    # The step's word rows, in the tile's first two dimensions: Triton gives the threads of
    # a warp the fastest-varying dimension (SUB_N) and then the tile's first ones.
    word_rows = (
        tl.arange(0, GROUP_WORDS)[:, None, None, None]
        + tl.arange(0, STEP_GROUPS)[None, :, None, None] * GROUP_WORDS
    )  # [GROUP_WORDS, STEP_GROUPS, 1, 1]
    k_len = K // SPLIT_K
    k_start = pid_k * k_len
    word_ptrs = qw_ptr + (k_start // 8 + word_rows).to(tl.int64) * stride_qk + offs_n
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    # A step's scales (and zeros) are loaded before its words: Triton then lays out the
    # products as the words are. The first step's come before the wait under PDL (weights
    # are no kernel's output); with PREFETCH, each step's while the step before is computed.
    words, scale, zero = _load_step(
        word_ptrs, k_start, offs_n, n_mask, s_ptr, z_ptr, stride_sg, stride_zg, GROUP_SIZE,
        STEP_GROUPS, HAS_ZEROS, HAS_GIDX,
    )  # fmt: skip
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([GROUP_WORDS, STEP_GROUPS, COLS, SUB_N], tl.float32)
    k_last = k_start + k_len - BLOCK_K
    for k0 in range(k_start, k_last, BLOCK_K):
        word_ptrs += (BLOCK_K // 8) * stride_qk
        if PREFETCH:
            ahead = _load_step(
                word_ptrs, k0 + BLOCK_K, offs_n, n_mask, s_ptr, z_ptr, stride_sg, stride_zg,
                GROUP_SIZE, STEP_GROUPS, HAS_ZEROS, HAS_GIDX,
            )  # fmt: skip
        acc = _step(
            acc, words, scale, zero, k0, x_row, word_rows, offs_n, n_mask, s_ptr, z_ptr,
            perm_ptr, gidx_ptr, stride_sg, stride_zg, HAS_ZEROS, HAS_PERM, HAS_GIDX,
        )  # fmt: skip
        if not PREFETCH:
            ahead = _load_step(
                word_ptrs, k0 + BLOCK_K, offs_n, n_mask, s_ptr, z_ptr, stride_sg, stride_zg,
                GROUP_SIZE, STEP_GROUPS, HAS_ZEROS, HAS_GIDX,
            )  # fmt: skip
        words, scale, zero = ahead
    acc = _step(
        acc, words, scale, zero, k_last, x_row, word_rows, offs_n, n_mask, s_ptr, z_ptr,
        perm_ptr, gidx_ptr, stride_sg, stride_zg, HAS_ZEROS, HAS_PERM, HAS_GIDX,
    )  # fmt: skip
    out = tl.sum(tl.sum(acc, axis=1), axis=0)  # [COLS, SUB_N]
    out_mask = cols < N
    y_ptrs = y_ptr + pid_m.to(tl.int64) * stride_ym + cols
    offs = pid_m.to(tl.int64) * N + cols
    store_split_k(out, y_ptrs, offs, out_mask, part_ptr, lock_ptr, pid, pid_k, M, N, SPLIT_K)


def _sub_n(launch: W4a16Launch) -> int:
    """Columns the threads of a warp cover side by side (`SUB_N`): the warps and the rest of
    each warp's threads spread over the step's word rows, so that each thread holds about
    one row and many columns; at least 8 (32-byte sectors), at most 128 (a warp of 16-byte
    loads) and `block_n`."""
    threads_per_row = 32 * launch.num_warps * 8 // launch.block_k
    return 4 * max(2, min(threads_per_row, 32, launch.block_n // 4))


def launch_w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    out: torch.Tensor,
    parts: torch.Tensor,
    locks: torch.Tensor | None,
    *,
    group_size: int,
    launch: W4a16Launch,
) -> None:
    """Run the matrix-vector form into `out` for operands `w4a16` has checked and a
    `launch` it has fitted (`block_m` 1; `block_k` dividing K, and the group or a multiple
    of it unless `g_idx`; `split_k` dividing the steps).

    Args:
        x: `[M, K]` activations.
        qweight, scales, zeros, perm, g_idx: the weight, as `w4a16` takes it.
        out: `[M, N]` output, x's dtype.
        parts: `[split_k, M, N]` float32 workspace when `split_k > 1` (else any tensor).
        locks: split-K counters, at least `M * cdiv(N, block_n)`, when `split_k > 1`.
        group_size: Input features per group.
        launch: The launch.
    """
    num_m, num_k = x.shape
    num_n = qweight.shape[1]
    grid = (num_m * cdiv(num_n, launch.block_n), launch.split_k)
    _w4a16_gemv_kernel[grid](
        x, qweight, scales,
        zeros if zeros is not None else qweight,
        perm if perm is not None else qweight,
        g_idx if g_idx is not None else qweight,
        out, parts, locks if locks is not None else qweight,
        num_m, num_n, num_k,
        x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_PERM=perm is not None,
        HAS_GIDX=g_idx is not None,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        SUB_N=_sub_n(launch),
        EVEN_N=num_n % launch.block_n == 0,
        SPLIT_K=launch.split_k,
        PREFETCH=launch.num_stages > 1,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **launch_options(_w4a16_gemv_kernel, x.device),
    )  # fmt: skip
