"""The job spec: what a `batchlm run JOB.yaml` reads, as frozen dataclasses.

A job names its input files, the task, the model and its engine options, the sampling or
pooling params, the output folder and the runner. Every level rejects unknown keys (listing
the valid ones), every value is type-checked, and the job holds the `OperatorConfig` the
runners share (`job.config`), which validates the task and its params. Each option of the
engine stage is declared once, in `OperatorConfig` or `RowSpec`; the job keys derive from
their fields (`STAGE_KEYS`).

Relative paths are taken from the current working directory.

Example:
    >>> job = JobSpec.from_dict({
    ...     "input": {"path": "conf/data/prompts", "columns": {"prompt": "question"}},
    ...     "task": "generate",
    ...     "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    ...     "sampling_params": {"temperature": 0, "max_tokens": 16},
    ...     "output": "out/answers",
    ... })
    >>> job.config.spec.prompt_column, job.batch_size
    ('question', 64)
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Union

import yaml

from batchlm.operators.config import OperatorConfig
from batchlm.operators.row_params import unknown_keys
from batchlm.operators.rows import TASKS, RowContractError, RowSpec

RUNNERS = ("local", "ray", "spark")
FORMATS = ("auto", "parquet", "jsonl", "csv")
_COLUMN_SUFFIX = "_column"
COLUMN_ROLES = tuple(
    f.name.removesuffix(_COLUMN_SUFFIX) for f in fields(RowSpec) if f.name.endswith(_COLUMN_SUFFIX)
)
"""Row-contract inputs a job may map to its own column names (`input.columns`): the
`<role>_column` options of `RowSpec`."""
_RENAMED = {"engine_kwargs": "engine"}
"""`OperatorConfig` fields whose job key is not the field's name."""


def _stage_keys() -> dict[str, tuple[type, str]]:
    """Top-level job key → (the dataclass that declares it, the field's name there): the
    fields of `OperatorConfig`, with those of its `RowSpec` in place of `spec`; the column
    roles go under `input.columns` instead."""
    keys: dict[str, tuple[type, str]] = {}
    for f in fields(OperatorConfig):
        if f.name != "spec":
            keys[_RENAMED.get(f.name, f.name)] = (OperatorConfig, f.name)
            continue
        for g in fields(RowSpec):
            if g.init and not g.name.endswith(_COLUMN_SUFFIX):
                keys[g.name] = (RowSpec, g.name)
    return keys


STAGE_KEYS = _stage_keys()
"""The job keys the engine stage's config declares, e.g. `batch_size` → `(OperatorConfig,
"batch_size")`, `engine` → `(OperatorConfig, "engine_kwargs")`, `task` → `(RowSpec, "task")`."""


class JobSpecError(ValueError):
    """The job file or its values are wrong; the message names the key and the fix."""


