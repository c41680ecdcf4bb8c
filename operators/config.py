"""`OperatorConfig`: one engine task over table rows, shared by the Ray and Spark front ends.

It names the model and engine options (what `LLM(...)` takes), the row contract's task and
params (`RowSpec`), and how the front end batches and parallelises. It is plain data, so it
travels to actors and Python workers and hashes to a stable key.

Example:
    >>> config = OperatorConfig.create(
    ...     "sentence-transformers/all-MiniLM-L6-v2", "embed", batch_size=256, concurrency=2
    ... )
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .lora_rows import adapter_engine_kwargs, add_adapters, lora_engine_kwargs
from .rows import ModelInfo, RowContractError, RowSpec, stable_hash

_ROW_FIELDS = {f.name for f in fields(RowSpec) if f.init}


@dataclass(frozen=True)
class OperatorConfig:
    """Everything an engine stage needs; build it with `OperatorConfig.create(...)`."""

    model: str
    """A local folder, a `.gguf` file or a model name that resolves offline."""
    spec: RowSpec
    """The task, its input columns and its sampling / pooling params."""
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments for `LLM(model, **engine_kwargs)` (dtype, max_model_len, ...)."""
    batch_size: int = 64
    """Rows per batch handed to the engine stage."""
    concurrency: int | tuple[int, int] = 1
    """Engine replicas (Ray actors; Spark: partitions at once), each loading the model once;
    `(min, max)` lets Ray autoscale the actor pool between the two (Spark takes the max)."""
    num_gpus: float | None = None
    """GPUs per replica; None: `tensor_parallel_size` on a CUDA machine, else 0."""
    max_batch_retries: int = 2
    """Times a batch is retried on a fresh engine after an engine failure (not a bad row)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise RowContractError(f"model={self.model!r} must be a non-empty path or name")
        if not _is_count(self.batch_size):
            raise RowContractError(f"batch_size={self.batch_size!r} must be an integer >= 1")
        concurrency = self.concurrency
        if isinstance(concurrency, list):  # YAML and JSON have no tuples
            concurrency = tuple(concurrency)
            object.__setattr__(self, "concurrency", concurrency)
        if isinstance(concurrency, tuple):
            if (
                len(concurrency) != 2
                or not all(map(_is_count, concurrency))
                or (concurrency[0] > concurrency[1])
            ):
                raise RowContractError(
                    f"concurrency={concurrency!r} must be an integer >= 1 or (min, max) with "
                    "1 <= min <= max"
                )
        elif not _is_count(concurrency):
            raise RowContractError(
                f"concurrency={concurrency!r} must be an integer >= 1 or (min, max) with "
                "1 <= min <= max"
            )
        if self.max_batch_retries < 0:
            raise RowContractError(f"max_batch_retries={self.max_batch_retries} must be >= 0")
        if "model" in self.engine_kwargs:
            raise RowContractError("engine_kwargs must not repeat 'model'; pass it as model=")
        lora_engine_kwargs(self.engine_kwargs, self.spec.adapters)  # enable_lora=False refused

    @classmethod
    def create(
        cls,
        model: str,
        task: str,
        *,
        engine_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> OperatorConfig:
        """Row-contract fields (`prompt_column`, `sampling_params`, ...) and the stage's own
        fields (`batch_size`, `concurrency`, ...) in one call.

        Args:
            model: A local folder, a .gguf file, a name that resolves offline, or a store
                URI (`s3://bucket/models/name/`).
            task: generate, chat, embed, score, classify or loglikelihood.
            engine_kwargs: `LLM(model, **engine_kwargs)` options (default none).
            **kwargs: the stage's options: batch_size (64), concurrency (1), num_gpus
                (None), max_batch_retries (2) (and, for `ProcessorConfig`,
                max_tasks_per_actor, ray_remote_args, stats_dir); the row contract's
                (`RowSpec`): the input columns (prompt_column "prompt", messages_column
                "messages", text_column "text", text_pair_column "text_pair",
                context_column "context", continuation_column "continuation"), the params
                (sampling_params, pooling_params, structured_outputs, truncate_prompt_tokens,
                chat_template, chat_template_kwargs; all None), the per-row columns
                (sampling_params_column "sampling_params", structured_outputs_column
                "structured_outputs"), the optional generation columns
                (output_token_ids, output_logprobs, cumulative_logprob, prompt_logprobs;
                all False), and LoRA adapters (lora_modules None: `{name: folder}`;
                lora_column "lora": each row's adapter name, null for the base model),
                and images (image_column "image": each generate / chat row's image;
                keep_images False: the image column is left out of the output).
                docs/operators.md says what each does.

        Raises:
            RowContractError: an unknown option (the valid ones are listed) or a bad value.
        """
        row = {k: kwargs.pop(k) for k in list(kwargs) if k in _ROW_FIELDS}
        own = {f.name for f in fields(cls)} - {"model", "spec", "engine_kwargs"}
        unknown = sorted(set(kwargs) - own)
        if unknown:
            valid = sorted(own | _ROW_FIELDS - {"task"})
            raise RowContractError(
                f"unknown option(s) {unknown}; valid: {', '.join(valid)} "
                "(engine options go in engine_kwargs)"
            )
        return cls(
            model=model,
            spec=RowSpec(task=task, **row),
            engine_kwargs=dict(engine_kwargs or {}),
            **kwargs,
        )

    @property
    def max_concurrency(self) -> int:
        """The most engine replicas: `concurrency`, or its max."""
        c = self.concurrency
        return c[1] if isinstance(c, tuple) else c

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size", 1) or 1)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["spec"] = self.spec.to_dict()
        out["engine_kwargs"] = dict(self.engine_kwargs)
        return out

    def fingerprint(self) -> str:
        """Stable across processes: the key for engine caches and job manifests."""
        return stable_hash(self.to_dict())

    def engine_fingerprint(self) -> str:
        """What determines the engine itself (model, engine options and the adapters given
        to it), not the rows."""
        engine = [self.model, dict(self.engine_kwargs)]
        if self.spec.lora_modules is not None:
            engine.append(dict(self.spec.lora_modules))
        return stable_hash(engine)

    def build_llm(self, **overrides: Any) -> Any:
        """`LLM(model, **engine_kwargs, **overrides)`, with the LoRA options `lora_modules`
        needs and every adapter given to it (`lora_rows.py`): a bad adapter fails here,
        before any row runs."""
        from batchlm.engine import LLM

        adapters = self.spec.adapters
        llm = LLM(
            self.model, **{**adapter_engine_kwargs(self.engine_kwargs, adapters), **overrides}
        )
        add_adapters(llm, adapters)
        return llm

    def model_info(self) -> ModelInfo:
        """Reads the model's config (no weights) for the declared output schema; a model on
        a store is read from a copy of its files without the weights (the engines fetch
        the whole folder where they run)."""
        from batchlm.engine.engine_args import EngineArgs
        from batchlm.engine.loader.remote import download_model, is_remote

        model = self.model
        if is_remote(model):
            model = str(download_model(model, config_only=True, progress=False))
        engine_kwargs = lora_engine_kwargs(self.engine_kwargs, self.spec.adapters)
        args = EngineArgs.from_kwargs(model, **engine_kwargs)
        return ModelInfo.from_hf_config(args.create_engine_config().model.hf_config)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


__all__ = ["OperatorConfig"]
