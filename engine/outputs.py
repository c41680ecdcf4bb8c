"""What `LLM.generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
"""Per prompt position: None for the first token (and for those before
`SamplingParams.prompt_logprobs_start`), then token id → Logprob holding the prompt token
(with its rank among all tokens) and the top-k at that position."""


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (`time.time()`, seconds) of one request, filled when the engine
    collects statistics (`LLM(..., disable_log_stats=False)`)."""

    arrival_time: float
    """When the request entered the engine."""
    first_scheduled_time: float | None = None
    """When the scheduler first gave it tokens to compute."""
    first_token_time: float | None = None
    """When its first output token was sampled."""
    last_token_time: float | None = None
    """When its latest output token was sampled."""
    finished_time: float | None = None
    """When it finished."""

    @property
    def time_in_queue(self) -> float | None:
        """Seconds between arrival and first scheduling."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def first_token_latency(self) -> float | None:
        """Seconds between arrival and the first token (time to first token)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @staticmethod
    def merge(parts: list[RequestMetrics]) -> RequestMetrics:
        """The span of several requests run for one prompt (the n samples of `n > 1`)."""

        def first(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return min(present) if present else None

        def last(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return max(present) if present else None

        return RequestMetrics(
            arrival_time=min(p.arrival_time for p in parts),
            first_scheduled_time=first([p.first_scheduled_time for p in parts]),
            first_token_time=first([p.first_token_time for p in parts]),
            last_token_time=last([p.last_token_time for p in parts]),
            finished_time=last([p.finished_time for p in parts]),
        )


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
    metrics: RequestMetrics | None = field(default=None, repr=False)
    """Timestamps of the request when the engine collects statistics; else None."""
    lora_request: Any = None
    """The `LoRARequest` the prompt ran with (None: the base model)."""


class _LazyField:
    """A dataclass field stored as given and converted on its first read (`materialize`),
    the result kept.

    Large pooling calls hand each output a view of one host array of the call (its flat
    token ids, a batch's embeddings), because most callers never read every output as
    Python objects, and 100k lists or tensors cost more than the forward.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:  # no class-level default: the dataclass keeps the field required
            raise AttributeError(self.key[1:])
        value = obj.__dict__[self.key]
        ready = self.materialize(value)
        if ready is not value:
            obj.__dict__[self.key] = ready
        return ready

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.key] = value

    @staticmethod
    def materialize(value: Any) -> Any:
        return value


class _ListField(_LazyField):
    """May be given a numpy array (or a CPU tensor); always reads as a list."""

    @staticmethod
    def materialize(value: Any) -> list:
        return value if isinstance(value, list) else value.tolist()


@dataclass
class EmbeddingOutput:
    embedding: list[float] = _ListField()  # type: ignore[assignment]

    @property
    def hidden_size(self) -> int:
        return len(self.__dict__["_embedding"])


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


class _TensorRowField(_LazyField):
    """May be given `(matrix, i)`, row `i` of a call's result matrix; always reads as a
    tensor (the row's view: `encode` over 100k texts then makes no tensor object per text
    unless it is read, each view costing about 2 us, a tenth of the call)."""

    @staticmethod
    def materialize(value: Any) -> Any:
        if isinstance(value, tuple):
            matrix, row = value
            return matrix[row]
        return value


@dataclass
class PoolingOutput:
    data: Any = _TensorRowField()
    """A torch tensor: `[hidden]` / `[num_labels]` per sequence, `[num_tokens, ...]` per token."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as a tensor of its own: a row of a call's matrix would carry the whole
        matrix's storage with it."""
        data = self.data
        if isinstance(data, torch.Tensor) and data.untyped_storage().nbytes() > data.nbytes:
            data = data.clone()
        return {"_data": data}


@dataclass
class PoolingRequestOutput:
    """One input's pooling result (`outputs` is the task's output type)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int] = _ListField()  # type: ignore[assignment]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`outputs` is an `EmbeddingOutput`."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """`outputs` is a `ClassificationOutput`."""


class ScoringRequestOutput(PoolingRequestOutput):
    """`outputs` is a `ScoringOutput`."""
