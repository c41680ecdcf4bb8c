"""The row contract: which columns feed which task, and how results become columns.

One module shared by the Ray Data and Spark front ends and the local pipeline runner.

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

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa

from batchlm.engine.errors import InvalidParamError, InvalidPromptError
from batchlm.engine.pooling_params import PoolingParams
from batchlm.engine.sampling_params import SamplingParams

from .loglikelihood import (
    LOGLIKELIHOOD_FIELDS,
    continuation_score,
    encode_pairs,
    loglikelihood_arrays,
    loglikelihood_params,
)
from .logprob_columns import (
    OUTPUT_COLUMN_TYPES,
    PARAMS_NEEDED,
    output_column_arrays,
    output_column_fields,
)
from .model_info import ModelInfo
from .row_cells import (
    column_values,
    messages_cell,
    prompt_cell,
    text_cell,
    text_or_token_ids_cell,
)
from .row_params import RowSamplingParams, build_params, params_fields
from .structured_rows import job_constraint, params_per_row

TASKS = ("generate", "chat", "embed", "score", "classify", "loglikelihood")
GENERATION_TASKS = ("generate", "chat")
POOLING_TASKS = ("embed", "score", "classify")
QUEUED_TASKS = ("generate", "chat", "loglikelihood")
"""Tasks whose requests are queued in the generation engine and finish step by step."""
ERROR_COLUMN = "error"

# Errors that concern one row's input: they become that row's `error` cell.
ROW_ERRORS = (InvalidPromptError, InvalidParamError)


class RowContractError(ValueError):
    """The table or the task specification does not fit the row contract."""


class MissingColumnsError(RowContractError):
    """Input columns the task needs are absent."""


@dataclass(frozen=True)
class RowSpec:
    """What to do with each row: the task, where its inputs are, and the request params."""

    task: str
    """One of `generate`, `chat`, `embed`, `score`, `classify`, `loglikelihood`."""
    prompt_column: str = "prompt"
    """`generate`: the prompt text (or a list of token ids)."""
    messages_column: str = "messages"
    """`chat`: a conversation, as a list of `{role, content}` structs or a JSON string."""
    text_column: str = "text"
    """`embed` / `classify`: the text; `score`: the query side."""
    text_pair_column: str = "text_pair"
    """`score`: the document side, scored against `text_column` of the same row."""
    sampling_params: Mapping[str, Any] | None = None
    """`SamplingParams` fields for generate / chat (`n` must be 1: one completion per row);
    omitted: the model's defaults, from its generation config."""
    pooling_params: Mapping[str, Any] | None = None
    """`PoolingParams` fields for embed / classify / score."""
    truncate_prompt_tokens: int | None = None
    """Pooling tasks: keep at most this many tokens (-1: the model's maximum) instead of
    failing the row when it is longer."""
    chat_template: str | None = None
    """`chat`: a template (text or path) overriding the model's."""
    chat_template_kwargs: Mapping[str, Any] | None = None
    """`chat`: extra variables for the template."""
    context_column: str = "context"
    """`loglikelihood`: the text (or token ids) the continuation follows."""
    continuation_column: str = "continuation"
    """`loglikelihood`: the text (or token ids) whose log probability is summed."""
    sampling_params_column: str = "sampling_params"
    """`generate` / `chat`: an optional column of each row's own `SamplingParams` fields (a
    struct, or a JSON object string), merged over `sampling_params`. A null cell, or a table
    without the column, takes the job's; unknown keys and bad values fail that row alone."""
    output_token_ids: bool = False
    """`generate` / `chat`: add the column `output_token_ids` (`list<int32>`)."""
    output_logprobs: bool = False
    """`generate` / `chat`: add `output_logprobs`, per generated token its logprob and the top
    `sampling_params.logprobs` alternatives (`list<list<struct<token_id, logprob>>>`)."""
    cumulative_logprob: bool = False
    """`generate` / `chat`: add `cumulative_logprob` (`float64`), the sum of the generated
    tokens' logprobs."""
    prompt_logprobs: bool = False
    """`generate` / `chat`: add `prompt_logprobs`, per prompt token its logprob and the top
    `sampling_params.prompt_logprobs` alternatives (null for the first token). Such requests
    compute their whole prompt (no prefix cache)."""
    structured_outputs: Mapping[str, Any] | None = None
    """generate / chat: every row's output constraint, `StructuredOutputsParams` fields
    (`json`, `regex`, `choice`, `grammar`, `json_object`, ...); see `structured_rows.py`."""
    structured_outputs_column: str = "structured_outputs"
    """generate / chat: an optional column of per-row constraints overriding the job's (a
    JSON string or a struct of the same fields; null: the job's)."""
    _sampling: SamplingParams | None = field(default=None, init=False, repr=False, compare=False)
    _pooling: PoolingParams | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise RowContractError(f"task={self.task!r} is unknown; use one of {', '.join(TASKS)}")
        if self.task in GENERATION_TASKS and self.sampling_params is not None:
            params = _build_params(SamplingParams, self.sampling_params, "sampling_params")
            if params.n != 1:
                raise RowContractError(
                    f"sampling_params.n={params.n}: the row contract has one completion per "
                    "row; use n=1 (repeat the rows to get several samples)"
                )
            object.__setattr__(self, "_sampling", params)
        elif self.sampling_params:
            hint = "use pooling_params" if self.task in POOLING_TASKS else "it sets its own"
            raise RowContractError(
                f"sampling_params apply to generate / chat, not task={self.task!r}; {hint}"
            )
        if self.task in POOLING_TASKS:
            pooling = _build_params(PoolingParams, self.pooling_params, "pooling_params")
            object.__setattr__(self, "_pooling", pooling)
        elif self.pooling_params:
            raise RowContractError(
                f"pooling_params apply to embed / score / classify, not task={self.task!r}"
            )
        for name in OUTPUT_COLUMN_TYPES:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise RowContractError(f"{name}={value!r} must be true or false")
            if value and self.task not in GENERATION_TASKS:
                raise RowContractError(
                    f"{name} adds a column to generate / chat rows, not to task={self.task!r}; "
                    "drop it"
                )
        try:
            job_constraint(self.task, self.structured_outputs, self.sampling_params)
        except InvalidParamError as e:
            raise RowContractError(str(e)) from None

    @property
    def input_roles(self) -> tuple[str, ...]:
        """The inputs this task reads, by role; `<role>_column` names each one's column."""
        return {
            "generate": ("prompt",),
            "chat": ("messages",),
            "embed": ("text",),
            "classify": ("text",),
            "score": ("text", "text_pair"),
            "loglikelihood": ("context", "continuation"),
        }[self.task]

    @property
    def input_columns(self) -> tuple[str, ...]:
        """The columns this task reads."""
        return tuple(getattr(self, f"{role}_column") for role in self.input_roles)

    @property
    def output_columns(self) -> tuple[str, ...]:
        """The optional generation columns switched on (`output_token_ids`, ...), in the order
        they are written."""
        return tuple(name for name in OUTPUT_COLUMN_TYPES if getattr(self, name))

    @property
    def sampling(self) -> SamplingParams | None:
        """The generation tasks' params; None when `sampling_params` is omitted: the
        model's defaults then apply (`LLM.get_default_sampling_params()`, from its
        generation config)."""
        assert self.task in GENERATION_TASKS, "only generation tasks have sampling params"
        return self._sampling

    @property
    def pooling(self) -> PoolingParams:
        assert self._pooling is not None, "only pooling tasks have pooling params"
        return self._pooling

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain JSON-able data (what `RowSpec(**d)` takes back)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def fingerprint(self) -> str:
        """A stable hash of the spec, for caching engines and checking resumed output."""
        return stable_hash(self.to_dict())


