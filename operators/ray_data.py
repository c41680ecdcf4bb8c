"""Ray Data operators: engine actors for `Dataset.map_batches` and `build_processor`.

Each actor builds its engine once and keeps it for every batch. Its `__call__` is a
coroutine: Ray Data hands an actor several batches at once (up to four per task, and
`max_tasks_per_actor` tasks), each batch queues its rows into the one engine
(`EngineLoop`) and is answered as soon as its own rows are done, so the engine stays full.

Rows may carry their own sampling params (a `sampling_params` struct or JSON column, merged
over the config's: see `rows.py`) and their own LoRA adapter (a `lora` column of names of the
config's `lora_modules`: see `lora_rows.py`; each actor's engine is given every adapter when
it is built).

Failures: a row the engine refuses gets its message in `error` and the job goes on. Any
other engine exception rebuilds the engine inside the actor and retries the batches that
were in it; an actor process that dies is restarted by Ray and its task retried. Both are
bounded by `max_batch_retries`; past it the job fails with the last error.

`ray` itself is imported only where Ray runs: importing this module does not load it.

Example:
    >>> import ray.data
    >>> config = ProcessorConfig.create(
    ...     "HuggingFaceTB/SmolLM2-135M-Instruct", "generate",
    ...     sampling_params={"max_tokens": 32, "temperature": 0}, batch_size=32,
    ... )
    >>> processor = build_processor(config, preprocess=lambda r: {**r, "prompt": r["q"]})
    >>> processor(ray.data.read_parquet("in/")).write_parquet("out/")

    The actor on its own (what `build_processor` does for the engine stage):
    >>> ds.map_batches(GenerateActor, **map_batches_kwargs(config))
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import socket
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from . import fault_injection
from .config import OperatorConfig
from .engine_loop import EngineFailedError, EngineLoop
from .rows import RowContractError, output_fields, output_schema

if TYPE_CHECKING:
    from ray.data import Dataset

Row = dict[str, Any]


@dataclass(frozen=True)
class ProcessorConfig(OperatorConfig):
    """The Ray Data engine stage: `OperatorConfig` plus what only Ray needs. Build it with
    `ProcessorConfig.create(model, task, engine_kwargs=None, **options)`; docs/operators.md
    has the same list with each option's meaning.

    Attributes (default):
        model: (required) a local folder, a .gguf file, a name that resolves offline, or a
            store URI (s3://..., fetched once per machine).
        task: (required) generate, chat, embed, score, classify or loglikelihood.
        engine_kwargs ({}): LLM(model, **engine_kwargs) options.
        batch_size (64): rows per map_batches batch.
        concurrency (1): engine actors, or (min, max) for an autoscaling pool.
        num_gpus (None): GPUs per actor; None: tensor_parallel_size on a GPU cluster, else 0.
        max_batch_retries (2): retries of a batch on a rebuilt engine after an engine failure.
        max_tasks_per_actor (2): tasks one actor runs at once, sharing its engine.
        ray_remote_args ({}): actor options (num_cpus, memory, resources, runtime_env, ...).
        stats_dir (None): a folder for each actor's counts.
        Row contract (RowSpec): prompt_column ("prompt"), messages_column ("messages"),
            text_column ("text"), text_pair_column ("text_pair"), context_column
            ("context"), continuation_column ("continuation"), sampling_params (None),
            sampling_params_column ("sampling_params"), structured_outputs (None),
            structured_outputs_column ("structured_outputs"), pooling_params (None),
            truncate_prompt_tokens (None), chat_template (None), chat_template_kwargs
            (None), output_token_ids (False), output_logprobs (False), cumulative_logprob
            (False), prompt_logprobs (False), lora_modules (None: LoRA adapters as
            {name: folder or store URI}), lora_column ("lora": each row's adapter name,
            null for the base model), image_column ("image": each generate / chat row's
            image), keep_images (False: the image column is left out of the output).

    Example:
        >>> config = ProcessorConfig.create(
        ...     "sentence-transformers/all-MiniLM-L6-v2", "embed", batch_size=128,
        ...     concurrency=2, ray_remote_args={"num_cpus": 2},
        ... )
    """

    max_tasks_per_actor: int = 2
    """Ray tasks (input bundles) one actor runs at once. Each streams its batches into the
    same engine, so a second task keeps the engine busy while the first one's tail ends."""
    ray_remote_args: Mapping[str, Any] = field(default_factory=dict)
    """Extra actor options (`num_cpus`, `memory`, `resources`, `runtime_env`, or any option
    of `ray.remote`); they win over the ones derived here."""
    stats_dir: str | None = None
    """If set, every actor writes its counts (engine builds, batches, rows, most batches in
    the engine at once) to a JSON file there after each batch."""

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.max_tasks_per_actor
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RowContractError(f"max_tasks_per_actor={value!r} must be an integer >= 1")


# ---- actors ---------------------------------------------------------------------------------


class EngineActor:
    """A callable class for `ds.map_batches`: one engine per actor, batches overlapping.

    Args:
        config: The model, engine options, task and batching (`OperatorConfig` or
            `ProcessorConfig`).
        stats_dir: Where to write this actor's counts (default: `config.stats_dir`).
    """

    task: str | None = None
    """The task this class runs; None: whatever `config.spec.task` says."""

    def __init__(
        self,
        config: OperatorConfig,
        *,
        stats_dir: str | None = None,
    ) -> None:
        if self.task is not None and config.spec.task != self.task:
            raise RowContractError(
                f"{type(self).__name__} runs task {self.task!r}, but the config's task is "
                f"{config.spec.task!r}; use {actor_class(config.spec.task).__name__}"
            )
        self.config = config
        self._loop = EngineLoop(
            config.build_llm, config.spec, max_batch_retries=config.max_batch_retries
        )
        self._num_calls = 0
        stats_dir = stats_dir or getattr(config, "stats_dir", None)
        self._stats_path: Path | None = None
        if stats_dir:
            name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
            self._stats_path = Path(stats_dir) / name
            self._stats_path.parent.mkdir(parents=True, exist_ok=True)
            self._write_stats()

    async def __call__(self, batch: Any) -> pa.Table:
        """The batch (Arrow, pandas or a dict of columns) with the task's output columns."""
        table = _to_table(batch)
        self._num_calls += 1
        fault_injection.on_actor_call(self._num_calls, self._loop)
        out = await asyncio.wrap_future(self._loop.submit(table))
        self._write_stats()
        return out

    def stats(self) -> dict[str, Any]:
        """This actor's counts: `num_calls` plus the engine loop's `EngineLoopStats`."""
        return {"pid": os.getpid(), "num_calls": self._num_calls, **self._loop.stats.to_dict()}

    def shutdown(self) -> None:
        """Finishes queued batches and releases the engine."""
        self._loop.close()

    def _write_stats(self) -> None:
        if self._stats_path is None:
            return
        tmp = self._stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats()))
        os.replace(tmp, self._stats_path)


