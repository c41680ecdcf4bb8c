"""Batch-invariant matrix product: `y = x W^T (* s) (+ b)` where each row of `y` is
computed by the same arithmetic whatever the number of rows.

cuBLAS (and most GEMM libraries, the CPU ones included) choose their tiles, their kernel
and their split of the reduction dimension from all three sizes, so a row's sum over K is
ordered differently at 1, 7 or 300 rows. Here each program owns a `BLOCK_M x BLOCK_N` tile
of the output and walks K in `BLOCK_K` steps from 0, accumulating `tl.dot` partial
products in float32, with no split of K. A row's sum is then ordered by `BLOCK_K` alone,
never by the number of rows. The tiles are loaded through pointers with masks at the
edges or, where a launch asks for it and the operands' rows are 16-byte aligned, by
Hopper's tensor memory accelerator (`_matmul_kernel`'s `TMA`), which fills past the edges
with the same zeros: the same dots in the same order either way.

Weights may be stored in fp8 (e4m3) or int8 with one float32 scale per output channel
(`weight_scale`): the tile is converted to the activation dtype in the kernel and the
scale applied to the float32 sum (weight-only quantization; the activations are not
quantized).

Launches come from a table kept in the repository (`gpu_kernels/configs/matmul.json`, written
by `benchmarks/tools/tune_bi_matmul.py` on the device it names), keyed by the device's
name, `N`, `K` and the dtypes, with one launch per bucket of rows. The tile rows and
columns, warps, stages (and with them Triton's choice between Hopper's `wgmma` and `mma`)
gave every row the same bits in every pair the tuner compared on the H200, and the tuner
writes an entry only after comparing the launches it chose. An entry's launches share one
`BLOCK_K` unless it says `"same_bits_across_block_k": true`: both instructions chain
16-wide K steps into the float32 accumulator in order, so on the GPU the K tile need not
change a row's sum either, but that is a property of the device (under the interpreter it
does change it), so the tuner writes the key only where it compared launches of different
`BLOCK_K` and found equal bits. Shapes the table does not cover take the defaults: one
launch whatever the rows, so that nothing unmeasured is assumed.

`matmul_ref` is the plain PyTorch product, made batch-invariant on its own: it multiplies
fixed chunks of `REF_ROWS` rows (the last one padded with zeros), so every call of the
underlying CPU GEMM has the same shape. It is the CPU path of the batch-invariant mode.
"""

from __future__ import annotations

import bisect
import functools
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch import (
    FLOAT_DTYPES,
    cdiv,
    check_num_stages,
    check_power_of_2,
    check_same_device,
    check_tensor,
    device_name,
    dot_dtype,
    dtype_name,
)
from .launch_table import entry_fields, read_buckets, read_entry_shape, read_launch_table
from .pdl import launch_options, wait_for_previous_kernel

__all__ = [
    "DEFAULT_TABLE_PATH",
    "REF_ROWS",
    "MatmulLaunch",
    "MatmulShape",
    "MIXED_BLOCK_K",
    "MatmulTable",
    "choose_matmul_launch",
    "load_matmul_table",
    "matmul",
    "matmul_ref",
    "table_entry",
]

DEFAULT_TABLE_PATH = Path(__file__).parent / "configs" / "matmul.json"
"""The launch table `matmul` reads (absent: the defaults everywhere)."""

REF_ROWS = 16
"""Rows per product in `matmul_ref`: one GEMM shape for every call."""
QUANT_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8)
"""Weight dtypes that come with a per-output-channel `weight_scale`."""
# Output features per program: narrow enough that the narrow layers of a decode step
# (o_proj, down_proj) still spread over the SMs, wide where N is large.
_WIDE_N = 8192