@dataclass(frozen=True)
class InputSpec:
    """Where the rows come from. Each input file is one shard of the job.

    In a job file, `input.columns` maps row-contract roles to your columns, e.g.
    `{prompt: question}` for `RowSpec.prompt_column`; it becomes part of `JobSpec.config`.
    """

    path: str
    """A file, a folder (every file of the format inside, recursively, sorted) or a glob
    such as `data/*.jsonl`."""
    format: str = "auto"
    """`parquet`, `jsonl` or `csv`; `auto` picks by the files' extension."""
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
    """One offline inference job: input → the engine stage → output.

    A job file's keys besides `input`, `output` and `runner` are the options of the engine
    stage, declared where the stage reads them: `OperatorConfig`'s fields (`engine` is its
    `engine_kwargs`) and those of its `RowSpec` (`input.columns.<role>` is its
    `<role>_column`); `STAGE_KEYS` lists them. Each can be read here by its job key:
    `job.task`, `job.model`, `job.engine`, `job.batch_size`, ...
    """

    input: InputSpec
    """The input files (a string is shorthand for `input.path`)."""
    output: OutputSpec
    """The output folder (a string is shorthand for `output.path`)."""
    config: OperatorConfig
    """The engine stage: model, engine options, task, columns, params and batching."""
    runner: str = "local"
    """`local` (this process), `ray` (Ray Data actors) or `spark` (Spark Arrow UDF)."""

    def __getattr__(self, key: str) -> Any:
        # Only called for names that are not attributes: the stage's job keys.
        where = STAGE_KEYS.get(key)
        config = self.__dict__.get("config")
        if where is None or config is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")
        owner, name = where
        return getattr(config.spec if owner is RowSpec else config, name)

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """Validates plain data (a parsed YAML document) into a `JobSpec`."""
        if not isinstance(data, Mapping):
            raise JobSpecError(
                f"a job must be a mapping of keys (input, task, model, output, ...), "
                f"got {_type_name(data)}"
            )
        data = dict(data)
        columns: dict[str, Any] = {}
        for name, sub in (("input", InputSpec), ("output", OutputSpec)):
            if isinstance(data.get(name), str):
                data[name] = {"path": data[name]}
            if name in data:
                values = _checked(data[name], _nested_hints(sub), _required(sub), name)
                columns = values.pop("columns", columns)
                data[name] = sub(**values)
        values = _checked(data, _top_level_hints(), _top_level_required(), "")
        runner = values.pop("runner", "local")
        job_input, job_output = values.pop("input"), values.pop("output")
        _validate(values, runner, job_input, job_output, columns)
        return cls(job_input, job_output, _stage_config(values, columns), runner)

    def to_operator_config(self) -> OperatorConfig:
        """The engine stage's config (`config`), which the runners share."""
        return self.config

    def with_overrides(self, **changes: Any) -> JobSpec:
        """A copy with top-level keys replaced (`runner=`, `output=` as a path, ...),
        validated as a job file is."""
        data = self.to_dict()
        for name in ("input", "output"):
            value = changes.pop(name, None)
            if isinstance(value, (str, Path)):
                data[name]["path"] = str(value)
            elif value is not None:
                data[name] = asdict(value) if isinstance(value, (InputSpec, OutputSpec)) else value
        return JobSpec.from_dict({**data, **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `JobSpec.from_dict` takes back."""
        spec = self.config.spec
        columns = {}
        for role in COLUMN_ROLES:
            name = f"{role}{_COLUMN_SUFFIX}"
            if getattr(spec, name) != _default(RowSpec, name):
                columns[role] = getattr(spec, name)
        job_input = {
            "path": self.input.path,
            "format": self.input.format,
            "columns": columns,
            "rows_per_shard": self.input.rows_per_shard,
        }
        out: dict[str, Any] = {"input": job_input}
        out.update({key: _plain(getattr(self, key)) for key in STAGE_KEYS})
        out["output"] = asdict(self.output)
        out["runner"] = self.runner
        return out


def job_keys() -> list[str]:
    """Every key a job file accepts, nested ones dotted (`input.path`, `output.compression`)."""
    nested = [
        f"{name}.{key}"
        for name, sub in (("input", InputSpec), ("output", OutputSpec))
        for key in _nested_hints(sub)
    ]
    return [*_top_level_hints(), *nested]


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
    "task": f"one of {', '.join(TASKS)}",
    "model": "a model folder, a .gguf file or a bundled model name",
    "output": "the output folder",
    "path": "a path",
}
"""What to set for each required key, in the order they are checked (then the others)."""


def _validate(
    values: dict[str, Any],
    runner: str,
    job_input: InputSpec,
    job_output: OutputSpec,
    columns: Mapping[str, Any],
) -> None:
    """The checks of the job's own values; the stage's config checks its values itself."""
    task = values["task"]
    if task not in TASKS:
        raise JobSpecError(f"task: {task!r} is unknown; use one of {', '.join(TASKS)}")
    if runner not in RUNNERS:
        raise JobSpecError(f"runner: {runner!r} is unknown; use one of {', '.join(RUNNERS)}")
    if job_input.format not in FORMATS:
        raise JobSpecError(
            f"input.format: {job_input.format!r} is unknown; use one of {', '.join(FORMATS)}"
        )
    _check_keys(dict(columns), COLUMN_ROLES, "input.columns")
    for role, column in columns.items():
        if not isinstance(column, str) or not column:
            raise JobSpecError(f"input.columns.{role}: expected a column name, got {column!r}")
    if job_input.rows_per_shard is not None and job_input.rows_per_shard < 1:
        raise JobSpecError(f"input.rows_per_shard: {job_input.rows_per_shard} must be >= 1")
    if not job_input.path:
        raise JobSpecError("input.path is empty; name a file, a folder or a glob")
    if not job_output.path:
        raise JobSpecError("output.path is empty; name the output folder")
    engine = values.get("engine")
    if engine:
        from batchlm.engine.engine_args import EngineArgs
        from batchlm.engine.errors import InvalidParamError

        valid = tuple(f.name for f in fields(EngineArgs) if f.name != "model")
        _check_keys(dict(engine), valid, "engine")
        if values.get("lora_modules") is not None:  # they turn enable_lora on
            if dict(engine).get("enable_lora", True) is not True:
                raise JobSpecError(
                    f"engine.enable_lora: {engine['enable_lora']!r}, but lora_modules names "
                    "adapters; drop engine.enable_lora (lora_modules turns it on)"
                )
            engine = {**engine, "enable_lora": True}
        try:  # the values too, before any shard is read or engine built
            EngineArgs(model=str(values.get("model")), **dict(engine)).validate()
        except InvalidParamError as e:
            raise JobSpecError(f"engine: {e}") from None


def _stage_config(values: dict[str, Any], columns: Mapping[str, str]) -> OperatorConfig:
    """The `OperatorConfig` of checked job values; it validates the task's params."""
    row = {f"{role}{_COLUMN_SUFFIX}": column for role, column in columns.items()}
    own = {}
    for key, value in values.items():
        owner, name = STAGE_KEYS[key]
        (row if owner is RowSpec else own)[name] = _plain(value)
    try:
        return OperatorConfig(spec=RowSpec(**row), **own)
    except RowContractError as e:
        raise JobSpecError(str(e)) from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Field → type of `cls`'s init fields; nested specs (built first) map to None."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: None if _is_dataclass_type(hints[f.name]) else hints[f.name]
        for f in fields(cls)
        if f.init
    }


def _nested_hints(cls: type) -> dict[str, Any]:
    """The keys of `input` / `output`: the spec's fields, and `input.columns`."""
    if cls is InputSpec:
        return {**_hints(cls), "columns": Mapping[str, str]}
    return _hints(cls)


def _top_level_hints() -> dict[str, Any]:
    stage = {key: _hints(owner)[name] for key, (owner, name) in STAGE_KEYS.items()}
    return {"input": None, "output": None, "runner": str, **stage}


def _top_level_required() -> set[str]:
    stage = {key for key, (owner, name) in STAGE_KEYS.items() if name in _required(owner)}
    return {"input", "output", *stage}


def _required(cls: type) -> set[str]:
    return {
        f.name
        for f in fields(cls)
        if f.init and f.default is MISSING and f.default_factory is MISSING
    }


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in fields(cls) if f.name == name)


