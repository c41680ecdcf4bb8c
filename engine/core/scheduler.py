"""Continuous-batching scheduler with a per-step token budget (no prefill/decode phases).

Each step hands out `max_num_batched_tokens` to running requests first (in the order they
started), then to waiting ones in the waiting queue's order (`request_queue.py`: first
come, first served, or by priority). A request's `num_computed_tokens` catches up to its
token count; a prompt longer than the remaining budget is chunked across steps. When the
KV cache cannot grow a running request, a running request is preempted: the newest (fcfs)
or the one with the largest (priority, arrival) (priority policy; if it was already
scheduled in this step, that is undone). Its blocks are freed and it goes back to the
waiting queue, to be recomputed (prefix caching usually makes that cheap).

With async scheduling the engine schedules step N+1 while step N still runs (`schedule(
ahead=True)`): a request whose last step samples a token is scheduled again with that token
as PLACEHOLDER_TOKEN, which the model runner reads from step N's sampled ids on the device.
A request is only scheduled ahead when step N's token cannot change what N+1 does with it
(no penalties, bad words or min_tokens ban; not at its last token), and a step scheduled
ahead never preempts: where a running request cannot grow, it stops there (`blocked`), and
the engine waits for the steps in flight before scheduling the next one with preemption.

A model with a `long_context_len` (LongRoPE) computes a sequence longer than it with other
rotary frequencies at every position. A request is marked `long_context` when it is
admitted with more tokens than that, or, when a running request grows past it, its blocks
are freed and it is computed again from its first token (like a preemption, not counted as
one); draft tokens of a short request stop at the length.

With LoRA adapters (`max_loras`), the running requests use at most `max_loras` distinct
adapters: a waiting request whose adapter would be one too many stops admission until a
running adapter's requests are done (first come, first served: a call with more adapters
than slots completes in order of arrival).

A prompt's images need no decision here: each scheduled request names the images whose
placeholder tokens overlap its step (a chunk may end inside one), and the runner brings
their vision-tower rows. Except for a model whose image tokens attend to each other both
ways (`has_bidirectional_images`, Gemma 3): a step never ends inside an image, so that
every token of it sees all the others. A chunk that would end inside one stops before it;
a request whose next image does not fit the budget left waits for a step with room (an
image longer than `max_num_batched_tokens` is refused before it enters). Pure Python: no
tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..config import SchedulerConfig
from ..lora.request import LoRARequest
from ..multimodal.inputs import ImageInput
from ..multimodal.mrope import MRopePositions
from ..sampling_params import SamplingParams
from .kv_cache import KVCacheManager
from .request import Request, RequestStatus
from .request_queue import create_request_queue

PLACEHOLDER_TOKEN = -1
"""In `ScheduledRequest.token_ids`: the token sampled by the step in flight, not known yet."""


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]
    """Tokens whose KV is computed this step (a prompt chunk, or the last sampled token)."""
    start_pos: int
    """Position of `token_ids[0]` (= tokens already computed before this step)."""
    block_ids: list[int]
    """The request's whole block table (the live list: valid for this step only)."""
    needs_sample: bool
    """True when this step reaches the request's last token, so its logits give a new token."""
    sampling_params: SamplingParams
    output_token_ids: list[int]
    """Tokens generated so far (the live list; read-only for the runner, used by penalties)."""
    prompt_token_ids: list[int] = field(default_factory=list)
    """The prompt (read-only; repetition penalty and prompt logprobs read it)."""
    eos_token_ids: tuple[int, ...] = ()
    """The model's end-of-generation ids, banned (with stop_token_ids) while `min_tokens` is
    not reached."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens to verify (speculative decoding): the tail of `token_ids`, after the
    request's last token. The step computes their positions too and samples at each."""
    block_row: int = -1
    """The request's row in its step's `SchedulerOutput.block_table` (-1: none given)."""
    long_context: bool = False
    """The request is longer than the model's `long_context_len`: its positions read the
    long-context rows of the rotary table."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""
    images: tuple[ImageInput, ...] = ()
    """The request's images whose placeholder tokens overlap this step's (a chunk may
    start or end inside one): the runner needs their vision-tower rows."""
    mrope_positions: MRopePositions | None = None
    """An M-RoPE model's positions of the whole prompt (None: token indices); the runner
    slices this step's."""


