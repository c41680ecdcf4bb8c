"""W4A16 matrix product: `y = x' W^T` with W stored as 4-bit integers in groups along K,
dequantized tile by tile in registers and multiplied in float32.

The weight layout every int4 checkpoint format is repacked into at load
(`engine/models/layers/int4.py`):

- `qweight` int32 `[K // 8, N]`: word `(i, n)` holds input features `8i .. 8i + 7` of output
  `n`, feature `8i + j` in bits `4j .. 4j + 3`, as unsigned nibbles `q` in 0..15;
- `scales` `[G, N]` (float), `zeros` uint8 `[G, N]` (None: the midpoint 8 everywhere);
- `W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]`, with `g(k) = k // group_size`
  (groups contiguous along K), or `g_idx[k]` where they are not;
- `perm` int32 `[K]` (None: the identity): feature `k` of the weight multiplies activation
  column `perm[k]`, that is `x' = x[:, perm]`. Checkpoints quantized in activation order
  are sorted by group at load, so their groups are contiguous and `perm` says where each
  feature came from.

The tiled form: each program owns a `BLOCK_M x BLOCK_N` output tile and walks its share of
K in `BLOCK_K` steps (one scale group per step). A step loads `[BLOCK_K / 8, BLOCK_N]`
words, splits them into nibbles, turns each into `2**23 + q` in float32 by setting the
exponent bits (an integer OR, not a conversion instruction), subtracts `2**23 + zero`
(exact), multiplies by the scale and feeds the tile to `tl.dot` (float32 accumulation; the
weight tile in the activation dtype). Programs walk their tiles in groups of `GROUP_M` row
tiles per column band, so weight tiles stay in L2 while the rows that need them run.
`BLOCK_M` 1 is the matrix-vector form of a batch-1 decode step, a kernel of its own
(`w4a16_gemv.py`: the scale and zero applied per group after the products). Where it runs
(CUDA, sm_80 and newer, not under the interpreter), a call of 1-8 rows without launch
overrides or `g_idx` goes to the mma.sync form instead (`w4a16_mma.py`), which multiplies
on the tensor cores with the weight in registers; on sm_90, one of 65-512 rows to the wgmma
form (`w4a16_wgmma.py`), the weight dequantized in registers as wgmma's first operand.

With `SWAP_AB` (the launch's `swap_ab`) the same steps multiply the other way round: the
weight tile transposed, `[BLOCK_N, BLOCK_K]`, is the dot's first operand and the
activations transposed, `[BLOCK_K, BLOCK_M]`, its second, into a `[BLOCK_N, BLOCK_M]`
accumulator stored transposed. On Hopper wgmma reads its first operand from registers and
its second from shared memory, and its M is at least 64 per warpgroup: the outputs fill M
and 16 to 64 rows fit its N, where activation-first tiles of fewer than 64 rows compile to
the older mma.sync. The dequantized tile still passes through shared memory once (Triton
keeps a computed operand in registers only when it comes from a load by elementwise
upcasts), now read back into wgmma's register layout instead of read by wgmma itself.

Split-K (`split_k > 1`, for decode-sized calls whose output tiles are too few to fill the
SMs): the programs of a tile each sum a share of K, and the last of them to finish adds
their partial sums in split order (`split_k.py`), so the kernel stays one launch (CUDA
graphs replay it as is).

Under PDL a program reads its first weight tile before waiting for the previous kernel
(weights are no kernel's output) and everything else after it.

`w4a16_ref` (dequantize in float32, multiply) is the reference and the CPU path; the
`cublas` launch dequantizes the weight with `_dequantize_kernel` and multiplies with
cuBLAS (chosen by the launch table where the device measured that faster).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    FLOAT_DTYPES,
    cdiv,
    check_same_device,
    check_tensor,
    device_name,
    dot_dtype,
    dtype_name,
    num_sms,
)
from .pdl import launch_options, wait_for_previous_kernel
from .split_k import store_split_k
from .w4a16_gemv import launch_w4a16_gemv
from .w4a16_launch import CUBLAS, W4a16Launch, W4a16Shape, W4a16Table, choose_w4a16_launch
from .w4a16_mma import launch_w4a16_mma, mma_launch
from .w4a16_wgmma import WgmmaLaunch, launch_w4a16_wgmma, wgmma_launch

__all__ = [
    "PACK",
    "dequantize_int4",
    "dequantize_int4_ref",
    "fit_launch",
    "new_split_k_locks",
    "register_form_launch",
    "unpack_int4_ref",
    "w4a16",
    "w4a16_ref",
]

PACK = 8
"""4-bit values per int32 word."""
_MAGIC = 8388608.0  # 2**23: float32 bits 0x4B000000 | q read as a float are 2**23 + q
_GATHER_ROWS = 64  # above this many rows, `x[:, perm]` is gathered once before the kernel
SPLIT_K_LOCKS = 1 << 16
"""Output tiles a split-K call may have (one int32 counter each in `new_split_k_locks`)."""


@triton.jit
def _tile_of_program(
    pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr
):
    """`(row tile, column tile)` of program `pid`: consecutive programs walk `GROUP_M` row
    tiles of one column band, so a band's weight tiles are read from HBM once."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _load_words(qw_ptr, k0, offs_n, n_mask, stride_qk, BLOCK_K: tl.constexpr):
    """`[BLOCK_K // 8, BLOCK_N]` int32 words of input features `k0 .. k0 + BLOCK_K`."""
    rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    ptrs = qw_ptr + rows[:, None].to(tl.int64) * stride_qk + offs_n[None, :]
    return tl.load(ptrs, mask=n_mask[None, :], other=0)


