"""Every option of vLLM 0.26's `EngineArgs` is taken by `LLM(...)`: with the same meaning
(a field of batchlm's `EngineArgs`), accepted and logged as having no effect, or refused
unless at vLLM's default, naming what to use; never an unknown-keyword TypeError. The
names and defaults below are vLLM 0.26.0's (`vllm/engine/arg_utils.py`, `EngineArgs`,
with vLLM's config objects at their defaults written as `{}`), so that a change on
either side fails here. Also the new options' meanings, and the attributes scripts read
(`llm.model_config`, `llm.llm_engine.model_config`, `get_tokenizer()`)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.device_options import resolve_attention_backend, resolve_device
from batchlm.engine.engine_args import EngineArgs
from batchlm.engine.errors import InvalidParamError
from batchlm.engine.vllm_options import VLLM_OPTIONS, Treatment, is_unset, options_of

# vLLM 0.26.0's EngineArgs fields (less `model` and its private `_api_process_*`), in its
# order, with their defaults.
VLLM_026_DEFAULTS = {
    "enable_return_routed_experts": False,
    "model_weights": "",
    "served_model_name": None,
    "tokenizer": None,
    "hf_config_path": None,
    "runner": "auto",
    "convert": "auto",
    "skip_tokenizer_init": False,
    "enable_prompt_embeds": False,
    "tokenizer_mode": "auto",
    "trust_remote_code": False,
    "allowed_local_media_path": "",
    "allowed_media_domains": None,
    "download_dir": None,
    "safetensors_load_strategy": None,
    "safetensors_prefetch_num_threads": None,
    "safetensors_prefetch_block_size": None,
    "load_format": "auto",
    "config_format": "auto",
    "dtype": "auto",
    "kv_cache_dtype": "auto",
    "seed": 0,
    "max_model_len": None,
    "cudagraph_capture_sizes": None,
    "max_cudagraph_capture_size": None,
    "ir_op_priority": {},
    "distributed_executor_backend": None,
    "pipeline_parallel_size": 1,
    "master_addr": "127.0.0.1",
    "master_port": 29501,
    "nnodes": 1,
    "node_rank": 0,
    "distributed_timeout_seconds": None,
    "cpu_distributed_timeout_seconds": None,
    "numa_bind": False,
    "numa_bind_nodes": None,
    "numa_bind_cpus": None,
    "device_ids": None,
    "tensor_parallel_size": 1,
    "prefill_context_parallel_size": 1,
    "decode_context_parallel_size": 1,
    "dcp_comm_backend": "ag_rs",
    "dcp_kv_cache_interleave_size": 1,
    "cp_kv_cache_interleave_size": 1,
    "data_parallel_size": 1,
    "data_parallel_rank": None,
    "data_parallel_start_rank": None,
    "data_parallel_size_local": None,
    "data_parallel_address": None,
    "data_parallel_rpc_port": None,
    "data_parallel_hybrid_lb": False,
    "data_parallel_external_lb": False,
    "data_parallel_multi_port_external_lb": False,
    "data_parallel_backend": "mp",
    "enable_expert_parallel": False,
    "enable_ep_weight_filter": False,
    "moe_backend": "auto",
    "linear_backend": "auto",
    "all2all_backend": "allgather_reducescatter",
    "enable_elastic_ep": False,
    "enable_dbo": False,
    "ubatch_size": 0,
    "dbo_decode_token_threshold": 32,
    "dbo_prefill_token_threshold": 512,
    "disable_nccl_for_dp_synchronization": None,
    "eplb_config": {},
    "enable_eplb": False,
    "expert_placement_strategy": "linear",
    "max_parallel_loading_workers": None,
    "block_size": None,
    "enable_prefix_caching": None,
    "prefix_caching_hash_algo": "sha256",
    "disable_sliding_window": False,
    "disable_cascade_attn": True,
    "offload_backend": "auto",
    "cpu_offload_gb": 0,
    "cpu_offload_params": set(),
    "offload_group_size": 0,
    "offload_num_in_group": 1,
    "offload_prefetch_step": 1,
    "offload_params": set(),
    "gpu_memory_utilization": 0.92,
    "kv_cache_memory_bytes": None,
    "max_num_batched_tokens": None,
    "max_num_scheduled_tokens": None,
    "max_num_partial_prefills": 1,
    "max_long_partial_prefills": 1,
    "long_prefill_token_threshold": 0,
    "max_num_seqs": None,
    "max_logprobs": 20,
    "logprobs_mode": "raw_logprobs",
    "use_fp64_gumbel": False,
    "disable_log_stats": False,
    "aggregate_engine_logging": False,
    "revision": None,
    "code_revision": None,
    "hf_token": None,
    "hf_overrides": {},
    "model_class_overrides": {},
    "tokenizer_revision": None,
    "quantization": None,
    "quantization_config": None,
    "allow_deprecated_quantization": False,
    "enforce_eager": False,
    "disable_custom_all_reduce": False,
    "language_model_only": False,
    "limit_mm_per_prompt": {},
    "enable_mm_embeds": False,
    "interleave_mm_strings": False,
    "media_io_kwargs": {},
    "mm_processor_kwargs": None,
    "mm_processor_cache_gb": 4,
    "mm_processor_cache_type": "lru",
    "mm_shm_cache_max_object_size_mb": 128,
    "mm_encoder_only": False,
    "mm_encoder_tp_mode": "weights",
    "mm_encoder_attn_backend": None,
    "mm_encoder_attn_dtype": None,
    "mm_encoder_fp8_scale_path": None,
    "mm_encoder_fp8_scale_save_path": None,
    "mm_encoder_fp8_scale_save_margin": 1.5,
    "io_processor_plugin": None,
    "renderer_num_workers": 1,
    "skip_mm_profiling": False,
    "video_pruning_rate": None,
    "mm_tensor_ipc": "direct_rpc",
    "mm_ipc_gpu_memory_gb": 0,
    "enable_lora": False,
    "max_loras": 1,
    "max_lora_rank": 16,
    "default_mm_loras": None,
    "fully_sharded_loras": False,
    "max_cpu_loras": None,
    "lora_dtype": "auto",
    "lora_target_modules": None,
    "enable_tower_connector_lora": False,
    "specialize_active_lora": False,
    "enable_mixed_moe_lora_format": False,
    "enable_moe_shared_loras": False,
    "ray_workers_use_nsight": False,
    "num_gpu_blocks_override": None,
    "model_loader_extra_config": {},
    "ignore_patterns": ["original/**/*"],
    "enable_chunked_prefill": None,
    "disable_chunked_mm_input": False,
    "scheduler_reserve_full_isl": True,
    "prefill_schedule_interval": 1,
    "watermark": 0.0,
    "disable_hybrid_kv_cache_manager": None,
    "structured_outputs_config": {},
    "reasoning_parser": "",
    "reasoning_parser_plugin": None,
    "speculative_config": None,
    "spec_method": None,
    "spec_model": None,
    "spec_tokens": None,
    "diffusion_config": None,
    "show_hidden_metrics_for_version": None,
    "otlp_traces_endpoint": None,
    "collect_detailed_traces": None,
    "kv_cache_metrics": False,
    "kv_cache_metrics_sample": 0.01,
    "cudagraph_metrics": False,
    "enable_layerwise_nvtx_tracing": False,
    "enable_mfu_metrics": False,
    "enable_logging_iteration_details": False,
    "jit_monitor_mode": "warn",
    "jit_monitor_verbose": False,
    "enable_mm_processor_stats": False,
    "scheduling_policy": "fcfs",
    "scheduler_cls": None,
    "pooler_config": None,
    "compilation_config": {},
    "attention_config": {},
    "mamba_config": {},
    "kernel_config": {},
    "enable_flashinfer_autotune": False,
    "enable_bf16x3_router_gemm": None,
    "worker_cls": "auto",
    "worker_extension_cls": "",
    "profiler_config": {},
    "kv_transfer_config": None,
    "kv_events_config": None,
    "ec_transfer_config": None,
    "reasoning_config": {},
    "generation_config": "auto",
    "enable_sleep_mode": False,
    "enable_cumem_allocator": False,
    "override_generation_config": {},
    "model_impl": "auto",
    "override_attention_dtype": None,
    "attention_backend": None,
    "calculate_kv_scales": False,
    "kv_cache_dtype_skip_layers": [],
    "mamba_cache_dtype": "auto",
    "mamba_ssm_cache_dtype": "auto",
    "mamba_block_size": None,
    "prefix_match_unit": None,
    "mamba_cache_mode": "none",
    "mamba_backend": "triton",
    "enable_mamba_cache_stochastic_rounding": False,
    "mamba_cache_philox_rounds": 0,
    "additional_config": {},
    "use_tqdm_on_load": True,
    "pt_load_map_location": "cpu",
    "logits_processors": None,
    "async_scheduling": None,
    "stream_interval": 1,
    "kv_sharing_fast_prefill": False,
    "optimization_level": 2,
    "performance_mode": "balanced",
    "kv_offloading_size": None,
    "kv_offloading_backend": "native",
    "tokens_only": False,
    "shutdown_timeout": 0,
    "weight_transfer_config": None,
    "fail_on_environ_validation": False,
    "gdn_prefill_backend": None,
}

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = ["red green blue", "the quick brown fox"]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def other_than(default):
    """A value that sets an option away from vLLM's default."""
    if isinstance(default, bool) or default is None:
        return True
    if isinstance(default, (int, float)):
        return default + 3
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, dict):
        return {"some_key": 1}
    return ["other"]


