"""Structured outputs in the row contract: the job's constraint and each row's own.

A job (or `RowSpec`) may set `structured_outputs` (the fields of `StructuredOutputsParams`)
for every row; a table may also carry a column of per-row constraints
(`RowSpec.structured_outputs_column`, default `structured_outputs`): a JSON string or a
struct of the same fields per row, null for the job's. A row whose cell is malformed gets
its message in `error` here; one whose constraint the engine cannot compile gets the
engine's message there (the row contract queues rows one by one when a call is refused).
Give schemas as JSON text: an Arrow struct of schemas of different shapes unifies them,
filling every key one row lacks with null (a top-level null field is dropped, a nested one
would reach the schema).

Example:
    >>> spec = RowSpec(task="generate", structured_outputs={"choice": ["yes", "no"]})
    >>> table = pa.table({"prompt": ["Is it?", "Name one"],
    ...                   "structured_outputs": [None, '{"regex": "[A-Z][a-z]+"}']})
    >>> out = process_table(llm, spec, table)  # row 0: yes / no; row 1: a capitalised word
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from batchlm.engine.errors import InvalidParamError
from batchlm.engine.sampling_params import SamplingParams
from batchlm.engine.structured_outputs_params import StructuredOutputsParams, valid_keys


def job_constraint(
    task: str, structured_outputs: Mapping[str, Any] | None, sampling_params: Any
) -> StructuredOutputsParams | None:
    """The job's constraint for every row, checked.

    Raises:
        InvalidParamError: the task generates no text, the fields are wrong, or the
            constraint is also given in `sampling_params`.
    """
    if structured_outputs is None:
        return None
    if task not in ("generate", "chat"):
        raise InvalidParamError(
            f"structured_outputs apply to generate / chat, not task={task!r}; drop them"
        )
    if isinstance(sampling_params, Mapping) and "structured_outputs" in sampling_params:
        raise InvalidParamError(
            "structured_outputs is set both as a key of its own and in sampling_params; "
            "give it once"
        )
    try:
        return StructuredOutputsParams.from_dict(structured_outputs)
    except InvalidParamError as e:
        raise InvalidParamError(f"structured_outputs: {e}") from None


def params_per_row(
    llm: Any,
    bases: list[SamplingParams | None],
    job: Mapping[str, Any] | None,
    table: pa.Table,
    column: str,
    errors: list[str | None],
) -> list[SamplingParams | None] | None:
    """Each row's params when the job or the row constrains its output, else None (every
    row then runs with its base). Rows with the same base and constraint share one params
    object (the engine validates each distinct object once). A malformed cell's message
    goes into `errors` (rows already failed are skipped).

    Args:
        llm: The `LLM` (its default params where a base is None).
        bases: Each row's sampling params before its constraint (None: the model's
            defaults).
        job: The job's `structured_outputs` (checked by `job_constraint`).
        table: The batch.
        column: The per-row column (absent from the table: every row takes the job's).
        errors: Per row, its error so far; filled in place.
    """
    has_column = column in table.column_names
    if job is None and not has_column:
        return None
    defaults = llm.get_default_sampling_params() if any(b is None for b in bases) else None
    job_constraint_params = StructuredOutputsParams.from_dict(job) if job else None
    cells = table.column(column).to_pylist() if has_column else [None] * table.num_rows
    shared: dict[tuple[int, str | None], SamplingParams] = {}
    out: list[SamplingParams | None] = []
    for i, cell in enumerate(cells):
        if errors[i] is not None:
            out.append(None)
            continue
        base = bases[i] if bases[i] is not None else defaults
        # The job's constraint, or the one the row's sampling params carry (never both).
        default = job_constraint_params or base.structured_outputs
        try:
            values = _cell_values(cell, column)
        except InvalidParamError as e:
            errors[i] = str(e)
            out.append(None)
            continue
        key = (id(base), None if values is None else json.dumps(values, default=str))
        params = shared.get(key)
        if params is None:
            try:
                constraint = default if values is None else StructuredOutputsParams(**values)
            except InvalidParamError as e:
                errors[i] = f"column {column!r}: {e}"
                out.append(None)
                continue
            params = base.clone()
            params.structured_outputs = constraint
            shared[key] = params
        out.append(params)
    return out


def _cell_values(cell: Any, column: str) -> dict[str, Any] | None:
    """A cell's constraint fields (None: a null cell, the job's constraint applies)."""
    if cell is None:
        return None
    if isinstance(cell, str):
        try:
            cell = json.loads(cell)
        except json.JSONDecodeError as e:
            raise InvalidParamError(
                f"column {column!r} holds a string that is not JSON ({e.msg} at {e.pos}): "
                f"{cell!r:.80}"
            ) from None
    if not isinstance(cell, Mapping):
        raise InvalidParamError(
            f"column {column!r} must hold an object of StructuredOutputsParams fields (a JSON "
            f"string or a struct), got {type(cell).__name__}: {cell!r:.80}"
        )
    # Arrow structs bring every field of the struct type; unset ones come back as None.
    values = {k: v for k, v in cell.items() if v is not None}
    unknown = sorted(set(values) - set(valid_keys()))
    if unknown:
        raise InvalidParamError(
            f"column {column!r} has unknown key(s) {unknown}; valid keys: {', '.join(valid_keys())}"
        )
    return values or None
