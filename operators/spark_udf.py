"""Spark front end: pandas UDF factories and a whole-DataFrame `mapInArrow` helper.

Each factory returns an iterator pandas UDF (`Iterator[pd.Series] -> Iterator[pd.DataFrame]`)
whose result is a struct of the row contract's output fields, `error` included. Batches
stream through the engine (`operators/row_stream.py`: several in flight, results in input
order), so per-row errors, the declared schema and the engine calls are exactly those of the
Ray front end and the local runner.

- One engine per Python worker, kept in a module-level cache keyed by
  `OperatorConfig.engine_fingerprint()` and the device. Spark reuses Python workers across
  tasks (`spark.python.worker.reuse`, on by default), so the model loads once per worker,
  not per task or batch.
- Device: the GPUs Spark assigned to the task (`TaskContext.resources()["gpu"]`, one per
  tensor-parallel rank), else the CPU (with torch limited to the task's `spark.task.cpus`
  threads). An explicit `engine_kwargs["device"]` wins.
- A bad row gets its message in `error`. Anything else (the engine failing) drops the cached
  engine and fails the task with a RuntimeError naming the model and partition, so Spark's task
  retry (`spark.task.maxFailures`) runs the partition again on a fresh engine.
- Embeddings and class probabilities are `array<float>` in Spark. Their fixed length is in
  the column metadata of `map_in_arrow`'s schema (`FIXED_SIZE_KEY`); a UDF's return struct
  cannot carry metadata, so each UDF has attributes instead: `udf.embedding_dim` (embed),
  `udf.output_fields` (the Arrow fields, with `fixed_size_list` lengths) and
  `udf.input_columns` (the row-contract names of the columns it takes, in order).
- Rows may carry their own sampling params: `map_in_arrow` reads the `sampling_params`
  column (a struct or JSON text) when the DataFrame has it; `generate_udf` / `chat_udf` take
  it as an optional last argument (`generate_udf(config)("prompt", "params")`).
- Rows may run LoRA adapters (`lora_modules` in the config): `map_in_arrow` reads the `lora`
  column (each row's adapter name, null for the base model); `generate_udf` / `chat_udf`
  take it after the params (`F.lit(None).cast("string")` for none) and `loglikelihood_udf`
  after the continuation. The engine of each worker is given every adapter when built.
- Token ids and logprobs (`output_token_ids`, `output_logprobs`, `prompt_logprobs`) are
  arrays (of arrays) of `struct<token_id: int, logprob: float>`.
- Rows reach the engine in slices of at most `config.batch_size`; Spark's own batches are
  `spark.sql.execution.arrow.maxRecordsPerBatch` rows.
- Two of these UDFs in one `select` run in two Python workers per task (one Arrow
  evaluation each), so each loads its own engine: give each UDF its own query, or use
  `map_in_arrow`.

Example:
    >>> config = OperatorConfig.create(
    ...     "HuggingFaceTB/SmolLM2-135M-Instruct", "generate",
    ...     sampling_params={"max_tokens": 32, "temperature": 0},
    ... )
    >>> df = spark.read.parquet("prompts.parquet")
    >>> out = df.withColumn("out", generate_udf(config)("prompt")).select("id", "out.*")
    >>> map_in_arrow(df, config).write.parquet("generated.parquet")  # the same, as columns
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from . import fault_injection
from .config import OperatorConfig
from .image_rows import dropped_image_column
from .row_stream import stream_tables
from .rows import ModelInfo, RowContractError, check_columns, output_fields

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType, StructField, StructType

FIXED_SIZE_KEY = "batchlm.fixed_size"
"""Struct-field metadata key: the length of an `array<float>` that Arrow declares fixed-size."""

# Python-worker state: engine key → LLM. Lives as long as the worker process.
_ENGINES: dict[str, Any] = {}


# ---- Arrow ↔ Spark types ------------------------------------------------------------------


def spark_type(arrow_type: pa.DataType) -> DataType:
    """The Spark type a row-contract Arrow type is written as."""
    from pyspark.sql import types as T

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return T.StringType()
    if pa.types.is_int32(arrow_type):
        return T.IntegerType()
    if pa.types.is_int64(arrow_type):
        return T.LongType()
    if pa.types.is_float32(arrow_type):
        return T.FloatType()
    if pa.types.is_float64(arrow_type):
        return T.DoubleType()
    if pa.types.is_boolean(arrow_type):
        return T.BooleanType()
    if pa.types.is_fixed_size_list(arrow_type):
        return T.ArrayType(spark_type(arrow_type.value_type), containsNull=False)
    if pa.types.is_list(arrow_type):
        value = arrow_type.value_field
        return T.ArrayType(spark_type(value.type), containsNull=value.nullable)
    if pa.types.is_struct(arrow_type):
        return T.StructType(
            [T.StructField(f.name, spark_type(f.type), nullable=f.nullable) for f in arrow_type]
        )
    raise TypeError(f"no Spark type for Arrow type {arrow_type}")


def spark_field(field: pa.Field, *, with_metadata: bool = True) -> StructField:
    """A Spark field for an output field; a fixed-size list keeps its length in metadata.

    Fields inside a UDF's return struct must go without metadata: Spark compares the type
    the UDF declared with the one its Arrow batches carry, which has none.
    """
    from pyspark.sql.types import StructField

    metadata = {}
    if with_metadata and pa.types.is_fixed_size_list(field.type):
        metadata[FIXED_SIZE_KEY] = field.type.list_size
    return StructField(field.name, spark_type(field.type), nullable=True, metadata=metadata)


def spark_output_struct(config: OperatorConfig, info: ModelInfo | None = None) -> StructType:
    """The task's output fields (`error` last) as a Spark struct."""
    from pyspark.sql.types import StructType

    info = info or config.model_info()
    fields = output_fields(config.spec, info)
    return StructType([spark_field(f, with_metadata=False) for f in fields])