def test_every_vllm_option_has_exactly_one_treatment():
    assert len(VLLM_026_DEFAULTS) == 218
    assert set(VLLM_OPTIONS) == set(VLLM_026_DEFAULTS)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    same = set(options_of(Treatment.SAME))
    assert same <= fields, same - fields
    assert not (set(VLLM_OPTIONS) - same) & fields  # batchlm's own fields are SAME
    for name, option in VLLM_OPTIONS.items():
        if option.treatment is not Treatment.SAME:
            assert option.reason, name  # each says why (and, refused, what to use)
            assert is_unset(VLLM_026_DEFAULTS[name], option), name


def test_no_effect_options_take_any_value_and_say_why(caplog):
    for name in options_of(Treatment.NO_EFFECT):
        default = VLLM_026_DEFAULTS[name]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="batchlm.engine.vllm_options"):
            EngineArgs.from_kwargs("m", **{name: default})
            assert not caplog.records, name  # vLLM's default: nothing to say
            EngineArgs.from_kwargs("m", **{name: other_than(default)})
        if caplog.records:  # said once per process
            message = caplog.records[0].getMessage()
            assert name in message and VLLM_OPTIONS[name].reason in message


def test_refused_options_take_vllms_default_and_refuse_other_values():
    for name in options_of(Treatment.REFUSED):
        default = VLLM_026_DEFAULTS[name]
        EngineArgs.from_kwargs("m", **{name: default})
        with pytest.raises(InvalidParamError) as e:
            EngineArgs.from_kwargs("m", **{name: other_than(default)})
        assert f"LLM({name}=" in str(e.value) and VLLM_OPTIONS[name].reason in str(e.value)
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['not_an_option'\]"):
        EngineArgs.from_kwargs("m", not_an_option=1)


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(llama):
    llm = LLM(str(llama), max_model_len=128)
    yield llm
    llm.shutdown()


