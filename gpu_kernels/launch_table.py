"""Launch tables kept in the repository (`gpu_kernels/configs/*.json`): what the tables of
`fused_moe` (`moe_launch.py`) and of the batch-invariant `matmul` share.

A table is a JSON object `{"entries": [...]}`. Each entry names a layer's shape on one
device (`device`, sizes, `dtype`, `weight_dtype`) and maps bucket sizes (the most rows or
tokens a launch is for, as strings of positive integers) to launches; each kernel's module
says what a launch holds. A tuner under `benchmarks/tools/` writes the table on the device
it names; the kernel reads it once per path and validates every entry, so that a bad file
fails with the entry named rather than with a launch that cannot run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

__all__ = ["entry_fields", "read_buckets", "read_entry_shape", "read_launch_table"]

Shape = TypeVar("Shape", bound=NamedTuple)
Launch = TypeVar("Launch")
Value = TypeVar("Value")

_STR_FIELDS = ("device_name", "dtype", "weight_dtype")
"""The shape fields that are names; the others are sizes (positive integers)."""


def read_launch_table(
    path: Path | str, what: str, read_entry: Callable[[Any, str], tuple[Shape, Value]]
) -> dict[Shape, Value]:
    """The table in `path` (empty when the file does not exist), each entry read by
    `read_entry(entry, where)`.

    Raises:
        ValueError: the file is not JSON, not `{"entries": [...]}`, an entry is invalid
            (`read_entry`'s error) or repeats a shape; the message names `what` and the path.
    """
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} launch table {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f'{what} launch table {path} must be an object with an "entries" list')
    table: dict[Shape, Value] = {}
    for i, entry in enumerate(data["entries"]):
        where = f"{what} launch table {path}, entry {i}"
        shape, value = read_entry(entry, where)
        if shape in table:
            raise ValueError(f"{where}: a second entry for {shape}")
        table[shape] = value
    return table


def read_entry_shape(
    entry: Any, shape_type: type[Shape], where: str, optional: tuple[str, ...] = ()
) -> Shape:
    """The shape an entry is for: its keys are `shape_type`'s fields (`device` for
    `device_name`), `launches` and any of `optional`; names are strings, sizes positive
    integers."""
    keys = {*shape_type._fields, "launches"} - {"device_name"} | {"device"}
    if not isinstance(entry, dict) or not keys <= set(entry) <= keys | set(optional):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        also = f" (and optionally {sorted(optional)})" if optional else ""
        raise ValueError(f"{where}: expected the keys {sorted(keys)}{also}, got {got}")
    shape = shape_type(
        *(entry["device" if name == "device_name" else name] for name in shape_type._fields)
    )
    for name, value in shape._asdict().items():
        want = str if name in _STR_FIELDS else int
        if not isinstance(value, want) or isinstance(value, bool) or (want is int and value < 1):
            raise ValueError(f"{where}: {name}={value!r} must be a {want.__name__} (> 0)")
    return shape


def read_buckets(
    launches: Any, where: str, counted: str, read_launch: Callable[[Any], Launch]
) -> list[tuple[int, Launch]]:
    """An entry's `launches` as `(bucket, launch)` in ascending order, each launch read by
    `read_launch(value)`, whose `ValueError` / `TypeError` is raised naming the bucket.
    `counted`: what the buckets count, for the message of an empty or malformed mapping."""
    if not isinstance(launches, dict) or not launches:
        raise ValueError(f'{where}: "launches" must map {counted} to launches')
    buckets = []
    for key, value in launches.items():
        if not isinstance(key, str) or not key.isdigit() or int(key) < 1:
            raise ValueError(f"{where}: bucket {key!r} must be a positive integer")
        try:
            buckets.append((int(key), read_launch(value)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}, bucket {key}: {e}") from e
    return sorted(buckets)


def entry_fields(shape: NamedTuple) -> dict[str, Any]:
    """A shape's fields as an entry writes them (`device` for `device_name`)."""
    fields = shape._asdict()
    return {"device": fields.pop("device_name"), **fields}
