"""Image rows: the optional image column of generate / chat batches → each row's image in
its engine input, or the row's error.

A cell holds encoded bytes (a Spark `binaryFile` source's `content`), a path or an
`http(s)://`, `file://` or `data:` URL string, a numpy HWC uint8 array (what
`ray.data.read_images` makes: Ray's tensor column), a `{bytes, path}` struct (a Hugging
Face datasets image), or null (no image: a text row). `generate` rows get it as
`multi_modal_data` (their prompt holds the model's placeholder, `<image>` for LLaVA);
`chat` rows get it as the first part of their last message (a table without a messages
column makes each row one user message of its prompt column's text). A cell that cannot be read is that row's error, naming the column.
The image column is dropped from the output unless `keep_images` is set.

Example:
    >>> inputs, errors = row_inputs(spec, table)
    >>> inputs = with_images(spec, table, inputs, errors)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from batchlm.engine.multimodal.image_io import load_images

from .row_cells import column_values
from .row_spec import GENERATION_TASKS, RowSpec


def reads_images(spec: RowSpec, names: Sequence[str]) -> bool:
    """Whether a table with these columns gives its rows images."""
    return spec.task in GENERATION_TASKS and spec.image_column in names


def with_images(
    spec: RowSpec, table: pa.Table, inputs: list[Any], errors: list[str | None]
) -> list[Any]:
    """`inputs` with each valid row's image attached; a cell that cannot be read sets the
    row's error (in `errors`)."""
    if not reads_images(spec, table.column_names):
        return inputs
    column = spec.image_column
    cells = image_cells(table.column(column))
    rows = [i for i, e in enumerate(errors) if e is None and cells[i] is not None]
    images = load_images([cells[i] for i in rows], [f"column {column!r}"] * len(rows))
    out = list(inputs)
    for i, image in zip(rows, images, strict=True):
        if isinstance(image, Exception):
            errors[i] = str(image)
            out[i] = None
        else:
            out[i] = _attach(spec, out[i], image)
    return out


def image_cells(column: pa.ChunkedArray) -> list[Any]:
    """The column's cells: bytes, strings, dicts, numpy arrays (a tensor extension column,
    as Ray's, through its own `to_numpy`), or None."""
    if _is_nested_list(column.type):  # pixel arrays as nested lists (Spark's arrays)
        dtype = np.uint8 if _innermost(column.type) == pa.uint8() else None
        return [None if v is None else np.asarray(v, dtype) for v in column.to_pylist()]
    if not isinstance(column.type, pa.ExtensionType):
        return column_values(column)
    out: list[Any] = []
    for chunk in column.chunks:
        nulls = chunk.is_null().to_pylist() if chunk.null_count else [False] * len(chunk)
        arrays = chunk.to_numpy(zero_copy_only=False)
        out.extend(None if null else array for null, array in zip(nulls, arrays, strict=True))
    return out


def dropped_image_column(spec: RowSpec, names: Sequence[str]) -> str | None:
    """The image column the output leaves out (None: every input column is kept)."""
    if spec.keep_images or not reads_images(spec, names):
        return None
    return spec.image_column


def drop_image_column(spec: RowSpec, table_or_schema: Any) -> Any:
    """A table or schema without the image column, unless the spec keeps it (or its task
    does not read images)."""
    is_schema = isinstance(table_or_schema, pa.Schema)
    names = list(table_or_schema.names if is_schema else table_or_schema.column_names)
    dropped = dropped_image_column(spec, names)
    if dropped is None:
        return table_or_schema
    index = names.index(dropped)
    return table_or_schema.remove(index) if is_schema else table_or_schema.remove_column(index)


def _is_nested_list(arrow_type: pa.DataType) -> bool:
    return (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or (pa.types.is_fixed_size_list(arrow_type))
    )


def _innermost(arrow_type: pa.DataType) -> pa.DataType:
    while _is_nested_list(arrow_type):
        arrow_type = arrow_type.value_type
    return arrow_type


def _attach(spec: RowSpec, item: Any, image: Any) -> Any:
    if spec.task == "chat":
        messages = list(item)
        last = dict(messages[-1])
        content = last["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        last["content"] = [{"type": "image_pil", "image_pil": image}, *parts]
        return [*messages[:-1], last]
    prompt = {"prompt": item} if isinstance(item, str) else dict(item)
    prompt["multi_modal_data"] = {"image": image}
    return prompt


__all__ = [
    "reads_images",
    "with_images",
    "image_cells",
    "dropped_image_column",
    "drop_image_column",
]