class GenerateActor(EngineActor):
    """Completions for a prompt column (`generated_text`, `finish_reason`, token counts)."""

    task = "generate"


class ChatActor(EngineActor):
    """Completions for a chat-messages column, rendered with the model's chat template."""

    task = "chat"


class EmbedActor(EngineActor):
    """Embeddings of a text column as `fixed_size_list<float32>[d]`."""

    task = "embed"


class ScoreActor(EngineActor):
    """Similarity / relevance scores of text against text_pair."""

    task = "score"


class ClassifyActor(EngineActor):
    """Class probabilities and the top label of a text column."""

    task = "classify"


class LoglikelihoodActor(EngineActor):
    """Log-likelihoods of continuation after context (`logprob`, `is_greedy`, token counts);
    rows sharing a context compute it once (prefix cache)."""

    task = "loglikelihood"


_ACTORS: dict[str, type[EngineActor]] = {
    cls.task: cls
    for cls in (
        GenerateActor,
        ChatActor,
        EmbedActor,
        ScoreActor,
        ClassifyActor,
        LoglikelihoodActor,
    )
}


def actor_class(task: str) -> type[EngineActor]:
    """The actor class for a task (`generate` → `GenerateActor`, ...)."""
    try:
        return _ACTORS[task]
    except KeyError:
        raise RowContractError(
            f"task={task!r} is unknown; use one of {', '.join(_ACTORS)}"
        ) from None


def _to_table(batch: Any) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, Mapping):
        return pa.table(dict(batch))
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return pa.Table.from_pandas(batch, preserve_index=False)
    raise TypeError(f"batches must be Arrow tables, pandas frames or dicts, got {type(batch)}")


# ---- the stage ------------------------------------------------------------------------------


def default_num_gpus(config: OperatorConfig) -> float:
    """`config.num_gpus`, else `tensor_parallel_size` where there are GPUs, else 0."""
    if config.num_gpus is not None:
        return float(config.num_gpus)
    return float(config.tensor_parallel_size) if _has_gpus() else 0.0


def _has_gpus() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


# Actor resources that `map_batches` takes as parameters of its own (its `**ray_remote_args`
# are deprecated from Ray 2.60); other actor options reach it through `ray_remote_args_fn`.
_NAMED_RESOURCES = (
    "num_cpus",
    "num_gpus",
    "memory",
    "resources",
    "accelerator_type",
    "runtime_env",
    "label_selector",
)


