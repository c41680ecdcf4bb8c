"""Launch configurations of the grouped expert GEMMs of `fused_moe`: a table kept in the
repository (`gpu_kernels/configs/fused_moe.json`, written by `benchmarks/tools/tune_moe.py` on
the device it names), and defaults for every layer the table does not cover.

The table is keyed by the device's name, the layer's sizes on this rank and the dtypes:

    {
      "entries": [
        {
          "device": "NVIDIA H200", "num_experts": 128, "hidden": 2048, "inter": 768,
          "dtype": "bfloat16", "weight_dtype": "float8_e4m3fn",
          "launches": {
            "1": {"gate_up": [16, 64, 128, 4, 4], "down": [16, 64, 128, 4, 4]},
            "64": ...
          }
        }
      ]
    }

Each launch is `[block_m, block_n, block_k, num_warps, num_stages]`; the two GEMMs share
`block_m` (the token grouping is made once, for both). A call of `num_tokens` tokens takes
the smallest bucket `>= num_tokens` (the largest bucket beyond the last). The choice
depends on Python integers and names only, never on a tensor's values: no host
synchronisation, and under CUDA graphs each captured batch size keeps the launch chosen
for its padded `num_tokens`.
"""

from __future__ import annotations

import bisect
import functools
from pathlib import Path
from typing import Any, NamedTuple

from .launch import check_num_stages, check_power_of_2, device_name, next_power_of_2
from .launch_table import entry_fields, read_buckets, read_entry_shape, read_launch_table

__all__ = [
    "DEFAULT_TABLE_PATH",
    "LaunchTable",
    "MoeLaunch",
    "MoeLaunches",
    "MoeShape",
    "check_launches",
    "choose_moe_launch",
    "device_name",
    "load_launch_table",
    "table_entry",
]

DEFAULT_TABLE_PATH = Path(__file__).parent / "configs" / "fused_moe.json"
"""The launch table `fused_moe` reads (absent: the defaults everywhere)."""


class MoeLaunch(NamedTuple):
    """One grouped GEMM's launch."""

    block_m: int
    """Sorted slots per program (each expert's group is padded to a multiple)."""
    block_n: int
    """Output features per program."""
    block_k: int
    """Input features per loaded tile."""
    num_warps: int
    num_stages: int


class MoeLaunches(NamedTuple):
    """The launches of the gate|up GEMM and of the down GEMM (same `block_m`)."""

    gate_up: MoeLaunch
    down: MoeLaunch

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m


class MoeShape(NamedTuple):
    """What a table entry is for."""

    device_name: str
    """`torch.cuda.get_device_name` (`cpu` under the interpreter)."""
    num_experts: int
    hidden: int
    inter: int
    """One expert's MLP width on this rank."""
    dtype: str
    """The activations' dtype (`bfloat16`, ...)."""
    weight_dtype: str
    """The expert weights' dtype: the activations' or `float8_e4m3fn`."""


LaunchTable = dict[MoeShape, list[tuple[int, MoeLaunches]]]
"""Per shape, `(bucket, launches)` in ascending bucket order."""

# The launches where the table has no entry, by num_tokens (the largest count each row
# covers): Hopper-friendly guesses, not measured (a decode step at batch 1 takes narrow M
# blocks, prefill wide ones).
_DEFAULTS: dict[int | None, MoeLaunch] = {
    1: MoeLaunch(16, 64, 64, 4, 3),
    64: MoeLaunch(16, 128, 64, 4, 3),
    None: MoeLaunch(64, 128, 64, 8, 3),  # more tokens
}
_LAUNCH_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")


def check_launch(launch: MoeLaunch) -> MoeLaunch:
    """`launch`, or `ValueError` naming the value out of range."""
    check_power_of_2("block_m", launch.block_m, 16, 256, "sorted slots per program")
    check_power_of_2("block_n", launch.block_n, 16, 256, "output features per program")
    check_power_of_2("block_k", launch.block_k, 16, 256, "input features per tile")
    check_power_of_2("num_warps", launch.num_warps, 1, 16, "warps per program")
    check_num_stages(launch.num_stages)
    return launch


