"""Every `EngineArgs` option of vLLM 0.26, and what `LLM(...)` does with it.

A script written for vLLM passes its options to `LLM(...)` unchanged (or all of them at
once, `LLM(**vars(engine_args))`). Each vLLM option is one of:

- `SAME`: a field of batchlm's `EngineArgs`, with vLLM's meaning (its docstring there, or
  the config field it fills, says what it does);
- `NO_EFFECT`: accepted whatever its value; `reason` says why nothing in batchlm would
  change (a value other than vLLM's default is logged once, with the reason);
- `REFUSED`: accepted at vLLM's default (or a value in `accepted` that means the same
  here); any other value raises `InvalidParamError` with `reason`: why, and what to use.

`VLLM_OPTIONS` is the one table; `EngineArgs.from_kwargs` consults it for every keyword
that is not one of its own fields, and `tests/engine/test_vllm_options.py` walks vLLM's
list of names against it.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from .errors import InvalidParamError

logger = logging.getLogger(__name__)


class Treatment(enum.Enum):
    SAME = "same"
    NO_EFFECT = "no effect"
    REFUSED = "refused"


@dataclass(frozen=True)
class VllmOption:
    """How `LLM(...)` treats one of vLLM's options."""

    treatment: Treatment
    reason: str = ""
    """NO_EFFECT: why nothing changes; REFUSED: why, and what to use instead."""
    accepted: tuple[Any, ...] = ()
    """Values taken without effect besides vLLM's default (None, False, 0, an empty
    string or container, which always mean "not set"); REFUSED and NO_EFFECT only."""


_SAME = VllmOption(Treatment.SAME)


def _no_effect(reason: str, *accepted: Any) -> VllmOption:
    return VllmOption(Treatment.NO_EFFECT, reason, accepted)


def _refused(reason: str, *accepted: Any) -> VllmOption:
    return VllmOption(Treatment.REFUSED, reason, accepted)


_MULTIMODAL = (
    "images go through the checkpoint's Hugging Face processor in the calling process and "
    "the vision tower's outputs are cached by content hash; video and audio are refused"
)
_DATA_PARALLEL = (
    "data parallelism is one LLM per device: run one LLM per process, or the Ray Data / "
    "Spark operators (batchlm.operators), which place one engine per worker"
)
_EXPERT_PARALLEL = "mixture-of-experts layers split their experts over tensor_parallel_size ranks"
_ONE_NODE = "an engine runs on one machine; its ranks rendezvous over a local TCP store"
_LORA_SHARDING = (
    "under tensor parallelism each rank holds its part of every adapter's A and B, split "
    "with the layer they adapt"
)
_LORA_KERNELS = "the LoRA kernels run only for the adapters of each step, whatever their number"
_LORA_TARGETS = (
    "an adapter applies to the modules its adapter_config.json targets; to leave some "
    "out, save the adapter without them (peft's target_modules)"
)
_LORA_EXPERTS = (
    "LoRA on mixture-of-experts experts is refused by name; adapters apply to attention and "
    "dense / shared-expert MLPs"
)
_OBSERVABILITY = (
    "batchlm's statistics are its Prometheus metrics (disable_log_stats=False, metrics_port)"
)
_LOADING = "weights are read from safetensors files by batchlm's own loader"
_NO_DOWNLOAD = (
    "batchlm never downloads: a hub-style name is looked up in the local Hugging Face "
    "cache (HF_HUB_CACHE) or a model package"
)
_KERNELS = (
    "batchlm runs its own Triton kernels (attention_backend='triton' or 'torch' picks "
    "the attention)"
)
_MAMBA = "batchlm has no Mamba / state-space models"
_CONTEXT_PARALLEL = "context parallelism is not supported; use tensor_parallel_size"

