"""A job end to end: check → plan shards → skip finished ones → run → write → summary.

Everything that can be wrong with a job (its keys and values, the input files, the columns
the task reads, the model name and engine options) is checked by `plan_job`, which reads
the input schemas and the model's config but loads no weights. `run_job` then runs only
the shards whose output file is missing, whatever the runner.

Example:
    >>> summary = run_job(load_job("conf/generate_demo.yaml"))
    >>> print(summary.format())
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, fields, replace
from typing import IO, Any

import pyarrow as pa

from batchlm.engine.errors import InvalidParamError
from batchlm.engine.loader.remote import RemoteStoreError, is_remote
from batchlm.operators import fault_injection
from batchlm.operators.config import OperatorConfig
from batchlm.operators.rows import (
    GENERATION_TASKS,
    ModelInfo,
    RowContractError,
    RowSpec,
    output_schema,
    stable_hash,
)

from .output import OutputFolder, ShardCommitter, job_manifest
from .output_store import open_output_store
from .progress import JobSummary, Progress, metric_values
from .runner import Runner, ShardBatch, ShardInput
from .shards import InputFile, Shard, find_input_files, plan_shards, read_schema, read_shard
from .shards import input_fingerprint as files_fingerprint
from .spec import JobSpec, JobSpecError

# OperatorConfig fields that change how the work is spread, never its results: changing them
# between a crashed run and its resumption is allowed.
_PLACEMENT_DEFAULTS = {"concurrency": 1, "num_gpus": None, "max_batch_retries": 2}
# The per-row params column is optional: absent under its default name, the job's params
# apply to every row; a name the job maps it to must exist.
_PARAMS_COLUMN = RowSpec("generate").sampling_params_column
_ADAPTER_COLUMN = RowSpec("generate").lora_column
_IMAGE_COLUMN = RowSpec("generate").image_column


@dataclass(frozen=True)
class JobPlan:
    """A checked job: its engine config, model facts, shards and manifest."""

    job: JobSpec
    config: OperatorConfig
    info: ModelInfo
    files: list[InputFile]
    shards: list[Shard]
    manifest: dict[str, Any]


def results_fingerprint(config: OperatorConfig) -> str:
    """What decides a job's output: `config` without its placement fields (concurrency,
    GPUs, retries), and without the fields left at their defaults, so that an option added
    to the row contract later leaves the identity of output written before it unchanged;
    with LoRA adapters, a hash of each one's files too, so that changing an adapter changes
    the job (a store's adapter is fetched to be hashed).

    Raises:
        InvalidParamError: an adapter on a store that cannot be read.
    """
    data = _set_fields(replace(config, **_PLACEMENT_DEFAULTS))
    data["spec"] = _set_fields(config.spec)
    adapters = config.spec.adapters
    if adapters is not None:
        data["lora_files"] = adapters.fingerprint()
    return stable_hash(data)


def _set_fields(obj: Any) -> dict[str, Any]:
    """The init fields of dataclass `obj` whose values differ from their defaults."""
    out = {}
    for f in fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        if f.default is not MISSING and value == f.default:
            continue
        if f.default_factory is not MISSING and value == f.default_factory():
            continue
        out[f.name] = dict(value) if isinstance(value, Mapping) else value
    return out


def plan_job(job: JobSpec) -> JobPlan:
    """Validates the job against its input and model without loading weights.

    Raises:
        JobSpecError: the message names the key, file or column and the fix.
    """
    config = job.config
    files = find_input_files(job.input)
    for file in files:
        _check_input_columns(config, file, read_schema(file))
    _check_output(job.output.path)
    info = _model_info(config)
    _check_adapters(config)
    shards = plan_shards(files, job.input.rows_per_shard)
    config_fp = results_fingerprint(config)
    input_fp = files_fingerprint(job.input, files)
    manifest = job_manifest(
        config=config.to_dict(),
        config_fingerprint=config_fp,
        input_fingerprint=input_fp,
        inputs={"path": job.input.path, "files": [f.path for f in files]},
        shard_names=[s.name for s in shards],
    )
    return JobPlan(job, config, info, files, shards, manifest)


def _check_input_columns(config: OperatorConfig, file: InputFile, schema: pa.Schema) -> None:
    spec = config.spec
    read = spec.columns_read(schema.names)
    roles = spec.input_roles if read == spec.input_columns else ("prompt",)
    for role, column in zip(roles, read, strict=True):
        if column not in schema.names:
            raise JobSpecError(
                f"task {spec.task!r} reads column {column!r} (input.columns.{role}), but "
                f"{file.path!r} has columns {schema.names}; set input.columns.{role} to the "
                "column that holds it"
            )
    column = spec.sampling_params_column
    if column != _PARAMS_COLUMN and spec.task in GENERATION_TASKS and column not in schema.names:
        raise JobSpecError(
            f"input.columns.sampling_params names column {column!r}, but {file.path!r} has "
            f"columns {schema.names}; map it to the column of per-row params, or drop it"
        )
    column = spec.image_column
    if column != _IMAGE_COLUMN and spec.task in GENERATION_TASKS and column not in schema.names:
        raise JobSpecError(
            f"input.columns.image names column {column!r}, but {file.path!r} has columns "
            f"{schema.names}; map it to the column of images, or drop it"
        )
    column = spec.lora_column
    if column != _ADAPTER_COLUMN and column not in schema.names:
        raise JobSpecError(
            f"input.columns.lora names column {column!r}, but {file.path!r} has columns "
            f"{schema.names}; map it to the column of adapter names, or drop it"
        )
    try:
        output_schema(spec, ModelInfo(1, 1), schema)
    except RowContractError as e:
        raise JobSpecError(f"input {file.path!r}: {e}") from None


def _check_adapters(config: OperatorConfig) -> None:
    """Each adapter's folder holds a config the engine serves and a weight file (their
    tensors and modules are checked against the model when the engine is built)."""
    adapters = config.spec.adapters
    if adapters is None:
        return
    try:
        adapters.ranks()
    except InvalidParamError as e:
        raise JobSpecError(f"lora_modules: {e}") from None


def _check_output(path: str) -> None:
    """A store's output folder must answer and its bucket exist (local folders are created
    and locked when the job starts)."""
    if not is_remote(path):
        return
    try:
        open_output_store(path).open()
    except RemoteStoreError as e:
        raise JobSpecError(f"output.path: {e}") from None


def _model_info(config: OperatorConfig) -> ModelInfo:
    try:
        return config.model_info()
    except (OSError, ValueError, TypeError) as e:
        raise JobSpecError(
            f"model {config.model!r} with engine options {dict(config.engine_kwargs)}: {e}"
        ) from None


def run_job(
    job: JobSpec,
    *,
    overwrite: bool = False,
    progress: bool = True,
    stream: IO[str] | None = None,
    plan: JobPlan | None = None,
    announce: Callable[[str], None] | None = None,
) -> JobSummary:
    """Runs the shards of `job` that have no output yet and writes each atomically.

    Args:
        job: the validated job.
        overwrite: delete the output folder's earlier results (of this or another job) first.
        progress: draw a progress bar on `stream` (default stderr).
        plan: a plan already made by `plan_job(job)` (else made here).
        announce: called with one line saying what will run, once the output is checked.

    Raises:
        JobSpecError: see `plan_job`.
        OutputConflictError: the output folder holds another job's results (and not
            `overwrite`), or another process is writing there.
    """
    plan = plan or plan_job(job)
    out = OutputFolder(job.output.path, plan.manifest)
    try:
        out.prepare(overwrite=overwrite)
        pending = [s for s in plan.shards if not out.is_done(s.name)]
        if pending:
            out.claim()  # a store's lease, taken only when there is something to write
            pending = [s for s in pending if not out.is_done(s.name)]
        if announce is not None:
            announce(
                f"{len(pending)} of {len(plan.shards)} shard(s) to run on the {job.runner} "
                f"runner ({len(plan.shards) - len(pending)} already written) -> {out.path}"
            )
        bar = Progress(_known_rows(pending), stream or sys.stderr, enabled=progress)
        metrics = None
        num_written = 0
        try:
            if pending:
                with make_runner(job.runner, plan.config, plan.info) as runner:
                    num_written = _write_shards(plan, out, runner.run, pending, bar)
                    metrics = metric_values(_safe_metrics(runner))
        finally:
            bar.close()
        return JobSummary(
            output_path=str(out.path),
            num_shards=len(plan.shards),
            num_shards_written=num_written,
            num_shards_skipped=len(plan.shards) - len(pending),
            rows_written=bar.rows,
            rows_failed=bar.failed,
            rows_in_output=sum(out.num_rows(s.name) for s in plan.shards if out.is_done(s.name)),
            seconds=bar.seconds,
            prompt_tokens=bar.prompt_tokens,
            output_tokens=bar.output_tokens,
            cached_prompt_tokens=bar.cached_prompt_tokens,
            engine_metrics=metrics,
        )
    finally:
        out.close()


def _write_shards(
    plan: JobPlan,
    out: OutputFolder,
    run: Callable[[Iterable[ShardInput]], Iterator[ShardBatch]],
    pending: list[Shard],
    bar: Progress,
) -> int:
    """Feeds `pending` to the runner and commits each shard's file once it is whole, in the
    background while the next shard's rows arrive."""
    by_index = {s.index: s for s in pending}
    num_rows: dict[int, int] = {}
    schemas: dict[int, pa.Schema] = {}
    compression = plan.job.output.compression
    num_written = 0
    num_batches = 0

    def commit() -> None:
        nonlocal num_written
        num_written += 1
        fault_injection.after_shard_commit(num_written)

    def inputs() -> Iterator[ShardInput]:
        for shard in pending:
            table = read_shard(shard)
            schema = output_schema(plan.config.spec, plan.info, table.schema)
            if shard.num_rows is None:
                bar.add_total(table.num_rows)
            if table.num_rows == 0:
                with out.shard_writer(shard.name, schema, compression):
                    pass
                commit()
                continue
            num_rows[shard.index], schemas[shard.index] = table.num_rows, schema
            yield ShardInput(shard.index, table)

    stream = iter(run(inputs()))
    with ShardCommitter(out, commit) as committer:
        for batch in stream:
            index = batch.index
            shard = by_index[index]
            writer = out.open_shard(shard.name, schemas[index], compression)
            try:
                while True:
                    if batch.index != index:
                        raise RuntimeError(
                            f"runner {plan.job.runner!r} started shard {batch.index} before "
                            f"finishing shard {index} ({writer.num_rows}/{num_rows[index]} rows)"
                        )
                    fault_injection.before_batch_write(num_batches)
                    writer.write(batch.table)
                    num_batches += 1
                    bar.update(batch.table)
                    if writer.num_rows >= num_rows[index]:
                        break
                    batch = next(stream, None)
                    if batch is None:
                        raise RuntimeError(
                            f"runner {plan.job.runner!r} stopped after {writer.num_rows} of "
                            f"{num_rows[index]} rows of shard {shard.name}"
                        )
                if writer.num_rows != num_rows[index]:
                    raise RuntimeError(
                        f"runner {plan.job.runner!r} returned {writer.num_rows} rows for shard "
                        f"{shard.name}, which has {num_rows[index]}"
                    )
            except BaseException:
                out.abandon_shard(writer)
                raise
            committer.submit(writer)  # its last row group and rename overlap the next shard
        committer.wait()
    return num_written


def _known_rows(shards: list[Shard]) -> int | None:
    if any(s.num_rows is None for s in shards):
        known = sum(s.num_rows or 0 for s in shards)
        return known or None
    return sum(s.num_rows or 0 for s in shards)


def make_runner(name: str, config: OperatorConfig, info: ModelInfo) -> Runner:
    """The runner called `name` (`local`, `ray`, `spark`); Ray and Spark import lazily."""
    if name == "local":
        from .local_runner import LocalRunner

        return LocalRunner(config, info)
    if name == "ray":
        from .ray_runner import RayRunner

        return RayRunner(config, info)
    if name == "spark":
        from .spark_runner import SparkRunner

        return SparkRunner(config, info)
    raise ValueError(f"runner={name!r} is unknown; use local, ray or spark")


def _safe_metrics(runner: Any) -> list[Any] | None:
    try:
        return runner.metrics()
    except RuntimeError:  # the engine was built without statistics
        return None


__all__ = ["JobPlan", "plan_job", "run_job", "results_fingerprint", "make_runner"]
