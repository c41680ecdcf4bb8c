"""Engine configuration: frozen dataclasses built once from `LLM(...)` keyword arguments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import InvalidParamError

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """The checkpoint's end-of-generation ids and default sampling values."""

    eos_token_ids: tuple[int, ...] = ()
    """Ids that end a request besides the tokenizer's EOS (unless `ignore_eos`)."""
    sampling: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """`SamplingParams` field → default value, for calls that pass no params."""
    source: str | None = None
    """The file the values were read from (None: none was read)."""


@dataclass(frozen=True)
class QuantizationConfig:
    """How the decoder's linear layers are quantized (see `loader/quantization.py`)."""

    method: str
    """`fp8` (e4m3 weights, per-token fp8 activations where the device multiplies fp8) or
    `int8` (weight-only), both with one scale per output channel; or `int4` (weight-only,
    read from GPTQ / AWQ / compressed-tensors checkpoints, scales per group of inputs)."""
    from_checkpoint: bool = False
    """The checkpoint holds the quantized weights and their scales (its config.json has a
    `quantization_config`); otherwise full-precision weights are quantised at load."""
    checkpoint_method: str | None = None
    """`quant_method` of the checkpoint's `quantization_config` (`fp8`, `compressed-tensors`)."""
    ignored_modules: tuple[str, ...] = ()
    """Checkpoint module names (or `re:` patterns) the checkpoint keeps in full precision."""
    weight_format: str | None = None
    """`int4`: how the checkpoint packs its weights (`gptq`, `gptq_v2`, `awq`,
    `pack-quantized`; see `loader/int4_formats.py`)."""
    group_size: int | None = None
    """`int4`: input features per scale group (None: one group per output channel)."""
    symmetric: bool = True
    """`int4`: the checkpoint's zero point is the midpoint 8 (no zero points stored)."""
    act_order: bool = False
    """`int4`: the groups follow an order of the input features given per layer
    (GPTQ's `desc_act`, compressed-tensors' `actorder: group`)."""
    quantized_modules: tuple[str, ...] = ()
    """`int4` compressed-tensors: the config groups' `targets` (`Linear`, names or `re:`
    patterns); empty: every linear layer not ignored."""


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling model's engine-wide pooling (`LLM(pooler_config=...)`, vLLM's keys)."""

    task: str | None = None
    """The task the model serves (`embed`, `classify`, `token_embed`); None: the model's."""
    pooling_type: str | None = None
    """`CLS`, `MEAN` or `LAST` over each input's tokens; None: the checkpoint's
    (sentence-transformers' Pooling module, else the model's default)."""
    use_activation: bool | None = None
    """The default of `PoolingParams.use_activation` (normalised embeddings, softmax /
    sigmoid probabilities); None: True."""
    dimensions: int | None = None
    """The default of `PoolingParams.dimensions` (matryoshka truncation)."""


