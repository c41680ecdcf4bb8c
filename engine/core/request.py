"""A request's state as the scheduler sees it: token ids, progress, status. No tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..lora.request import LoRARequest
from ..multimodal.inputs import ImageInput
from ..multimodal.mrope import MRopePositions
from ..outputs import RequestMetrics
from ..sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish_reason string for a finished status."""
        return _FINISH_REASON.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Invariant: `num_computed_tokens <= num_scheduled_tokens`; the tokens
    `[num_computed_tokens, num_scheduled_tokens)` still need their KV computed; when the two
    are equal after a step, the step's logits at the last token produce the next output
    token. Outside a step scheduled ahead, `num_scheduled_tokens == num_tokens`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    """Every id that ends the request (unless `ignore_eos`): the tokenizer's EOS and the
    generation config's end-of-generation ids."""
    arrival_index: int
    """Order of arrival (first come, first served; under priority scheduling, the order
    among requests of equal priority)."""
    cache_salt: int | None = None
    """Root of this request's block-hash chain. None shares the global prefix cache; a
    private value limits sharing to requests with the same salt (the n samples of one prompt
    when prefix caching is off)."""
    max_cached_tokens: int | None = None
    """Most prompt tokens the prefix cache may serve (None: any). Prompt logprobs need the
    logits of the position before each scored token, so a request that asks for them reuses
    at most the `prompt_logprobs_start - 1` tokens before the first such position (none when
    it scores the whole prompt); set from its sampling params."""
    metrics: RequestMetrics | None = None
    """Timestamps, kept by the engine when it collects statistics (never by the scheduler)."""
    priority: int = 0
    """Under the `priority` scheduling policy, lower values start first (and are preempted
    last); ties go by arrival. Ignored under `fcfs`."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""
    images: tuple[ImageInput, ...] = ()
    """The prompt's images, by placeholder offset (a vision-language model's); their
    placeholder tokens take the vision tower's rows as input embeddings."""
    mrope_positions: MRopePositions | None = None
    """An M-RoPE model's positions of the prompt (None: token indices)."""

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.max_cached_tokens = max(self.sampling_params.prompt_logprobs_start - 1, 0)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens served from the prefix cache at first scheduling (-1: not yet)."""
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []
        """Chained hash of each full block of `all_token_ids`, filled by the KV cache manager."""
        self.num_inflight_tokens = 0
        """Tokens sampled by scheduled steps that have not reached the host yet: with async
        scheduling, the step in flight's and (once scheduled) the next one's, which reads
        the first from the device (see the scheduler's PLACEHOLDER_TOKEN)."""
        params = self.sampling_params
        self.reads_outputs = params.has_penalties or bool(params.bad_words)
        """Every sampling of this request reads its outputs so far (penalties, bad words)."""
        self.spec_token_ids: list[int] = []
        """Draft tokens for the next step to verify (speculative decoding); not part of
        `all_token_ids` until accepted."""
        self.long_context = False
        """The sequence outgrew the model's `long_context_len`: its KV is computed with the
        long-context rotary frequencies (LongRoPE), and hashed apart from a short
        sequence's. Once set, it stays."""

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens including the ones still being sampled on the device."""
        return len(self.all_token_ids) + self.num_inflight_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
