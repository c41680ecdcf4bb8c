"""The generation engine: scheduler → model runner → output processor, one step at a time."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .config import EngineConfig
from .core.kv_cache import KVCacheManager
from .core.request import Request, RequestStatus
from .core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, SchedulerStats
from .engine_base import EngineBase
from .errors import InvalidParamError
from .loader.generation_config import end_of_generation_ids
from .lora.registry import LoRARegistry
from .lora.request import LoRARequest
from .metrics import FinishedRequestStats
from .multimodal.image_pool import ImageWorkers
from .multimodal.inputs import ImageInput
from .multimodal.mrope import MRopePositions
from .multimodal.processor import ImagePromptProcessor
from .output_processor import OutputProcessor
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .spec_decode.manager import SpecDecodeManager
from .spec_decode.runner import SpecDecodeRunner
from .structured_output import StructuredOutputManager
from .worker.executor import create_executor
from .worker.model_runner import ModelRunner
from .worker.runner_output import ModelRunnerOutput, PendingOutput

if TYPE_CHECKING:
    from .distributed.parallel import TPGroup

logger = logging.getLogger(__name__)


@dataclass
class _ParentRequest:
    """A prompt with n > 1 samples, run as n child requests that share its KV blocks."""

    request_id: str
    child_ids: list[str]
    completions: dict[int, CompletionOutput]
    first_output: RequestOutput | None = None
    metrics: list[RequestMetrics | None] = field(default_factory=list)


def build_model_runner(
    config: EngineConfig, tp: TPGroup | None = None, device: torch.device | None = None
) -> ModelRunner:
    """One rank's model runner, with speculative decoding attached where `config` asks for
    it (the executors build every rank's runner with this)."""
    return SpecDecodeRunner.attach(config, ModelRunner(config, tp=tp, device=device))


class LLMEngine(EngineBase):
    """Owns one model runner (through its executor), its scheduler and KV cache manager,
    and the tokenizer.

    Args:
        config: Everything the engine is built from (`config.model.runner_type` is
            `generate`).
    """

    runner_type = "generate"

    def __init__(self, config: EngineConfig) -> None:
        self.scheduler: Scheduler | None = None
        super().__init__(config)
        mc = config.model
        self.eos_token_ids = end_of_generation_ids(
            self.tokenizer, mc.hf_config, mc.generation_defaults
        )
        """Every id that ends a request (unless `ignore_eos`)."""
        self.executor = create_executor(config, build_model_runner)
        try:
            num_blocks = self._init_kv_cache()
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed engine
            raise
        self.runner: ModelRunner = self.executor.runner
        """Rank 0's runner (the only one with tensor_parallel_size=1)."""
        self.runner.return_sampling_mask = config.return_sampling_mask
        self._execute_model = self.executor.execute_model
        self._launch_model = self.executor.launch_model
        block_size = config.cache.block_size
        max_len = mc.max_model_len
        bidirectional = bool(getattr(self.runner.model, "has_bidirectional_images", False))
        self.kv_cache = KVCacheManager(
            num_blocks, block_size, config.cache.enable_prefix_caching, bidirectional
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache,
            max_len,
            long_context_len=getattr(self.runner.model, "long_context_len", None),
            max_loras=config.lora.max_loras if config.lora is not None else None,
            has_bidirectional_images=bidirectional,
        )
        self.loras = LoRARegistry()
        """The adapters this engine has been given (`add_lora`)."""
        self.outputs = OutputProcessor(self.tokenizer)
        mm = config.multimodal
        self.image_processor = (
            ImagePromptProcessor(mc.path, mm.image_token_id, mm.processor_kwargs, mc.dtype)
            if mm is not None
            else None
        )
        """A vision-language model's processor on the host: prompts with images → token
        ids with expanded placeholders and prepared images (None: a text model)."""
        self.image_workers = ImageWorkers(
            self.image_processor, is_cuda=self.runner.device.type == "cuda"
        )
        """Worker processes that prepare the images of large calls (started on first use;
        none for a text model)."""
        self.spec: SpecDecodeManager | None = None
        """Speculative decoding's host side (draft tokens, rollback, acceptance counts)."""
        if config.speculative is not None:
            self.spec = SpecDecodeManager(config.speculative, max_len)
        self.structured = StructuredOutputManager(
            config.structured_outputs,
            self.tokenizer,
            self.runner.vocab_size,
            self.eos_token_ids,
            pin_memory=self.runner.device.type == "cuda",
            speculative_method=config.speculative.method if config.speculative else None,
        )
        """Structured outputs: compiled grammars, each constrained request's matcher (rank
        0 samples, so its matchers are the only ones), each step's token bitmask."""
        self._arrivals = itertools.count()
        self._parents: dict[str, _ParentRequest] = {}
        self._child_parent: dict[str, tuple[str, int]] = {}
        self._stash: dict[str, RequestOutput] = {}
        self._unscheduled: dict[str, Request] = {}
        """With statistics on: requests not scheduled yet (their first_scheduled_time)."""
        self._inflight: tuple[SchedulerOutput, PendingOutput] | None = None
        """Async scheduling: the step launched by the last `step`, outputs not processed."""
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, block_size)

    def _init_kv_cache(self) -> int:
        num_blocks = self.executor.determine_num_blocks()
        block_size = self.config.cache.block_size
        max_len = self.config.model.max_model_len
        if num_blocks * block_size < max_len:
            raise InvalidParamError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens "
                f"({num_blocks * block_size} tokens), less than max_model_len={max_len}; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
            )
        self.executor.initialize_kv_cache(num_blocks)
        return num_blocks

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self.executor.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache.reset_prefix_cache()

    def _release(self) -> None:
        workers = getattr(self, "image_workers", None)
        if workers is not None:
            workers.close()
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.pool.num_blocks

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter and read it into the host cache, as vLLM's `add_lora`; False
        when the engine has it already.

        Raises:
            InvalidParamError: LoRA is off, the adapter is refused, or its id or name is
                another adapter's; the engine goes on serving.
        """
        if not self.loras.check(lora_request):
            return False
        self.runner.add_lora(lora_request)
        self.loras.add(lora_request)
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters given so far."""
        return self.loras.ids()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        images: tuple[ImageInput, ...] = (),
        mrope_positions: MRopePositions | None = None,
    ) -> None:
        """Queue a validated request (n > 1 becomes n child requests, of one priority,
        adapter and images); its adapter is loaded with `add_lora` if it is new."""
        mm = (images, mrope_positions)
        if lora_request is not None and lora_request.lora_int_id not in self.loras:
            self.add_lora(lora_request)
        if params.n == 1:
            self._add(
                request_id, prompt_token_ids, params, prompt, None, priority, lora_request, *mm
            )
            return
        # Siblings always share the prompt's full blocks: with prefix caching off, a salt
        # private to this prompt keeps the sharing among them.
        salt = None if self.config.cache.enable_prefix_caching else hash(("n", request_id))
        child_ids = [f"{request_id}#{i}" for i in range(params.n)]
        self._parents[request_id] = _ParentRequest(request_id, child_ids, {})
        for i, child_id in enumerate(child_ids):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i
            self._child_parent[child_id] = (request_id, i)
            self._add(child_id, prompt_token_ids, child, prompt, salt, priority, lora_request, *mm)

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        cache_salt: int | None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        images: tuple[ImageInput, ...] = (),
        mrope_positions: MRopePositions | None = None,
    ) -> None:
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_index=next(self._arrivals),
            cache_salt=cache_salt,
            priority=priority,
            lora_request=lora_request,
            images=images,
            mrope_positions=mrope_positions,
        )
        self.structured.add_request(request)  # may refuse it: before anything else
        if self.metrics is not None:
            request.metrics = RequestMetrics(arrival_time=time.time())
            self._unscheduled[request_id] = request
        self.scheduler.add_request(request)
        self.outputs.add_request(request, prompt)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests (or n > 1 parents), freeing their KV blocks; outputs are discarded."""
        ids: list[str] = []
        for rid in request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                ids.append(rid)
                continue
            ids.extend(parent.child_ids)
            for child_id in parent.child_ids:
                self._child_parent.pop(child_id, None)
        if self.metrics is not None:
            self._record_aborts(ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self.structured.finish(ids)
        for rid in ids:
            self.outputs.states.pop(rid, None)
            self._stash.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stash_output(self, output: RequestOutput) -> None:
        """Keep a finished output that no caller is waiting for yet."""
        self._stash[output.request_id] = output

    def pop_stashed_output(self, request_id: str) -> RequestOutput | None:
        return self._stash.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that finished in it.

        With async scheduling, the step launched here is still running when `step` returns:
        the next call schedules and launches the step after it first, then processes its
        outputs while that one runs, so the device does not wait for the host in between.
        The requests returned are then those that finished in the previous step.

        Raises:
            EngineSleepingError: the engine is asleep (`sleep`); nothing changes.
        """
        self.sleep_state.check_awake("a step")
        if self.config.scheduler.async_scheduling:
            return self._step_ahead()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
            if self.structured.num_requests:
                self.structured.trim_drafts(self.scheduler.running)
        sched_out = self._schedule(ahead=False)
        try:
            runner_out = self._execute_model(sched_out, self.structured.mask_source(sched_out))
        except BaseException:  # an interrupt or a device error: the step's KV is not there
            self.scheduler.undo_schedule(sched_out)
            raise
        return self._process(sched_out, runner_out)

    def _step_ahead(self) -> list[RequestOutput]:
        """One step of async scheduling (see `step`)."""
        finished: list[RequestOutput] = []
        inflight, self._inflight = self._inflight, None
        if inflight is not None and inflight[0].sync_next:
            finished += self._complete(inflight)
            inflight = None
        sched_out = self._schedule(ahead=inflight is not None)
        try:
            # The constrained requests' mask is filled once this step's forward is launched:
            # their tokens in flight are read from the step before, which then reaches the
            # host while this one runs.
            grammar = self.structured.mask_source(sched_out, inflight[1] if inflight else None)
            launched = (sched_out, self._launch_model(sched_out, grammar))
        except BaseException:
            self.scheduler.undo_schedule(sched_out)
            if inflight is not None:
                self.scheduler.undo_schedule(inflight[0])
            raise
        if inflight is not None:
            finished += self._complete(inflight, newer=sched_out)
        # Nothing left to launch after it (or only requests that ended meanwhile, by a
        # stop string, say): finish the step now, so no step outlives its requests.
        if sched_out.is_empty or not self.scheduler.has_unfinished_requests():
            return finished + self._complete(launched)
        self._inflight = launched
        return finished

    def _complete(
        self, launched: tuple[SchedulerOutput, PendingOutput], newer: SchedulerOutput | None = None
    ) -> list[RequestOutput]:
        """Wait for a launched step's outputs and process them; a failure undoes it (and the
        `newer` step launched after it)."""
        sched_out, pending = launched
        try:
            runner_out = pending.result()
        except BaseException:
            if newer is not None:
                self.scheduler.undo_schedule(newer)
            self.scheduler.undo_schedule(sched_out)
            raise
        return self._process(sched_out, runner_out)

    def _schedule(self, ahead: bool) -> SchedulerOutput:
        sched_out = self.scheduler.schedule(ahead=ahead)
        if self._unscheduled:
            self._record_scheduled(sched_out.scheduled)
        return sched_out

    def _process(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply a step's outputs: new tokens, stop checks, finished requests."""
        if self.spec is None:
            return self._apply_tokens(sched_out, runner_out)
        # Speculative decoding: the tokens each request gained, one position at a time.
        views, stats = self.spec.fold(sched_out, runner_out, self.scheduler)
        if stats is not None and self.metrics is not None:
            self.metrics.record_spec_decode(
                stats.num_drafts,
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
                stats.accepted_per_position,
            )
        return [out for view in views for out in self._apply_tokens(sched_out, view)]

    def _apply_tokens(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append one new token per request (`runner_out.sampled`), run the stop checks and
        the detokenizer; the requests that finished."""
        updated = self.scheduler.update_from_output(sched_out, runner_out.sampled)
        if self.structured.num_requests:
            # A complete grammar ends its request (whatever ignore_eos says).
            ended = self.structured.advance(updated)
            if ended:
                self.scheduler.finish_requests(ended, RequestStatus.FINISHED_STOPPED)
        finished_ids, stopped = self.outputs.process(updated, runner_out)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.structured.finish(finished_ids)
        if self.metrics is not None:
            self._record_step(updated, finished_ids)
        finished = []
        for rid in finished_ids:
            out = self.outputs.finish(rid)
            if rid in self._child_parent:
                merged = self._merge_child(rid, out)
                if merged is not None:
                    finished.append(merged)
            else:
                finished.append(out)
        return finished

    def _merge_child(self, child_id: str, out: RequestOutput) -> RequestOutput | None:
        parent_id, index = self._child_parent.pop(child_id)
        parent = self._parents[parent_id]
        completion = out.outputs[0]
        completion.index = index
        parent.completions[index] = completion
        parent.metrics.append(out.metrics)
        if parent.first_output is None:
            parent.first_output = out
        if len(parent.completions) < len(parent.child_ids):
            return None
        del self._parents[parent_id]
        first = parent.first_output
        first.request_id = parent_id
        first.outputs = [parent.completions[i] for i in range(len(parent.child_ids))]
        if first.metrics is not None:
            first.metrics = RequestMetrics.merge([m for m in parent.metrics if m is not None])
        return first

    # ---- sleep mode -------------------------------------------------------------------

    def _settle_requests(self, mode: str, level: int) -> None:
        if self._inflight is not None:  # a step launched ahead: its outputs first
            inflight, self._inflight = self._inflight, None
            for out in self._complete(inflight):
                self.stash_output(out)
        if mode == "wait":
            while self.scheduler.has_unfinished_requests():
                for out in self.step():
                    self.stash_output(out)
        elif mode == "abort":
            self._abort_with_outputs(list(self.scheduler.requests))
        elif level >= 1:  # keep: the KV cache goes, the requests are computed again later
            self.scheduler.preempt_all()
        if level >= 1:
            self.kv_cache.reset_prefix_cache()

    def _abort_with_outputs(self, request_ids: list[str]) -> None:
        """End requests as aborted, keeping their outputs (finish reason "abort") for the
        callers that wait for them."""
        if self.metrics is not None:
            self._record_aborts(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.structured.finish(request_ids)
        for rid in request_ids:
            out = self.outputs.finish(rid)
            if rid in self._child_parent:
                out = self._merge_child(rid, out)
            if out is not None:
                self.stash_output(out)

    def _sleep_ranks(self, level: int) -> int:
        return self.executor.collective_rpc("sleep", kwargs={"level": level})[0]

    def _wake_ranks(self, tags: list[str]) -> None:
        self.executor.collective_rpc("wake_up", kwargs={"tags": tags})

    # ---- statistics -------------------------------------------------------------------

    def stats(self) -> SchedulerStats | None:
        """The scheduler's counts (None until the scheduler exists)."""
        return self.scheduler.stats() if self.scheduler is not None else None

    def _record_scheduled(self, scheduled: list[ScheduledRequest]) -> None:
        now = time.time()
        for sched in scheduled:
            request = self._unscheduled.pop(sched.request_id, None)
            if request is not None:
                request.metrics.first_scheduled_time = now

    def _record_step(self, updated: list[Request], finished_ids: list[str]) -> None:
        """Token counts and latencies of the step that just ran (timestamps on each request)."""
        now = time.time()
        first_latencies: list[float] = []
        gaps: list[float] = []
        num_prompt_tokens = 0
        for request in updated:
            m = request.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                first_latencies.append(now - m.arrival_time)
                num_prompt_tokens += request.num_prompt_tokens
            else:
                gaps.append(now - m.last_token_time)
            m.last_token_time = now
        metrics = self.metrics
        metrics.record_step(first_latencies, gaps, num_prompt_tokens, len(updated))
        if finished_ids:
            finished = []
            for rid in finished_ids:
                request = self.outputs.states[rid].request
                request.metrics.finished_time = now
                finished.append(
                    FinishedRequestStats(
                        request.status.finish_reason or "stop",
                        now - request.metrics.arrival_time,
                        request.num_prompt_tokens,
                        request.num_output_tokens,
                    )
                )
            metrics.record_finished(finished)
        metrics.log_if_due()

    def _record_aborts(self, request_ids: list[str]) -> None:
        now = time.time()
        finished = []
        for rid in request_ids:
            request = self.scheduler.requests.get(rid)
            if request is None or request.metrics is None:
                continue
            self._unscheduled.pop(rid, None)
            finished.append(
                FinishedRequestStats(
                    "abort",
                    now - request.metrics.arrival_time,
                    request.num_prompt_tokens,
                    request.num_output_tokens,
                )
            )
        self.metrics.record_finished(finished)