def _spark_arrow_type(arrow_type: pa.DataType) -> pa.DataType:
    """The Arrow type Spark reads back for a column: fixed-size lists become plain lists."""
    if pa.types.is_fixed_size_list(arrow_type):
        return pa.list_(pa.field("element", arrow_type.value_type, nullable=False))
    return arrow_type


# ---- the engine, once per Python worker ---------------------------------------------------


def _task_context() -> Any:
    from pyspark import TaskContext

    return TaskContext.get()


def task_device(config: OperatorConfig) -> str:
    """The GPUs Spark gave this task, as a device: `cuda:<n>`, or with
    `tensor_parallel_size` = k > 1 one index per rank (`cuda:<n1>,...,<nk>`: rank r on the
    task's r-th GPU); `cpu` without GPUs. `engine_kwargs["device"]` wins."""
    explicit = config.engine_kwargs.get("device")
    if explicit not in (None, "auto"):
        return str(explicit)
    ctx = _task_context()
    gpu = ctx.resources().get("gpu") if ctx is not None else None
    if gpu is None or not gpu.addresses:
        return "cpu"
    addresses = [str(a) for a in gpu.addresses]
    tp = config.tensor_parallel_size
    if len(addresses) < tp:
        raise RowContractError(
            f"tensor_parallel_size={tp} needs {tp} GPUs per task, but Spark gave this task "
            f"{len(addresses)} ({', '.join(addresses)}); set spark.task.resource.gpu.amount={tp}"
        )
    if not all(a.isdigit() for a in addresses):
        return "cuda"
    import torch

    # Executors isolated to their GPUs (CUDA_VISIBLE_DEVICES) see them renumbered from 0.
    ordinals = [int(a) for a in addresses[:tp]]
    count = torch.cuda.device_count()
    if count and max(ordinals) >= count:
        ordinals = list(range(tp))
    return "cuda:" + ",".join(map(str, ordinals))


def get_engine(config: OperatorConfig) -> Any:
    """This worker's engine for `config`, built on first use and kept for later tasks."""
    device = task_device(config)
    key = f"{config.engine_fingerprint()}@{device}"
    llm = _ENGINES.get(key)
    if llm is None:
        if device == "cpu":
            _limit_cpu_threads()
        llm = config.build_llm(device=device)
        _ENGINES[key] = llm
        fault_injection.on_spark_engine_build(key)
    return llm


