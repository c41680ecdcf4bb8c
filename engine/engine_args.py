"""`LLM(...)` keyword arguments → a validated `EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from . import envs
from .config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    config_torch_dtype,
    resolve_dtype,
)
from .errors import InvalidParamError


@dataclass
class EngineArgs:
    """The options `LLM` accepts (vLLM's names). See the config classes for each meaning."""

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    max_model_len: int | None = None
    trust_remote_code: bool = False
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    device: str = "auto"
    attention_backend: str | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidParamError(
                f"unknown LLM option(s) {unknown}; supported: {', '.join(sorted(known - {'model'}))}"
            )
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        from transformers import AutoConfig

        from .loader import resolve_model

        self._validate()
        if not isinstance(self.model, (str, Path)):
            raise InvalidParamError(f"model={self.model!r} must be a path or a model name")
        path = resolve_model(str(self.model))
        tokenizer_path = resolve_model(self.tokenizer) if self.tokenizer else path
        hf_config = AutoConfig.from_pretrained(
            str(path), trust_remote_code=self.trust_remote_code, local_files_only=True
        )
        device = self._device()
        dtype = resolve_dtype(self.dtype, config_torch_dtype(hf_config), device)
        derived_len = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
        max_model_len = self.max_model_len or derived_len
        if max_model_len > derived_len and not _allows_longer(hf_config):
            raise InvalidParamError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{derived_len}; lower it or use a model with rope scaling"
            )
        max_batched = self.max_num_batched_tokens or max(8192, self.max_num_seqs)
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise InvalidParamError(
                f"max_num_batched_tokens={max_batched} < max_model_len={max_model_len} needs "
                "chunked prefill; set enable_chunked_prefill=True or raise max_num_batched_tokens"
            )
        backend = self.attention_backend or envs.attention_backend()
        if backend is None:
            backend = "torch"
        if backend not in ("torch", "triton"):
            raise InvalidParamError(
                f"attention_backend={backend!r} is unknown; use 'torch' or 'triton'"
            )
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
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=None
                if self.kv_cache_dtype == "auto"
                else resolve_dtype(self.kv_cache_dtype, None, device),
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_batched,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            device=DeviceConfig(
                device=device, attention_backend=backend, enforce_eager=self.enforce_eager
            ),
        )

    def _device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise InvalidParamError(
                f"device={self.device!r} is not a device; use 'cpu' or 'cuda'"
            ) from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidParamError(f"device={self.device!r} but CUDA is not available; use 'cpu'")
        if device.type not in ("cpu", "cuda"):
            raise InvalidParamError(f"device={self.device!r} is not supported; use 'cpu' or 'cuda'")
        return device

    def _validate(self) -> None:
        def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParamError(f"{name}={value!r} must be an integer >= 1")

        positive_int("block_size", self.block_size)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_model_len", self.max_model_len, allow_none=True)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InvalidParamError(f"seed={self.seed!r} must be an integer")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise InvalidParamError(f"gpu_memory_utilization={util!r} must be in (0, 1]")
        if self.tensor_parallel_size != 1:
            raise InvalidParamError(
                f"tensor_parallel_size={self.tensor_parallel_size!r}: only 1 is supported so far"
            )


def _allows_longer(hf_config: Any) -> bool:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    return bool(params) and (params.get("rope_type") or params.get("type")) not in (None, "default")
