"""The declared output schema of the row contract: the columns each task adds, `error` last.

Declared from the spec and the model's config before any row runs, never inferred from a
batch, so every batch of a job (and every Ray or Spark partition) has the same columns.

Example:
    >>> output_fields(RowSpec("embed"), ModelInfo(hidden_size=384))
    [pyarrow.Field<embedding: fixed_size_list<item: float>[384]>, pyarrow.Field<error: string>]
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from .image_rows import drop_image_column
from .loglikelihood import LOGLIKELIHOOD_FIELDS
from .logprob_columns import output_column_fields
from .lora_rows import check_adapter_column
from .model_info import ModelInfo
from .row_spec import ERROR_COLUMN, GENERATION_TASKS, MissingColumnsError, RowContractError, RowSpec


def embedding_dim(spec: RowSpec, info: ModelInfo) -> int:
    dims = spec.pooling.dimensions if spec.task == "embed" else None
    return int(dims) if dims else info.hidden_size


def output_fields(spec: RowSpec, info: ModelInfo) -> list[pa.Field]:
    """The columns the task adds, `error` last; the same for every batch of a job."""
    if spec.task in GENERATION_TASKS:
        out = [
            pa.field("generated_text", pa.string()),
            pa.field("finish_reason", pa.string()),
            pa.field("num_input_tokens", pa.int32()),
            pa.field("num_output_tokens", pa.int32()),
            *output_column_fields(spec.output_columns),
        ]
    elif spec.task == "loglikelihood":
        out = list(LOGLIKELIHOOD_FIELDS)
    elif spec.task == "embed":
        out = [pa.field("embedding", pa.list_(pa.float32(), embedding_dim(spec, info)))]
    elif spec.task == "score":
        out = [pa.field("score", pa.float64())]
    else:
        num_labels = info.num_labels or 1
        out = [
            pa.field("probs", pa.list_(pa.float32(), num_labels)),
            pa.field("label", pa.string()),
        ]
    return [*out, pa.field(ERROR_COLUMN, pa.string())]


def output_schema(spec: RowSpec, info: ModelInfo, input_schema: pa.Schema) -> pa.Schema:
    """Input columns (passed through) followed by the task's output columns."""
    check_columns(spec, input_schema.names)
    kept = drop_image_column(spec, input_schema)
    return pa.schema([*kept, *output_fields(spec, info)])


def check_columns(spec: RowSpec, names: Sequence[str]) -> None:
    """Raises if a needed column is missing, an output column would overwrite an input, or
    an adapter column comes without the spec's `lora_modules`."""
    missing = [c for c in spec.columns_read(names) if c not in names]
    if missing:
        raise MissingColumnsError(
            f"task {spec.task!r} needs column(s) {missing}, but the input has "
            f"{list(names)}; rename the column or set the matching *_column option"
        )
    taken = [f.name for f in output_fields(spec, ModelInfo(1, 1)) if f.name in names]
    if taken:
        raise RowContractError(
            f"input column(s) {taken} would be overwritten by the {spec.task!r} output; "
            "rename or drop them first"
        )
    check_adapter_column(spec, names)


def empty_output(spec: RowSpec, info: ModelInfo, input_schema: pa.Schema) -> pa.Table:
    """A zero-row table with the declared output schema."""
    return output_schema(spec, info, input_schema).empty_table()


def attach_outputs(
    table: pa.Table,
    spec: RowSpec,
    info: ModelInfo,
    arrays: list[pa.Array],
    errors: list[str | None],
) -> pa.Table:
    """`table` with the task's output columns (`arrays`, in `output_fields` order) and the
    `error` column appended (its image column dropped unless the spec keeps it)."""
    table = drop_image_column(spec, table)
    out_fields = output_fields(spec, info)
    for f, array in zip(out_fields, [*arrays, pa.array(errors, pa.string())], strict=True):
        table = table.append_column(f, array)
    return table


__all__ = [
    "embedding_dim",
    "output_fields",
    "output_schema",
    "check_columns",
    "empty_output",
    "attach_outputs",
]