def drop_engine(config: OperatorConfig) -> None:
    """Forgets (and shuts down) this worker's engines for `config`, after a failure."""
    prefix = config.engine_fingerprint() + "@"
    for key in [k for k in _ENGINES if k.startswith(prefix)]:
        llm = _ENGINES.pop(key)
        try:
            llm.shutdown()
        except Exception:  # noqa: BLE001 - a broken engine may fail to shut down too
            pass


def _limit_cpu_threads() -> None:
    """Spark runs several tasks per executor; torch would otherwise take every core each.
    Only lowers the count, so a smaller OMP_NUM_THREADS still holds."""
    ctx = _task_context()
    if ctx is None:
        return
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), int(ctx.cpus()))))


# ---- batches ------------------------------------------------------------------------------


def process_batches(
    config: OperatorConfig, info: ModelInfo, tables: Iterator[pa.Table]
) -> Iterator[pa.Table]:
    """Streams the incoming tables through the engine in slices of `config.batch_size` rows
    (`operators/row_stream.py`: the engine is not drained between slices), each result in
    input order.

    Row errors stay in their rows. Any other failure drops the engine and raises a
    RuntimeError that fails the task, for Spark to retry.
    """
    ctx = _task_context()
    partition_id = ctx.partitionId() if ctx is not None else -1
    attempt = ctx.attemptNumber() if ctx is not None else 0

    def pieces() -> Iterator[tuple[int, pa.Table]]:
        index = 0
        for table in tables:
            for start in range(0, table.num_rows, config.batch_size):
                piece = table.slice(start, config.batch_size)
                fault_injection.on_spark_batch(partition_id, attempt, piece.num_rows)
                yield index, piece
                index += 1

    num_done = 0
    try:
        batches = pieces()
        first = next(batches, None)
        if first is None:  # an empty partition builds no engine
            return
        llm = get_engine(config)
        rows_in_flight = 2 * llm.llm_engine.config.scheduler.max_num_seqs
        batches = itertools.chain([first], batches)
        for _, out in stream_tables(llm, config.spec, batches, info, rows_in_flight=rows_in_flight):
            num_done += 1
            yield out
    except RowContractError:
        raise
    except Exception as e:
        drop_engine(config)
        raise RuntimeError(
            f"batchlm: model {config.model!r} failed in partition {partition_id}, attempt "
            f"{attempt}, after {num_done} batch(es) of {config.batch_size} rows: "
            f"{type(e).__name__}: {e}"
        ) from e


# ---- pandas UDFs --------------------------------------------------------------------------


def _series_table(names: tuple[str, ...], series: tuple[pd.Series, ...]) -> pa.Table:
    arrays = []
    for s in series:
        if hasattr(s, "columns"):  # a struct column reaches a pandas UDF as a DataFrame
            arrays.append(_struct_array(s))
            continue
        try:
            arrays.append(pa.Array.from_pandas(s))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # Mixed cells (numpy arrays of Rows, say): let the row contract judge each one.
            arrays.append(pa.array([_plain(v) for v in s], from_pandas=True))
    return pa.table(dict(zip(names, arrays, strict=True)))


def _struct_array(frame: pd.DataFrame) -> pa.StructArray:
    table = pa.Table.from_pandas(frame, preserve_index=False)
    null_rows = frame.isna().all(axis=1).to_numpy()
    return pa.StructArray.from_arrays(
        [table.column(c).combine_chunks() for c in table.column_names],
        names=table.column_names,
        mask=pa.array(null_rows) if null_rows.any() else None,
    )


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return [_plain(v) for v in value.tolist()]
    if hasattr(value, "asDict"):
        return value.asDict(recursive=True)
    return value


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    import pandas as pd

    # Nullable integer columns stay integers (numpy would turn them into floats with NaN).
    nullable = {pa.int32(): pd.Int32Dtype(), pa.int64(): pd.Int64Dtype()}
    return table.to_pandas(types_mapper=nullable.get)