@triton.jit
def _dequantize(
    words,  # [BLOCK_K // 8, BLOCK_N] int32
    k0,
    offs_n,
    n_mask,
    s_ptr,  # [G, N]
    z_ptr,  # [G, N] uint8 (read when HAS_ZEROS)
    gidx_ptr,  # [K] int32 (read when HAS_GIDX)
    stride_sg,
    stride_zg,
    GROUP_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_GIDX: tl.constexpr,
):
    """The weight of features `k0 .. k0 + BLOCK_K` as float32 `[BLOCK_K // 8, 8, BLOCK_N]`
    (feature `k0 + 8i + j` at `[i, j]`)."""
    shifts = tl.arange(0, 8) * 4
    nibbles = (words[:, None, :] >> shifts[None, :, None]) & 0xF
    q = (nibbles | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q, exactly
    if HAS_GIDX:
        ks = k0 + tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
        g = tl.load(gidx_ptr + ks).to(tl.int64)[:, :, None]  # [BLOCK_K // 8, 8, 1]
        mask = n_mask[None, None, :]
        scale = tl.load(s_ptr + g * stride_sg + offs_n[None, None, :], mask=mask, other=0.0)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + g * stride_zg + offs_n[None, None, :], mask=mask, other=0)
            offset = zero.to(tl.float32) + 8388608.0
        else:
            offset = 8388616.0  # 2**23 + 8
    else:
        g = k0 // GROUP_SIZE
        scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0)[None, None, :]
        if HAS_ZEROS:
            zero = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask, other=0)
            offset = (zero.to(tl.float32) + 8388608.0)[None, None, :]
        else:
            offset = 8388616.0
    return (q - offset) * scale.to(tl.float32)


