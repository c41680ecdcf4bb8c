"""Verification of draft tokens by rejection sampling, batched on the device.

A request with `s` draft tokens `d_0 .. d_{s-1}` is scored at `s + 1` rows: row `j` holds
the target's logits after the request's tokens and `d_0 .. d_{j-1}`. Each row goes through
the sampler's full logits processing (penalties and `min_tokens` count the drafts before
it as output tokens; temperature, top-k / top-p / min-p) to the target distribution `p_j`.
Then, row by row until the first rejection:

- greedy: `d_j` is accepted when it is the argmax of `p_j`; the first rejected row (or row
  `s` when all are accepted) yields its argmax. Greedy output is exactly what decoding one
  token at a time gives.
- sampling: `d_j` is accepted with probability `min(1, p_j(d_j) / q_j(d_j))`, where `q_j` is
  the distribution the draft was drawn from (a point mass for n-gram drafts); the first
  rejected row yields a token drawn from `norm(max(0, p_j - q_j))`, and row `s` (all
  accepted) a token drawn from `p_s`. Every emitted token is then distributed exactly as
  `p` (Leviathan et al., 2023; Chen et al., 2023).

So a request gains `a + 1` tokens, where `a` counts its accepted drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.scheduler import ScheduledRequest
from ..worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_logits_processing,
    chosen_logprobs,
)


def spec_sample_rows(reqs: Sequence[ScheduledRequest], query_start_loc: np.ndarray) -> np.ndarray:
    """Rows of the step's hidden states to score: for each request that samples, its last
    `1 + len(spec_token_ids)` tokens (the last real token, then each draft token)."""
    rows = [
        np.arange(query_start_loc[i + 1] - 1 - len(r.spec_token_ids), query_start_loc[i + 1])
        for i, r in enumerate(reqs)
        if r.needs_sample
    ]
    return np.concatenate(rows) if rows else np.zeros(0, np.int64)


@dataclass
class VerifiedRows:
    """Per scored row (device tensors, `[num_rows]`), what verification decided."""

    token_ids: torch.Tensor  # int64: the draft token where accepted, else the token drawn
    accepted: torch.Tensor  # bool: the row's draft token was accepted (False on bonus rows)
    logprobs: torch.Tensor | None  # float32: raw logprob of `token_ids`
    ranks: torch.Tensor | None  # int64: its rank among the raw logits (1 = most likely)
    topk_token_ids: torch.Tensor | None  # [num_rows, max_num_logprobs] int64
    topk_logprobs: torch.Tensor | None  # [num_rows, max_num_logprobs] float32


class RejectionSampler:
    """Verifies the draft tokens of a step.

    Args:
        generator: The engine's generator, for requests without their own seed.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32, rows as `spec_sample_rows`
        reqs: Sequence[ScheduledRequest],  # the requests that sample, in row order
        generators: dict[int, torch.Generator],  # request index → its own generator
        vocab_size: int,
        draft_probs: dict[int, torch.Tensor] | None = None,
    ) -> VerifiedRows:
        """Accept or reject every draft token and draw the replacement / bonus tokens.

        Args:
            draft_probs: Request index → `[num_drafts, vocab]` distributions its drafts were
                drawn from; requests not in it have deterministic drafts (point masses).
        """
        device = logits.device
        row_params, row_outputs, row_prompts, row_eos, draft_ids = [], [], [], [], []
        row_generators: dict[int, torch.Generator] = {}
        for i, r in enumerate(reqs):
            spec = r.spec_token_ids
            for j in range(len(spec) + 1):
                if i in generators:
                    row_generators[len(draft_ids)] = generators[i]
                row_params.append(r.sampling_params)
                row_outputs.append(r.output_token_ids + spec[:j])
                row_prompts.append(r.prompt_token_ids)
                row_eos.append(r.eos_token_ids)
                draft_ids.append(spec[j] if j < len(spec) else -1)
        meta = SamplingMetadata.build(
            row_params,
            row_generators,
            vocab_size,
            device,
            output_token_ids=row_outputs,
            prompt_token_ids=row_prompts,
            eos_token_ids=row_eos,
        )
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        )
        if meta.processing is not None:
            logits = apply_logits_processing(logits.clone(), meta.processing)
        drafts = torch.tensor(draft_ids, dtype=torch.int64).to(device)  # [num_rows], -1: none
        has_draft = drafts >= 0
        safe_drafts = drafts.clamp(min=0)[:, None]  # [num_rows, 1]
        greedy_ids = logits.argmax(dim=-1)
        greedy_accepted = has_draft & (drafts == greedy_ids)
        if meta.all_greedy:
            accepted, drawn = greedy_accepted, greedy_ids
        else:
            probs, _ = Sampler.filtered_probs(logits, meta)  # [num_rows, vocab]
            q = self._draft_distribution(probs, safe_drafts, has_draft, reqs, draft_probs)
            p_draft = probs.gather(1, safe_drafts).squeeze(1)
            q_draft = q.gather(1, safe_drafts).squeeze(1)
            uniform, noise = self._draws(probs, row_generators)
            random_accepted = has_draft & (uniform * q_draft < p_draft)
            # The replacement: norm(max(0, p - q)); bonus rows (q = 0) draw from p itself.
            residual = (probs - q).clamp(min=0)
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
            random_drawn = residual.div(noise).argmax(dim=-1)  # exponential race
            accepted = torch.where(meta.greedy, greedy_accepted, random_accepted)
            drawn = torch.where(meta.greedy, greedy_ids, random_drawn)
        token_ids = torch.where(accepted, drafts, drawn)
        out = VerifiedRows(token_ids, accepted, None, None, None, None)
        if raw_logprobs is not None:
            out.logprobs, out.ranks, out.topk_token_ids, out.topk_logprobs = chosen_logprobs(
                raw_logprobs, token_ids, meta.max_num_logprobs
            )
        return out

    @staticmethod
    def _draft_distribution(
        probs: torch.Tensor,  # [num_rows, vocab]
        safe_drafts: torch.Tensor,  # [num_rows, 1]
        has_draft: torch.Tensor,  # [num_rows]
        reqs: Sequence[ScheduledRequest],
        draft_probs: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        """`q` per row `[num_rows, vocab]`: a point mass on the draft token, or the draft
        model's distribution; zero on bonus rows."""
        q = torch.zeros_like(probs).scatter_(1, safe_drafts, 1.0)
        q.masked_fill_(~has_draft[:, None], 0.0)
        if draft_probs:
            row = 0
            for i, r in enumerate(reqs):
                num = len(r.spec_token_ids)
                if i in draft_probs and num:
                    q[row : row + num] = draft_probs[i]
                row += num + 1
        return q

    def _draws(
        self, probs: torch.Tensor, row_generators: dict[int, torch.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform `[num_rows]` and exponential noise `[num_rows, vocab]` per row, from the
        row's request generator where it has one."""
        uniform = torch.empty(probs.shape[0], device=probs.device)
        noise = torch.empty_like(probs)
        if len(row_generators) < probs.shape[0]:
            uniform.uniform_(generator=self.generator)
            noise.exponential_(generator=self.generator)
        for row, gen in row_generators.items():
            uniform[row].uniform_(generator=gen)
            noise[row].exponential_(generator=gen)
        return uniform, noise


def accepted_spans(reqs: Sequence[ScheduledRequest], accepted: list[bool]) -> list[tuple[int, int]]:
    """Per request, `(first row, number of tokens)` of what it gains: its rows up to and
    including the first one whose draft was not accepted."""
    spans = []
    row = 0
    for r in reqs:
        num_rows = len(r.spec_token_ids) + 1
        n = 1
        while n < num_rows and accepted[row + n - 1]:
            n += 1
        spans.append((row, n))
        row += num_rows
    return spans
