"""What `LLM.generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None
    """1 for the most likely token."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated position: token id → Logprob, holding the sampled token and the top-k."""


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    """'stop' (EOS, stop string or stop token), 'length' (max_tokens / max_model_len),
    'abort', or None while unfinished."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: object | None = field(default=None, repr=False)
