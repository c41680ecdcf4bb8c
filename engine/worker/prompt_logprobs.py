"""Prompt logprobs: which rows of a step's hidden states score which prompt tokens, scoring
them from the raw logits in bounded slices, and splitting the host copies into one chunk per
request.

The logits at position p score token p + 1, so a prefill chunk `[start, end)` scores the
prompt tokens `start + 1 .. min(end, num_prompt_tokens - 1)`, less those before the request's
`prompt_logprobs_start`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..core.scheduler import ScheduledRequest
from ..host_copy import to_device
from .runner_output import PromptLogprobsChunk

# Most logits elements (rows × vocab) materialised at once when scoring prompt tokens.
PROMPT_LOGITS_ELEMENTS = 1 << 24


@dataclass
class PromptLogprobsJob:
    """Where one request's prompt-logprob positions sit in the step's rows."""

    request_id: str
    start: int
    num_positions: int
    num_top: int


@dataclass
class PromptLogprobsRows:
    """A step's prompt-logprob work: one job per request, the rows whose logits score a
    prompt token (`[num_positions]`), and those tokens (`[num_positions]`)."""

    jobs: list[PromptLogprobsJob]
    rows: np.ndarray
    targets: np.ndarray


def prompt_logprobs_rows(reqs: list[ScheduledRequest], qsl: np.ndarray) -> PromptLogprobsRows:
    """The step's rows whose logits score a prompt token, and those tokens (`qsl`: each
    request's first row, then the step's token count)."""
    jobs: list[PromptLogprobsJob] = []
    rows: list[np.ndarray] = []
    targets: list[list[int]] = []
    for i, r in enumerate(reqs):
        k = r.sampling_params.prompt_logprobs
        if k is None:
            continue
        end = min(r.start_pos + len(r.token_ids), len(r.prompt_token_ids) - 1)
        # The position whose logits score the first wanted token (position >= 1).
        first = max(r.start_pos, r.sampling_params.prompt_logprobs_start - 1)
        n = end - first
        if n <= 0:
            continue
        jobs.append(PromptLogprobsJob(r.request_id, first + 1, n, k))
        rows.append(qsl[i] + (first - r.start_pos) + np.arange(n))
        targets.append(r.prompt_token_ids[first + 1 : end + 1])
    if not jobs:
        return PromptLogprobsRows([], np.zeros(0, np.int64), np.zeros(0, np.int64))
    flat_targets = np.fromiter((t for ts in targets for t in ts), np.int64)
    return PromptLogprobsRows(jobs, np.concatenate(rows), flat_targets)


def prompt_slices(num_rows: int, vocab_size: int) -> list[tuple[int, int]]:
    """Row ranges whose `[rows, vocab]` logits are materialised one at a time."""
    step = max(1, PROMPT_LOGITS_ELEMENTS // vocab_size)
    return [(lo, min(lo + step, num_rows)) for lo in range(0, num_rows, step)]


def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    work: PromptLogprobsRows,
    vocab_size: int,
) -> list[torch.Tensor]:
    """Logprob and rank of each target token, and the top-k, from the raw logits.

    Computed in slices of rows so the `[rows, vocab]` logits stay bounded whatever the
    chunk length. Returns `[logprobs, ranks]` plus `[top_ids, top_logprobs]` when a job
    wants k > 0 (device tensors, one row per position).
    """
    max_k = max(job.num_top for job in work.jobs)
    rows_t, targets_t = to_device(work.rows, hidden.device), to_device(work.targets, hidden.device)
    parts: list[list[torch.Tensor]] = []
    for lo, hi in prompt_slices(len(work.rows), vocab_size):
        logprobs = torch.log_softmax(compute_logits(hidden[rows_t[lo:hi]]), dim=-1)  # [n, vocab]
        target_lp = logprobs.gather(1, targets_t[lo:hi, None]).squeeze(1)
        part = [target_lp, (logprobs > target_lp[:, None]).sum(-1) + 1]
        if max_k:
            top = logprobs.topk(max_k, dim=-1)
            part += [top.indices, top.values]
        parts.append(part)
    return [torch.cat(column) for column in zip(*parts, strict=True)]


def unpack_prompt_logprobs(
    jobs: list[PromptLogprobsJob], host: list[torch.Tensor]
) -> dict[str, PromptLogprobsChunk]:
    """Split the step's prompt-logprob rows (`[logprobs, ranks, top_ids?, top_logprobs?]`,
    in job order) into one chunk per request."""
    lp, ranks = host[0].tolist(), host[1].tolist()
    top_ids = host[2].tolist() if len(host) > 2 else None
    top_lp = host[3].tolist() if len(host) > 2 else None
    out: dict[str, PromptLogprobsChunk] = {}
    lo = 0
    for job in jobs:
        hi, k = lo + job.num_positions, job.num_top
        out[job.request_id] = PromptLogprobsChunk(
            start=job.start,
            logprobs=lp[lo:hi],
            ranks=ranks[lo:hi],
            top_ids=[row[:k] for row in top_ids[lo:hi]] if top_ids else [[] for _ in lp[lo:hi]],
            top_logprobs=[row[:k] for row in top_lp[lo:hi]] if top_lp else [[] for _ in lp[lo:hi]],
        )
        lo = hi
    return out
