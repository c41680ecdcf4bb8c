"""The row contract: which columns feed which task, and how results become columns.

One module shared by the Ray Data and Spark front ends and the local pipeline runner.

- Inputs: a prompt column (`generate`), a chat-messages column (`chat`), a text column
  (`embed`, `classify`) or text / text-pair columns (`score`). Every other column passes
  through unchanged.
- Outputs have a fixed schema declared before any row runs (`output_fields`):
  generate / chat → `generated_text`, `finish_reason`, `num_input_tokens`,
  `num_output_tokens`; embed → `embedding` (`fixed_size_list<float32>[d]`); score → `score`;
  classify → `probs` (`fixed_size_list<float32>[num_labels]`), `label`. Always `error`:
  null on success, the message when that row failed.
- A row the engine refuses (empty, over-long, null, wrong type, invalid UTF-8) gets its
  message in `error`; the other rows of the batch still run. Errors that are not about one
  row's input (device failures, bugs) propagate so that the front end can retry or fail.

Example:
    >>> spec = RowSpec(task="generate", sampling_params={"max_tokens": 32, "temperature": 0})
    >>> out = process_table(llm, spec, pa.table({"id": [1, 2], "prompt": ["Hi", "Bye"]}))
"""

from __future__ import annotations

import difflib
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

from .structured_rows import job_constraint, params_per_row

TASKS = ("generate", "chat", "embed", "score", "classify")
GENERATION_TASKS = ("generate", "chat")
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
    """One of `generate`, `chat`, `embed`, `score`, `classify`."""
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
            raise RowContractError(
                f"sampling_params apply to generate / chat, not task={self.task!r}; "
                "use pooling_params"
            )
        if self.task not in GENERATION_TASKS:
            pooling = _build_params(PoolingParams, self.pooling_params, "pooling_params")
            object.__setattr__(self, "_pooling", pooling)
        elif self.pooling_params:
            raise RowContractError(
                f"pooling_params apply to embed / score / classify, not task={self.task!r}"
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
        }[self.task]

    @property
    def input_columns(self) -> tuple[str, ...]:
        """The columns this task reads."""
        return tuple(getattr(self, f"{role}_column") for role in self.input_roles)

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


def unknown_keys(unknown: Sequence[str], valid: Sequence[str]) -> str:
    """`'k' (did you mean 'key'?), ...; valid keys: ...` for keys that are not in `valid`."""
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(str(k), valid, n=1)
        hints.append(f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k))
    return f"{', '.join(hints)}; valid keys: {', '.join(sorted(valid))}"


def _build_params(cls: type, values: Mapping[str, Any] | None, name: str) -> Any:
    values = dict(values or {})
    # The constructor's own arguments, not derived fields (`_stop_strs`, token ids of
    # `bad_words`).
    known = [f.name for f in fields(cls) if f.init and not f.name.startswith("_")]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise RowContractError(f"{name} has unknown key(s) {unknown_keys(unknown, known)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise RowContractError(f"{name}: {e}") from e


# ---- schema -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What the output schema needs to know about the model, read from its config."""

    hidden_size: int
    num_labels: int | None = None
    id2label: Mapping[int, str] | None = None

    @classmethod
    def from_llm(cls, llm: Any) -> ModelInfo:
        return cls.from_hf_config(llm.llm_engine.config.model.hf_config)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelInfo:
        id2label = getattr(hf_config, "id2label", None)
        num_labels = getattr(hf_config, "num_labels", None)
        return cls(
            hidden_size=int(hf_config.hidden_size),
            num_labels=int(num_labels) if num_labels is not None else None,
            id2label={int(k): str(v) for k, v in id2label.items()} if id2label else None,
        )


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
        ]
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


def _text_cell(value: Any, column: str) -> str:
    """A text cell, or a ValueError naming what is wrong with it."""
    if value is None:
        raise InvalidPromptError(f"column {column!r} is null in this row")
    if isinstance(value, _InvalidUtf8):
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


def _prompt_cell(value: Any, column: str) -> Any:
    if isinstance(value, (list, tuple, np.ndarray)):
        ids = [int(t) for t in value] if all(_is_int(t) for t in value) else None
        if ids is None:
            raise InvalidPromptError(f"column {column!r} holds a list that is not token ids")
        return {"prompt_token_ids": ids}
    return _text_cell(value, column)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _messages_cell(value: Any, column: str) -> list[dict[str, Any]]:
    if value is None:
        raise InvalidPromptError(f"column {column!r} is null in this row")
    if isinstance(value, _InvalidUtf8):
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


