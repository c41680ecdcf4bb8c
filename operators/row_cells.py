"""Cells of an Arrow column as Python values the row contract judges one by one.

Text, prompts (text or token ids), chat messages and key-value objects (an Arrow struct or a
JSON object string). A cell that cannot be what its column should hold raises
`InvalidPromptError` (inputs) or `InvalidParamError` (params) naming the column and what is
wrong, so that the row gets the message in its `error` cell and the other rows run.

Example:
    >>> values = column_values(table.column("prompt"))
    >>> prompt_cell(values[0], "prompt")
    'Hello'
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from batchlm.engine.errors import InvalidParamError, InvalidPromptError


class InvalidUtf8:
    """A cell whose bytes are not UTF-8 (Arrow does not check this on read)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


def column_values(column: pa.ChunkedArray) -> list[Any]:
    """The column's cells as Python values; a cell whose bytes are not UTF-8 becomes an
    `InvalidUtf8` instead of failing the whole column."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    out: list[Any] = []
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        for value in column.cast(pa.large_binary()).to_pylist():
            try:
                out.append(None if value is None else value.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(InvalidUtf8(value))
        return out
    # Nested (chat messages as list<struct>), dictionary-encoded, ...: cell by cell.
    for chunk in column.chunks:
        for i in range(len(chunk)):
            try:
                out.append(chunk[i].as_py())
            except UnicodeDecodeError as e:
                out.append(InvalidUtf8(e.object[max(0, e.start - 20) : e.end + 20]))
    return out


def text_cell(value: Any, column: str) -> str:
    """A text cell, or an `InvalidPromptError` naming what is wrong with it."""
    if value is None:
        raise InvalidPromptError(f"column {column!r} is null in this row")
    if isinstance(value, InvalidUtf8):
        raise InvalidPromptError(
            f"column {column!r} holds bytes that are not valid UTF-8: {value.raw!r:.80}"
        )
    if not isinstance(value, str):
        raise InvalidPromptError(
            f"column {column!r} holds a {type(value).__name__}, not a string: {value!r:.80}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidPromptError(
            f"column {column!r} has a character that is not valid UTF-8 (a lone surrogate "
            f"{value[e.start]!r} at offset {e.start}); clean the text"
        ) from None
    return value


def text_or_token_ids_cell(value: Any, column: str) -> str | list[int]:
    """A text cell, or a list of token ids."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if not all(is_int(t) for t in value):
            raise InvalidPromptError(f"column {column!r} holds a list that is not token ids")
        return [int(t) for t in value]
    return text_cell(value, column)


def prompt_cell(value: Any, column: str) -> Any:
    """A prompt: its text, or `{"prompt_token_ids": [...]}` for a list of token ids."""
    cell = text_or_token_ids_cell(value, column)
    return cell if isinstance(cell, str) else {"prompt_token_ids": cell}


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def messages_cell(value: Any, column: str) -> list[dict[str, Any]]:
    """A conversation: a list of `{role, content}` structs, or the same as JSON text."""
    if value is None:
        raise InvalidPromptError(f"column {column!r} is null in this row")
    if isinstance(value, InvalidUtf8):
        raise InvalidPromptError(
            f"column {column!r} holds text that is not valid UTF-8: {value.raw!r:.80}"
        )
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidPromptError(
                f"column {column!r} is a string but not JSON messages ({e.msg} at {e.pos})"
            ) from None
    if not isinstance(value, (list, tuple)):
        raise InvalidPromptError(
            f"column {column!r} must hold a list of {{role, content}} messages, "
            f"got {type(value).__name__}"
        )
    # Arrow structs bring every field of the struct type; unset ones come back as None.
    return [
        {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value
    ]


def object_cell(value: Any, column: str) -> dict[str, Any]:
    """Keys and values from a struct cell or a JSON object string; a null cell is `{}`.

    A struct brings every field of its type, unset ones as None: those are dropped (a JSON
    object keeps an explicit null). An Arrow map (a list of key-value pairs) becomes a dict.
    """
    if value is None:
        return {}
    if isinstance(value, InvalidUtf8):
        raise InvalidParamError(
            f"column {column!r} holds text that is not valid UTF-8: {value.raw!r:.80}"
        )
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidParamError(
                f"column {column!r} is a string but not a JSON object ({e.msg} at {e.pos}); "
                'write it as {"temperature": 0.7, ...}'
            ) from None
        if not isinstance(parsed, dict):
            raise InvalidParamError(
                f"column {column!r} must hold a JSON object, got {type(parsed).__name__}: "
                f"{value!r:.80}"
            )
        return parsed
    if isinstance(value, dict):
        return {k: _map_to_dict(v) for k, v in value.items() if v is not None}
    raise InvalidParamError(
        f"column {column!r} must hold a struct or a JSON object string, got "
        f"{type(value).__name__}: {value!r:.80}"
    )


def _map_to_dict(value: Any) -> Any:
    """An Arrow map cell (a list of (key, value) tuples) as a dict; other values unchanged."""
    if (
        isinstance(value, list)
        and value
        and all(isinstance(p, tuple) and len(p) == 2 for p in value)
    ):
        return dict(value)
    return value


__all__ = [
    "InvalidUtf8",
    "column_values",
    "text_cell",
    "text_or_token_ids_cell",
    "prompt_cell",
    "messages_cell",
    "object_cell",
    "is_int",
]