@triton.jit
def _tile_step(
    acc,  # [BLOCK_M, BLOCK_N] float32, or [BLOCK_N, BLOCK_M] with SWAP_AB
    words, k0, x_rows, m_mask, offs_n, n_mask, s_ptr, z_ptr, perm_ptr, gidx_ptr, stride_sg,
    stride_zg, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_GIDX: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """One step of the tiled form, accumulated in float32: `[BLOCK_M, BLOCK_K]` activations
    times the dequantized `[BLOCK_K, BLOCK_N]` tile (in the dot dtype), or with SWAP_AB the
    tile transposed first, `[BLOCK_N, BLOCK_K]` times the activations transposed."""
    w = _dequantize(
        words, k0, offs_n, n_mask, s_ptr, z_ptr, gidx_ptr, stride_sg, stride_zg,
        GROUP_SIZE, BLOCK_K, HAS_ZEROS, HAS_GIDX,
    )  # fmt: skip
    w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(DOT_DTYPE)
    ks = k0 + tl.arange(0, BLOCK_K)
    if HAS_PERM:
        ks = tl.load(perm_ptr + ks)
    xs = tl.load(x_rows + ks[None, :], mask=m_mask[:, None], other=0.0).to(DOT_DTYPE)
    if SWAP_AB:
        acc = tl.dot(tl.trans(w), tl.trans(xs), acc, input_precision="ieee")
    else:
        acc = tl.dot(xs, w, acc, input_precision="ieee")
    return acc


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] activations, rows `stride_xm` apart
    qw_ptr,  # [K // 8, N] int32 words, rows `stride_qk` apart
    s_ptr,  # [G, N] scales, rows `stride_sg` apart
    z_ptr,  # [G, N] uint8 zeros, rows `stride_zg` apart (read when HAS_ZEROS)
    perm_ptr,  # [K] int32: activation column of each weight feature (read when HAS_PERM)
    gidx_ptr,  # [K] int32: scale group of each weight feature (read when HAS_GIDX)
    y_ptr,  # [M, N] output, rows `stride_ym` apart
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums (SPLIT_K > 1)
    lock_ptr,  # [programs along axis 0] int32 counters, zero between calls (SPLIT_K > 1)
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Axis 0: output tiles; axis 1: the split of K, program `pid_k` summing features
    `[pid_k * K / SPLIT_K, (pid_k + 1) * K / SPLIT_K)` (a multiple of BLOCK_K, itself
    dividing GROUP_SIZE unless HAS_GIDX)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _tile_of_program(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_len = K // SPLIT_K
    k_start = pid_k * k_len
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    words = _load_words(qw_ptr, k_start, offs_n, n_mask, stride_qk, BLOCK_K)
    wait_for_previous_kernel(PDL)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _tile_step(
        acc, words, k_start, x_rows, m_mask, offs_n, n_mask, s_ptr, z_ptr, perm_ptr,
        gidx_ptr, stride_sg, stride_zg, GROUP_SIZE, BLOCK_N, BLOCK_K, HAS_ZEROS, HAS_PERM,
        HAS_GIDX, DOT_DTYPE, SWAP_AB,
    )  # fmt: skip
    for k0 in range(k_start + BLOCK_K, k_start + k_len, BLOCK_K):
        words = _load_words(qw_ptr, k0, offs_n, n_mask, stride_qk, BLOCK_K)
        acc = _tile_step(
            acc, words, k0, x_rows, m_mask, offs_n, n_mask, s_ptr, z_ptr, perm_ptr,
            gidx_ptr, stride_sg, stride_zg, GROUP_SIZE, BLOCK_N, BLOCK_K, HAS_ZEROS,
            HAS_PERM, HAS_GIDX, DOT_DTYPE, SWAP_AB,
        )  # fmt: skip
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    store_split_k(acc, y_ptrs, offs, out_mask, part_ptr, lock_ptr, pid, pid_k, M, N, SPLIT_K)


@triton.jit
def _dequantize_kernel(
    qw_ptr,  # [K // 8, N] int32
    s_ptr,  # [G, N]
    z_ptr,  # [G, N] uint8 (HAS_ZEROS)
    perm_ptr,  # [K] int32 (HAS_PERM): the output row of each weight feature
    gidx_ptr,  # [K] int32 (HAS_GIDX)
    w_ptr,  # [K, N] output: the weight transposed, in activation column order
    N,
    stride_qk,
    stride_sg,
    stride_zg,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    words = _load_words(qw_ptr, k0, offs_n, n_mask, stride_qk, BLOCK_K)
    w = _dequantize(
        words, k0, offs_n, n_mask, s_ptr, z_ptr, gidx_ptr, stride_sg, stride_zg,
        GROUP_SIZE, BLOCK_K, HAS_ZEROS, HAS_GIDX,
    )  # fmt: skip
    ks = k0 + tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
    if HAS_PERM:
        ks = tl.load(perm_ptr + ks)
    ptrs = w_ptr + ks[:, :, None].to(tl.int64) * N + offs_n[None, None, :]
    tl.store(ptrs, w.to(w_ptr.dtype.element_ty), mask=n_mask[None, None, :])


def new_split_k_locks(device: torch.device) -> torch.Tensor:
    """Zeroed split-K counters for `w4a16` calls on `device` (one per output tile; the
    kernel leaves them zero). Calls that may overlap in time need their own."""
    return torch.zeros(SPLIT_K_LOCKS, dtype=torch.int32, device=device)


def _check_operands(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> tuple[int, int, int]:
    """`(M, N, K)`, or `ValueError` naming the argument that does not fit."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_m, num_k = x.shape
    if num_k % PACK:
        raise ValueError(f"x has {num_k} input features, not a multiple of {PACK}")
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), shape={0: num_k // PACK})
    num_n = qweight.shape[1]
    check_tensor("scales", scales, ndim=2, dtypes=FLOAT_DTYPES, shape={1: num_n})
    num_groups = scales.shape[0]
    if zeros is not None:
        check_tensor("zeros", zeros, ndim=2, dtypes=(torch.uint8,), shape={0: num_groups, 1: num_n})
    if not isinstance(group_size, int) or group_size < PACK or group_size % PACK:
        raise ValueError(f"group_size={group_size!r} must be a positive multiple of {PACK}")
    if g_idx is None and num_groups * group_size != num_k:
        raise ValueError(
            f"scales has {num_groups} groups of group_size={group_size}, covering "
            f"{num_groups * group_size} input features; x has {num_k}"
        )
    for name, index in (("perm", perm), ("g_idx", g_idx)):
        if index is not None:
            check_tensor(name, index, ndim=1, dtypes=(torch.int32,), shape={0: num_k})
    return num_m, num_n, num_k


def _split_k_parts(
    split_k: int, locks: torch.Tensor | None, y: torch.Tensor, num_n: int | None = None
) -> torch.Tensor:  # fmt: skip
    """The float32 workspace `[split_k, M, N]` of a split-K call into `y` (its locks
    checked), or `y` itself (unused by the kernels) without a split. N is `y`'s width, or
    `num_n` where `y` takes only some of the outputs (the queries of a q|k|v product)."""
    if split_k == 1:
        return y
    check_tensor("locks", locks, ndim=1, dtypes=(torch.int32,))
    shape = (split_k, y.shape[0], y.shape[1] if num_n is None else num_n)
    return torch.empty(shape, dtype=torch.float32, device=y.device)


def _mma_split(launch: W4a16Launch, locks: torch.Tensor | None, num_n: int) -> W4a16Launch:
    """The mma.sync form's `launch` as it runs: split over K only where `locks` holds a
    counter for each column of programs."""
    if locks is None or locks.numel() < cdiv(num_n, launch.block_n):
        return launch._replace(split_k=1)
    return launch


def register_form_launch(
    num_m: int, num_n: int, num_k: int, group_size: int, dtype: torch.dtype,
    device: torch.device,
) -> W4a16Launch | WgmmaLaunch | None:  # fmt: skip
    """The register-operand form `w4a16` takes by itself for a call without launch
    overrides or `g_idx`: the mma.sync form's launch (1-8 rows), the wgmma form's (65-512
    rows on sm_90), or None where neither applies."""
    mma = mma_launch(num_m, num_n, num_k, group_size, dtype, device)
    if mma is not None:
        return mma
    return wgmma_launch(num_m, num_n, num_k, group_size, dtype, device)


def fit_launch(
    launch: W4a16Launch, num_k: int, group_size: int, has_g_idx: bool, num_tiles: int
) -> W4a16Launch:
    """`launch` made valid for a layer: `block_k` halved until it divides K and the group
    (a step never straddles a group; in the matrix-vector form, a multiple of the group
    also fits: whole groups per step), the matrix-vector form where a step is below
    `tl.dot`'s 16, `split_k` halved until it divides the steps and the tiles fit the
    counters."""
    if launch.backend == CUBLAS:
        return launch

    def fits(block_k: int) -> bool:
        if num_k % block_k:
            return False
        whole_groups = launch.block_m == 1 and block_k % group_size == 0
        return has_g_idx or group_size % block_k == 0 or whole_groups

    block_k = launch.block_k
    while block_k > PACK and not fits(block_k):
        block_k //= 2
    block_m = 1 if block_k < 16 else launch.block_m
    split_k = launch.split_k
    while split_k > 1 and ((num_k // block_k) % split_k or num_tiles > SPLIT_K_LOCKS):
        split_k //= 2
    swap_ab = launch.swap_ab and block_m > 1
    return launch._replace(block_m=block_m, block_k=block_k, split_k=split_k, swap_ab=swap_ab)


def w4a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    locks: torch.Tensor | None = None,
    table: W4a16Table | None = None,
    **launch: int | str | None,
) -> torch.Tensor:
    """`x[:, perm] @ W^T` for the int4 weight `W` (see the module docstring).

    Args:
        x: `[M, K]` activations (float32 / float16 / bfloat16), unit stride along K.
        qweight: `[K // 8, N]` int32 words. Under PDL its first tile is read before the
            wait for the previous kernel: it must not be that kernel's output.
        scales: `[G, N]` scales (a float dtype; read as float32).
        zeros: `[G, N]` uint8 zero points, or None (8).
        group_size: Input features per group, when `g_idx` is None (`G * group_size == K`);
            with `g_idx`, any multiple of 8 that divides K (it only bounds the step).
        perm: `[K]` int32 activation column of each weight feature, or None.
        g_idx: `[K]` int32 group of each weight feature, or None (`k // group_size`).
        locks: split-K counters (`new_split_k_locks`); without them no call splits K.
        table: launch table (None: the repository's).
        **launch: overrides of the chosen launch (see `choose_w4a16_launch`).

    Returns:
        `[M, N]` in x's dtype, accumulated in float32.
    """
    num_m, num_n, num_k = _check_operands(x, qweight, scales, zeros, group_size, perm, g_idx)
    tensors = {"x": x, "qweight": qweight, "scales": scales}
    for name, t in (("zeros", zeros), ("perm", perm), ("g_idx", g_idx), ("locks", locks)):
        if t is not None:
            tensors[name] = t
    device = check_same_device(_w4a16_kernel, **tensors)
    y = torch.empty((num_m, num_n), dtype=x.dtype, device=device)
    if num_m == 0 or num_n == 0:
        return y
    # The register-operand forms: only where no launch is asked for and groups are contiguous.
    form = None
    if not any(v is not None for v in launch.values()) and g_idx is None:
        form = register_form_launch(num_m, num_n, num_k, group_size, x.dtype, device)
    if isinstance(form, W4a16Launch):
        form = _mma_split(form, locks, num_n)
        parts = _split_k_parts(form.split_k, locks, y)
        launch_w4a16_mma(
            x, qweight, scales, zeros, perm, y, parts, locks, group_size=group_size,
            launch=form, pdl=launch_options(_w4a16_kernel, device)["PDL"],
        )  # fmt: skip
        return y
    if form is not None:
        xs = x if perm is None else x.index_select(1, perm)
        launch_w4a16_wgmma(
            xs, qweight, scales, zeros, y, group_size=group_size, launch=form,
            pdl=launch_options(_w4a16_kernel, device)["PDL"],
        )  # fmt: skip
        return y
    shape = W4a16Shape(device_name(device), num_n, num_k, group_size, dtype_name(x.dtype))
    cfg = choose_w4a16_launch(num_m, shape, num_sms(device), table, **launch)
    if cfg.backend == CUBLAS:
        weight = dequantize_int4(qweight, scales, zeros, group_size, perm, g_idx, x.dtype)
        return torch.mm(x, weight, out=y)
    if perm is not None and num_m > _GATHER_ROWS:
        # Many rows re-read each activation tile once per column band: gather them once.
        x, perm = x.index_select(1, perm), None

    def tiles(launch: W4a16Launch) -> int:
        rows = num_m if launch.block_m == 1 else cdiv(num_m, launch.block_m)
        return rows * cdiv(num_n, launch.block_n)

    cfg = fit_launch(cfg, num_k, group_size, g_idx is not None, tiles(cfg))
    if locks is None:
        cfg = cfg._replace(split_k=1)
    num_tiles = tiles(cfg)
    parts = _split_k_parts(cfg.split_k, locks, y)
    if cfg.split_k > 1 and locks.numel() < num_tiles:
        raise ValueError(f"locks has {locks.numel()} counters; the call needs {num_tiles}")
    if cfg.block_m == 1:
        launch_w4a16_gemv(
            x, qweight, scales, zeros, perm, g_idx, y, parts, locks,
            group_size=group_size, launch=cfg,
        )  # fmt: skip
        return y
    _w4a16_kernel[(num_tiles, cfg.split_k)](
        x, qweight, scales,
        zeros if zeros is not None else qweight,
        perm if perm is not None else qweight,
        g_idx if g_idx is not None else qweight,
        y, parts, locks if locks is not None else qweight,
        num_m, num_n, num_k,
        x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        y.stride(0),
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_PERM=perm is not None,
        HAS_GIDX=g_idx is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        GROUP_M=8,
        DOT_DTYPE=dot_dtype(x.dtype, _w4a16_kernel),
        SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(_w4a16_kernel, device),
    )  # fmt: skip
    return y


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight as `[K, N]` in `dtype`, rows in activation column order (row `perm[k]`
    holds feature `k`), so that `x @ result` is the product `w4a16` computes; written into
    `out` (contiguous `[K, N]` of `dtype`) when given."""
    num_k, num_n = qweight.shape[0] * PACK, qweight.shape[1]
    check_same_device(_dequantize_kernel, qweight=qweight, scales=scales)
    while block_k > PACK and (num_k % block_k or (g_idx is None and group_size % block_k)):
        block_k //= 2
    if out is None:
        out = torch.empty((num_k, num_n), dtype=dtype, device=qweight.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(dtype,), shape={0: num_k, 1: num_n})
        if not out.is_contiguous():
            raise ValueError("out must be contiguous: the kernel writes rows N apart")
    _dequantize_kernel[(num_k // block_k, cdiv(num_n, block_n))](
        qweight, scales,
        zeros if zeros is not None else qweight,
        perm if perm is not None else qweight,
        g_idx if g_idx is not None else qweight,
        out, num_n, qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_PERM=perm is not None,
        HAS_GIDX=g_idx is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def unpack_int4_ref(qweight: torch.Tensor) -> torch.Tensor:
    """`[K // 8, N]` int32 words → `[K, N]` int32 nibbles (feature `8i + j` from bits `4j`)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    nibbles = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K // 8, 8, N]
    return nibbles.reshape(-1, qweight.shape[1])


def dequantize_int4_ref(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight in float32 as `[K, N]`, features in the weight's own order."""
    q = unpack_int4_ref(qweight).float()
    num_k = q.shape[0]
    if g_idx is None:
        g = torch.arange(num_k, device=q.device) // group_size
    else:
        g = g_idx.long()
    z = 8.0 if zeros is None else zeros[g].float()
    return (q - z) * scales[g].float()


def w4a16_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """`w4a16` in plain PyTorch: the weight dequantized in float32, `x[:, perm]` times it
    in float32, cast to x's dtype."""
    _check_operands(x, qweight, scales, zeros, group_size, perm, g_idx)
    weight = dequantize_int4_ref(qweight, scales, zeros, group_size, g_idx)  # [K, N]
    xs = x if perm is None else x[:, perm.long()]
    return (xs.float() @ weight).to(x.dtype)
