"""The job spec: what a `batchlm run JOB.yaml` reads, as frozen dataclasses.

A job names its input files, the task, the model and its engine options, the sampling or
pooling params, the output folder and the runner. Every level rejects unknown keys (listing
the valid ones), every value is type-checked, and `to_operator_config()` builds the
`OperatorConfig` the runners share, which validates the task and its params.

Relative paths are taken from the current working directory.

Example:
    >>> job = JobSpec.from_dict({
    ...     "input": {"path": "conf/data/prompts", "columns": {"prompt": "question"}},
    ...     "task": "generate",
    ...     "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    ...     "sampling_params": {"temperature": 0, "max_tokens": 16},
    ...     "output": "out/answers",
    ... })
    >>> config = job.to_operator_config()
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Union

import yaml

from batchlm.operators.config import OperatorConfig
from batchlm.operators.rows import TASKS, RowContractError, unknown_keys

RUNNERS = ("local", "ray", "spark")
FORMATS = ("auto", "parquet", "jsonl", "csv")
COLUMN_ROLES = ("prompt", "messages", "text", "text_pair")
"""Row-contract inputs a job may map to its own column names (`input.columns`)."""


class JobSpecError(ValueError):
    """The job file or its values are wrong; the message names the key and the fix."""


@dataclass(frozen=True)
class InputSpec:
    """Where the rows come from. Each input file is one shard of the job."""

    path: str
    """A file, a folder (every file of the format inside, recursively, sorted) or a glob
    such as `data/*.jsonl`."""
    format: str = "auto"
    """`parquet`, `jsonl` or `csv`; `auto` picks by the files' extension."""
    columns: Mapping[str, str] = field(default_factory=dict)
    """Row-contract input → your column, e.g. `{prompt: question}`. Roles: `prompt`
    (generate), `messages` (chat), `text` (embed / classify / score's query side), `text_pair`
    (score's document side). Unmapped roles use the role's own name as column."""
    rows_per_shard: int | None = None
    """Parquet only: split files with more rows than this into shards of whole row groups,
    so a crash loses less work. None: one shard per file."""


@dataclass(frozen=True)
class OutputSpec:
    """Where results go: one Parquet file per input shard and a manifest, in one folder."""

    path: str
    """The output folder (created if absent)."""
    compression: str = "zstd"
    """Parquet compression codec (`zstd`, `snappy`, `gzip`, `none`)."""


