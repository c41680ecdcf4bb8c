"""The engine loop: scheduler → model runner → output processor, one step at a time."""

from __future__ import annotations

import itertools
import logging
from typing import Any

from .config import EngineConfig
from .core.kv_cache import KVCacheManager
from .core.request import Request, RequestStatus
from .core.scheduler import Scheduler, SchedulerStats
from .errors import InvalidParamError
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import load_tokenizer
from .worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns one model runner, its scheduler and KV cache manager, and the tokenizer.

    Args:
        config: Everything the engine is built from.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.trust_remote_code)
        self.runner = ModelRunner(config)
        num_blocks = self.runner.determine_num_blocks()
        block_size = config.cache.block_size
        max_len = config.model.max_model_len
        if num_blocks * block_size < max_len:
            raise InvalidParamError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens "
                f"({num_blocks * block_size} tokens), less than max_model_len={max_len}; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
            )
        self.runner.initialize_kv_cache(num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, max_len)
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_id = _eos_token_id(config.model.hf_config, self.tokenizer)
        self._arrivals = itertools.count()
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, block_size)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.pool.num_blocks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        """Queue a validated request."""
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_index=next(self._arrivals),
        )
        self.scheduler.add_request(request)
        self.outputs.add_request(request, prompt)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests, freeing their KV blocks; their outputs are discarded."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.outputs.states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that finished in it."""
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute_model(sched_out)
        updated = self.scheduler.update_from_output(sched_out, runner_out.sampled)
        finished_ids, stopped = self.outputs.process(updated, runner_out.logprobs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return [self.outputs.finish(rid) for rid in finished_ids]

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()


def _eos_token_id(hf_config: Any, tokenizer: Any) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos
