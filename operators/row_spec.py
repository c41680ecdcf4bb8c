"""`RowSpec`: what a row-contract stage does with each row (task, input columns, params).

The task names, the errors of the contract, and the spec's fingerprint. The spec is plain,
frozen data: it travels to Ray actors and Spark workers, and hashes into engine caches and
job manifests. A per-row input column is one `<role>_column` field here (its role listed in
`RowSpec.input_roles`), or, for an optional per-row option (like `sampling_params_column`), a
field here and its reading in `generation_rows.py` (the adapter column: `lora_rows.py`).

Example:
    >>> spec = RowSpec(task="generate", sampling_params={"max_tokens": 32, "temperature": 0})
    >>> spec.input_columns
    ('prompt',)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from batchlm.engine.errors import InvalidParamError, InvalidPromptError
from batchlm.engine.loader.remote import is_remote
from batchlm.engine.lora.registry import LoRAModules
from batchlm.engine.pooling_params import PoolingParams
from batchlm.engine.sampling_params import SamplingParams

from .logprob_columns import OUTPUT_COLUMN_TYPES
from .row_params import build_params
from .structured_rows import job_constraint

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
    lora_modules: Mapping[str, str] | None = None
    """generate / chat / loglikelihood: LoRA adapters by name, `{name: PEFT folder or store
    URI}` (local paths are made absolute here, so that every worker finds them). The engine
    is built with them (`lora_rows.py`); each row names its adapter in `lora_column`."""
    lora_column: str = "lora"
    """An optional column of each row's adapter: a name of `lora_modules`, or null for the
    base model; an unknown name fails that row alone. A table with the column needs
    `lora_modules`."""
    image_column: str = "image"
    """generate / chat: an optional column of each row's image: encoded bytes, a path or
    URL, a numpy HWC uint8 array (`ray.data.read_images`), or null for none; a cell that
    cannot be read fails that row alone (`image_rows.py`)."""
    keep_images: bool = False
    """generate / chat: write the image column to the output too; by default it is dropped
    (images are large, and the input keeps them)."""
    _sampling: SamplingParams | None = field(default=None, init=False, repr=False, compare=False)
    _pooling: PoolingParams | None = field(default=None, init=False, repr=False, compare=False)
    _adapters: LoRAModules | None = field(default=None, init=False, repr=False, compare=False)

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
        if not isinstance(self.keep_images, bool):
            raise RowContractError(f"keep_images={self.keep_images!r} must be true or false")
        if self.keep_images and self.task not in GENERATION_TASKS:
            raise RowContractError(
                f"keep_images: only generate / chat rows read images, not task={self.task!r} "
                "(its columns all pass through); drop it"
            )
        try:
            job_constraint(self.task, self.structured_outputs, self.sampling_params)
        except InvalidParamError as e:
            raise RowContractError(str(e)) from None
        self._check_adapters()

    def _check_adapters(self) -> None:
        if self.lora_modules is None:
            if self.lora_column != _default_lora_column():
                raise RowContractError(
                    f"lora_column={self.lora_column!r} (input.columns.lora in a job) names "
                    "each row's LoRA adapter, but no lora_modules are given; add lora_modules "
                    "({name: adapter folder}), or drop lora_column"
                )
            return
        if self.task not in QUEUED_TASKS:
            raise RowContractError(
                f"lora_modules: task={self.task!r} runs the base model (adapters apply to "
                "generate, chat and loglikelihood); drop lora_modules, or merge the adapter "
                "into the base weights (peft's merge_and_unload) and load the merged folder"
            )
        if not isinstance(self.lora_modules, Mapping) or not self.lora_modules:
            raise RowContractError(
                f"lora_modules={self.lora_modules!r} must name at least one adapter: "
                "{name: PEFT adapter folder}"
            )
        try:
            adapters = LoRAModules(self.lora_modules)
        except InvalidParamError as e:
            raise RowContractError(str(e)) from None
        absolute = {r.lora_name: _absolute(r.lora_path) for r in adapters.requests()}
        object.__setattr__(self, "lora_modules", absolute)
        object.__setattr__(self, "_adapters", LoRAModules(absolute))

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

    def columns_read(self, names: Sequence[str]) -> tuple[str, ...]:
        """The input columns a table with these columns is read from: `input_columns`,
        except that `chat` over a table without its messages column but with its prompt
        column makes each row one user message of that text."""
        if (
            self.task == "chat"
            and self.messages_column not in names
            and self.prompt_column in names
        ):
            return (self.prompt_column,)
        return self.input_columns

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
    def adapters(self) -> LoRAModules | None:
        """`lora_modules` as `LoRARequest`s (ids 1..n in the order given); None without."""
        return self._adapters

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


def _default_lora_column() -> str:
    return next(f.default for f in fields(RowSpec) if f.name == "lora_column")


def _absolute(path: str) -> str:
    """A local path from the current directory on; a store URI as given."""
    if is_remote(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def _build_params(cls: type, values: Mapping[str, Any] | None, name: str) -> Any:
    try:
        return build_params(cls, values, name)
    except InvalidParamError as e:
        raise RowContractError(str(e)) from e.__cause__


__all__ = [
    "TASKS",
    "GENERATION_TASKS",
    "POOLING_TASKS",
    "QUEUED_TASKS",
    "ERROR_COLUMN",
    "ROW_ERRORS",
    "RowContractError",
    "MissingColumnsError",
    "RowSpec",
    "stable_hash",
]
