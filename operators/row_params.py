"""Request params from plain keys: the job's, checked once, and each row's own.

A generate / chat row may carry its own `SamplingParams` fields in its params column (a
struct, or a JSON object string); they are merged over the job's `sampling_params` (or the
model's defaults, from its generation config, when the job gives none) into that row's
params. A row whose keys are unknown or whose values are bad fails alone: its
`InvalidParamError` becomes its `error` cell.

Example:
    >>> rows = RowSamplingParams({"temperature": 0, "max_tokens": 16}, "sampling_params")
    >>> rows.for_cell('{"max_tokens": 4}').max_tokens
    4
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from batchlm.engine.errors import InvalidParamError
from batchlm.engine.sampling_params import SamplingParams

from .row_cells import object_cell


def unknown_keys(unknown: Sequence[str], valid: Sequence[str]) -> str:
    """`'k' (did you mean 'key'?), ...; valid keys: ...` for keys that are not in `valid`."""
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(str(k), valid, n=1)
        hints.append(f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k))
    return f"{', '.join(hints)}; valid keys: {', '.join(sorted(valid))}"


def param_names(cls: type) -> list[str]:
    """The constructor's own arguments, not derived fields (`_stop_strs`, token ids of
    `bad_words`)."""
    return [f.name for f in fields(cls) if f.init and not f.name.startswith("_")]


def build_params(cls: type, values: Mapping[str, Any] | None, name: str) -> Any:
    """`cls(**values)`; unknown keys and bad values raise `InvalidParamError` naming `name`."""
    values = dict(values or {})
    known = param_names(cls)
    unknown = sorted(set(values) - set(known), key=str)
    if unknown:
        raise InvalidParamError(f"{name} has unknown key(s) {unknown_keys(unknown, known)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise InvalidParamError(f"{name}: {e}") from e


def params_fields(params: SamplingParams) -> dict[str, Any]:
    """The fields that rebuild `params` (`SamplingParams(**fields)` equals it)."""
    return {name: getattr(params, name) for name in param_names(SamplingParams)}


class RowSamplingParams:
    """Each row's `SamplingParams`: the base fields, the row's cell over them, then `fill`.

    Rows with equal cells share one `SamplingParams` object (the engine checks each distinct
    object once).

    Args:
        base: The job's fields, or the model's defaults (`params_fields`).
        column: The params column's name, for messages.
        fill: Fields set where the merged value is None (an output column that needs
            `logprobs` sets it to 0).
    """

    def __init__(
        self, base: Mapping[str, Any], column: str, fill: Mapping[str, Any] | None = None
    ) -> None:
        self.base = dict(base)
        self.column = column
        self.fill = dict(fill or {})
        self._built: dict[str, SamplingParams] = {}

    def for_cell(self, cell: Any) -> SamplingParams:
        """The params of a row whose params cell is `cell` (None: the base alone)."""
        own = _whole_floats_as_ints(object_cell(cell, self.column))
        values = {**self.base, **own}
        for key, value in self.fill.items():
            if values.get(key) is None:
                values[key] = value
        key = json.dumps(values, sort_keys=True, default=repr)
        params = self._built.get(key)
        if params is None:
            where = f"column {self.column!r}" if own else "sampling_params"
            params = build_params(SamplingParams, values, where)
            if params.n != 1:
                raise InvalidParamError(
                    f"{where} sets n={params.n}: the row contract has one completion per row; "
                    "use n=1 (repeat the row to get several samples)"
                )
            self._built[key] = params
        return params


def _whole_floats_as_ints(values: dict[str, Any]) -> dict[str, Any]:
    """`4.0` as `4` for the integer fields (`max_tokens`, `seed`, ...): integer struct fields
    with nulls reach a Spark pandas UDF as floats."""
    out = dict(values)
    for key, value in values.items():
        if isinstance(value, float) and value.is_integer() and key in _INT_FIELDS:
            out[key] = int(value)
    return out


_INT_FIELDS = {
    f.name
    for f in fields(SamplingParams)
    if f.init and "int" in str(f.type) and "float" not in str(f.type) and "list" not in str(f.type)
}


__all__ = ["RowSamplingParams", "build_params", "params_fields", "param_names", "unknown_keys"]
