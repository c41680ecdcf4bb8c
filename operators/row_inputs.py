"""Each row's engine input, read from the columns its task reads, or the row's error.

The task's input columns (`RowSpec.input_columns`) are read cell by cell (`row_cells.py`); a
cell the contract refuses (null, wrong type, invalid UTF-8) becomes that row's error and the
row never reaches the engine.

Example:
    >>> inputs, errors = row_inputs(RowSpec("generate"), pa.table({"prompt": ["Hi", None]}))
    >>> inputs[0], errors[1] is not None
    ('Hi', True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from .row_cells import (
    column_values,
    messages_cell,
    prompt_cell,
    text_cell,
    text_or_token_ids_cell,
)
from .row_spec import ROW_ERRORS, RowSpec


def row_inputs(spec: RowSpec, table: pa.Table) -> tuple[list[Any], list[str | None]]:
    """Per row: the engine input (None where the row is already an error) and its error;
    tasks of two input columns give a tuple per row."""
    names = spec.columns_read(table.column_names)
    columns = [column_values(table.column(c)) for c in names]
    parse: Callable[..., Any]
    if spec.task == "generate":
        parse = prompt_cell
    elif spec.task == "chat" and names != spec.input_columns:
        parse = user_message_cell
    elif spec.task == "chat":
        parse = messages_cell
    elif spec.task == "loglikelihood":
        parse = text_or_token_ids_cell
    else:
        parse = text_cell
    inputs: list[Any] = []
    errors: list[str | None] = []
    if len(names) == 1:  # one Python call per row: embedding jobs read millions of rows
        name = names[0]
        for value in columns[0]:
            try:
                inputs.append(parse(value, name))
                errors.append(None)
            except ROW_ERRORS as e:
                inputs.append(None)
                errors.append(str(e))
        return inputs, errors
    for values in zip(*columns, strict=True):
        try:
            inputs.append(tuple(parse(v, c) for v, c in zip(values, names, strict=True)))
            errors.append(None)
        except ROW_ERRORS as e:
            inputs.append(None)
            errors.append(str(e))
    return inputs, errors


def user_message_cell(value: Any, column: str) -> list[dict[str, Any]]:
    """A conversation of one user message: the cell's text."""
    return [{"role": "user", "content": text_cell(value, column)}]


def strip_index(message: str) -> str:
    """Engine messages name the position in the call (`prompts[3] ...`); in a row's own
    error cell that position means nothing."""
    if message.startswith("prompts[") and "] " in message:
        return "the input " + message.split("] ", 1)[1]
    return message


__all__ = ["row_inputs", "strip_index"]
