"""How many KV blocks an engine gets: an explicit count or byte budget, a share of the
CPU's memory, or on CUDA what a profiling forward at the full token budget leaves of
`gpu_memory_utilization` (minus what the decode graphs will hold)."""

from __future__ import annotations

import gc
import logging
from typing import Any, Protocol

import torch

from ..config import EngineConfig
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..errors import InvalidParamError
from ..sampling_params import SamplingParams
from .cuda_graphs import graph_batch_sizes, verify_graph_sizes

logger = logging.getLogger(__name__)

# CPU default KV budget when neither kv_cache_memory_bytes nor num_gpu_blocks_override is set.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30

# Device memory kept out of the KV cache for CUDA graphs, on top of their estimated
# activations (graph bookkeeping, the decode kernel's split buffers).
CUDA_GRAPH_EXTRA_BYTES = 256 << 20


class ProfiledRunner(Protocol):
    """What sizing needs of a model runner."""

    config: EngineConfig
    device: torch.device
    block_size: int
    block_bytes: int
    """Bytes of one KV block across all layers (and a draft model's, if any)."""
    use_cuda_graphs: bool
    allocated_by_others: int
    """Device bytes this process held before the runner's engine (other engines)."""

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def free_kv_cache(self) -> None: ...

    def execute_model(self, out: SchedulerOutput) -> Any: ...


def determine_num_blocks(runner: ProfiledRunner) -> int:
    """How many KV blocks fit the memory budget."""
    config = runner.config
    cache = config.cache
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes // runner.block_bytes
    if runner.device.type == "cuda":
        return profile_cuda_num_blocks(runner)
    sched = config.scheduler
    max_useful = sched.max_num_seqs * -(-config.model.max_model_len // runner.block_size)
    return min(DEFAULT_CPU_KV_CACHE_BYTES // runner.block_bytes, max_useful)


@torch.inference_mode()
def profile_cuda_num_blocks(runner: ProfiledRunner) -> int:
    """Run a forward at the full token budget, then give the KV cache what is left."""
    config, device = runner.config, runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    num_tokens = min(
        config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs * config.model.max_model_len,
    )
    profile_forward(runner, num_tokens)
    torch.cuda.synchronize(device)
    # gpu_memory_utilization is this engine's share of the device (as in vLLM): its own
    # weights, activations and KV cache. The allocator's counters also hold other
    # engines of this process; they, like other processes, keep what they use, and the
    # cache takes no more than the device has free.
    others_here = min(runner.allocated_by_others, weights)
    peak = torch.cuda.max_memory_allocated(device) - others_here
    weights -= others_here
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device) + others_here
    budget = total * config.cache.gpu_memory_utilization - peak
    graph_reserve = cuda_graph_reserve(runner, peak - weights, num_tokens)
    # Each layer's cache is one allocation: memory the caching allocator keeps in
    # segments that still hold other tensors cannot take it, so the cache gets no more
    # than what the device itself has free once the allocator's free segments go back.
    gc.collect()
    torch.cuda.empty_cache()
    device_free, _ = torch.cuda.mem_get_info(device)
    budget = min(budget, device_free)
    num_blocks = int((budget - graph_reserve) // runner.block_bytes)
    logger.info(
        "KV cache: %d blocks (%.2f GiB); peak activations + weights %.2f GiB; "
        "kept for CUDA graphs %.2f GiB",
        num_blocks,
        num_blocks * runner.block_bytes / 2**30,
        peak / 2**30,
        graph_reserve / 2**30,
    )
    if num_blocks * runner.block_size < config.model.max_model_len:
        util = config.cache.gpu_memory_utilization
        raise InvalidParamError(
            f"gpu_memory_utilization={util} leaves no room for a KV cache of "
            f"max_model_len={config.model.max_model_len} tokens on {device}: "
            f"{util * total / 2**30:.2f} GiB of {total / 2**30:.2f} GiB allowed, "
            f"{used_by_others / 2**30:.2f} GiB already used by other processes or "
            f"engines, {peak / 2**30:.2f} GiB for this engine's weights and activations; "
            "free the device (shut down other engines), raise gpu_memory_utilization, or "
            "lower it for the engines that share the device"
        )
    return num_blocks


def cuda_graph_reserve(runner: ProfiledRunner, activation_bytes: int, num_tokens: int) -> int:
    """Memory the decode graphs will hold: their largest batch's share of the profiled
    activations, twice over (the graph pool is separate from the eager steps' memory),
    plus a fixed margin."""
    if not runner.use_cuda_graphs:
        return 0
    sched = runner.config.scheduler
    max_size = graph_batch_sizes(sched.max_num_seqs, sched.max_num_batched_tokens)[-1]
    for q, sizes in verify_graph_sizes(runner.config).items():
        max_size = max(max_size, q * sizes[-1])
    share = max(activation_bytes, 0) * min(1.0, max_size / max(num_tokens, 1))
    return int(2 * share) + CUDA_GRAPH_EXTRA_BYTES


def profile_forward(runner: ProfiledRunner, num_tokens: int) -> None:
    """A prefill of `num_tokens` tokens with no cache, for profiling: sequences of at most
    max_model_len tokens (positions past it do not exist), each sampled once."""
    max_len = runner.config.model.max_model_len
    seq_lens = [max_len] * (num_tokens // max_len)
    if num_tokens % max_len:
        seq_lens.append(num_tokens % max_len)
    blocks_per_seq = [-(-n // runner.block_size) for n in seq_lens]
    runner.allocate_kv_cache(sum(blocks_per_seq))
    params = SamplingParams()
    dummies = []
    first_block = 0
    for i, (n, num_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        blocks = list(range(first_block, first_block + num_blocks))
        # The prompt too: a draft model reads the request's tokens from it.
        tokens = [0] * n
        dummies.append(
            ScheduledRequest(
                f"__profile{i}__", tokens, 0, blocks, True, params, [], prompt_token_ids=tokens
            )
        )
        first_block += num_blocks
    runner.execute_model(SchedulerOutput(dummies, num_tokens))
    # The dummies finish: the runner (and a draft model) drop their state.
    runner.execute_model(SchedulerOutput([], 0, {d.request_id for d in dummies}))
    runner.free_kv_cache()
