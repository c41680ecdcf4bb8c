"""Launches of the W4A16 GEMM (`w4a16.py`): a table kept in the repository
(`gpu_kernels/configs/w4a16.json`, written by `benchmarks/tools/tune_w4a16.py` on the device it
names), and defaults for every layer the table does not cover.

The table is keyed by the device's name, the layer's sizes on this rank (`n` outputs, `k`
inputs), its scale group and the activations' dtype, with one launch per bucket of rows:

    {
      "entries": [
        {
          "device": "NVIDIA H200", "n": 4096, "k": 4096, "group_size": 128,
          "dtype": "bfloat16",
          "launches": {"1": [1, 64, 128, 8, 4, 3], "64": [16, 128, 128, 4, 4, 3, "swap_ab"],
                       "256": [128, 128, 64, 1, 8, 4], "2048": "cublas"}
        }
      ]
    }

A launch is `[block_m, block_n, block_k, split_k, num_warps, num_stages]`, the same with
a seventh element `"swap_ab"` (the `tl.dot` form with the weight tile as the dot's first
operand, see `W4a16Launch.swap_ab`), or `"cublas"`: dequantize the weight to the
activation dtype in one kernel, then multiply with cuBLAS (the tuner writes it for the
buckets where the device measured that faster). `block_m` 1 is the matrix-vector form
(`w4a16_gemv.py`, no `tl.dot`: each program one row). A call of `num_m` rows takes the
smallest bucket `>= num_m` (the largest beyond the last). The choice depends on
Python integers and names only: no host synchronisation, and under CUDA graphs each
captured batch size keeps the launch chosen for its padded rows.
"""

from __future__ import annotations

import bisect
import functools
from pathlib import Path
from typing import Any, NamedTuple

from .launch import check_num_stages, check_power_of_2, next_power_of_2
from .launch_table import entry_fields, read_buckets, read_entry_shape, read_launch_table

__all__ = [
    "CUBLAS",
    "CUBLAS_LAUNCH",
    "DEFAULT_TABLE_PATH",
    "SWAP_AB",
    "W4a16Launch",
    "W4a16Shape",
    "W4a16Table",
    "check_launch",
    "choose_w4a16_launch",
    "default_launch",
    "launch_value",
    "load_w4a16_table",
    "table_entry",
]

DEFAULT_TABLE_PATH = Path(__file__).parent / "configs" / "w4a16.json"
"""The launch table `w4a16` reads (absent: the defaults everywhere)."""

CUBLAS = "cublas"
"""The table's word for the dequantize + cuBLAS path."""

MMA = "mma"
"""The backend of the decode-sized mma.sync form (`w4a16_mma.py`), which `w4a16` chooses
by itself for up to 8 rows where it runs; not a table entry."""

SWAP_AB = "swap_ab"
"""The table's word, after a launch's six numbers, for the weight-first `tl.dot` form."""


class W4a16Launch(NamedTuple):
    """One launch of the W4A16 GEMM."""

    block_m: int
    """Rows per program: 1 is the matrix-vector form, 16 or more tile rows for `tl.dot`."""
    block_n: int
    """Output features per program."""
    block_k: int
    """Input features per step: in the `tl.dot` form at most the scale group (one group per
    step); the matrix-vector form also takes whole groups per step."""
    split_k: int
    """Programs sharing one output tile, each over `k / split_k` inputs; the last of them
    to finish adds the partial sums in split order."""
    num_warps: int
    num_stages: int
    """Software-pipelining stages of the `tl.dot` form. The matrix-vector form loads the
    next step's weights while it computes a step when this is 2 or more, else each step's
    when it starts."""
    backend: str = "triton"
    """`triton`, `cublas` (dequantize, then cuBLAS; the block fields are then unused), or
    `mma` (`w4a16_mma.py`; chosen by `w4a16`, never by the table)."""
    swap_ab: bool = False
    """The `tl.dot` form with the operands swapped: the dequantized weight tile
    `[block_n, block_k]` first, the activations transposed `[block_k, block_m]` second,
    summed as `[block_n, block_m]` and stored transposed. On Hopper wgmma takes its first
    operand from registers and needs 64 of its M per warpgroup: the outputs fill M and 16
    to 64 rows fit its N (see `w4a16.py`). Only with `block_m` 16 or more."""


CUBLAS_LAUNCH = W4a16Launch(0, 0, 0, 1, 0, 0, CUBLAS)
"""The dequantize + cuBLAS path as a launch."""


class W4a16Shape(NamedTuple):
    """What a table entry is for."""

    device_name: str
    """`torch.cuda.get_device_name` (`cpu` under the interpreter)."""
    n: int
    """Output features on this rank."""
    k: int
    """Input features on this rank."""
    group_size: int
    """Input features per scale group (`k` for one group per output channel)."""
    dtype: str
    """The activations' dtype (`bfloat16`, ...)."""


W4a16Table = dict[W4a16Shape, list[tuple[int, W4a16Launch]]]
"""Per shape, `(rows, launch)` buckets in ascending order."""

_LAUNCH_FIELDS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
# Each program should have several peers on the SMs for a decode-sized call: the split
# over K grows until the programs number about this many per SM.
_PROGRAMS_PER_SM = 4