def test_llm_takes_all_of_vllms_options_at_their_defaults(llama, llm):
    """`LLM(**vars(EngineArgs(...)))`, as vLLM's `LLM.from_engine_args` does."""
    every = LLM(str(llama), **{**VLLM_026_DEFAULTS, "max_model_len": 128})
    assert tokens(every.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    )
    config = every.llm_engine.config
    assert (config.cache.block_size, config.cache.enable_prefix_caching) == (16, True)
    assert config.scheduler.enable_chunked_prefill and config.scheduler.policy == "fcfs"
    every.shutdown()
    pooling = LLM("sentence-transformers/all-MiniLM-L6-v2", **VLLM_026_DEFAULTS)
    assert pooling.embed_matrix(["hello"]).shape == (1, 384)
    pooling.shutdown()


def test_model_config_attributes_scripts_read(llm, llama):
    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

    mc = llm.model_config
    assert mc is llm.llm_engine.model_config
    hf = AutoConfig.from_pretrained(llama)
    assert isinstance(mc.hf_config, PretrainedConfig) and mc.hf_config.hidden_size == 64
    assert (mc.max_model_len, mc.dtype, mc.runner_type) == (128, torch.float32, "generate")
    assert llm.runner_type == "generate"
    assert mc.embedding_size == mc.get_hidden_size() == hf.hidden_size
    assert mc.get_vocab_size() == hf.vocab_size and mc.architectures == ["LlamaForCausalLM"]
    assert mc.get_head_size() == 16 and mc.get_total_num_kv_heads() == 2
    assert mc.get_total_num_hidden_layers() == 2 and mc.hf_text_config is mc.hf_config
    assert mc.model == str(llama) and mc.served_model_name == str(llama)
    assert llm.get_world_size() == 1
    tok = llm.get_tokenizer()
    assert tok is llm.llm_engine.get_tokenizer()
    assert tok("hello")["input_ids"] == AutoTokenizer.from_pretrained(llama)("hello")["input_ids"]
    minilm = LLM("sentence-transformers/all-MiniLM-L6-v2")
    assert minilm.model_config.runner_type == minilm.runner_type == "pooling"
    assert minilm.model_config.embedding_size == 384
    minilm.shutdown()


