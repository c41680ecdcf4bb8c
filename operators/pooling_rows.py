"""Embed / score / classify rows: one engine call per batch, failed rows isolated.

The valid rows of a batch go to the engine in one call (`embed_matrix`, `score`,
`classify`); when the engine refuses the call, it is halved until each refused row stands
alone with its error. Embeddings and probabilities become `fixed_size_list<float32>`
columns, made from the engine's float32 matrix without a copy when every row succeeded.

Example:
    >>> out = pooling_rows(llm, RowSpec("embed"), pa.table({"text": ["a", "b"]}), info)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from .model_info import ModelInfo
from .row_inputs import row_inputs, strip_index
from .row_schema import attach_outputs, embedding_dim
from .row_spec import ROW_ERRORS, RowSpec


def _run_isolated(fn: Callable[[list[Any]], list[Any]], items: list[Any]) -> list[Any]:
    """`fn` over `items`; where the engine refuses the call, halves it until the refused
    rows stand alone, and returns their exception in their place."""
    if not items:
        return []
    try:
        return fn(items)
    except ROW_ERRORS as e:
        if len(items) == 1:
            return [e]
    mid = len(items) // 2
    return _run_isolated(fn, items[:mid]) + _run_isolated(fn, items[mid:])


def pooling_rows(llm: Any, spec: RowSpec, table: pa.Table, info: ModelInfo) -> pa.Table:
    """The batch with its embed / score / classify columns and `error`."""
    inputs, errors = row_inputs(spec, table)
    ok = [i for i, e in enumerate(errors) if e is None]
    truncate = spec.truncate_prompt_tokens
    kwargs = dict(truncate_prompt_tokens=truncate, use_tqdm=False)
    if spec.task == "embed":

        def call(items: list[Any]) -> list[Any]:
            # Rows of one float32 matrix, not an output object and a list of floats per
            # text; when every row succeeds the column is the matrix itself.
            return _MatrixRows(llm.embed_matrix(items, spec.pooling, **kwargs))
    elif spec.task == "classify":

        def call(items: list[Any]) -> list[Any]:
            outs = llm.classify(items, spec.pooling, **kwargs)
            return [o.outputs.probs for o in outs]
    else:

        def call(items: list[Any]) -> list[Any]:
            left = [a for a, _ in items]
            right = [b for _, b in items]
            outs = llm.score(left, right, pooling_params=spec.pooling, **kwargs)
            return [o.outputs.score for o in outs]

    values = _run_isolated(call, [inputs[i] for i in ok])
    results: list[Any] = [None] * len(inputs)
    for i, value in zip(ok, values, strict=True):
        if isinstance(value, Exception):
            errors[i] = strip_index(str(value))
        else:
            results[i] = value
    if spec.task == "embed":
        whole = isinstance(values, _MatrixRows) and len(ok) == len(inputs)
        matrix = values.matrix if whole else None
        arrays = [_fixed_size(results, embedding_dim(spec, info), matrix)]
    elif spec.task == "classify":
        num_labels = info.num_labels or 1
        labels = [
            None if p is None else _label(int(np.argmax(p)), info, num_labels) for p in results
        ]
        arrays = [_fixed_size(results, num_labels), pa.array(labels, pa.string())]
    else:
        arrays = [pa.array(results, pa.float64())]
    return attach_outputs(table, spec, info, arrays, errors)


def _label(index: int, info: ModelInfo, num_labels: int) -> str:
    if num_labels == 1:
        return "LABEL_0"
    if info.id2label and index in info.id2label:
        return info.id2label[index]
    return f"LABEL_{index}"


class _MatrixRows(list):
    """The rows of one `[n, dim]` matrix, and the matrix (`matrix`)."""

    def __init__(self, matrix: np.ndarray) -> None:
        super().__init__(matrix)
        self.matrix = matrix


def _fixed_size(
    rows: list[Any], size: int, matrix: np.ndarray | None = None
) -> pa.FixedSizeListArray:
    """Vectors (None for failed rows) as `fixed_size_list<float32>[size]`; `matrix`, when
    given, holds every row in order (the column is made from it without a copy)."""
    if matrix is not None and matrix.dtype == np.float32 and matrix.shape[1:] == (size,):
        flat = pa.array(np.ascontiguousarray(matrix).reshape(-1), pa.float32())
        return pa.FixedSizeListArray.from_arrays(flat, size)
    failed = [i for i, row in enumerate(rows) if row is None]
    picked = [row for row in rows if row is not None] if failed else rows
    if not picked:
        values = np.zeros((0, size), np.float32)
    elif isinstance(picked[0], np.ndarray):  # rows of `embed_matrix`
        # np.stack copies row by row; np.asarray over a list of arrays took 10-20 us a
        # row (3.6 s of a 200,000-text job on the 2-core machine, against 0.3 s).
        values = np.stack(picked).astype(np.float32, copy=False)
    else:  # lists of probabilities
        values = np.asarray(picked, dtype=np.float32)
    mask = None
    if failed:  # null rows, with zeros under them
        is_null = np.zeros(len(rows), bool)
        is_null[failed] = True
        full = np.zeros((len(rows), size), np.float32)
        full[~is_null] = values
        values, mask = full, pa.array(is_null)
    flat = pa.array(values.reshape(-1), pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, size, mask=mask)


__all__ = ["pooling_rows"]