def check_launch(launch: W4a16Launch) -> W4a16Launch:
    """`launch`, or `ValueError` naming the value out of range."""
    if launch.backend == CUBLAS:
        return launch
    if launch.backend != "triton":
        raise ValueError(f"backend={launch.backend!r} must be 'triton' or {CUBLAS!r}")
    if not isinstance(launch.swap_ab, bool):
        raise ValueError(f"swap_ab={launch.swap_ab!r} must be True or False")
    if launch.swap_ab and launch.block_m == 1:
        raise ValueError("swap_ab=True needs block_m >= 16 (block_m=1 is the matrix-vector form)")
    if launch.block_m != 1:
        check_power_of_2("block_m", launch.block_m, 16, 256, "rows per tile (or 1: one row)")
    check_power_of_2("block_n", launch.block_n, 8, 512, "output features per program")
    check_power_of_2("block_k", launch.block_k, 8, 1024, "input features per step")
    check_power_of_2("split_k", launch.split_k, 1, 64, "programs per output tile")
    check_power_of_2("num_warps", launch.num_warps, 1, 16, "warps per program")
    check_num_stages(launch.num_stages)
    return launch


def default_launch(num_m: int, num_n: int, num_k: int, num_sms: int, fp32: bool) -> W4a16Launch:
    """The untuned launch: the matrix-vector form for one row (128 outputs by 128 features
    a step: 16 words a thread at 4 warps, the next step's loaded during each), narrow
    `tl.dot` tiles for up to 64 rows, with the split over K grown until the programs fill
    the SMs for decode-sized calls; wide tiles without a split for more rows. Not measured;
    the table overrides it."""
    if num_m > 64:
        block_m = 64 if num_m <= 128 or fp32 else 128
        block_n = 64 if fp32 else 128
        return W4a16Launch(block_m, block_n, 32 if fp32 else 64, 1, 8 if block_m == 128 else 4, 3)
    if num_m == 1:
        block_m, block_n, block_k, num_stages = 1, 128, 128, 2
    else:
        block_m, block_n = max(16, next_power_of_2(num_m)), 64
        block_k, num_stages = (64 if fp32 else 128), 3
    tiles = (num_m if block_m == 1 else -(-num_m // block_m)) * -(-num_n // block_n)
    split_k = 1
    steps = max(1, num_k // block_k)
    while tiles * split_k * 2 <= _PROGRAMS_PER_SM * num_sms and steps // (split_k * 2) >= 2:
        split_k *= 2
    return W4a16Launch(block_m, block_n, block_k, split_k, 4, num_stages)


def choose_w4a16_launch(
    num_m: int,
    shape: W4a16Shape,
    num_sms: int,
    table: W4a16Table | None = None,
    **overrides: int | str | None,
) -> W4a16Launch:
    """The launch for `num_m` rows of a layer of `shape`: the table's bucket (`table`
    None: `load_w4a16_table()`, the repository's), else the default. Each override
    (`block_m`, `block_n`, `block_k`, `split_k`, `num_warps`, `num_stages`, `backend`,
    `swap_ab`) that is not None replaces the chosen value; `block_m=1` alone also turns
    `swap_ab` off.

    Raises:
        ValueError: an unknown override or a value out of range.
    """
    unknown = set(overrides) - set(W4a16Launch._fields)
    if unknown:
        raise ValueError(
            f"unknown launch options {sorted(unknown)}; expected {W4a16Launch._fields}"
        )
    if table is None:
        table = load_w4a16_table()
    buckets = table.get(shape)
    if buckets:
        i = bisect.bisect_left(buckets, num_m, key=lambda bucket: bucket[0])
        chosen = buckets[min(i, len(buckets) - 1)][1]
    else:
        fp32 = shape.dtype == "float32"
        chosen = default_launch(num_m, shape.n, shape.k, num_sms, fp32)
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    if given.get("block_m") == 1:
        given.setdefault("swap_ab", False)
    wants_triton = given.get("backend") == "triton" or bool(
        set(given) & {*_LAUNCH_FIELDS, "swap_ab"}
    )
    if chosen.backend == CUBLAS and wants_triton:
        chosen = default_launch(num_m, shape.n, shape.k, num_sms, shape.dtype == "float32")
        given.setdefault("backend", "triton")
    return check_launch(chosen._replace(**given))


@functools.cache
def load_w4a16_table(path: Path | str = DEFAULT_TABLE_PATH) -> W4a16Table:
    """The launch table in `path` (see the module docstring), read and validated once per
    path; an empty table when the file does not exist.

    Raises:
        ValueError: the file is not a valid table (the message names the entry).
    """
    return read_launch_table(path, "w4a16", _read_entry)


def _read_entry(entry: Any, where: str) -> tuple[W4a16Shape, list[tuple[int, W4a16Launch]]]:
    shape = read_entry_shape(entry, W4a16Shape, where)
    return shape, read_buckets(entry["launches"], where, "row counts", _read_launch)


def _read_launch(value: Any) -> W4a16Launch:
    if value == CUBLAS:
        return CUBLAS_LAUNCH
    num = len(_LAUNCH_FIELDS)
    if not isinstance(value, list) or len(value) not in (num, num + 1):
        raise ValueError(
            f"a launch is {list(_LAUNCH_FIELDS)} (then optionally {SWAP_AB!r}) or {CUBLAS!r}, "
            f"got {value!r}"
        )
    if len(value) > num and value[num] != SWAP_AB:
        raise ValueError(f"{value[num]!r} after a launch's numbers must be {SWAP_AB!r}")
    return check_launch(W4a16Launch(*value[:num])._replace(swap_ab=len(value) > num))


def table_entry(shape: W4a16Shape, buckets: dict[int, W4a16Launch]) -> dict[str, Any]:
    """One entry of the JSON table (what the tuner writes)."""
    return {
        **entry_fields(shape),
        "launches": {str(m): launch_value(launch) for m, launch in sorted(buckets.items())},
    }


def launch_value(launch: W4a16Launch) -> str | list[int | str]:
    """A launch as the table writes it (and the tools' records show it)."""
    if launch.backend == CUBLAS:
        return CUBLAS
    numbers: list[int | str] = list(launch[: len(_LAUNCH_FIELDS)])
    return [*numbers, SWAP_AB] if launch.swap_ab else numbers
