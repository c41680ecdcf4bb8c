"""The engine's side of speculative decoding (host only, no tensors).

Before a step it gives every request that is decoding its draft tokens (`spec_token_ids`):
n-gram drafts looked up in the request's tokens, or placeholders that the draft model fills
in on the device. Never more than `num_speculative_tokens`, nor more than the request can
still use: a step yields up to one token more than it has drafts, and positions past
`max_model_len` do not exist.

After the step, it rolls back the KV of rejected drafts (`num_computed_tokens`), records
the acceptance counts, and splits the runner's output into one output per token position,
so that the scheduler and the output processor take the gained tokens one at a time: stop
tokens, stop strings, `max_tokens` and `min_tokens` apply exactly as without speculation,
and tokens after a stop are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..config import SpeculativeConfig
from ..core.request import Request
from ..core.scheduler import Scheduler, SchedulerOutput
from ..worker.runner_output import ModelRunnerOutput
from .ngram import NgramProposer

PLACEHOLDER_TOKEN_ID = 0
"""Stands for a draft-model token until the runner draws it."""


@dataclass
class SpecDecodeStats:
    """Acceptance counts of one step (the metrics' `record_spec_decode` arguments)."""

    num_drafts: int
    """Requests that had draft tokens."""
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    """Requests whose draft at position i was accepted."""


class SpecDecodeManager:
    """Args:
    config: The speculative-decoding configuration.
    max_model_len: Longest sequence.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = (
            NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
            if config.method == "ngram"
            else None
        )

    def propose(self, requests: Iterable[Request]) -> None:
        """Set the draft tokens of every running request for the coming step."""
        for request in requests:
            limit = self._limit(request)
            if limit <= 0:
                request.spec_token_ids = []
            elif self.ngram is not None:
                request.spec_token_ids = self.ngram.propose(request.all_token_ids, limit)
            else:
                request.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * limit

    def _limit(self, request: Request) -> int:
        """How many draft tokens the request can use now (0 while it is still prefilling)."""
        if request.num_computed_tokens != request.num_tokens - 1:
            return 0
        limit = min(self.num_speculative_tokens, self.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        return limit

    def fold(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput, scheduler: Scheduler
    ) -> tuple[list[ModelRunnerOutput], SpecDecodeStats | None]:
        """Roll back rejected drafts and split the step's output by token position.

        Returns:
            One runner output per token position (the first is `runner_out`, with the
            prompt logprobs), and the acceptance counts (None when no request had drafts).
        """
        num_drafts = num_draft_tokens = num_accepted = 0
        per_position = [0] * self.num_speculative_tokens
        for sched in sched_out.scheduled:
            num_spec = len(sched.spec_token_ids)
            tokens = runner_out.spec_tokens.get(sched.request_id)
            if not num_spec or tokens is None:
                continue
            accepted = len(tokens) - 1
            scheduler.discard_rejected_drafts(sched.request_id, num_spec - accepted)
            num_drafts += 1
            num_draft_tokens += num_spec
            num_accepted += accepted
            for position in range(accepted):
                per_position[position] += 1
        if not num_drafts:
            return [runner_out], None
        views = [runner_out]
        longest = max(len(tokens) for tokens in runner_out.spec_tokens.values())
        for j in range(1, longest):
            views.append(
                ModelRunnerOutput(
                    sampled={
                        rid: tokens[j]
                        for rid, tokens in runner_out.spec_tokens.items()
                        if len(tokens) > j
                    },
                    logprobs={
                        rid: entries[j]
                        for rid, entries in runner_out.spec_logprobs.items()
                        if len(entries) > j
                    },
                )
            )
        stats = SpecDecodeStats(num_drafts, num_draft_tokens, num_accepted, per_position)
        return views, stats