def test_new_options_mean_what_they_mean_in_vllm(llama, llm, caplog):
    want = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    # distributed_executor_backend: ranks are processes the engine spawns.
    for backend in (None, "mp", "uni", "ray"):
        args = EngineArgs.from_kwargs(str(llama), distributed_executor_backend=backend)
        assert args.create_engine_config().parallel.tensor_parallel_size == 1
    for backend, match in [
        ("external_launcher", "external launcher"),
        ("uni", "'uni' runs one rank"),
    ]:
        with pytest.raises(InvalidParamError, match=match):
            EngineArgs.from_kwargs(
                str(llama), distributed_executor_backend=backend, tensor_parallel_size=2
            ).create_engine_config()
    # hf_overrides (a dict, or a callable), override_generation_config, tokens_only,
    # vLLM's None / -1 for "the engine's default".
    other = LLM(
        str(llama),
        hf_overrides={"max_position_embeddings": 96},
        override_generation_config={"temperature": 0.5, "max_new_tokens": 7},
        tokens_only=True,
        max_model_len=-1,
        block_size=None,
        enable_prefix_caching=None,
        load_format="safetensors",
        renderer_num_workers=4,
    )
    assert (
        other.model_config.max_model_len
        == 96
        == other.model_config.hf_config.max_position_embeddings
    )
    defaults = other.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.5, 7)
    assert other.model_config.get_diff_sampling_param() == {"temperature": 0.5, "max_tokens": 7}
    assert other.get_tokenizer() is None  # tokens_only: no tokenizer
    ids = [llm.get_tokenizer()(p)["input_ids"] for p in PROMPTS]
    assert tokens(other.generate([{"prompt_token_ids": i} for i in ids], GREEDY)) == want
    other.shutdown()

    def widen(config):
        config.max_position_embeddings = 200
        return config

    args = EngineArgs.from_kwargs(str(llama), hf_overrides=widen)
    assert args.create_engine_config().model.max_model_len == 200
    with pytest.raises(InvalidParamError, match=r"\['presence'\] that set no sampling value"):
        EngineArgs.from_kwargs(
            str(llama), override_generation_config={"presence": 1}
        ).create_engine_config()
    # max_logprobs: vLLM's limit (20) and its message; -1 lifts it.
    with pytest.raises(
        InvalidParamError, match="Requested sample logprobs of 21, which is greater"
    ):
        llm.generate(PROMPTS, SamplingParams(max_tokens=1, logprobs=21))
    with pytest.raises(InvalidParamError, match="Requested prompt logprobs of 25"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=25))
    assert not llm.llm_engine.has_unfinished_requests()
    lifted = LLM(str(llama), max_model_len=64, max_logprobs=-1)
    out = lifted.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=30), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 30
    lifted.shutdown()
    # device_ids: one CUDA index per rank, as device="cuda:2,3".
    with pytest.raises(InvalidParamError, match="both place the engine"):
        resolve_device("cpu", [0], 1)
    with pytest.raises(InvalidParamError, match="UUIDs are not supported"):
        resolve_device("auto", ["GPU-1234"], 1)
    with pytest.raises(InvalidParamError, match="duplicates"):
        resolve_device("auto", [1, 1], 2)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidParamError, match=r"device='cuda:2,3' but CUDA is not"):
            resolve_device("auto", [2, 3], 2)
    # vLLM's name of the Triton attention backend.
    assert resolve_attention_backend("TRITON_ATTN", torch.device("cuda")) == "triton"
    with pytest.raises(InvalidParamError, match="'FLASH_ATTN' is unknown.*'TRITON_ATTN'"):
        resolve_attention_backend("FLASH_ATTN", torch.device("cpu"))