@dataclass(frozen=True)
class JobSpec:
    """One offline inference job: input → task → output."""

    input: InputSpec
    """The input files and column mapping (a string is shorthand for `input.path`)."""
    task: str
    """`generate`, `chat`, `embed`, `score` or `classify`."""
    model: str
    """A local model folder, a `.gguf` file or a name that resolves offline."""
    output: OutputSpec
    """The output folder (a string is shorthand for `output.path`)."""
    engine: Mapping[str, Any] = field(default_factory=dict)
    """`LLM(model, **engine)` options: `dtype`, `max_model_len`, `max_num_seqs`, ..."""
    sampling_params: Mapping[str, Any] | None = None
    """generate / chat: `SamplingParams` fields (`temperature`, `max_tokens`, ...)."""
    pooling_params: Mapping[str, Any] | None = None
    """embed / score / classify: `PoolingParams` fields (`normalize`, `dimensions`, ...)."""
    truncate_prompt_tokens: int | None = None
    """Pooling tasks: keep at most this many tokens (-1: the model's maximum) instead of
    failing the row when it is longer."""
    chat_template: str | None = None
    """chat: a template (text or file) overriding the model's."""
    chat_template_kwargs: Mapping[str, Any] | None = None
    """chat: extra variables for the template."""
    runner: str = "local"
    """`local` (this process), `ray` (Ray Data actors) or `spark` (Spark Arrow UDF)."""
    batch_size: int = 64
    """Rows per batch handed to the engine."""
    concurrency: int = 1
    """Engine replicas (ray: actors; spark: partitions processed at once)."""
    num_gpus: float | None = None
    """GPUs per replica; None: `tensor_parallel_size` on a CUDA machine, else 0."""
    max_batch_retries: int = 2
    """ray / spark: retries of a batch on a fresh engine after an engine failure."""

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """Validates plain data (a parsed YAML document) into a `JobSpec`."""
        if not isinstance(data, Mapping):
            raise JobSpecError(
                f"a job must be a mapping of keys (input, task, model, output, ...), "
                f"got {_type_name(data)}"
            )
        data = dict(data)
        for name, sub in (("input", InputSpec), ("output", OutputSpec)):
            if isinstance(data.get(name), str):
                data[name] = {"path": data[name]}
            if name in data:
                data[name] = _build(sub, data[name], name)
        job = _build(cls, data, "")
        job._validate()
        return job

    def _validate(self) -> None:
        if self.task not in TASKS:
            raise JobSpecError(f"task: {self.task!r} is unknown; use one of {', '.join(TASKS)}")
        if self.runner not in RUNNERS:
            raise JobSpecError(
                f"runner: {self.runner!r} is unknown; use one of {', '.join(RUNNERS)}"
            )
        if self.input.format not in FORMATS:
            raise JobSpecError(
                f"input.format: {self.input.format!r} is unknown; use one of {', '.join(FORMATS)}"
            )
        _check_keys(dict(self.input.columns), COLUMN_ROLES, "input.columns")
        for role, column in self.input.columns.items():
            if not isinstance(column, str) or not column:
                raise JobSpecError(f"input.columns.{role}: expected a column name, got {column!r}")
        if self.input.rows_per_shard is not None and self.input.rows_per_shard < 1:
            raise JobSpecError(f"input.rows_per_shard: {self.input.rows_per_shard} must be >= 1")
        if not self.input.path:
            raise JobSpecError("input.path is empty; name a file, a folder or a glob")
        if not self.output.path:
            raise JobSpecError("output.path is empty; name the output folder")
        if self.engine:
            from batchlm.engine.engine_args import EngineArgs

            valid = tuple(f.name for f in fields(EngineArgs) if f.name != "model")
            _check_keys(dict(self.engine), valid, "engine")

    def to_operator_config(self) -> OperatorConfig:
        """The engine stage's config; task, params and options are validated here."""
        columns = {f"{role}_column": name for role, name in self.input.columns.items()}
        optional = {
            "sampling_params": self.sampling_params,
            "pooling_params": self.pooling_params,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "chat_template": self.chat_template,
            "chat_template_kwargs": self.chat_template_kwargs,
            "num_gpus": self.num_gpus,
        }
        try:
            return OperatorConfig.create(
                self.model,
                self.task,
                engine_kwargs=dict(self.engine),
                batch_size=self.batch_size,
                concurrency=self.concurrency,
                max_batch_retries=self.max_batch_retries,
                **columns,
                **{k: _plain(v) for k, v in optional.items() if v is not None},
            )
        except RowContractError as e:
            raise JobSpecError(str(e)) from None

    def with_overrides(self, **changes: Any) -> JobSpec:
        """A copy with top-level fields replaced (`runner=`, `output=` as a path, ...)."""
        if isinstance(changes.get("output"), (str, Path)):
            changes["output"] = replace(self.output, path=str(changes["output"]))
        job = replace(self, **changes)
        job._validate()
        return job

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `JobSpec.from_dict` takes back."""
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        out["input"] = {f.name: _plain(getattr(self.input, f.name)) for f in fields(InputSpec)}
        out["output"] = {f.name: getattr(self.output, f.name) for f in fields(OutputSpec)}
        return out


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    """Reads a job file, applies `key.path=value` overrides, validates.

    Args:
        path: the YAML file.
        overrides: `--set` items such as `sampling_params.max_tokens=8`; each value is read
            as YAML (`8` is an int, `true` a bool, `[a, b]` a list).

    Raises:
        JobSpecError: the file is missing or not valid YAML, a key is unknown, a value has
            the wrong type.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise JobSpecError(f"job file {str(path)!r} does not exist") from None
    except OSError as e:
        raise JobSpecError(f"cannot read job file {str(path)!r}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise JobSpecError(f"{path} is not valid YAML: {_yaml_message(e)}") from None
    if data is None:
        raise JobSpecError(f"{path} is empty; a job needs input, task, model and output")
    if isinstance(data, dict):
        for item in overrides:
            set_path(data, item)
    try:
        return JobSpec.from_dict(data)
    except JobSpecError as e:
        raise JobSpecError(f"{path}: {e}") from None


def set_path(data: dict[str, Any], item: str) -> None:
    """Applies one `key.path=value` override to parsed job data, in place."""
    key, sep, raw = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(keys):
        raise JobSpecError(
            f"--set {item!r}: expected KEY.PATH=VALUE, e.g. sampling_params.max_tokens=8"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise JobSpecError(
            f"--set {item!r}: the value is not valid YAML: {_yaml_message(e)}"
        ) from None
    node = data
    for depth, name in enumerate(keys[:-1]):
        child = node.get(name)
        if child is None:
            child = node[name] = {}
        elif isinstance(child, str) and depth == 0 and name in ("input", "output"):
            child = node[name] = {"path": child}
        elif not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise JobSpecError(f"--set {item!r}: {where} is {_type_name(child)}, not a mapping")
        node = child
    node[keys[-1]] = value


# ---- validation helpers -----------------------------------------------------------------

_REQUIRED = {
    "input": "a Parquet / JSONL / CSV file, a folder of them or a glob",
    "output": "the output folder",
    "task": f"one of {', '.join(TASKS)}",
    "model": "a model folder, a .gguf file or a bundled model name",
    "path": "a path",
}


def _build(cls: type, data: Any, where: str) -> Any:
    """`cls(**data)` with unknown keys, missing keys and value types checked."""
    label = where or "job"
    if not isinstance(data, Mapping):
        raise JobSpecError(f"{label}: expected a mapping of keys, got {_type_name(data)}")
    known = [f.name for f in fields(cls)]
    _check_keys(dict(data), known, label if where else "the job")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise JobSpecError(f"{key} is required: {_REQUIRED.get(f.name, 'set it')}")
            continue
        value = data[f.name]
        if not _is_dataclass_type(hints[f.name]):
            value = _check_type(value, hints[f.name], key)
        values[f.name] = value
    return cls(**values)


def _is_dataclass_type(hint: Any) -> bool:
    """Nested specs (`input`, `output`) arrive already built."""
    return isinstance(hint, type) and hasattr(hint, "__dataclass_fields__")


def _check_type(value: Any, hint: Any, key: str) -> Any:
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        origin = typing.get_origin(option) or option
        if option is Any:
            return value
        if origin in (Mapping, dict) and isinstance(value, Mapping):
            return dict(value)
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is str and isinstance(value, str):
            return value
    wanted = " or ".join(_hint_name(o) for o in options)
    raise JobSpecError(f"{key}: expected {wanted}, got {value!r} ({_type_name(value)})")


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType)


def _hint_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint) or hint
    return {str: "a string", int: "an integer", float: "a number", bool: "true/false"}.get(
        origin, "a mapping" if origin in (Mapping, dict) else str(hint)
    )


def _check_keys(data: dict[str, Any], valid: Sequence[str], where: str) -> None:
    unknown = [k for k in data if k not in valid]
    if unknown:
        raise JobSpecError(f"unknown key(s) in {where}: {unknown_keys(unknown, valid)}")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


def _yaml_message(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return problem


def _plain(value: Any) -> Any:
    """Mappings as plain dicts (frozen dataclasses hold them; YAML and JSON want dicts)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


__all__ = [
    "JobSpec",
    "InputSpec",
    "OutputSpec",
    "JobSpecError",
    "load_job",
    "set_path",
    "RUNNERS",
    "FORMATS",
    "COLUMN_ROLES",
]