@triton.jit
def _tile_of_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """`(row tile, column tile)` of program `pid`: consecutive programs walk `GROUP_M` row
    tiles of one column band (weight tiles stay in L2). The order of programs changes
    nothing in any tile's arithmetic."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _matmul_kernel(
    x,  # [M, K]: a pointer, or with TMA a tensor descriptor of [BLOCK_M, BLOCK_K] blocks
    w,  # [N, K]: a pointer (rows `stride_wn` apart), or with TMA a descriptor of
    #     [BLOCK_N, BLOCK_K] blocks
    scale_ptr,  # [N] float32 (read when HAS_SCALE)
    bias_ptr,  # [N] (read when HAS_BIAS)
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,  # (pointers only)
    stride_wn,  # (pointers only)
    stride_ym,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program `pid` owns one output tile (`_tile_of_program`) and walks K from 0 in
    `BLOCK_K` steps. Tiles are loaded through pointers, masked at the edges, or with TMA
    by the tensor memory accelerator (Hopper's bulk copy of a whole tile, no per-element
    addresses or masks), whose out-of-bounds elements load as the masks' zeros: the same
    tiles reach the same `tl.dot`s in the same order, so each row gets the same bits."""
    pid_m, pid_n = _tile_of_program(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TMA:
        wait_for_previous_kernel(PDL)
        for k0 in range(0, K, BLOCK_K):
            x_tile = x.load([pid_m * BLOCK_M, k0])
            w_tile = w.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(x_tile.to(DOT_DTYPE), w_tile.to(DOT_DTYPE).T, acc, input_precision="ieee")
    else:
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x + offs_m[:, None].to(tl.int64) * stride_xm
        w_cols = w + offs_n[None, :].to(tl.int64) * stride_wn
        wait_for_previous_kernel(PDL)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < K
            x_tile = tl.load(
                x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            w_tile = tl.load(
                w_cols + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0
            )
            # [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]; masked K columns add exact zeros.
            acc = tl.dot(x_tile.to(DOT_DTYPE), w_tile.to(DOT_DTYPE), acc, input_precision="ieee")
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


class MatmulLaunch(NamedTuple):
    """The launch of one `matmul` call: a function of the weight's shape and dtype only."""

    block_m: int
    """Rows per output tile."""
    block_n: int
    """Output features per tile."""
    block_k: int
    """Input features per step of the K loop: the unit of every row's reduction order."""
    num_warps: int
    num_stages: int
    tma: bool = False
    """Load tiles with the tensor memory accelerator (`_matmul_kernel`'s `TMA`, Hopper and
    later) where the operands allow (16-byte aligned rows); the same bits as without."""


class MatmulShape(NamedTuple):
    """What a launch table entry is for."""

    device_name: str
    """`torch.cuda.get_device_name` (`cpu` under the interpreter)."""
    n: int
    """Output features."""
    k: int
    """Input features."""
    dtype: str
    """The activations' dtype (`bfloat16`, ...)."""
    weight_dtype: str
    """The weight's dtype: the activations' or `float8_e4m3fn` / `int8`."""


MatmulTable = dict[MatmulShape, list[tuple[int, MatmulLaunch]]]
"""Per shape, `(rows, launch)` buckets in ascending order, all with one `block_k` unless
the entry said `MIXED_BLOCK_K`."""

MIXED_BLOCK_K = "same_bits_across_block_k"
"""The entry key with which the tuner says it compared launches of different `block_k` on
the entry's device and found every row's bits equal."""


def choose_matmul_launch(
    num_n: int,
    num_k: int,
    dtype: torch.dtype,
    *,
    num_m: int = 1,
    shape: MatmulShape | None = None,
    table: MatmulTable | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tma: bool | None = None,
) -> MatmulLaunch:
    """The launch `matmul` makes for `num_m` rows times a weight of `num_n` outputs by
    `num_k` inputs whose activations are `dtype`.

    With a table entry for `shape` (`table` None: `load_matmul_table()`, the
    repository's), the entry's smallest bucket of at least `num_m` rows (its largest
    beyond the last). The tuner wrote the entry only after checking on its device that
    the buckets' launches give every row the same bits (and they share one `block_k`
    unless it found that equal across `block_k` too); so the tile may follow the rows
    while a row's sum does not.
    Without one, the defaults: one launch whatever the rows. Each None override takes the
    chosen value; the rest are validated (`ValueError` naming the value)."""
    if table is None:
        table = load_matmul_table()
    buckets = table.get(shape) if shape is not None else None
    if buckets:
        i = bisect.bisect_left(buckets, num_m, key=lambda bucket: bucket[0])
        base = buckets[min(i, len(buckets) - 1)][1]
    else:
        wide = num_n >= _WIDE_N
        small = dtype == torch.float32  # float32 tiles take twice the shared memory
        base = MatmulLaunch(
            64, 128 if wide and not small else 64, 32 if small else 64, 4, 3 if small else 4
        )
    given = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        tma=tma,
    )
    return _check_launch(base._replace(**{k: v for k, v in given.items() if v is not None}))


def _check_launch(launch: MatmulLaunch) -> MatmulLaunch:
    check_power_of_2("block_m", launch.block_m, 16, 256, "rows per tile")
    check_power_of_2("block_n", launch.block_n, 16, 256, "output features per tile")
    check_power_of_2("block_k", launch.block_k, 16, 256, "input features per K step")
    check_power_of_2("num_warps", launch.num_warps, 1, 16, "warps per program")
    check_num_stages(launch.num_stages)
    if not isinstance(launch.tma, bool):
        raise ValueError(f"tma={launch.tma!r} must be true or false")
    return launch


@functools.cache
def load_matmul_table(path: Path | str = DEFAULT_TABLE_PATH) -> MatmulTable:
    """The launch table in `path`, read and validated once per path; empty when the file
    does not exist. Its form:

        {"entries": [{"device": "NVIDIA H200", "n": 6144, "k": 4096, "dtype": "bfloat16",
                      "weight_dtype": "bfloat16",
                      "launches": {"1": [16, 32, 64, 4, 4], "256": [64, 64, 64, 4, 4],
                                   "16384": [128, 128, 64, 8, 4]}}, ...]}

    with each launch `[block_m, block_n, block_k, num_warps, num_stages]` (and optionally
    `tma`, a boolean, last), keyed by the
    most rows it is for, all of one entry with the same `block_k` unless the entry also
    holds `"same_bits_across_block_k": true` (`MIXED_BLOCK_K`).

    Raises:
        ValueError: the file is not a valid table (the message names the entry).
    """
    return read_launch_table(path, "matmul", _read_entry)


def _read_entry(entry: Any, where: str) -> tuple[MatmulShape, list[tuple[int, MatmulLaunch]]]:
    shape = read_entry_shape(entry, MatmulShape, where, optional=(MIXED_BLOCK_K,))
    buckets = read_buckets(entry["launches"], where, "row counts", _read_launch)
    checked = entry.get(MIXED_BLOCK_K, False)
    if not isinstance(checked, bool):
        raise ValueError(f"{where}: {MIXED_BLOCK_K}={checked!r} must be true or false")
    _check_block_k(buckets, checked, where)
    return shape, buckets


def _check_block_k(buckets: list[tuple[int, MatmulLaunch]], checked: bool, where: str) -> bool:
    """Whether the buckets mix `block_k` (`ValueError` if they do and `checked` is false)."""
    steps = sorted({launch.block_k for _, launch in buckets})
    if len(steps) > 1 and not checked:
        raise ValueError(
            f"{where}: buckets with block_k {steps}; a row's sum order may follow block_k, "
            f"so an entry keeps one unless its tuner compared the bits on the device and "
            f'wrote "{MIXED_BLOCK_K}": true (else a row\'s bits could depend on its batch)'
        )
    return len(steps) > 1


def _read_launch(launch: Any) -> MatmulLaunch:
    try:
        return _check_launch(MatmulLaunch(*launch))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e} (a launch is {list(MatmulLaunch._fields)})") from e