VLLM_OPTIONS: dict[str, VllmOption] = {
    # ---- model and tokenizer ----------------------------------------------------------
    "tokenizer": _SAME,
    "hf_config_path": _refused(
        "config.json is read from the model folder; pass a folder holding both as model="
    ),
    "model_weights": _refused(
        "weights are read from the model folder; pass a folder with config.json and the "
        "safetensors files as model="
    ),
    "served_model_name": _no_effect("it names the model in an API server, and there is none"),
    "runner": _SAME,
    "convert": _SAME,
    "skip_tokenizer_init": _SAME,
    "tokens_only": _SAME,
    "enable_prompt_embeds": _refused("prompt embeddings are not supported; pass text or token ids"),
    "tokenizer_mode": _refused(
        "the tokenizer is always transformers' fast tokenizer of the model (tokenizer_mode "
        "'auto' or 'hf')",
        "auto",
        "hf",
    ),
    "trust_remote_code": _SAME,
    "allowed_local_media_path": _no_effect(_MULTIMODAL),
    "allowed_media_domains": _no_effect(_MULTIMODAL),
    "download_dir": _refused(_NO_DOWNLOAD + "; pass the model's local folder as model="),
    "safetensors_load_strategy": _no_effect(_LOADING),
    "safetensors_prefetch_num_threads": _no_effect(_LOADING),
    "safetensors_prefetch_block_size": _no_effect(_LOADING),
    "load_format": _SAME,
    "config_format": _refused(
        "config.json is read in Hugging Face's format (config_format 'auto' or 'hf')",
        "auto",
        "hf",
    ),
    "dtype": _SAME,
    "kv_cache_dtype": _SAME,
    "seed": _SAME,
    "max_model_len": _SAME,
    "revision": _SAME,
    "code_revision": _no_effect("code shipped with a checkpoint never runs in batchlm"),
    "hf_token": _no_effect(_NO_DOWNLOAD),
    "hf_overrides": _SAME,
    "model_class_overrides": _refused(
        "the model class is picked from config.json's architectures by batchlm's registry"
    ),
    "tokenizer_revision": _SAME,
    "quantization": _SAME,
    "quantization_config": _refused(
        "name the method with quantization= ('fp8' or 'int8'), or load a checkpoint whose "
        "config.json has a quantization_config"
    ),
    "allow_deprecated_quantization": _no_effect("batchlm has no deprecated quantization methods"),
    "generation_config": _SAME,
    "override_generation_config": _SAME,
    "model_impl": _refused(
        "models always run batchlm's own implementations (model_impl 'auto' or 'vllm')",
        "auto",
        "vllm",
    ),
    "language_model_only": _no_effect(
        "multimodal checkpoints already run as their language model on text"
    ),
    "enable_return_routed_experts": _refused(
        "outputs carry no mixture-of-experts routing; drop the option"
    ),
    "logits_processors": _refused(
        "custom logits processors are not supported; use SamplingParams' logit_bias, "
        "allowed_token_ids, bad_words or structured_outputs"
    ),
    "max_logprobs": _SAME,
    "logprobs_mode": _refused(
        "logprobs are the model's raw log-probabilities (logprobs_mode='raw_logprobs')",
        "raw_logprobs",
    ),
    "use_fp64_gumbel": _no_effect("sampling draws its random numbers its own way"),
    "pooler_config": _SAME,
    "io_processor_plugin": _refused("pooling IO plugins are not supported"),
    "diffusion_config": _refused("diffusion language models are not supported"),
    # ---- parallelism and placement ----------------------------------------------------
    "distributed_executor_backend": _SAME,
    "pipeline_parallel_size": _refused(
        "pipeline parallelism is not supported; split the model with tensor_parallel_size",
        1,
    ),
    "tensor_parallel_size": _SAME,
    "device_ids": _SAME,
    "master_addr": _no_effect(_ONE_NODE, "127.0.0.1"),
    "master_port": _no_effect(_ONE_NODE + " on a free port", 29501),
    "nnodes": _refused(_ONE_NODE, 1),
    "node_rank": _refused(_ONE_NODE),
    "distributed_timeout_seconds": _no_effect(
        "the ranks' timeout is the environment variable BATCHLM_TP_TIMEOUT_S"
    ),
    "cpu_distributed_timeout_seconds": _no_effect(
        "the ranks' timeout is the environment variable BATCHLM_TP_TIMEOUT_S"
    ),
    "numa_bind": _no_effect("ranks are not pinned to NUMA nodes"),
    "numa_bind_nodes": _no_effect("ranks are not pinned to NUMA nodes"),
    "numa_bind_cpus": _no_effect("ranks are not pinned to NUMA nodes"),
    "prefill_context_parallel_size": _refused(_CONTEXT_PARALLEL, 1),
    "decode_context_parallel_size": _refused(_CONTEXT_PARALLEL, 1),
    "dcp_comm_backend": _no_effect(_CONTEXT_PARALLEL, "ag_rs"),
    "dcp_kv_cache_interleave_size": _no_effect(_CONTEXT_PARALLEL, 1),
    "cp_kv_cache_interleave_size": _no_effect(_CONTEXT_PARALLEL, 1),
    "data_parallel_size": _refused(_DATA_PARALLEL, 1),
    "data_parallel_rank": _refused(_DATA_PARALLEL),
    "data_parallel_start_rank": _refused(_DATA_PARALLEL),
    "data_parallel_size_local": _refused(_DATA_PARALLEL, 1),
    "data_parallel_address": _no_effect(_DATA_PARALLEL),
    "data_parallel_rpc_port": _no_effect(_DATA_PARALLEL),
    "data_parallel_hybrid_lb": _no_effect(_DATA_PARALLEL),
    "data_parallel_external_lb": _no_effect(_DATA_PARALLEL),
    "data_parallel_multi_port_external_lb": _no_effect(_DATA_PARALLEL),
    "data_parallel_backend": _no_effect(_DATA_PARALLEL, "mp"),
    "disable_nccl_for_dp_synchronization": _no_effect(_DATA_PARALLEL),
    "enable_expert_parallel": _refused(_EXPERT_PARALLEL),
    "enable_ep_weight_filter": _no_effect(_EXPERT_PARALLEL),
    "all2all_backend": _no_effect(_EXPERT_PARALLEL, "allgather_reducescatter"),
    "enable_elastic_ep": _refused(_EXPERT_PARALLEL),
    "eplb_config": _no_effect(_EXPERT_PARALLEL),
    "enable_eplb": _refused(_EXPERT_PARALLEL),
    "expert_placement_strategy": _no_effect(_EXPERT_PARALLEL, "linear"),
    "enable_dbo": _refused("dual-batch overlap is not supported; drop the option"),
    "ubatch_size": _no_effect("micro-batches exist only under dual-batch overlap"),
    "dbo_decode_token_threshold": _no_effect("dual-batch overlap is not supported", 32),
    "dbo_prefill_token_threshold": _no_effect("dual-batch overlap is not supported", 512),
    "max_parallel_loading_workers": _no_effect("each rank loads its own shard of the weights"),
    "disable_custom_all_reduce": _SAME,
    "ray_workers_use_nsight": _no_effect("ranks are processes batchlm spawns, not Ray workers"),
    "worker_cls": _refused(
        "ranks run batchlm's Worker; reach it with collective_rpc (a callable gets the "
        "worker as its first argument)",
        "auto",
    ),
    "worker_extension_cls": _refused(
        "ranks run batchlm's Worker; extend it with collective_rpc and a callable, which "
        "gets the worker as its first argument"
    ),
    # ---- KV cache, memory and scheduling ----------------------------------------------
    "block_size": _SAME,
    "enable_prefix_caching": _SAME,
    "prefix_caching_hash_algo": _no_effect(
        "prefix-cache blocks are keyed by a chained hash of their tokens, whatever "
        "algorithm is named",
        "sha256",
    ),
    "prefix_match_unit": _no_effect("prefix-cache hits land on block boundaries"),
    "disable_sliding_window": _refused(
        "sliding-window layers always attend within their window; to cap the context, "
        "set max_model_len"
    ),
    "disable_cascade_attn": _no_effect("batchlm has no cascade attention", True),
    "gpu_memory_utilization": _SAME,
    "kv_cache_memory_bytes": _SAME,
    "num_gpu_blocks_override": _SAME,
    "max_num_batched_tokens": _SAME,
    "max_num_seqs": _SAME,
    "max_num_scheduled_tokens": _no_effect(
        "a step schedules at most max_num_batched_tokens tokens, draft tokens included"
    ),
    "max_num_partial_prefills": _refused(
        "the scheduler's prompt chunking follows the token budget alone", 1
    ),
    "max_long_partial_prefills": _refused(
        "the scheduler's prompt chunking follows the token budget alone", 1
    ),
    "long_prefill_token_threshold": _refused(
        "the scheduler's prompt chunking follows the token budget alone; lower "
        "max_num_batched_tokens for smaller chunks"
    ),
    "enable_chunked_prefill": _SAME,
    "disable_chunked_mm_input": _no_effect(_MULTIMODAL),
    "scheduler_reserve_full_isl": _no_effect(
        "a waiting request is admitted with the blocks of its first chunk; a full cache "
        "preempts (recomputes) the newest request",
        True,
    ),
    "prefill_schedule_interval": _refused(_DATA_PARALLEL, 1),
    "watermark": _refused(
        "no blocks are kept free when admitting requests; lower max_num_seqs to admit fewer at once"
    ),
    "disable_hybrid_kv_cache_manager": _no_effect("one KV cache manager serves every layer"),
    "scheduling_policy": _SAME,
    "scheduler_cls": _refused("the scheduler is batchlm's own"),
    "async_scheduling": _SAME,
    "stream_interval": _no_effect("offline calls return whole outputs", 1),
    "cpu_offload_gb": _refused(
        "weights stay on the device; lower the footprint with quantization='fp8' / 'int8' "
        "or split the model with tensor_parallel_size"
    ),
    "cpu_offload_params": _no_effect("weights are not offloaded to the CPU"),
    "offload_backend": _no_effect("weights are not offloaded to the CPU", "auto"),
    "offload_group_size": _refused(
        "weights stay on the device; lower the footprint with quantization='fp8' / 'int8' "
        "or split the model with tensor_parallel_size"
    ),
    "offload_num_in_group": _no_effect("weights are not offloaded to the CPU", 1),
    "offload_prefetch_step": _no_effect("weights are not offloaded to the CPU", 1),
    "offload_params": _no_effect("weights are not offloaded to the CPU"),
    "kv_offloading_size": _refused(
        "the KV cache stays on the device; size it with gpu_memory_utilization or "
        "kv_cache_memory_bytes"
    ),
    "kv_offloading_backend": _no_effect("the KV cache is not offloaded", "native"),
    "kv_sharing_fast_prefill": _refused("cross-layer KV sharing is not supported; drop the option"),
    "calculate_kv_scales": _refused(
        "the fp8 KV cache (kv_cache_dtype='fp8') stores keys and values with scale 1.0"
    ),
    "kv_cache_dtype_skip_layers": _refused(
        "kv_cache_dtype applies to every layer; drop kv_cache_dtype_skip_layers"
    ),
    "kv_transfer_config": _refused("KV cache transfer between engines is not supported"),
    "kv_events_config": _refused("KV cache events are not published"),
    "ec_transfer_config": _refused("encoder cache transfer is not supported"),
    "enable_sleep_mode": _SAME,
    "enable_cumem_allocator": _no_effect(
        "sleep mode (enable_sleep_mode=True) frees and restores the engine's tensors "
        "itself; no custom allocator is needed"
    ),
    # ---- execution, kernels and compilation -------------------------------------------
    "enforce_eager": _SAME,
    "cudagraph_capture_sizes": _no_effect(
        "decode graphs are captured for a ladder of batch sizes up to max_num_seqs "
        "(enforce_eager=True turns them off)"
    ),
    "max_cudagraph_capture_size": _no_effect(
        "decode graphs are captured for a ladder of batch sizes up to max_num_seqs "
        "(enforce_eager=True turns them off)"
    ),
    "compilation_config": _no_effect(
        "nothing is compiled with torch.compile; CUDA graphs follow enforce_eager"
    ),
    "optimization_level": _no_effect("nothing is compiled with torch.compile", 2, "O2"),
    "performance_mode": _no_effect("there is one execution mode", "balanced"),
    "attention_backend": _SAME,
    "attention_config": _no_effect("the attention follows attention_backend ('triton' or 'torch')"),
    "override_attention_dtype": _refused("attention runs in the model's dtype (dtype=)"),
    "kernel_config": _no_effect(_KERNELS),
    "moe_backend": _refused(_KERNELS, "auto"),
    "linear_backend": _refused(_KERNELS, "auto"),
    "ir_op_priority": _no_effect(_KERNELS),
    "enable_flashinfer_autotune": _no_effect(_KERNELS),
    "enable_bf16x3_router_gemm": _no_effect(_KERNELS),
    "gdn_prefill_backend": _no_effect(_KERNELS),
    "additional_config": _no_effect("batchlm has no platform plugins to pass it to"),
    "fail_on_environ_validation": _no_effect(
        "batchlm reads only its own BATCHLM_* variables (engine/envs.py)"
    ),
    "shutdown_timeout": _no_effect("shutdown() stops the ranks at once"),
    "weight_transfer_config": _refused(
        "weight transfer from a trainer is not supported; rebuild the LLM on the new "
        "weights, or put it to sleep meanwhile (enable_sleep_mode=True)"
    ),
    "model_loader_extra_config": _no_effect(_LOADING),
    "ignore_patterns": _no_effect(
        "only the model folder's *.safetensors files are read", ["original/**/*"]
    ),
    "use_tqdm_on_load": _no_effect("loading shows no progress bar", True),
    "pt_load_map_location": _no_effect(_LOADING, "cpu"),
    # ---- structured outputs, speculation, reasoning ------------------------------------
    "structured_outputs_config": _SAME,
    "reasoning_parser": _refused(
        "reasoning parsers are not supported: structured outputs constrain the whole "
        "output, reasoning included"
    ),
    "reasoning_parser_plugin": _refused("reasoning parsers are not supported"),
    "reasoning_config": _no_effect("reasoning parsers are not supported"),
    "speculative_config": _SAME,
    "spec_method": _SAME,
    "spec_model": _SAME,
    "spec_tokens": _SAME,
    # ---- statistics and tracing --------------------------------------------------------
    "disable_log_stats": _SAME,
    "aggregate_engine_logging": _no_effect("there is one engine per LLM"),
    "show_hidden_metrics_for_version": _no_effect(_OBSERVABILITY),
    "otlp_traces_endpoint": _no_effect("no OpenTelemetry traces are exported"),
    "collect_detailed_traces": _no_effect("no OpenTelemetry traces are exported"),
    "kv_cache_metrics": _no_effect(_OBSERVABILITY),
    "kv_cache_metrics_sample": _no_effect(_OBSERVABILITY, 0.01),
    "cudagraph_metrics": _no_effect(_OBSERVABILITY),
    "enable_layerwise_nvtx_tracing": _no_effect("no NVTX ranges are emitted"),
    "enable_mfu_metrics": _no_effect(_OBSERVABILITY),
    "enable_logging_iteration_details": _no_effect(_OBSERVABILITY),
    "jit_monitor_mode": _no_effect("nothing is compiled with torch.compile", "warn"),
    "jit_monitor_verbose": _no_effect("nothing is compiled with torch.compile"),
    "enable_mm_processor_stats": _no_effect(_MULTIMODAL),
    # ---- LoRA -----------------------------------------------------------------------------
    "enable_lora": _SAME,
    "max_loras": _SAME,
    "max_lora_rank": _SAME,
    "max_cpu_loras": _SAME,
    "lora_dtype": _SAME,
    "default_mm_loras": _no_effect(_MULTIMODAL),
    "enable_tower_connector_lora": _no_effect(_MULTIMODAL),
    "fully_sharded_loras": _no_effect(_LORA_SHARDING),
    "specialize_active_lora": _no_effect(_LORA_KERNELS),
    "lora_target_modules": _refused(_LORA_TARGETS),
    "enable_mixed_moe_lora_format": _refused(_LORA_EXPERTS),
    "enable_moe_shared_loras": _refused(_LORA_EXPERTS),
    # ---- multimodal ------------------------------------------------------------------------
    "limit_mm_per_prompt": _SAME,
    "enable_mm_embeds": _no_effect(_MULTIMODAL),
    "interleave_mm_strings": _no_effect(_MULTIMODAL),
    "media_io_kwargs": _no_effect(_MULTIMODAL),
    "mm_processor_kwargs": _SAME,
    "mm_processor_cache_gb": _no_effect(_MULTIMODAL, 4),
    "mm_processor_cache_type": _no_effect(_MULTIMODAL, "lru"),
    "mm_shm_cache_max_object_size_mb": _no_effect(_MULTIMODAL, 128),
    "mm_encoder_only": _refused(_MULTIMODAL),
    "mm_encoder_tp_mode": _no_effect(_MULTIMODAL, "weights"),
    "mm_encoder_attn_backend": _no_effect(_MULTIMODAL),
    "mm_encoder_attn_dtype": _no_effect(_MULTIMODAL),
    "mm_encoder_fp8_scale_path": _no_effect(_MULTIMODAL),
    "mm_encoder_fp8_scale_save_path": _no_effect(_MULTIMODAL),
    "mm_encoder_fp8_scale_save_margin": _no_effect(_MULTIMODAL, 1.5),
    "skip_mm_profiling": _no_effect(_MULTIMODAL),
    "video_pruning_rate": _no_effect(_MULTIMODAL),
    "mm_tensor_ipc": _no_effect(_MULTIMODAL, "direct_rpc"),
    "mm_ipc_gpu_memory_gb": _no_effect(_MULTIMODAL),
    "renderer_num_workers": _no_effect(
        "prompts are tokenized in one batched call (large pooling calls in worker "
        "processes: BATCHLM_TOKENIZE_WORKERS); vLLM's offline LLM ignores it too",
        1,
    ),
    # ---- Mamba ----------------------------------------------------------------------------
    "mamba_config": _no_effect(_MAMBA),
    "mamba_cache_dtype": _no_effect(_MAMBA, "auto"),
    "mamba_ssm_cache_dtype": _no_effect(_MAMBA, "auto"),
    "mamba_block_size": _no_effect(_MAMBA),
    "mamba_cache_mode": _no_effect(_MAMBA, "none"),
    "mamba_backend": _no_effect(_MAMBA, "triton"),
    "enable_mamba_cache_stochastic_rounding": _no_effect(_MAMBA),
    "mamba_cache_philox_rounds": _no_effect(_MAMBA),
    # ---- profiling ---------------------------------------------------------------------
    "profiler_config": _no_effect(
        "batchlm has no built-in profiler; benchmarks/tools/ holds its step profilers"
    ),
}
"""vLLM 0.26's `EngineArgs` field name → its treatment here (vLLM's private
`_api_process_*` fields and `model` itself aside)."""