def _default_launch(num_tokens: int, out_features: int, in_features: int) -> MoeLaunch:
    """The untuned launch of one GEMM, its tiles no wider than the layer needs."""
    base = next(c for n, c in _DEFAULTS.items() if n is None or num_tokens <= n)
    return base._replace(
        block_n=min(base.block_n, max(16, next_power_of_2(out_features))),
        block_k=min(base.block_k, max(16, next_power_of_2(in_features))),
    )


def choose_moe_launch(
    num_tokens: int,
    shape: MoeShape,
    table: LaunchTable | None = None,
    **overrides: int | None,
) -> MoeLaunches:
    """The launches `fused_moe` makes for `num_tokens` tokens of a layer of `shape`.

    Args:
        num_tokens: Rows of the call (the padded batch under CUDA graphs).
        shape: The layer, device and dtypes.
        table: Launch table (None: `load_launch_table()`, the repository's).
        **overrides: `block_m`, `block_n`, `block_k`, `num_warps`, `num_stages` for both
            GEMMs (None: the table's or the default).

    Raises:
        ValueError: an unknown override or a value out of range.
    """
    unknown = set(overrides) - set(_LAUNCH_FIELDS)
    if unknown:
        raise ValueError(f"unknown launch options {sorted(unknown)}; expected {_LAUNCH_FIELDS}")
    if table is None:
        table = load_launch_table()
    buckets = table.get(shape)
    if buckets:
        i = bisect.bisect_left(buckets, num_tokens, key=lambda bucket: bucket[0])
        chosen = buckets[min(i, len(buckets) - 1)][1]
    else:
        chosen = MoeLaunches(
            _default_launch(num_tokens, shape.inter, shape.hidden),
            _default_launch(num_tokens, shape.hidden, shape.inter),
        )
    given = {k: v for k, v in overrides.items() if v is not None}
    launches = MoeLaunches(chosen.gate_up._replace(**given), chosen.down._replace(**given))
    return check_launches(launches)


def check_launches(launches: MoeLaunches) -> MoeLaunches:
    """`launches` validated: each in range, the same `block_m` for both GEMMs."""
    check_launch(launches.gate_up)
    check_launch(launches.down)
    if launches.gate_up.block_m != launches.down.block_m:
        raise ValueError(
            f"gate_up block_m={launches.gate_up.block_m} and down block_m="
            f"{launches.down.block_m} must be equal (one token grouping serves both)"
        )
    return launches


@functools.cache
def load_launch_table(path: Path | str = DEFAULT_TABLE_PATH) -> LaunchTable:
    """The launch table in `path` (see the module docstring), read and validated once per
    path (each forward of each MoE layer looks its launch up here); an empty table when the
    file does not exist.

    Raises:
        ValueError: the file is not a valid table (the message names the entry).
    """
    return read_launch_table(path, "MoE", _read_entry)


def _read_entry(entry: Any, where: str) -> tuple[MoeShape, list[tuple[int, MoeLaunches]]]:
    shape = read_entry_shape(entry, MoeShape, where)
    return shape, read_buckets(entry["launches"], where, "token counts", _read_pair)


def _read_pair(pair: Any) -> MoeLaunches:
    if not isinstance(pair, dict) or set(pair) != {"gate_up", "down"}:
        raise ValueError('expected {"gate_up": [...], "down": [...]}')
    try:
        both = MoeLaunches(*(MoeLaunch(*pair[gemm]) for gemm in ("gate_up", "down")))
        return check_launches(both)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e} (each launch is {_LAUNCH_FIELDS})") from e


def table_entry(shape: MoeShape, buckets: dict[int, MoeLaunches]) -> dict[str, Any]:
    """One entry of the JSON table (what the tuner writes)."""
    return {
        **entry_fields(shape),
        "launches": {
            str(n): {"gate_up": list(pair.gate_up), "down": list(pair.down)}
            for n, pair in sorted(buckets.items())
        },
    }