def _checked(data: Any, hints: Mapping[str, Any], required: set[str], where: str) -> dict[str, Any]:
    """`data` with unknown keys, missing keys and value types checked (None: any value)."""
    label = where or "job"
    if not isinstance(data, Mapping):
        raise JobSpecError(f"{label}: expected a mapping of keys, got {_type_name(data)}")
    _check_keys(dict(data), list(hints), label if where else "the job")
    values: dict[str, Any] = {}
    first = list(_REQUIRED)
    for name in sorted(hints, key=lambda n: first.index(n) if n in first else len(first)):
        hint = hints[name]
        key = f"{where}.{name}" if where else name
        if name not in data:
            if name in required:
                raise JobSpecError(f"{key} is required: {_REQUIRED.get(name, 'set it')}")
            continue
        values[name] = data[name] if hint is None else _check_type(data[name], hint, key)
    return values


def _is_dataclass_type(hint: Any) -> bool:
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
        if origin is tuple and isinstance(value, (list, tuple)):
            items = typing.get_args(option)
            if len(value) == len(items) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                return tuple(value)
    wanted = " or ".join(_hint_name(o) for o in options)
    raise JobSpecError(f"{key}: expected {wanted}, got {value!r} ({_type_name(value)})")


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType)


def _hint_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint) or hint
    if origin is tuple:
        return f"a list of {len(typing.get_args(hint))} integers"
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
    "STAGE_KEYS",
    "job_keys",
]