def stable_hash(value: Any) -> str:
    """A short hash of JSON-able data, equal across processes (keys sorted)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _build_params(cls: type, values: Mapping[str, Any] | None, name: str) -> Any:
    try:
        return build_params(cls, values, name)
    except InvalidParamError as e:
        raise RowContractError(str(e)) from e.__cause__


# ---- schema -----------------------------------------------------------------------------


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
    return pa.schema([*input_schema, *output_fields(spec, info)])


def check_columns(spec: RowSpec, names: Sequence[str]) -> None:
    """Raises if a needed column is missing or an output column would overwrite an input."""
    missing = [c for c in spec.input_columns if c not in names]
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


# ---- row inputs -------------------------------------------------------------------------


def _row_inputs(spec: RowSpec, table: pa.Table) -> tuple[list[Any], list[str | None]]:
    """Per row: the engine input (None where the row is already an error) and its error."""
    names = spec.input_columns
    columns = [column_values(table.column(c)) for c in names]
    parse: Callable[..., Any]
    if spec.task == "generate":
        parse = prompt_cell
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


# ---- generation: submit now, collect later -----------------------------------------------


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
    inputs, errors = _row_inputs(spec, table)
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
    ok = [i for i, e in enumerate(errors) if e is None]
    request_ids: list[str | None] = [None] * len(inputs)

    def enqueue(rows: list[int]) -> list[str]:
        items = [inputs[i] for i in rows]
        row_params = _one_or_each([params[i] for i in rows])
        if spec.task == "chat":
            return llm.enqueue_chat(
                items,
                row_params,
                chat_template=spec.chat_template,
                chat_template_kwargs=dict(spec.chat_template_kwargs or {}) or None,
            )
        return llm.enqueue(items, row_params)

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
                errors[i] = _strip_index(str(e))
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
        return _attach(pending.table, spec, info, loglikelihood_arrays(scores), pending.errors)
    completions = [None if out is None else out.outputs[0] for out in outs]
    arrays = [
        pa.array([c and c.text for c in completions], pa.string()),
        pa.array([c and c.finish_reason for c in completions], pa.string()),
        pa.array([o and len(o.prompt_token_ids) for o in outs], pa.int32()),
        pa.array([c and len(c.token_ids) for c in completions], pa.int32()),
        *output_column_arrays(spec.output_columns, outs),
    ]
    return _attach(pending.table, spec, info, arrays, pending.errors)


# ---- pooling -----------------------------------------------------------------------------


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


def _pooling_rows(llm: Any, spec: RowSpec, table: pa.Table, info: ModelInfo) -> pa.Table:
    inputs, errors = _row_inputs(spec, table)
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
            errors[i] = _strip_index(str(value))
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
    return _attach(table, spec, info, arrays, errors)


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


# ---- the whole batch ------------------------------------------------------------------------


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
    return _pooling_rows(llm, spec, table, info)


def empty_output(spec: RowSpec, info: ModelInfo, input_schema: pa.Schema) -> pa.Table:
    """A zero-row table with the declared output schema."""
    return output_schema(spec, info, input_schema).empty_table()


def _attach(
    table: pa.Table,
    spec: RowSpec,
    info: ModelInfo,
    arrays: list[pa.Array],
    errors: list[str | None],
) -> pa.Table:
    out_fields = output_fields(spec, info)
    for f, array in zip(out_fields, [*arrays, pa.array(errors, pa.string())], strict=True):
        table = table.append_column(f, array)
    return table


def _strip_index(message: str) -> str:
    """Engine messages name the position in the call (`prompts[3] ...`); in a row's own
    error cell that position means nothing."""
    if message.startswith("prompts[") and "] " in message:
        return "the input " + message.split("] ", 1)[1]
    return message


__all__ = [
    "TASKS",
    "ERROR_COLUMN",
    "RowSpec",
    "ModelInfo",
    "RowContractError",
    "MissingColumnsError",
    "PendingRows",
    "check_columns",
    "output_fields",
    "output_schema",
    "empty_output",
    "submit_rows",
    "finish_rows",
    "process_table",
]
