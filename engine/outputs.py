"""What `LLM.generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """Log probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None
    """1 for the most likely token."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated position: token id → Logprob, holding the sampled token and the top-k."""

PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt position: None for the first token, then token id → Logprob holding the
prompt token (with its rank among all tokens) and the top-k at that position."""


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
    sampling_mask: list[list[int]] | None = None
    """With `LLM(return_sampling_mask=True)`: one entry per generated token (parallel to
    `token_ids`), the sorted ids of the tokens the sampler could draw at that step, i.e.
    those left after allowed_token_ids, bad_words, -inf logit_bias, min_tokens bans,
    top-k, top-p and min-p. A greedy step gives `[argmax]` alone. None when not asked for."""

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
    prompt_logprobs: PromptLogprobs | None = None
    """With `SamplingParams(prompt_logprobs=k)`: see `PromptLogprobs`; else None."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: object | None = field(default=None, repr=False)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]
    """Class probabilities (raw logits with use_activation=False)."""

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    data: Any
    """A torch tensor: `[hidden]` / `[num_labels]` per sequence, `[num_tokens, ...]` per token."""


@dataclass
class PoolingRequestOutput:
    """One input's pooling result (`outputs` is the task's output type)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`outputs` is an `EmbeddingOutput`."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """`outputs` is a `ClassificationOutput`."""


class ScoringRequestOutput(PoolingRequestOutput):
    """`outputs` is a `ScoringOutput`."""
