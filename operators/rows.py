"""The row contract: which columns feed which task, and how results become columns.

The facade the Ray Data and Spark front ends and the pipeline runners import; each part
lives in a module of its own: `row_spec.py` (the task and its params), `row_schema.py` (the
declared columns), `row_inputs.py` (cells to engine inputs), `generation_rows.py` (queued
requests to columns) and `pooling_rows.py` (one pooling call per batch).

- Inputs: a prompt column (`generate`), a chat-messages column (`chat`), a text column
  (`embed`, `classify`), text / text-pair columns (`score`) or context / continuation
  columns (`loglikelihood`). Generate / chat rows may carry their own sampling params (the
  params column, merged over the job's). Every other column passes through unchanged.
- Outputs have a fixed schema declared before any row runs (`output_fields`):
  generate / chat → `generated_text`, `finish_reason`, `num_input_tokens`,
  `num_output_tokens`, then the token-id and logprob columns switched on
  (`logprob_columns.py`); embed → `embedding` (`fixed_size_list<float32>[d]`); score →
  `score`; classify → `probs` (`fixed_size_list<float32>[num_labels]`), `label`;
  loglikelihood → `logprob`, `is_greedy`, `num_tokens`, `num_input_tokens`,
  `num_cached_tokens` (`loglikelihood.py`). Always `error`: null on success, the message
  when that row failed.
- A row the engine refuses (empty, over-long, null, wrong type, invalid UTF-8) gets its
  message in `error`; the other rows of the batch still run. Errors that are not about one
  row's input (device failures, bugs) propagate so that the front end can retry or fail.

Example:
    >>> spec = RowSpec(task="generate", sampling_params={"max_tokens": 32, "temperature": 0})
    >>> out = process_table(llm, spec, pa.table({"id": [1, 2], "prompt": ["Hi", "Bye"]}))
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from .generation_rows import PendingRows, finish_rows, submit_rows
from .model_info import ModelInfo
from .pooling_rows import pooling_rows
from .row_schema import check_columns, embedding_dim, empty_output, output_fields, output_schema
from .row_spec import (
    ERROR_COLUMN,
    GENERATION_TASKS,
    POOLING_TASKS,
    QUEUED_TASKS,
    ROW_ERRORS,
    TASKS,
    MissingColumnsError,
    RowContractError,
    RowSpec,
    stable_hash,
)


def process_table(
    llm: Any, spec: RowSpec, table: pa.Table, info: ModelInfo | None = None
) -> pa.Table:
    """Runs one batch through the engine: input columns plus the task's output columns."""
    check_columns(spec, table.column_names)
    info = info or ModelInfo.from_llm(llm)
    if spec.task in QUEUED_TASKS:
        pending = submit_rows(llm, spec, table)
        outputs = {o.request_id: o for o in llm.wait_for_completion(use_tqdm=False)}
        return finish_rows(spec, pending, outputs, info)
    return pooling_rows(llm, spec, table, info)


__all__ = [
    "TASKS",
    "GENERATION_TASKS",
    "POOLING_TASKS",
    "QUEUED_TASKS",
    "ERROR_COLUMN",
    "ROW_ERRORS",
    "RowSpec",
    "ModelInfo",
    "RowContractError",
    "MissingColumnsError",
    "PendingRows",
    "check_columns",
    "embedding_dim",
    "output_fields",
    "output_schema",
    "empty_output",
    "stable_hash",
    "submit_rows",
    "finish_rows",
    "process_table",
]
