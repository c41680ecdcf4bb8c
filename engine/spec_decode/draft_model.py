"""Draft tokens from a smaller model with the same tokenizer.

The draft runs in its own model runner, with its own KV cache laid out on the target's
block ids (same block tables, same slots), so it needs no block management of its own.
Before each target step it:

1. catches up: computes its KV for every token the target has but it has not (this step's
   prompt chunks, the tokens accepted last step, the token sampled after them), and from
   the last one's logits draws the first draft token of each request that asked for drafts;
2. feeds each draft token back for the next one, `num_drafts - 1` single-token steps.

Draft tokens are drawn from the draft's distribution after the request's temperature /
top-k / top-p / min-p (the argmax for greedy requests); those distributions go to the
rejection sampler as `q`. The draft's KV only affects which tokens are proposed, never the
output: verification keeps the target's distribution whatever the draft does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ..config import EngineConfig, ParallelConfig
from ..core.scheduler import ScheduledRequest
from ..sampling_params import SamplingParams
from ..worker.model_runner import ModelRunner
from ..worker.sampler import Sampler, SamplingMetadata

_PLAIN = SamplingParams()  # the draft's forward runs no sampling of its own


class DraftModelProposer:
    """Args:
    config: The engine's configuration (its `speculative.draft_model` is the draft).
    device: The target's device.
    vocab_size: The target's vocabulary (draft logits are cut or padded to it).
    """

    def __init__(self, config: EngineConfig, device: torch.device, vocab_size: int) -> None:
        draft_config = dataclasses.replace(
            config,
            model=config.speculative.draft_model,
            parallel=ParallelConfig(),
            speculative=None,
        )
        self.runner: ModelRunner = ModelRunner(draft_config, device=device)
        self.vocab_size = vocab_size
        self.num_computed: dict[str, int] = {}
        """Request id → positions whose draft KV is valid."""
        self.draft_probs: dict[str, torch.Tensor] = {}
        """Request id → `[num_drafts, vocab]`: the distributions of this step's drafts
        (sampled requests only)."""

    def propose(
        self,
        reqs: Sequence[ScheduledRequest],
        generator_for: Callable[[ScheduledRequest], torch.Generator | None],
        default_generator: torch.Generator,
    ) -> None:
        """Fill the draft tokens of the requests that have some (placeholders until now), in
        `spec_token_ids` and at the tail of `token_ids`."""
        self.draft_probs = {}
        catch_up: list[ScheduledRequest] = []
        drafting: list[ScheduledRequest] = []
        for r in reqs:
            num_real = len(r.token_ids) - len(r.spec_token_ids)
            end = r.start_pos + num_real
            # A preempted request recomputes from its start (its blocks were freed); one
            # that is new trusts the KV of the prefix-cache blocks it starts with.
            start = min(self.num_computed.get(r.request_id, r.start_pos), r.start_pos)
            self.num_computed[r.request_id] = end
            if start >= end:
                continue
            tokens = _tokens(r, start, end)
            needs = bool(r.spec_token_ids)
            catch_up.append(
                ScheduledRequest(r.request_id, tokens, start, r.block_ids, needs, _PLAIN, [])
            )
            if needs:
                drafting.append(r)
        if not drafting:
            if catch_up:
                self._forward(catch_up)
            return
        logits = self._forward(catch_up)
        max_drafts = max(len(r.spec_token_ids) for r in drafting)
        probs: dict[str, list[torch.Tensor]] = {}
        for j in range(max_drafts):
            if j > 0:
                drafting = [r for r in drafting if len(r.spec_token_ids) > j]
                steps = [
                    ScheduledRequest(
                        r.request_id,
                        [r.spec_token_ids[j - 1]],
                        r.start_pos + j,  # the draft before it, right after the real tokens
                        r.block_ids,
                        True,
                        _PLAIN,
                        [],
                    )
                    for r in drafting
                ]
                logits = self._forward(steps)
            tokens, q = self._draw(logits, drafting, generator_for, default_generator)
            for i, r in enumerate(drafting):
                r.spec_token_ids[j] = tokens[i]
                r.token_ids[len(r.token_ids) - len(r.spec_token_ids) + j] = tokens[i]
                if q is not None and not r.sampling_params.is_greedy:
                    probs.setdefault(r.request_id, []).append(q[i])
        self.draft_probs = {rid: torch.stack(rows) for rid, rows in probs.items()}

    def after_verify(self, request: ScheduledRequest, num_accepted: int) -> None:
        """Draft KV stays valid for the real tokens and the accepted drafts it computed
        (all but the last draft were fed back)."""
        num_drafts = len(request.spec_token_ids)
        first_draft = request.start_pos + len(request.token_ids) - num_drafts
        self.num_computed[request.request_id] = first_draft + min(num_accepted, num_drafts - 1)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft's KV cache on the target's `num_blocks` block ids (nothing in it yet)."""
        self.runner.allocate_kv_cache(num_blocks)
        self.num_computed.clear()

    @property
    def block_bytes(self) -> int:
        return self.runner.block_bytes

    def forget(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            self.num_computed.pop(rid, None)

    def _forward(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """Run the draft on `reqs`; logits `[num_needing_sample, vocab]` (target's width)."""
        runner = self.runner
        inputs, _ = runner.prepare_inputs(reqs)
        hidden = runner.forward(inputs)
        if not len(inputs.sample_rows):
            return torch.empty(0)
        logits = runner.model.compute_logits(runner.sample_hidden(hidden, inputs))
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[:, : self.vocab_size]
        if width < self.vocab_size:
            pad = logits.new_full((logits.shape[0], self.vocab_size - width), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def _draw(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab]
        reqs: list[ScheduledRequest],
        generator_for: Callable[[ScheduledRequest], torch.Generator | None],
        default_generator: torch.Generator,
    ) -> tuple[list[int], torch.Tensor | None]:
        """One draft token per request, and the distributions they were drawn from (None
        when every request is greedy)."""
        params = [r.sampling_params for r in reqs]
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1).tolist(), None
        meta = SamplingMetadata.build(params, {}, self.vocab_size, logits.device)
        probs, _ = Sampler.filtered_probs(logits, meta)
        noise = torch.empty_like(probs)
        generators = [generator_for(r) for r in reqs]
        if any(gen is None for gen in generators):
            noise.exponential_(generator=default_generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        drawn = torch.where(meta.greedy, logits.argmax(dim=-1), probs.div(noise).argmax(dim=-1))
        return drawn.tolist(), probs


def _tokens(r: ScheduledRequest, start: int, end: int) -> list[int]:
    """The request's real tokens `[start, end)` (prompt, then output)."""
    prompt, output = r.prompt_token_ids, r.output_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    head = prompt[start:] if start < num_prompt else []
    return head + output[max(start - num_prompt, 0) : end - num_prompt]
