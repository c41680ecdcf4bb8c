"""The model runner: owns the model, the KV cache tensors and every per-step input tensor.

It makes no policy decisions: the scheduler says which tokens run; the runner lays them
out (input ids, positions, slot mapping, block tables), runs the model once, samples the
requests that reached their last token, and hands token ids back as plain Python values
(one device → host copy per step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention.backend import AttentionMetadata, get_attention_backend
from ..config import EngineConfig
from ..core.scheduler import SchedulerOutput
from ..loader.weights import build_model
from ..models.registry import get_model_class
from .sampler import Sampler, SamplingMetadata

logger = logging.getLogger(__name__)

# CPU default KV budget when neither kv_cache_memory_bytes nor num_gpu_blocks_override is set.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: its own, its rank, and the top-k alternatives."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    """Request id → the new token, for requests that reached their last token."""
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class ModelRunner:
    """Runs one model on one device.

    Args:
        config: The engine configuration (model, cache, device).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device.device
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.backend = get_attention_backend(config.device.attention_backend)
        hf_config = config.model.hf_config
        model_cls = get_model_class(config.model.architecture)
        self.model = build_model(
            model_cls,
            _path(config.model.path),
            self.dtype,
            self.device,
            config=hf_config,
            backend=self.backend,
            max_position=config.model.max_model_len,
        )
        self.vocab_size = int(hf_config.vocab_size)
        self.num_layers, self.num_kv_heads, self.head_dim = self.model.kv_cache_shape()
        self.kv_dtype = config.cache.cache_dtype or self.dtype
        self.kv_caches: list[torch.Tensor] = []
        self.generator = torch.Generator(self.device).manual_seed(config.model.seed)
        self.request_generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler(self.generator)

    # ---- KV cache ---------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (keys and values)."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes // self.block_bytes
        if self.device.type == "cuda":
            return self._profile_cuda_blocks()
        sched = self.config.scheduler
        max_useful = sched.max_num_seqs * -(-self.config.model.max_model_len // self.block_size)
        return min(DEFAULT_CPU_KV_CACHE_BYTES // self.block_bytes, max_useful)

    @torch.inference_mode()
    def _profile_cuda_blocks(self) -> int:
        """Run a forward at the full token budget, then give the KV cache what is left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(
            self.config.scheduler.max_num_batched_tokens,
            self.config.scheduler.max_num_seqs * self.config.model.max_model_len,
        )
        self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - peak - used_by_others
        num_blocks = int(budget // self.block_bytes)
        logger.info(
            "KV cache: %d blocks (%.2f GiB); peak activations + weights %.2f GiB",
            num_blocks,
            num_blocks * self.block_bytes / 2**30,
            peak / 2**30,
        )
        return num_blocks

    def _dummy_forward(self, num_tokens: int) -> None:
        """A prefill of `num_tokens` tokens in one sequence with no cache, for profiling."""
        self.initialize_kv_cache(-(-num_tokens // self.block_size))
        from ..core.scheduler import ScheduledRequest
        from ..sampling_params import SamplingParams

        blocks = list(range(len(self.kv_caches[0][0])))
        dummy = ScheduledRequest(
            "__profile__", [0] * num_tokens, 0, blocks, True, SamplingParams(), []
        )
        self.execute_model(SchedulerOutput([dummy], num_tokens))
        self.request_generators.clear()
        self.kv_caches = []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.num_layers)
        ]

    # ---- one step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            self.request_generators.pop(rid, None)
        if out.is_empty:
            return ModelRunnerOutput()
        reqs = out.scheduled
        num_seqs = len(reqs)
        query_lens = np.fromiter((len(r.token_ids) for r in reqs), np.int64, num_seqs)
        starts = np.fromiter((r.start_pos for r in reqs), np.int64, num_seqs)
        seq_lens = starts + query_lens
        qsl = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])

        input_ids = np.fromiter(
            (t for r in reqs for t in r.token_ids), np.int64, num_tokens
        )  # [num_tokens]
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - qsl[seq_of_token] + starts[seq_of_token]
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_tables = np.zeros((num_seqs, max_blocks), np.int64)
        for i, r in enumerate(reqs):
            block_tables[i, : len(r.block_ids)] = r.block_ids
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )

        dev = self.device
        metadata = AttentionMetadata(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=_to(qsl.astype(np.int32), dev),
            seq_lens=_to(seq_lens.astype(np.int32), dev),
            block_tables=_to(block_tables.astype(np.int32), dev),
            slot_mapping=_to(slot_mapping, dev),
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )
        self.backend.prepare(metadata)
        hidden = self.model(_to(input_ids, dev), _to(positions, dev), self.kv_caches, metadata)

        sample_rows = [i for i, r in enumerate(reqs) if r.needs_sample]
        if not sample_rows:
            return ModelRunnerOutput()
        last_token = _to(qsl[1:][sample_rows] - 1, dev)
        logits = self.model.compute_logits(hidden[last_token])  # [num_sampled, vocab]
        sampled_reqs = [reqs[i] for i in sample_rows]
        generators = {}
        for row, r in enumerate(sampled_reqs):
            gen = self._generator_for(r.request_id, r.sampling_params.seed)
            if gen is not None:
                generators[row] = gen
        meta = SamplingMetadata.build(
            [r.sampling_params for r in sampled_reqs], generators, self.vocab_size, dev
        )
        result = self.sampler(logits, meta)
        return self._to_host(sampled_reqs, result)

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(seed % 2**64)
            self.request_generators[request_id] = gen
        return gen

    def _to_host(self, reqs, result) -> ModelRunnerOutput:
        # One transfer for everything the host needs from this step.
        tensors = [result.sampled_token_ids]
        if result.sampled_logprobs is not None:
            tensors += [result.sampled_logprobs, result.sampled_ranks]
        if result.topk_token_ids is not None:
            tensors += [result.topk_token_ids, result.topk_logprobs]
        host = [t.cpu() for t in tensors]
        ids = host[0].tolist()
        out = ModelRunnerOutput({r.request_id: t for r, t in zip(reqs, ids, strict=True)})
        if result.sampled_logprobs is None:
            return out
        lp, ranks = host[1].tolist(), host[2].tolist()
        top_ids = host[3].tolist() if len(host) > 3 else None
        top_lp = host[4].tolist() if len(host) > 3 else None
        for i, r in enumerate(reqs):
            k = r.sampling_params.logprobs
            if k is None:
                continue
            out.logprobs[r.request_id] = TokenLogprobs(
                lp[i],
                ranks[i],
                top_ids[i][:k] if top_ids else [],
                top_lp[i][:k] if top_lp else [],
            )
        return out


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def _path(path: str):
    from pathlib import Path

    return Path(path)