def _make_udf(config: OperatorConfig, task: str, images: bool = False) -> Any:
    if config.spec.task != task:
        raise RowContractError(
            f"{task}_udf needs a config with task={task!r}, got task={config.spec.task!r}; "
            f"build it with OperatorConfig.create(model, {task!r}, ...)"
        )
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    info = config.model_info()
    fields = output_fields(config.spec, info)
    names = config.spec.input_columns
    if images:  # the image column comes right after the inputs
        names = (*names, config.spec.image_column)
    # Optional arguments after the inputs: generate / chat the row's own sampling params,
    # then its adapter; loglikelihood its adapter.
    spec = config.spec
    optional: tuple[str, ...] = ()
    if task in ("generate", "chat"):
        optional = (spec.sampling_params_column, spec.lora_column)
    elif task == "loglikelihood":
        optional = (spec.lora_column,)
    out_names = [f.name for f in fields]

    def run(batches: Iterator[Any]) -> Iterator[pd.DataFrame]:
        def tables() -> Iterator[pa.Table]:
            for batch in batches:
                series = tuple(batch) if isinstance(batch, tuple) else (batch,)
                if not len(names) <= len(series) <= len(names) + len(optional):
                    extra = f" and optionally {', '.join(optional)}" if optional else ""
                    raise RowContractError(
                        f"{task}_udf takes {len(names)} column(s) ({', '.join(names)}{extra}), "
                        f"got {len(series)}"
                    )
                yield _series_table((*names, *optional)[: len(series)], series)

        for out in process_batches(config, info, tables()):
            yield _to_pandas(out.select(out_names))

    return_type = spark_output_struct(config, info)

    def udf_fn(batches):  # type: ignore[no-untyped-def]
        return run(batches)

    # Real objects, not strings: pyspark reads the eval type (SCALAR_ITER) from them. A
    # multi-column call (score) hands the function tuples of series under the same type.
    udf_fn.__annotations__ = {"batches": Iterator[pd.Series], "return": Iterator[pd.DataFrame]}
    udf_fn.__name__ = f"batchlm_{task}"
    udf = pandas_udf(udf_fn, return_type)  # type: ignore[call-overload]
    udf.output_fields = fields
    udf.input_columns = names
    udf.embedding_dim = fields[0].type.list_size if task == "embed" else None
    return udf


def generate_udf(config: OperatorConfig, images: bool = False) -> Any:
    """A pandas UDF `(prompt[, sampling_params[, lora]]) → struct<generated_text: string,
    finish_reason: string, num_input_tokens: int, num_output_tokens: int, error: string>`;
    with `images`, `(prompt, image[, sampling_params[, lora]])`.

    The prompt column holds text or token ids; the optional second column each row's own
    sampling params (struct or JSON text, merged over `config`'s); the optional third each
    row's LoRA adapter (a name of `config`'s lora_modules, null for the base model; give
    `F.lit(None).cast("string")` as the second when rows have no params). The optional
    generation columns switched on in `config` (output_token_ids, output_logprobs,
    cumulative_logprob, prompt_logprobs) join the struct before `error`.
    `udf.output_fields` lists the struct's Arrow fields.

    With `images` (a vision-language model) the second column holds each row's image:
    encoded bytes (a `binaryFile` source's `content`), a path or URL, or null for none; the
    prompt holds the model's placeholder. A row whose image cannot be read gets `error`.

    Example: `df.withColumn("out", generate_udf(config)("prompt")).select("id", "out.*")`;
    with images, `generate_udf(config, images=True)("prompt", "content")`.
    """
    return _make_udf(config, "generate", images)


def chat_udf(config: OperatorConfig, images: bool = False) -> Any:
    """A pandas UDF `(messages[, sampling_params[, lora]]) → struct<generated_text,
    finish_reason, num_input_tokens, num_output_tokens, error>`, as `generate_udf`; messages
    are an array of {role, content} structs, or JSON text, rendered with the model's chat
    template (or `config`'s chat_template). With `images`, `(messages, image[, ...])`: the
    row's image goes first in its last user message, as in `generate_udf`.

    Example: `df.withColumn("out", chat_udf(config)("messages"))`.
    """
    return _make_udf(config, "chat", images)


