"""`LLM(...)` keyword arguments → a validated `EngineConfig`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .checkpoint_options import (
    allows_longer_context,
    apply_hf_overrides,
    embedding_size,
    generation_overrides,
    load_hf_config,
)
from .config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    GenerationDefaults,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    config_torch_dtype,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from .device_options import check_executor_backend, resolve_attention_backend, resolve_device
from .errors import InvalidParamError
from .loader import resolve_model
from .loader.resolve import resolve_tokenizer
from .multimodal.options import multimodal_config

logger = logging.getLogger(__name__)


@dataclass
class EngineArgs:
    """The options `LLM` accepts (vLLM's names). See the config classes for each meaning."""

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    max_model_len: int | None = None
    trust_remote_code: bool = False
    block_size: int | None = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool | None = True
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool | None = True
    async_scheduling: bool | None = None
    device: str = "auto"
    attention_backend: str | None = None
    enforce_eager: bool = False
    batch_invariant: bool = False
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    skip_tokenizer_init: bool = False
    chat_template: str | None = None
    disable_log_stats: bool = False
    metrics_port: int | None = None
    return_sampling_mask: bool = False
    runner: str = "auto"
    convert: str = "auto"
    quantization: str | None = None
    load_format: str = "auto"
    speculative_config: dict[str, Any] | None = None
    spec_method: str | None = None
    spec_model: str | None = None
    spec_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    generation_config: str = "auto"
    structured_outputs_config: dict[str, Any] | None = None
    scheduling_policy: str = "fcfs"
    enable_sleep_mode: bool = False
    distributed_executor_backend: str | None = None
    device_ids: list[int] | None = None
    tokens_only: bool = False
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = None
    override_generation_config: dict[str, Any] | None = None
    max_logprobs: int = 20
    pooler_config: Any = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str | torch.dtype = "auto"
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # vLLM's None for these means "the engine's default".
        if self.block_size is None:
            self.block_size = 16
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = True
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = True
        if self.max_model_len in (-1, "auto"):  # vLLM: the model's, where it fits
            self.max_model_len = None
        if self.tokens_only:
            self.skip_tokenizer_init = True
        if self.load_format == "safetensors":  # vLLM's name of what "auto" reads here
            self.load_format = "auto"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        """The options of `LLM(model, **kwargs)`: batchlm's fields, and every other option
        of vLLM's `EngineArgs` as `vllm_options.VLLM_OPTIONS` says (no effect, or refused
        unless at vLLM's default).

        Raises:
            TypeError: a keyword that is neither (it lists the valid ones).
            InvalidParamError: a vLLM option batchlm refuses, set to another value than
                vLLM's default (the message says what to use).
        """
        from .vllm_options import VLLM_OPTIONS, apply_vllm_option

        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known - set(VLLM_OPTIONS))
        if unknown:
            raise TypeError(
                f"LLM() got unknown keyword argument(s) {unknown}; valid ones: "
                f"{', '.join(sorted(known - {'model'}))} (and the other options of vLLM's "
                "EngineArgs, see batchlm.engine.vllm_options)"
            )
        for name in [n for n in kwargs if n not in known]:
            apply_vllm_option(name, kwargs.pop(name))
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        self.validate()
        if not isinstance(self.model, (str, Path)):
            raise InvalidParamError(f"model={self.model!r} must be a path or a model name")
        path = resolve_model(str(self.model), self.revision)
        tokenizer_path = self._tokenizer_path(path)
        hf_config = apply_hf_overrides(
            load_hf_config(path, self.trust_remote_code), self.hf_overrides
        )
        device, device_ids = resolve_device(self.device, self.device_ids, self.tensor_parallel_size)
        dtype = resolve_dtype(self.dtype, config_torch_dtype(hf_config), device)
        if self.dtype == "auto" and device.type == "cpu":
            logger.info("dtype='auto' on CPU runs float32: half-precision matmuls are slow on CPUs")
        runner_type = self._runner_type(hf_config)
        self._check_tensor_parallel(hf_config, runner_type, device)
        quantization = self._quantization(hf_config, runner_type, device)
        derived_len = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
        if getattr(hf_config, "model_type", "") in ("xlm-roberta", "roberta"):
            # Positions start after the padding index.
            derived_len -= int(getattr(hf_config, "pad_token_id", 1) or 1) + 1
        max_model_len = self.max_model_len or derived_len
        if max_model_len > derived_len and not allows_longer_context(hf_config):
            raise InvalidParamError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{derived_len}; lower it or use a model with rope scaling"
            )
        max_num_seqs = self.max_num_seqs or default_max_num_seqs(runner_type)
        max_batched = self.max_num_batched_tokens or max(
            default_max_num_batched_tokens(runner_type, device), max_num_seqs
        )
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise InvalidParamError(
                f"max_num_batched_tokens={max_batched} < max_model_len={max_model_len} needs "
                "chunked prefill; set enable_chunked_prefill=True or raise max_num_batched_tokens"
            )
        backend = resolve_attention_backend(self.attention_backend, device)
        check_executor_backend(self.distributed_executor_backend, self.tensor_parallel_size)
        speculative = self._speculative(runner_type, dtype, max_model_len, device)
        generation_defaults = self._generation_defaults(path, hf_config, runner_type)
        return EngineConfig(
            model=ModelConfig(
                model=str(self.model),
                path=str(path),
                tokenizer_path=str(tokenizer_path),
                hf_config=hf_config,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=self.seed,
                trust_remote_code=self.trust_remote_code,
                revision=self.revision,
                skip_tokenizer_init=self.skip_tokenizer_init,
                chat_template=self._chat_template(),
                runner_type=runner_type,
                convert=self.convert,
                quantization=quantization,
                generation_defaults=generation_defaults,
                load_format=self.load_format,
                enable_sleep_mode=self.enable_sleep_mode,
                max_logprobs=self.max_logprobs,
                pooler_config=self._pooler_config(runner_type),
                embedding_size=embedding_size(path, hf_config, runner_type),
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=self._kv_cache_dtype(runner_type),
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_batched,
                max_num_seqs=max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=self._async_scheduling(runner_type, device, speculative),
                policy=self.scheduling_policy,
            ),
            device=DeviceConfig(
                device=device,
                attention_backend=backend,
                enforce_eager=self.enforce_eager,
                batch_invariant=self.batch_invariant,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                disable_custom_all_reduce=self.disable_custom_all_reduce,
                device_ids=device_ids,
            ),
            disable_log_stats=self.disable_log_stats,
            metrics_port=self.metrics_port,
            return_sampling_mask=self.return_sampling_mask,
            speculative=speculative,
            structured_outputs=self._structured_outputs(runner_type),
            lora=self._lora(runner_type, dtype, speculative),
            multimodal=multimodal_config(self, path, hf_config, runner_type),
        )

    def _pooler_config(self, runner_type: str) -> PoolerConfig | None:
        from .pooling_params import parse_pooler_config

        config = parse_pooler_config(self.pooler_config)
        if config is not None and runner_type != "pooling":
            raise InvalidParamError(
                "pooler_config applies to pooling models; load the model with "
                "runner='pooling' (a generative checkpoint: convert='embed' or 'classify'), "
                "or drop pooler_config"
            )
        return config

    def _lora(
        self, runner_type: str, dtype: torch.dtype, speculative: SpeculativeConfig | None
    ) -> LoRAConfig | None:
        from .lora.options import DEFAULTS, parse_lora_options

        lora = parse_lora_options(
            self.enable_lora, {key: getattr(self, key) for key in DEFAULTS}, dtype
        )
        if lora is None:
            return None
        if runner_type != "generate":
            raise InvalidParamError(
                "enable_lora=True applies to generation; pooling models (embed / classify / "
                "score) run the base model: drop enable_lora"
            )
        if speculative is not None and speculative.method == "draft_model":
            raise InvalidParamError(
                "enable_lora=True with a draft model (method='draft_model'): the draft runs "
                "without the requests' adapters; use method='ngram' or drop enable_lora"
            )
        if self.batch_invariant:
            raise InvalidParamError(
                "batch_invariant=True does not cover LoRA adapters (their kernels split "
                "their sums by the step's size); drop one of the two"
            )
        return lora

    def _structured_outputs(self, runner_type: str) -> StructuredOutputsConfig:
        from .structured_output import parse_structured_outputs_config

        if self.structured_outputs_config and runner_type != "generate":
            raise InvalidParamError(
                "structured_outputs_config applies to generation models; pooling models "
                "(embed / classify / score) generate no text: drop it"
            )
        return parse_structured_outputs_config(self.structured_outputs_config)

    def _generation_defaults(
        self, path: Path, hf_config: Any, runner_type: str
    ) -> GenerationDefaults:
        """The checkpoint's end-of-generation ids and default sampling values, checked."""
        from .loader.generation_config import read_generation_defaults
        from .sampling_params import SamplingParams

        defaults = read_generation_defaults(self.generation_config, path, hf_config)
        if self.override_generation_config:
            defaults = dataclasses.replace(
                defaults,
                sampling={
                    **defaults.sampling,
                    **generation_overrides(self.override_generation_config),
                },
            )
        if runner_type != "generate" or not defaults.sampling:
            return defaults
        try:
            SamplingParams(**defaults.sampling)
        except (InvalidParamError, TypeError) as e:
            raise InvalidParamError(
                f"{defaults.source}: its sampling values {dict(defaults.sampling)} cannot be "
                f"defaults ({e}); fix the file, or pass generation_config='vllm' to ignore it"
            ) from None
        return defaults

    def _runner_type(self, hf_config: Any) -> str:
        from .errors import UnsupportedModelError
        from .models.registry import check_supported, is_generative, pooling_task_of

        if self.runner not in ("auto", "generate", "pooling"):
            raise InvalidParamError(
                f"runner={self.runner!r} is unknown; use 'auto', 'generate' or 'pooling'"
            )
        if self.convert not in ("auto", "none", "embed", "classify"):
            raise InvalidParamError(
                f"convert={self.convert!r} is unknown; use 'auto', 'none', 'embed' or 'classify'"
            )
        archs = getattr(hf_config, "architectures", None) or []
        arch = archs[0] if archs else ""
        check_supported(arch)
        generative = is_generative(arch)
        runner = self.runner
        if runner == "auto":
            runner = "generate" if generative and self.convert in ("auto", "none") else "pooling"
        if runner == "generate" and not generative:
            raise UnsupportedModelError(
                f"{arch or 'this model'} cannot generate text; load it with runner='pooling' "
                "(or runner='auto') and call embed / classify / score / encode"
            )
        if runner == "pooling":
            pooling_task_of(arch, self.convert)  # raises with how to load it otherwise
        return runner

    def _quantization(self, hf_config: Any, runner_type: str, device: torch.device):
        from .loader.quantization import resolve_quantization

        quantization = resolve_quantization(self.quantization, hf_config, device)
        if quantization is not None and runner_type != "generate":
            fix = (
                "drop quantization="
                if self.quantization is not None
                else "load a full-precision checkpoint"
            )
            raise InvalidParamError(
                f"quantization={quantization.method!r} applies to generation models; pooling "
                f"models (embed / classify / score) run in full precision: {fix}"
            )
        return quantization

    def _kv_cache_dtype(self, runner_type: str) -> torch.dtype | None:
        cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype)
        if cache_dtype == torch.float8_e4m3fn and runner_type != "generate":
            raise InvalidParamError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} applies to generation models; pooling "
                "models (embed / classify / score) keep no KV cache: drop kv_cache_dtype="
            )
        return cache_dtype

    def _async_scheduling(
        self, runner_type: str, device: torch.device, speculative: SpeculativeConfig | None
    ) -> bool:
        """None (auto): on for generation on CUDA without speculation."""
        if runner_type == "pooling":
            return False
        if self.async_scheduling is None:
            return device.type == "cuda" and speculative is None
        if self.async_scheduling and speculative is not None:
            raise InvalidParamError(
                "async_scheduling=True is not supported with speculative decoding (every "
                "step's drafts need the previous step's tokens on the host); drop "
                "async_scheduling or speculative_config"
            )
        return self.async_scheduling

    def _speculative(
        self, runner_type: str, dtype: torch.dtype, max_model_len: int, device: torch.device
    ) -> SpeculativeConfig | None:
        from .spec_decode.options import ALIASES, parse_speculative_options

        options = parse_speculative_options(
            self.speculative_config, {alias: getattr(self, alias) for alias in ALIASES}
        )
        if options is None:
            return None
        if runner_type != "generate":
            raise InvalidParamError(
                "speculative decoding applies to generation; pooling models (embed / classify "
                "/ score) run one forward per input: drop the speculative options"
            )
        if self.return_sampling_mask:
            raise InvalidParamError(
                "return_sampling_mask=True is not supported with speculative decoding; drop "
                "one of the two"
            )
        if options.num_speculative_tokens >= max_model_len:
            raise InvalidParamError(
                f"num_speculative_tokens={options.num_speculative_tokens} must be below "
                f"max_model_len={max_model_len}"
            )
        draft = None
        if options.method == "draft_model":
            if self.tensor_parallel_size > 1:
                raise InvalidParamError(
                    "method='draft_model' runs on one device; use tensor_parallel_size=1 or "
                    "method='ngram'"
                )
            draft = self._draft_model_config(options.model, dtype, max_model_len)
        return SpeculativeConfig(
            method=options.method,
            num_speculative_tokens=options.num_speculative_tokens,
            prompt_lookup_min=options.prompt_lookup_min,
            prompt_lookup_max=options.prompt_lookup_max,
            draft_model=draft,
        )

    def _draft_model_config(self, model: str, dtype: torch.dtype, max_model_len: int):
        from .errors import UnsupportedModelError
        from .models.registry import is_generative

        path = resolve_model(model)
        hf_config = load_hf_config(path, self.trust_remote_code)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs or not is_generative(archs[0]):
            raise UnsupportedModelError(
                f"draft model {model!r} ({archs[0] if archs else 'no architecture'}) cannot "
                f"generate; supported: {', '.join(_supported())}"
            )
        draft_len = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
        if draft_len < max_model_len and not allows_longer_context(hf_config):
            raise InvalidParamError(
                f"draft model {model!r} handles {draft_len} positions, fewer than "
                f"max_model_len={max_model_len}; lower max_model_len or use another draft"
            )
        return ModelConfig(
            model=model,
            path=str(path),
            tokenizer_path=str(path),
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
        )

    def _tokenizer_path(self, model_path: Path) -> Path:
        if not self.tokenizer:
            if self.tokenizer_revision is not None:
                return resolve_tokenizer(str(self.model), self.tokenizer_revision)
            return model_path
        return resolve_tokenizer(str(self.tokenizer), self.tokenizer_revision)

    def _chat_template(self) -> str | None:
        """The template text, read now from a file; a bare name stays as it is (one of the
        tokenizer's named templates, checked once the tokenizer is loaded)."""
        from .chat_utils import is_template_name, load_chat_template

        if self.chat_template is None or is_template_name(self.chat_template):
            return self.chat_template
        return load_chat_template(self.chat_template)

    def validate(self) -> None:
        """Checks every option's value on its own (no model file is read);
        `InvalidParamError` names the first bad one."""

        def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParamError(f"{name}={value!r} must be an integer >= 1")

        for name in (
            "trust_remote_code",
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "enforce_eager",
            "batch_invariant",
            "disable_custom_all_reduce",
            "skip_tokenizer_init",
            "disable_log_stats",
            "return_sampling_mask",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParamError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise InvalidParamError(
                f"async_scheduling={self.async_scheduling!r} must be True, False or None (auto)"
            )
        positive_int("block_size", self.block_size)
        positive_int("max_num_seqs", self.max_num_seqs, allow_none=True)
        positive_int("max_model_len", self.max_model_len, allow_none=True)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InvalidParamError(f"seed={self.seed!r} must be an integer")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise InvalidParamError(f"gpu_memory_utilization={util!r} must be in (0, 1]")
        port = self.metrics_port
        if port is not None:
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise InvalidParamError(
                    f"metrics_port={port!r} must be a port number in [0, 65535] (0: any free port)"
                )
            if self.disable_log_stats:
                raise InvalidParamError(
                    f"metrics_port={port} serves statistics, but disable_log_stats=True turns "
                    "them off; drop one of the two"
                )
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        for name in ("enable_sleep_mode", "tokens_only"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParamError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidParamError(
                f"scheduling_policy={self.scheduling_policy!r} is unknown; Input should be "
                "'fcfs' or 'priority'"
            )
        m = self.max_logprobs
        if isinstance(m, bool) or not isinstance(m, int) or m < -1:
            raise InvalidParamError(f"max_logprobs={m!r} must be an integer >= -1 (-1: no limit)")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidParamError(
                f"load_format={self.load_format!r} is not supported; use one of "
                f"{', '.join(map(repr, LOAD_FORMATS))}"
            )

    def _check_tensor_parallel(self, hf_config: Any, runner_type: str, device: torch.device):
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        if runner_type != "generate":
            raise InvalidParamError(
                f"tensor_parallel_size={tp}: pooling models (embed / classify / score) run on "
                "one device; use tensor_parallel_size=1"
            )
        if device.type == "cuda" and torch.cuda.device_count() < tp:
            raise InvalidParamError(
                f"tensor_parallel_size={tp} needs {tp} GPUs, {torch.cuda.device_count()} "
                "visible; lower it or expose more devices (CUDA_VISIBLE_DEVICES)"
            )
        from .models.llama import check_tensor_parallel

        try:
            check_tensor_parallel(hf_config, tp)
        except ValueError as e:
            raise InvalidParamError(str(e)) from e


SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's `scheduling_policy` values (see `SchedulerConfig.policy`)."""

LOAD_FORMATS = ("auto", "dummy")
"""`auto`: the checkpoint's safetensors files; `dummy`: random weights, from config.json alone."""

LARGE_GPU_BYTES = 70 * 2**30
"""GPUs with at least this much memory (H100, H200, ...) get the larger default budget."""


def default_max_num_seqs(runner_type: str) -> int:
    """Most sequences at once when none is given: 256 requests for generation (vLLM's
    default), 4096 inputs per forward for pooling (short texts: the token budget, not the
    count, should bound a batch)."""
    return 256 if runner_type == "generate" else 4096


def default_max_num_batched_tokens(runner_type: str, device: torch.device) -> int:
    """The step token budget when none is given: on a GPU with at least 70 GiB, 16384 for
    generation (fewer, larger prefill steps, a little faster) and 32768 for pooling (an
    encoder's forward of short texts is too small to fill the GPU below that); else 8192.
    See docs/performance.md."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_properties(index).total_memory >= LARGE_GPU_BYTES:
            return 16384 if runner_type == "generate" else 32768
    return 8192


def _supported() -> list[str]:
    from .models.registry import supported_architectures

    return supported_architectures()