class _InvalidUtf8:
    """A cell whose bytes are not UTF-8 (Arrow does not check this on read)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


def _column_values(column: pa.ChunkedArray) -> list[Any]:
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
                out.append(_InvalidUtf8(value))
        return out
    # Nested (chat messages as list<struct>), dictionary-encoded, ...: cell by cell.
    for chunk in column.chunks:
        for i in range(len(chunk)):
            try:
                out.append(chunk[i].as_py())
            except UnicodeDecodeError as e:
                out.append(_InvalidUtf8(e.object[max(0, e.start - 20) : e.end + 20]))
    return out


def _row_inputs(spec: RowSpec, table: pa.Table) -> tuple[list[Any], list[str | None]]:
    """Per row: the engine input (None where the row is already an error) and its error."""
    columns = [_column_values(table.column(c)) for c in spec.input_columns]
    parse: Callable[..., Any]
    if spec.task == "generate":
        parse = _prompt_cell
    elif spec.task == "chat":
        parse = _messages_cell
    else:
        parse = _text_cell
    inputs: list[Any] = []
    errors: list[str | None] = []
    for values in zip(*columns, strict=True):
        try:
            parsed = tuple(parse(v, c) for v, c in zip(values, spec.input_columns, strict=True))
            inputs.append(parsed if len(parsed) > 1 else parsed[0])
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


def submit_rows(llm: Any, spec: RowSpec, table: pa.Table) -> PendingRows:
    """Queues every valid row of a generate / chat batch; invalid rows get their error.

    Nothing runs until the caller drives the engine (`llm.wait_for_completion()`), so
    several batches can be queued together and keep the engine full.
    """
    if spec.task not in GENERATION_TASKS:
        raise RowContractError(f"submit_rows is for generate / chat, not {spec.task!r}")
    check_columns(spec, table.column_names)
    inputs, errors = _row_inputs(spec, table)
    per_row = params_per_row(
        llm, spec.sampling, spec.structured_outputs, table, spec.structured_outputs_column, errors
    )
    ok = [i for i, e in enumerate(errors) if e is None]
    request_ids: list[str | None] = [None] * len(inputs)

    def enqueue(rows: list[int]) -> list[str]:
        items = [inputs[i] for i in rows]
        params = spec.sampling if per_row is None else [per_row[i] for i in rows]
        if spec.task == "generate":
            return llm.enqueue(items, params)
        return llm.enqueue_chat(
            items,
            params,
            chat_template=spec.chat_template,
            chat_template_kwargs=dict(spec.chat_template_kwargs or {}) or None,
        )

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
    return PendingRows(table, request_ids, errors)


def finish_rows(
    spec: RowSpec, pending: PendingRows, outputs: Mapping[str, Any], info: ModelInfo
) -> pa.Table:
    """The batch with its output columns, from `RequestOutput`s keyed by request id."""
    n = len(pending.request_ids)
    text: list[str | None] = [None] * n
    reason: list[str | None] = [None] * n
    num_in: list[int | None] = [None] * n
    num_out: list[int | None] = [None] * n
    for i, rid in enumerate(pending.request_ids):
        if rid is None:
            continue
        out = outputs[rid]
        completion = out.outputs[0]
        text[i] = completion.text
        reason[i] = completion.finish_reason
        num_in[i] = len(out.prompt_token_ids)
        num_out[i] = len(completion.token_ids)
    arrays = [
        pa.array(text, pa.string()),
        pa.array(reason, pa.string()),
        pa.array(num_in, pa.int32()),
        pa.array(num_out, pa.int32()),
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
            outs = llm.embed(items, spec.pooling, **kwargs)
            return [o.outputs.embedding for o in outs]
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

    results: list[Any] = [None] * len(inputs)
    for i, value in zip(ok, _run_isolated(call, [inputs[i] for i in ok]), strict=True):
        if isinstance(value, Exception):
            errors[i] = _strip_index(str(value))
        else:
            results[i] = value
    if spec.task == "embed":
        arrays = [_fixed_size(results, embedding_dim(spec, info))]
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


def _fixed_size(rows: list[Any], size: int) -> pa.FixedSizeListArray:
    """Vectors (None for failed rows) as `fixed_size_list<float32>[size]`."""
    values = np.zeros((len(rows), size), dtype=np.float32)
    mask = np.zeros(len(rows), dtype=bool)
    for i, row in enumerate(rows):
        if row is None:
            mask[i] = True
        else:
            values[i] = np.asarray(row, dtype=np.float32)
    flat = pa.array(values.reshape(-1), pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, size, mask=pa.array(mask))


# ---- the whole batch ------------------------------------------------------------------------


def process_table(
    llm: Any, spec: RowSpec, table: pa.Table, info: ModelInfo | None = None
) -> pa.Table:
    """Runs one batch through the engine: input columns plus the task's output columns."""
    check_columns(spec, table.column_names)
    info = info or ModelInfo.from_llm(llm)
    if spec.task in GENERATION_TASKS:
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