def embed_udf(config: OperatorConfig) -> Any:
    """A pandas UDF `(text) → struct<embedding: array<float>, error: string>`; the
    dimension is `udf.embedding_dim` (the model's, or `pooling_params.dimensions`).

    Example: `df.withColumn("out", embed_udf(config)("text")).select("id", "out.embedding")`.
    """
    return _make_udf(config, "embed")


def score_udf(config: OperatorConfig) -> Any:
    """A pandas UDF `(text, text_pair) → struct<score: double, error: string>`: a
    cross-encoder's relevance, an embedding model's cosine, or a late-interaction model's
    MaxSim.

    Example: `df.withColumn("out", score_udf(config)("query", "document"))`.
    """
    return _make_udf(config, "score")


def classify_udf(config: OperatorConfig) -> Any:
    """A pandas UDF `(text) → struct<probs: array<float>, label: string, error: string>`:
    the class probabilities (`num_labels` of them) and the top label's name.

    Example: `df.withColumn("out", classify_udf(config)("review")).select("out.label")`.
    """
    return _make_udf(config, "classify")


def loglikelihood_udf(config: OperatorConfig) -> Any:
    """A pandas UDF `(context, continuation[, lora]) → struct<logprob: double, is_greedy:
    boolean, num_tokens: int, num_input_tokens: int, num_cached_tokens: int, error: string>`;
    the optional `lora` column names each row's adapter (null: the base model).

    Example: `df.withColumn("out", loglikelihood_udf(config)("question", "choice"))`.
    """
    return _make_udf(config, "loglikelihood")


# ---- whole DataFrames ---------------------------------------------------------------------


def map_in_arrow(df: DataFrame, config: OperatorConfig) -> DataFrame:
    """Every column of `df` followed by the task's output columns, via `mapInArrow`.

    Reads the task's columns by the names `config` gives (prompt, messages, text /
    text_pair, context / continuation), and the per-row `sampling_params`,
    `structured_outputs` and `lora` (adapter name) columns when `df` has them; generate /
    chat also read the image column when `df` has it (`image`, or `image_column`: say a
    `binaryFile` source's `content`), and leave it out of the output unless `keep_images`.
    The output schema is declared before any row runs: `df`'s schema + the task's fields (generate /
    chat: generated_text, finish_reason, num_input_tokens, num_output_tokens and the
    optional generation columns; embed: embedding array<float> with its length in the field
    metadata `FIXED_SIZE_KEY`; score: score; classify: probs, label; loglikelihood:
    logprob, is_greedy, num_tokens, num_input_tokens, num_cached_tokens), `error` last.

    Example:
        >>> map_in_arrow(spark.read.parquet("docs.parquet"), embed_config).write.parquet(out)
    """
    from pyspark.sql.types import StructType

    info = config.model_info()
    fields = output_fields(config.spec, info)
    check_columns(config.spec, df.columns)  # on the driver, before any task starts
    dropped = dropped_image_column(config.spec, df.columns)
    kept = [f for f in df.schema.fields if f.name != dropped]
    schema = StructType([*kept, *(spark_field(f) for f in fields)])
    casts = {f.name: _spark_arrow_type(f.type) for f in fields}

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        tables = (pa.Table.from_batches([b]) for b in batches)
        for out in process_batches(config, info, tables):
            target = pa.schema(
                [pa.field(f.name, casts.get(f.name, f.type), f.nullable) for f in out.schema]
            )
            yield from out.cast(target).to_batches()

    return df.mapInArrow(run, schema)


__all__ = [
    "FIXED_SIZE_KEY",
    "generate_udf",
    "chat_udf",
    "embed_udf",
    "score_udf",
    "classify_udf",
    "loglikelihood_udf",
    "map_in_arrow",
    "spark_type",
    "spark_field",
    "spark_output_struct",
    "get_engine",
    "process_batches",
]