@dataclass
class SchedulerOutput:
    """What the model runner executes in one step."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests finished since the last step: the runner drops their state."""
    preempted_request_ids: list[str] = field(default_factory=list)
    block_table: np.ndarray | None = None
    """The KV cache manager's table of block ids, one row per request (`block_row`) with
    zeros past its blocks, as of this step; None when the step was made by hand."""
    sync_next: bool = False
    """The next step must be scheduled with this one's outputs known: scheduled ahead, a
    running request could not grow (the KV cache is full, and only a step scheduled with
    every output known may preempt), or a request sampled here samples next from its
    outputs (penalties, bad words, min_tokens)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    """Decides which tokens of which requests run each step.

    Args:
        config: Token and sequence budgets.
        kv_cache: The block manager, sized by the model runner.
        max_model_len: Longest sequence (prompt + output) a request may reach.
        long_context_len: The model's (see `CausalLM.long_context_len`); None: every
            length is computed alike.
        max_loras: Most distinct LoRA adapters among the running requests (None: no
            adapters). A waiting request whose adapter would be one too many waits, and
            those behind it too (first come, first served), until a running adapter's
            requests are done.
        has_bidirectional_images: The model's image tokens attend to each other both ways
            (`VisionLanguageModel.has_bidirectional_images`): no step ends inside an
            image's placeholder tokens.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        long_context_len: int | None = None,
        max_loras: int | None = None,
        has_bidirectional_images: bool = False,
    ):
        self.config = config
        self.has_bidirectional_images = has_bidirectional_images
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.long_context_len = long_context_len
        self.max_loras = max_loras
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        """Requests not running, the next to start first (see `request_queue.py`)."""
        self.running: list[Request] = []
        self.finished_request_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (stop strings, aborts)."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        self.finished_request_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- scheduling -------------------------------------------------------------------

    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """The next step.

        Args:
            ahead: The last step is still running (its tokens are not appended yet):
                schedule only what does not depend on them, and never preempt.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        blocked = False

        # A request sampled in this step whose next sampling reads its outputs: the step
        # after it must wait for them.
        sync_next = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.long_context_len is not None and not request.long_context:
                if request.num_scheduled_tokens > self.long_context_len:
                    if ahead or request.num_inflight_tokens:
                        blocked = True  # recomputed once its tokens are known
                        break
                    self._restart_long(request)
                    continue
                # Drafts past the length would be scored with the short-context frequencies.
                del request.spec_token_ids[self.long_context_len - request.num_scheduled_tokens :]
            num_pending = request.num_scheduled_tokens + len(request.spec_token_ids)
            num_new = min(num_pending - request.num_computed_tokens, budget)
            if self.has_bidirectional_images and request.images:
                num_new = whole_images(request.images, request.num_computed_tokens, num_new)
            in_flight = request.num_inflight_tokens
            if num_new <= 0 or (in_flight and not self._can_run_ahead(request)):
                i += 1  # nothing to do until a token is appended
                continue
            while self.kv_cache.allocate_slots(request, num_new) is None:
                if ahead:
                    blocked = True
                    break
                victim = self._preemption_victim()
                index = self.running.index(victim)
                del self.running[index]
                if index < i:  # scheduled earlier in this step (priority policy): undone
                    step = next(s for s in scheduled if s.request_id == victim.request_id)
                    scheduled.remove(step)
                    budget += len(step.token_ids)
                    i -= 1
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                step = self._scheduled(request, num_new)
                scheduled.append(step)
                # (One with a token in flight passed _can_run_ahead: it reads no outputs.)
                if step.needs_sample and not sync_next and not in_flight:
                    sync_next = _samples_from_outputs(request)
                budget -= num_new
                i += 1
                continue
            break  # the request was preempted or blocked; nobody after it can run either

        # Waiting requests only when nothing was preempted this step, so a preempted request
        # is not immediately rescheduled ahead of the running ones it yielded to.
        while (
            not preempted
            and not blocked
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.lora_request is not None and not self._adapter_fits(request):
                break
            if self.long_context_len is not None and request.num_tokens > self.long_context_len:
                self._enter_long_context(request)
            computed = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - computed.num_computed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.has_bidirectional_images and request.images:
                num_new = whole_images(request.images, computed.num_computed_tokens, num_new)
                if num_new <= 0:
                    break  # its next image waits for a step with room
            if self.kv_cache.allocate_slots(request, num_new, computed) is None:
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed.num_computed_tokens
            request.num_computed_tokens = computed.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step = self._scheduled(request, num_new)
            scheduled.append(step)
            if step.needs_sample and not sync_next:
                sync_next = _samples_from_outputs(request)
            budget -= num_new

        finished = self.finished_request_ids
        self.finished_request_ids = set()
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            block_table=self.kv_cache.block_table,
            sync_next=blocked or sync_next,
        )

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the request's adapter can run beside the running requests': it is one of
        theirs, or they use fewer than `max_loras`."""
        running = {r.lora_int_id for r in self.running if r.lora_request is not None}
        return request.lora_int_id in running or len(running) < (self.max_loras or 0)

    def _can_run_ahead(self, request: Request) -> bool:
        """Whether a request with a token in flight may be scheduled before it is known:
        the token does not end it by length, and its sampling does not read the outputs."""
        params = request.sampling_params
        num_out = request.num_output_tokens + request.num_inflight_tokens
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return False
        if request.num_scheduled_tokens >= self.max_model_len:
            return False
        return not _samples_from_outputs(request)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new
        token_ids = request.all_token_ids[start : start + num_new]
        if len(token_ids) < num_new and request.num_inflight_tokens:
            token_ids.append(PLACEHOLDER_TOKEN)
        # Draft tokens that fit the budget; the step's KV for rejected ones is rolled back
        # (`num_computed_tokens`) once they are verified.
        spec = request.spec_token_ids[: num_new - len(token_ids)]
        request.spec_token_ids = []
        needs_sample = request.num_computed_tokens >= request.num_scheduled_tokens
        if needs_sample:
            request.num_inflight_tokens += 1
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids + spec,
            start_pos=start,
            block_ids=self.kv_cache.block_ids(request.request_id),
            needs_sample=needs_sample,
            sampling_params=request.sampling_params,
            output_token_ids=request.output_token_ids,
            prompt_token_ids=request.prompt_token_ids,
            eos_token_ids=request.eos_token_ids,
            spec_token_ids=spec,
            block_row=self.kv_cache.block_rows.get(request.request_id, -1),
            long_context=request.long_context,
            lora_request=request.lora_request,
            images=_overlapping_images(request.images, start, start + len(token_ids))
            if request.images
            else (),
            mrope_positions=request.mrope_positions,
        )

    def undo_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Roll back a step whose execution failed, so the engine can go on serving.

        Nothing the step computed is kept: its requests that are still unfinished go back
        to the front of the waiting queue (in their order) to be recomputed, the blocks
        that became full in it leave the prefix cache (their KV was never written), and
        the requests that finished before it are announced again with the next step, so
        that the runner still drops their state.
        """
        self.finished_request_ids |= scheduler_output.finished_request_ids
        for sched in reversed(scheduler_output.scheduled):
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.kv_cache.uncache_from(request, sched.start_pos)
            self.running.remove(request)
            self.kv_cache.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_inflight_tokens = 0
            self.waiting.appendleft(request)

    def _enter_long_context(self, request: Request) -> None:
        """Mark a request that has no KV as long-context (its block hashes change)."""
        if not request.long_context:
            request.long_context = True
            request.block_hashes = []

    def _restart_long(self, request: Request) -> None:
        """A running request grew past `long_context_len`: its KV, computed with the
        short-context frequencies, is dropped, and it waits at the front of the queue to be
        computed again as a long-context request."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._enter_long_context(request)
        self.waiting.appendleft(request)

    def preempt_all(self) -> None:
        """Preempt every running request (the KV cache is about to go: sleep mode); they
        wait to be computed again, in the order they would have run."""
        while self.running:
            self._preempt(self.running.pop())

    def _preemption_victim(self) -> Request:
        """The running request to preempt when the KV cache is full: the newest (fcfs), or
        the one with the largest (priority, arrival) (priority policy, as in vLLM)."""
        if self.waiting.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_index))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.spec_token_ids = []
        request.num_inflight_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results ----------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Request]:
        """Append sampled tokens and finish requests that hit a stop condition.

        Args:
            scheduler_output: The step that ran.
            sampled: Request id → the token sampled for it (only requests with needs_sample).

        Returns:
            The requests that got a new token this step (finished ones included), in
            scheduling order.
        """
        updated = []
        for sched in scheduler_output.scheduled:
            token_id = sampled.get(sched.request_id)
            if token_id is None:
                continue
            request = self.requests.get(sched.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.append_output_token(token_id)
            if request.num_inflight_tokens > 0:  # (the later tokens of a verified draft: 0)
                request.num_inflight_tokens -= 1
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    def discard_rejected_drafts(self, request_id: str, num_rejected: int) -> None:
        """Forget the KV of a step's rejected draft tokens: they count as not computed, so
        the next step writes over their slots (the blocks stay allocated)."""
        request = self.requests.get(request_id)
        if request is not None and num_rejected > 0:
            request.num_computed_tokens -= num_rejected

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_out = request.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
        )


def _samples_from_outputs(request: Request) -> bool:
    """Whether the request's next sampling reads its outputs so far (penalties, bad words,
    or min_tokens not reached), so they must be known on the host."""
    return (
        request.reads_outputs or len(request.output_token_ids) < request.sampling_params.min_tokens
    )


def whole_images(images: tuple[ImageInput, ...], start: int, num_new: int) -> int:
    """How many of `num_new` tokens from position `start` a step computes so that it ends
    inside no image: up to the first image it would cut (0 when it starts inside that
    image, which the step cannot finish)."""
    end = start + num_new
    for image in images:  # by offset
        if image.offset < end < image.end:
            return max(image.offset - start, 0)
    return num_new


def _overlapping_images(
    images: tuple[ImageInput, ...], start: int, end: int
) -> tuple[ImageInput, ...]:
    """The images with placeholder tokens in positions `[start, end)`."""
    return tuple(image for image in images if image.offset < end and image.end > start)