@dataclass(frozen=True)
class ModelConfig:
    """What model runs and at which precision / length."""

    model: str
    """What the user passed as `model=`: a local folder, a .gguf file or a hub-style name."""
    path: str
    """The resolved local Hugging Face-style folder the weights and config are read from."""
    tokenizer_path: str
    """Folder of the tokenizer files (the model folder unless `tokenizer=` was given)."""
    hf_config: Any = field(repr=False, compare=False)
    """The transformers `PretrainedConfig` of the model."""
    dtype: torch.dtype
    """Weights and activations dtype. `auto` picks the checkpoint's dtype on CUDA and float32
    on CPU (half-precision matmuls are slow on most CPUs)."""
    max_model_len: int
    """Most tokens (prompt + output) one sequence may hold; defaults to the model's
    `max_position_embeddings`."""
    seed: int
    """Seed of the engine's generator for requests without their own seed."""
    trust_remote_code: bool = False
    """Accepted for vLLM parity; batchlm never runs code that ships with a checkpoint."""
    revision: str | None = None
    """Snapshot of a hub-style name in the local Hugging Face cache (None: `main`)."""
    skip_tokenizer_init: bool = False
    """Run without a tokenizer: prompts must be token ids and outputs carry no text."""
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's (`LLM(chat_template=...)`)."""
    runner_type: str = "generate"
    """`generate` (KV cache, scheduler, sampler) or `pooling` (embed / classify / score)."""
    convert: str = "auto"
    """For pooling: `embed` or `classify` turns a generative checkpoint into that task."""
    quantization: QuantizationConfig | None = None
    """Quantized linear layers (`quantization=`, or what the checkpoint declares); None runs
    every layer in `dtype`."""
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    """End-of-generation ids and default sampling values from the checkpoint's generation
    config (`generation_config=`; empty with "vllm")."""
    load_format: str = "auto"
    """`auto` reads the checkpoint's safetensors files; `dummy` (vLLM's name) builds the
    model from config.json alone with seeded random weights, reading no weight file (for
    trying out shapes, profiling and tests)."""
    enable_sleep_mode: bool = False
    """`LLM.sleep` may free the engine's device memory (weights to host memory or dropped,
    KV cache and CUDA graphs freed) and `wake_up` restore it, as in vLLM."""
    max_logprobs: int = 20
    """Most `logprobs` / `prompt_logprobs` a request may ask for (vLLM's default 20; -1: no
    limit)."""
    pooler_config: PoolerConfig | None = None
    """Pooling models: the engine-wide pooling type and request defaults
    (`LLM(pooler_config=...)`); None keeps the checkpoint's."""
    embedding_size: int = 0
    """Width of the model's embeddings (config.json's `embedding_size`, else the last
    sentence-transformers Dense module's output, else the hidden size)."""

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    # ---- vLLM's ModelConfig readers (scripts read these from `llm.model_config`) -------

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def hf_text_config(self) -> Any:
        """The language model's config (already the text config for multimodal folders)."""
        return self.hf_config

    @property
    def tokenizer(self) -> str:
        """The tokenizer's folder."""
        return self.tokenizer_path

    @property
    def served_model_name(self) -> str:
        return self.model

    @property
    def is_matryoshka(self) -> bool:
        return bool(getattr(self.hf_config, "matryoshka_dimensions", None)) or bool(
            getattr(self.hf_config, "is_matryoshka", False)
        )

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        return getattr(self.hf_config, "matryoshka_dimensions", None)

    def get_vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def get_hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)

    def get_head_size(self) -> int:
        hf = self.hf_config
        head_dim = getattr(hf, "head_dim", None)
        return int(head_dim or hf.hidden_size // hf.num_attention_heads)

    def get_total_num_kv_heads(self) -> int:
        hf = self.hf_config
        return int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)

    def get_total_num_hidden_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    def get_sliding_window(self) -> int | None:
        return getattr(self.hf_config, "sliding_window", None)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The default sampling values that differ from `SamplingParams()`'s (the
        generation config's, with `override_generation_config` applied)."""
        return dict(self.generation_defaults.sampling)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block; 16 balances fragmentation against block-table length."""
    gpu_memory_utilization: float = 0.9
    """On CUDA: fraction of the device memory the engine may use (weights, activations and
    KV cache together); the KV cache gets what is left after a profiling forward, and no
    more than the device has free (other processes and engines keep what they use)."""
    kv_cache_memory_bytes: int | None = None
    """Explicit KV cache size in bytes (overrides gpu_memory_utilization). On CPU the default
    is 2 GiB, capped to what max_num_seqs full-length sequences can use."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (tests and debugging)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    cache_dtype: torch.dtype | None = None
    """dtype of the KV cache; None follows the model dtype. `float8_e4m3fn` (vLLM's
    `kv_cache_dtype="fp8"`) stores keys and values with scale 1.0, clamped to ±448: half the
    bytes of a 16-bit cache, so twice the blocks and half the KV reads per decode step."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 8192
    """Token budget of one engine step (prefill chunks plus decode tokens)."""
    max_num_seqs: int = 256
    """Most requests running at once (pooling: most inputs in one forward)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    async_scheduling: bool = False
    """Schedule and launch step N+1 before step N's tokens reach the host: the tokens a
    request has not seen yet are read on the device, and step N's outputs are processed
    while N+1 runs (see `LLMEngine.step`)."""
    policy: str = "fcfs"
    """`fcfs`: waiting requests start in order of arrival, and a full KV cache preempts
    the newest running one. `priority`: waiting requests start by their `priority` (lower
    first), ties by arrival, and a full KV cache preempts the running request with the
    largest (priority, arrival), as in vLLM."""


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs."""

    device: torch.device
    """`cuda` when available, else `cpu`; `device=` overrides."""
    attention_backend: str
    """`torch` (the reference, any device) or `triton` (CUDA)."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    batch_invariant: bool = False
    """Compute every request's logits the same way whatever else runs beside it (other
    requests, their order, prompt chunking, prefix-cache hits): batch-invariant matmuls,
    norms and attention, and tensor-parallel sums in rank order. Greedy and seeded tokens
    and logprobs are then bitwise reproducible; it costs some speed on the GPU
    (docs/performance.md)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over devices."""

    tensor_parallel_size: int = 1
    """Ranks the model's heads, MLP and vocabulary are split over, one process each (rank 0
    is the calling process, ranks 1.. are spawned); one GPU per rank on CUDA, gloo over the
    CPU cores otherwise. 1 runs everything in this process."""

    disable_custom_all_reduce: bool = False
    """Reduce every tensor with NCCL. By default, on GPUs with peer access to each other,
    small tensors (decode steps) are reduced by one kernel reading the peers' memory."""

    device_ids: tuple[int, ...] = ()
    """On CUDA, the device of each rank (rank r on `cuda:device_ids[r]`), from
    `device="cuda:2,3"`; empty: rank r on `cuda:r`."""

    def rank_device(self, device: torch.device, rank: int) -> torch.device:
        """Where rank `rank` runs, given the engine's device."""
        if device.type != "cuda":
            return device
        return torch.device("cuda", self.device_ids[rank] if self.device_ids else rank)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decode step verifies draft tokens with the target model
    (see `spec_decode/`)."""

    method: str
    """`ngram` (prompt lookup: the tokens that followed an earlier occurrence of the
    sequence's last n-gram) or `draft_model` (a smaller model with the same tokenizer)."""
    num_speculative_tokens: int
    """Most draft tokens verified per request and step; a step then computes up to this
    many positions more per request and yields up to this many tokens more."""
    prompt_lookup_min: int = 1
    """ngram: shortest n-gram matched."""
    prompt_lookup_max: int = 1
    """ngram: longest n-gram matched (tried first)."""
    draft_model: ModelConfig | None = None
    """draft_model: the draft, run in the target's dtype with its own KV cache (same blocks)."""


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The grammar engine behind `SamplingParams.structured_outputs`
    (`LLM(structured_outputs_config={...})`, vLLM's keys)."""

    backend: str = "auto"
    """`xgrammar`, `guidance` (llguidance), or `auto`: xgrammar, and guidance for what only
    it serves (`whitespace_pattern`) or when xgrammar is not installed."""
    disable_any_whitespace: bool = False
    """Every JSON request as if it set `disable_any_whitespace` (no whitespace between
    JSON tokens)."""
    disable_additional_properties: bool = False
    """Every JSON request as if it set `disable_additional_properties`."""


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served per request (`LLM(enable_lora=True, ...)`, vLLM's names; see
    `lora/`)."""

    max_loras: int = 1
    """Most distinct adapters in one step: the device slots their weights are copied into.
    Requests of further adapters wait until a slot's requests are done."""
    max_lora_rank: int = 16
    """The slots' rank: adapters of a higher rank are refused, lower ones zero-padded.
    Each step computes at this rank, so keep it at the largest rank served."""
    max_cpu_loras: int = 1
    """Parsed adapters kept in host memory (least recently used dropped past it), so that
    an adapter coming back to a slot is not read from disk again; at least `max_loras`."""
    lora_dtype: torch.dtype = torch.float32
    """dtype of the adapters' weights on the device (`auto`: the model's)."""


@dataclass(frozen=True)
class MultiModalConfig:
    """Images in prompts, for a vision-language model (`LLM(limit_mm_per_prompt=...,
    mm_processor_kwargs=...)`, vLLM's names; see `multimodal/`)."""

    hf_config: Any = field(repr=False, compare=False)
    """The checkpoint's whole transformers config (vision tower, projector, placeholder
    token); `ModelConfig.hf_config` is its language model's."""
    image_token_id: int
    """The placeholder token of an image in a prompt (config.json's `image_token_index`)."""
    max_images_per_prompt: int | None = None
    """Most images one prompt may carry (`limit_mm_per_prompt={"image": n}`); None: any."""
    processor_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Keyword arguments of every call to the checkpoint's processor; a prompt's own
    `mm_processor_kwargs` override them."""
    mrope_merge_size: int | None = None
    """M-RoPE models (Qwen2-VL): the vision tower's spatial merge, which turns an image's
    patch grid into its placeholder grid, whose (t, h, w) indices are the tokens' positions
    (`multimodal/mrope.py`); None: positions are token indices."""
    encoder_cache_rows: int = 16384
    """Vision-tower output rows (one per placeholder token) kept for images no running
    request needs any more, least recently used dropped past it: a later prompt with the
    same image (same content hash) skips the tower."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    disable_log_stats: bool = False
    """Skip collecting statistics: no metrics (`get_metrics`), no `RequestOutput.metrics`,
    no periodic statistics log. `LLM` turns it on unless asked otherwise, as vLLM does."""
    metrics_port: int | None = None
    """Serve the engine's Prometheus registry over HTTP on this port (0: any free port);
    None serves nothing. For long jobs scraped by Prometheus."""
    return_sampling_mask: bool = False
    """Return, per generated token, the token ids that survived top-k / top-p / min-p."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding; None decodes one token per request and step."""
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    """The grammar engine of requests with `structured_outputs` (compiled when one first
    asks for it: an engine that never sees one never imports it)."""
    lora: LoRAConfig | None = None
    """LoRA adapters per request; None: `lora_request` is refused."""
    multimodal: MultiModalConfig | None = None
    """Images in prompts; None for a text-only model (`multi_modal_data` is refused)."""


def resolve_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None, device: torch.device):
    """Turn `dtype=` into a torch dtype (see ModelConfig.dtype for what `auto` means)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidParamError(
                f"dtype={dtype} is not supported; use float32, float16 or bfloat16"
            )
        return dtype
    if not isinstance(dtype, str):
        raise InvalidParamError(f"dtype={dtype!r} must be a string such as 'auto' or 'bfloat16'")
    key = dtype.lower()
    if key == "auto":
        # CPU: float32, because half-precision matmuls are slow on most CPUs.
        if device.type == "cpu":
            return torch.float32
        # CUDA: the checkpoint's dtype, with float32 checkpoints run in float16 (as vLLM does).
        if config_dtype is None or config_dtype == torch.float32:
            return torch.float16
        return config_dtype
    if key not in _DTYPES:
        raise InvalidParamError(
            f"dtype={dtype!r} is not supported; use one of 'auto', {', '.join(map(repr, _DTYPES))}"
        )
    return _DTYPES[key]


_FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype) -> torch.dtype | None:
    """Turn `kv_cache_dtype=` into the cache's torch dtype; None (for `auto`) follows the
    model dtype. Accepts vLLM's `auto`, `fp8` and `fp8_e4m3`, and the float names of
    `dtype=`."""
    valid = f"'auto', 'fp8', 'fp8_e4m3', {', '.join(map(repr, _DTYPES))}"
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype in _DTYPES.values() or kv_cache_dtype == torch.float8_e4m3fn:
            return kv_cache_dtype
        raise InvalidParamError(
            f"kv_cache_dtype={kv_cache_dtype} is not supported; use one of {valid}"
        )
    if not isinstance(kv_cache_dtype, str):
        raise InvalidParamError(
            f"kv_cache_dtype={kv_cache_dtype!r} must be a string such as 'auto' or 'fp8'"
        )
    key = kv_cache_dtype.lower()
    if key == "auto":
        return None
    if key in _FP8_KV_DTYPES:
        return _FP8_KV_DTYPES[key]
    if key in _DTYPES:
        return _DTYPES[key]
    if key.startswith("fp8"):
        raise InvalidParamError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported: the fp8 KV cache is e4m3 "
            "only; use kv_cache_dtype='fp8' (or 'fp8_e4m3')"
        )
    raise InvalidParamError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of {valid}"
    )


def config_torch_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype a checkpoint's config declares, if any (`dtype`; `torch_dtype` in
    transformers before 4.56, read only where it is a plain attribute: later versions
    keep it as a deprecated alias of `dtype` that logs a warning when read)."""
    value = getattr(hf_config, "dtype", None)
    if value is None:
        value = vars(hf_config).get("torch_dtype")
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return _DTYPES.get(value.lower())
    return None
