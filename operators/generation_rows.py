"""Generate / chat / loglikelihood rows: queue the valid rows now, build their columns later.

`submit_rows` turns a batch's rows into engine requests (each row's own sampling params and
structured-output constraint merged over the job's, and its LoRA adapter) and queues them
with `LLM.enqueue`;
`finish_rows` turns the finished `RequestOutput`s back into the declared columns. Between the
two the caller drives the engine, so that several batches share its steps
(`row_stream.py`). Rows the engine refuses get their error; the others still run.

Example:
    >>> pending = submit_rows(llm, spec, table)
    >>> outputs = {o.request_id: o for o in llm.wait_for_completion(use_tqdm=False)}
    >>> out = finish_rows(spec, pending, outputs, info)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from batchlm.engine.sampling_params import SamplingParams

from .image_rows import with_images
from .loglikelihood import (
    continuation_score,
    encode_pairs,
    loglikelihood_arrays,
    loglikelihood_params,
)
from .logprob_columns import PARAMS_NEEDED, output_column_arrays
from .lora_rows import adapters_per_row
from .model_info import ModelInfo
from .row_cells import column_values
from .row_inputs import row_inputs, strip_index
from .row_params import RowSamplingParams, params_fields
from .row_schema import attach_outputs, check_columns
from .row_spec import QUEUED_TASKS, ROW_ERRORS, RowContractError, RowSpec
from .structured_rows import params_per_row


@dataclass
class PendingRows:
    """A batch whose valid rows are queued in the engine (`LLM.enqueue`)."""

    table: pa.Table
    request_ids: list[str | None]
    errors: list[str | None]
    context_lens: list[int | None] = field(default_factory=list)
    """`loglikelihood`: each row's context tokens (its continuation follows them)."""


def submit_rows(llm: Any, spec: RowSpec, table: pa.Table) -> PendingRows:
    """Queues every valid row of a generate / chat / loglikelihood batch; invalid rows get
    their error.

    Nothing runs until the caller drives the engine (`llm.wait_for_completion()`), so
    several batches can be queued together and keep the engine full.
    """
    if spec.task not in QUEUED_TASKS:
        raise RowContractError(
            f"submit_rows is for generate / chat / loglikelihood, not {spec.task!r}"
        )
    check_columns(spec, table.column_names)
    inputs, errors = row_inputs(spec, table)
    inputs = with_images(spec, table, inputs, errors)
    context_lens: list[int | None] = []
    if spec.task == "loglikelihood":
        inputs, params, context_lens = _loglikelihood_requests(llm, inputs, errors)
    else:
        params = _sampling_per_row(llm, spec, table, errors)
        constrained = params_per_row(
            llm, params, spec.structured_outputs, table, spec.structured_outputs_column, errors
        )
        if constrained is not None:
            params = constrained
    loras = adapters_per_row(spec, table, errors)
    ok = [i for i, e in enumerate(errors) if e is None]
    request_ids: list[str | None] = [None] * len(inputs)

    def enqueue(rows: list[int]) -> list[str]:
        items = [inputs[i] for i in rows]
        row_params = _one_or_each([params[i] for i in rows])
        # Only a table with the adapter column passes adapters (one entry per row).
        lora = {} if loras is None else {"lora_request": [loras[i] for i in rows]}
        if spec.task == "chat":
            return llm.enqueue_chat(
                items,
                row_params,
                chat_template=spec.chat_template,
                chat_template_kwargs=dict(spec.chat_template_kwargs or {}) or None,
                **lora,
            )
        return llm.enqueue(items, row_params, **lora)

    try:
        ids = enqueue(ok) if ok else []
        for i, rid in zip(ok, ids, strict=True):
            request_ids[i] = rid
    except ROW_ERRORS:
        # The engine validates a whole call before queueing any of it: queue row by row to
        # find the rows it refuses (queueing runs nothing, so this is cheap).
        for i in ok:
            try:
                request_ids[i] = enqueue([i])[0]
            except ROW_ERRORS as e:
                errors[i] = strip_index(str(e))
    return PendingRows(table, request_ids, errors, context_lens)


def _sampling_per_row(
    llm: Any, spec: RowSpec, table: pa.Table, errors: list[str | None]
) -> list[SamplingParams | None]:
    """Each row's params: the job's (None: the model's defaults), with the row's own cell
    of the params column merged over them; a bad cell sets the row's error."""
    column = spec.sampling_params_column
    fill = {PARAMS_NEEDED[n]: 0 for n in spec.output_columns if n in PARAMS_NEEDED}
    if column not in table.column_names and not fill:
        return [spec.sampling] * table.num_rows
    base = spec.sampling_params
    if base is None:
        base = params_fields(llm.get_default_sampling_params())
    rows = RowSamplingParams(base, column, fill)
    cells = (
        column_values(table.column(column))
        if column in table.column_names
        else [None] * table.num_rows
    )
    out: list[SamplingParams | None] = []
    for i, cell in enumerate(cells):
        params = None
        if errors[i] is None:
            try:
                params = rows.for_cell(cell)
            except ROW_ERRORS as e:
                errors[i] = str(e)
        out.append(params)
    return out


def _loglikelihood_requests(
    llm: Any, pairs: list[Any], errors: list[str | None]
) -> tuple[list[Any], list[SamplingParams | None], list[int | None]]:
    """Each valid row's prompt (context + continuation tokens), params and context length;
    a pair that cannot be encoded sets the row's error."""
    n = len(pairs)
    prompts: list[Any] = [None] * n
    params: list[SamplingParams | None] = [None] * n
    context_lens: list[int | None] = [None] * n
    ok = [i for i, e in enumerate(errors) if e is None]
    encoded = encode_pairs(llm.get_tokenizer(), [pairs[i] for i in ok])
    for i, pair in zip(ok, encoded, strict=True):
        if isinstance(pair, Exception):
            errors[i] = str(pair)
            continue
        prompts[i] = {"prompt_token_ids": pair.prompt_token_ids}
        params[i] = loglikelihood_params(len(pair.context_ids))
        context_lens[i] = len(pair.context_ids)
    return prompts, params, context_lens


def _one_or_each(params: list[SamplingParams | None]) -> Any:
    """One object when every row has the same (None: the model's defaults), else the list."""
    first = params[0] if params else None
    return first if all(p is first for p in params) else params


def finish_rows(
    spec: RowSpec, pending: PendingRows, outputs: Mapping[str, Any], info: ModelInfo
) -> pa.Table:
    """The batch with its output columns, from `RequestOutput`s keyed by request id."""
    outs = [None if rid is None else outputs[rid] for rid in pending.request_ids]
    if spec.task == "loglikelihood":
        scores = [
            None if out is None else continuation_score(out, num_context)
            for out, num_context in zip(outs, pending.context_lens, strict=True)
        ]
        return attach_outputs(
            pending.table, spec, info, loglikelihood_arrays(scores), pending.errors
        )
    completions = [None if out is None else out.outputs[0] for out in outs]
    arrays = [
        pa.array([c and c.text for c in completions], pa.string()),
        pa.array([c and c.finish_reason for c in completions], pa.string()),
        pa.array([o and len(o.prompt_token_ids) for o in outs], pa.int32()),
        pa.array([c and len(c.token_ids) for c in completions], pa.int32()),
        *output_column_arrays(spec.output_columns, outs),
    ]
    return attach_outputs(pending.table, spec, info, arrays, pending.errors)


__all__ = ["PendingRows", "submit_rows", "finish_rows"]