def is_unset(value: Any, option: VllmOption) -> bool:
    """Whether `value` leaves the option as vLLM's default would (nothing to do)."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return True
    if isinstance(value, (str, list, tuple, set, frozenset, dict)) and not value:
        return True
    if isinstance(value, enum.Enum):
        value = value.value
    return any(
        value == a and isinstance(value, bool) == isinstance(a, bool) for a in option.accepted
    )


_logged: set[str] = set()


def apply_vllm_option(name: str, value: Any) -> None:
    """Take a vLLM option that batchlm's `EngineArgs` has no field for.

    Raises:
        InvalidParamError: a REFUSED option set to a value other than vLLM's default.
        KeyError: `name` is not one of vLLM's options (or is one of batchlm's own).
    """
    option = VLLM_OPTIONS[name]
    if option.treatment is Treatment.SAME:
        raise KeyError(name)
    if is_unset(value, option):
        return
    if option.treatment is Treatment.REFUSED:
        raise InvalidParamError(f"LLM({name}={value!r:.80}) is not supported: {option.reason}")
    if name not in _logged:
        _logged.add(name)
        logger.warning("LLM(%s=%.80r) has no effect in batchlm: %s", name, value, option.reason)


def options_of(treatment: Treatment) -> list[str]:
    """The names of vLLM's options treated so, in table order."""
    return [name for name, option in VLLM_OPTIONS.items() if option.treatment is treatment]
