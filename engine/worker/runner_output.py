"""What a model runner step hands back to the engine: sampled tokens, their logprobs,
prompt logprobs, speculative tokens (`ModelRunnerOutput`), and the wait for them
(`PendingOutput`). Plain data: the engine, the speculative decoder and the runner all read
it, and none of them owns it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: its own, its rank, and the top-k alternatives."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PromptLogprobsChunk:
    """Logprobs of a run of consecutive prompt tokens, scored in one step (a prefill chunk).

    Entry j is for prompt token `start + j`, scored by the logits at the position before it.
    """

    start: int
    """Index in the prompt of the first token scored (>= 1: the first token has none)."""
    logprobs: list[float]
    ranks: list[int]
    """Rank of each prompt token among all tokens at its position (1 = most likely)."""
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


LOGPROB_KEYS = ("lp", "ranks", "top_ids", "top_lp")
"""A step's host lists of logprobs, by name: each scored row's logprob and rank, and (when
any request asked for alternatives) its top token ids and their logprobs."""


def token_logprobs_at(host: dict[str, list], row: int, num_top: int) -> TokenLogprobs:
    """Row `row` of a step's logprob lists (`LOGPROB_KEYS`), its top `num_top` kept."""
    return TokenLogprobs(
        host["lp"][row],
        host["ranks"][row],
        host["top_ids"][row][:num_top] if "top_ids" in host else [],
        host["top_lp"][row][:num_top] if "top_lp" in host else [],
    )


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    """Request id → the new token, for requests that reached their last token."""
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    """Request id → logprobs of the token sampled for it (requests asking for logprobs)."""
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    """Request id → the prompt-logprob chunk computed this step."""
    sampling_masks: dict[str, list[int]] = field(default_factory=dict)
    """Request id → sorted ids of the tokens that survived filtering, when the runner's
    `return_sampling_mask` is on."""
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: request id → every token it gained this step (its accepted
    draft tokens, then one drawn token), for requests that had draft tokens; `sampled`
    holds the first."""
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """Logprobs of each token in `spec_tokens` (requests asking for logprobs); `logprobs`
    holds the first."""


class PendingOutput:
    """A step's output on its way to the host.

    Args:
        unpack: Builds the output from the host copies (run once, by `result`).
        copied: Recorded after the copies were queued (None: they are done).
    """

    def __init__(
        self, unpack: Callable[[], ModelRunnerOutput], copied: torch.cuda.Event | None
    ) -> None:
        self._unpack = unpack
        self._copied = copied
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> PendingOutput:
        return cls(lambda: output, None)

    def result(self) -> ModelRunnerOutput:
        """Wait for the copies (the step's only wait for the device) and unpack them."""
        if self._output is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._output = self._unpack()
        return self._output