def map_batches_kwargs(config: OperatorConfig, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `ds.map_batches(<Task>Actor, **kwargs)`.

    The actor pool has `concurrency` actors, or autoscales between `(min, max)`. Ray
    restarts a dead actor (`max_restarts=-1`) and retries its task at most
    `max_batch_retries` times (`max_task_retries`), so a batch that kills its actor every
    time fails the job instead of looping. Resources go through `map_batches`' own
    parameters (`num_gpus`, `num_cpus`, `memory`, ...), other actor options through
    `ray_remote_args_fn`.
    """
    from ray.data import ActorPoolStrategy

    max_tasks = getattr(config, "max_tasks_per_actor", 2)
    extra = dict(getattr(config, "ray_remote_args", {}) or {})
    actor_options = {"max_restarts": -1, "max_task_retries": config.max_batch_retries}
    actor_options.update({k: v for k, v in extra.items() if k not in _NAMED_RESOURCES})
    kwargs: dict[str, Any] = {
        "fn_constructor_kwargs": {"config": config},
        "batch_size": config.batch_size,
        "batch_format": "pyarrow",
        "num_gpus": default_num_gpus(config),
        "ray_remote_args_fn": functools.partial(dict, actor_options),
    }
    kwargs.update({k: v for k, v in extra.items() if k in _NAMED_RESOURCES})
    concurrency = config.concurrency
    lo, hi = concurrency if isinstance(concurrency, tuple) else (concurrency, concurrency)
    pool = {"size": lo} if lo == hi else {"min_size": lo, "max_size": hi}
    if "max_concurrent_calls_per_actor" in inspect.signature(ActorPoolStrategy).parameters:
        compute = ActorPoolStrategy(**pool, max_concurrent_calls_per_actor=max_tasks)
    else:  # Ray before 2.5x: the actor option itself
        compute = ActorPoolStrategy(**pool)
        actor_options["max_concurrency"] = max_tasks
    kwargs["compute"] = compute
    kwargs.update(overrides)
    if "concurrency" in kwargs and "compute" not in overrides:
        del kwargs["compute"]  # the caller sized the pool the older way
    return kwargs


class Processor:
    """`Dataset → Dataset`: optional preprocess map, the engine stage, optional postprocess.

    The engine stage's columns are the declared ones (`output_fields`), whatever the rows.
    """

    def __init__(
        self,
        config: OperatorConfig,
        preprocess: Callable[[Row], Row] | None = None,
        postprocess: Callable[[Row], Row] | None = None,
        **map_batches_overrides: Any,
    ) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.map_batches_overrides = map_batches_overrides

    def __call__(self, ds: Dataset) -> Dataset:
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        with warnings.catch_warnings():
            # Ray 2.60 deprecates `ray_remote_args_fn` but has no named parameter for the
            # actor options it carries (bounded `max_task_retries`); resources are named.
            warnings.filterwarnings("ignore", message=".*ray_remote_args_fn.*deprecated")
            ds = ds.map_batches(
                actor_class(self.config.spec.task),
                **map_batches_kwargs(self.config, **self.map_batches_overrides),
            )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds

    def output_fields(self) -> list[pa.Field]:
        """The columns the engine stage adds, `error` last (reads the model's config)."""
        return output_fields(self.config.spec, self.config.model_info())

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        """The engine stage's schema for rows of `input_schema` (after preprocess)."""
        return output_schema(self.config.spec, self.config.model_info(), input_schema)


def build_processor(
    config: OperatorConfig,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
    **map_batches_overrides: Any,
) -> Processor:
    """A `Dataset → Dataset` callable running `config`'s task over every row.

    The engine stage is `ds.map_batches(<Task>Actor, ...)` over a pool of
    `config.concurrency` actors (or an autoscaling pool between `(min, max)`), each with
    `config.num_gpus` GPUs (default: `tensor_parallel_size` on a GPU cluster, else 0) and
    one engine built once, shared by `max_tasks_per_actor` tasks at a time. Every input
    column passes through; the task's columns are appended with the declared types
    (`Processor.output_schema`), `error` last: null, or why that row failed (the other rows
    run). An engine failure retries the batch on a rebuilt engine, a dead actor is
    restarted, each at most `max_batch_retries` times.

    Args:
        config: `ProcessorConfig` (or a plain `OperatorConfig`: Ray defaults).
        preprocess: Row → row before the engine (e.g. build the prompt column).
        postprocess: Row → row after it (e.g. parse `generated_text`).
        **map_batches_overrides: Extra `map_batches` arguments for the engine stage.

    Example:
        >>> processor = build_processor(config, postprocess=lambda r: {"id": r["id"],
        ...     "answer": r["generated_text"], "error": r["error"]})
        >>> processor(ray.data.read_parquet("in/")).write_parquet("out/")
    """
    actor_class(config.spec.task)  # an unknown task fails here, not in an actor
    return Processor(config, preprocess, postprocess, **map_batches_overrides)


__all__ = [
    "ProcessorConfig",
    "EngineActor",
    "GenerateActor",
    "ChatActor",
    "EmbedActor",
    "ScoreActor",
    "ClassifyActor",
    "LoglikelihoodActor",
    "EngineFailedError",
    "Processor",
    "actor_class",
    "build_processor",
    "default_num_gpus",
    "map_batches_kwargs",
]
