"""A step's outputs on their way to the host: one device → host transfer of everything the
host needs (sampled ids, logprobs, sampling masks, prompt logprobs, the peer all-reduce's
error flag), unpacked into a `ModelRunnerOutput` once it has landed."""

from __future__ import annotations

import torch

from ..core.scheduler import ScheduledRequest
from .prompt_logprobs import PromptLogprobsJob, unpack_prompt_logprobs
from .runner_output import LOGPROB_KEYS, ModelRunnerOutput, PendingOutput, token_logprobs_at
from .sampler import SamplerOutput, unpack_sampling_masks
from .step_buffers import start_copy_to_host


def copy_step_to_host(
    reqs: list[ScheduledRequest],
    result: SamplerOutput | None,
    prompt_jobs: list[PromptLogprobsJob],
    prompt_result: list[torch.Tensor],
    peer_errors: torch.Tensor | None,
    vocab_size: int,
    return_sampling_mask: bool,
) -> PendingOutput:
    """Start the copy of a step's results (`reqs`: the sampled requests, in `result`'s row
    order); the returned output unpacks them when waited for.

    Args:
        peer_errors: The peer all-reduce's error flag (tensor parallelism), or None.
    """
    named: dict[str, torch.Tensor] = {}
    if result is not None:
        named["ids"] = result.sampled_token_ids
        if result.sampled_logprobs is not None:
            named["lp"], named["ranks"] = result.sampled_logprobs, result.sampled_ranks
        if result.topk_token_ids is not None:
            named["top_ids"], named["top_lp"] = result.topk_token_ids, result.topk_logprobs
        if result.sampling_mask_bits is not None:
            named["mask_bits"] = result.sampling_mask_bits
    for i, t in enumerate(prompt_result):
        named[f"prompt{i}"] = t
    if peer_errors is not None:
        named["peer_errors"] = peer_errors
    copies, copied = start_copy_to_host(list(named.values()))

    def unpack() -> ModelRunnerOutput:
        host = dict(zip(named, copies, strict=True))
        return unpack_step_output(reqs, host, prompt_jobs, vocab_size, return_sampling_mask)

    return PendingOutput(unpack, copied)


def unpack_step_output(
    reqs: list[ScheduledRequest],
    host: dict[str, torch.Tensor],
    prompt_jobs: list[PromptLogprobsJob],
    vocab_size: int,
    return_sampling_mask: bool,
) -> ModelRunnerOutput:
    """The step's output from its host copies."""
    out = ModelRunnerOutput()
    if "peer_errors" in host and host["peer_errors"].item():
        raise RuntimeError(
            "a tensor-parallel all-reduce gave up waiting for a rank (dead, or stuck for "
            "minutes); this step's results are lost"
        )
    if prompt_jobs:
        prompt_host = [host[name] for name in host if name.startswith("prompt")]
        out.prompt_logprobs = unpack_prompt_logprobs(prompt_jobs, prompt_host)
    if "ids" not in host:
        return out
    ids = host["ids"].tolist()
    out.sampled = {r.request_id: t for r, t in zip(reqs, ids, strict=True)}
    if return_sampling_mask:
        masks = (
            unpack_sampling_masks(host["mask_bits"].numpy(), vocab_size)
            if "mask_bits" in host
            else [[t] for t in ids]  # every row greedy: the mask is the argmax alone
        )
        out.sampling_masks = {r.request_id: m for r, m in zip(reqs, masks, strict=True)}
    if "lp" not in host:
        return out
    lists = {key: host[key].tolist() for key in LOGPROB_KEYS if key in host}
    for i, r in enumerate(reqs):
        if r.sampling_params.logprobs is not None:
            out.logprobs[r.request_id] = token_logprobs_at(lists, i, r.sampling_params.logprobs)
    return out