def table_entry(
    shape: MatmulShape, buckets: dict[int, MatmulLaunch], *, same_bits_across_block_k: bool = False
) -> dict[str, object]:
    """One entry of the JSON table (what the tuner writes). `same_bits_across_block_k`:
    the caller compared the buckets' launches on the device and their rows' bits were
    equal although their `block_k` differ (`ValueError` for mixed `block_k` without it)."""
    mixed = _check_block_k(sorted(buckets.items()), same_bits_across_block_k, f"entry for {shape}")
    entry: dict[str, object] = {
        **entry_fields(shape),
        "launches": {str(m): list(launch) for m, launch in sorted(buckets.items())},
    }
    if mixed:
        entry[MIXED_BLOCK_K] = True
    return entry


def _check_operands(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_k = x.shape[1]
    quantized = weight.dtype in QUANT_WEIGHT_DTYPES if isinstance(weight, torch.Tensor) else False
    check_tensor(
        "weight",
        weight,
        ndim=2,
        dtypes=QUANT_WEIGHT_DTYPES if quantized else (x.dtype,),
        shape={1: num_k},
    )
    num_n = weight.shape[0]
    if quantized != (weight_scale is not None):
        raise ValueError(
            f"weight of dtype {weight.dtype} "
            + ("needs a weight_scale [N]" if quantized else "takes no weight_scale")
        )
    if weight_scale is not None:
        check_tensor("weight_scale", weight_scale, ndim=1, dtypes=(torch.float32,))
        check_tensor("weight_scale", weight_scale, shape={0: num_n})
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, shape={0: num_n})


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    **launch: int | None,
) -> torch.Tensor:
    """`x @ weight.T`, times `weight_scale` per column, plus `bias`, with every row's
    arithmetic independent of the other rows and of their number.

    Args:
        x: `[M, K]` activations (float32 / float16 / bfloat16), unit stride along K.
        weight: `[N, K]` in x's dtype, or fp8 e4m3 / int8 with `weight_scale`; unit stride
            along K. Under PDL it is read after the wait, like any input.
        bias: `[N]` or None, added after the scale.
        weight_scale: `[N]` float32 per-output-channel scales of a quantized weight.
        **launch: `block_m`, `block_n`, `block_k`, `num_warps`, `num_stages`, `tma`
            overrides of the table's launch (see `choose_matmul_launch`; a row's result depends on
            `block_k` and the tile shapes, so callers that compare results keep them fixed).

    Returns:
        `[M, N]` in x's dtype, accumulated in float32.
    """
    _check_operands(x, weight, bias, weight_scale)
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        tensors["bias"] = bias
    if weight_scale is not None:
        tensors["weight_scale"] = weight_scale
    device = check_same_device(_matmul_kernel, **tensors)
    num_m, num_k = x.shape
    num_n = weight.shape[0]
    shape = MatmulShape(
        device_name(device), num_n, num_k, dtype_name(x.dtype), dtype_name(weight.dtype)
    )
    cfg = choose_matmul_launch(num_n, num_k, x.dtype, num_m=num_m, shape=shape, **launch)
    y = torch.empty((num_m, num_n), dtype=x.dtype, device=device)
    if num_m == 0 or num_n == 0:
        return y
    grid = (cdiv(num_m, cfg.block_m) * cdiv(num_n, cfg.block_n),)
    tma = cfg.tma and _tma_loadable(x) and _tma_loadable(weight)
    operands = (x, weight)
    if tma:
        operands = (
            TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
        )
    _matmul_kernel[grid](
        *operands,
        weight_scale if weight_scale is not None else y,
        bias if bias is not None else y,
        y,
        num_m,
        num_n,
        num_k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_SCALE=weight_scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=8,
        DOT_DTYPE=dot_dtype(x.dtype, _matmul_kernel),
        TMA=tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_options(_matmul_kernel, device),
    )
    return y


def _tma_loadable(t: torch.Tensor) -> bool:
    """Whether a 2-D operand meets the TMA's layout rules: unit stride along K, the row
    stride and the start 16-byte aligned."""
    size = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def matmul_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    weight_scale: torch.Tensor | None = None,  # [N] float32, for fp8 / int8 weights
) -> torch.Tensor:  # [M, N] in x's dtype
    """`matmul` in plain PyTorch, batch-invariant in its own way: rows are multiplied
    `REF_ROWS` at a time (the last chunk padded with zeros), so the GEMM underneath always
    has the same shape, and a row's result does not depend on how many rows came with it.
    Quantized weights are converted to x's dtype and the product scaled per column."""
    _check_operands(x, weight, bias, weight_scale)
    w = weight.to(x.dtype) if weight_scale is not None else weight
    num_m = x.shape[0]
    if num_m == 0:
        return x.new_empty(0, weight.shape[0])
    pad = -num_m % REF_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    y = torch.cat([F.linear(chunk, w) for chunk in x.split(REF_ROWS)])[:num_m]
    if weight_scale is not None:
        y = y * weight_scale.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y
