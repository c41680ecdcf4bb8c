"""The model runner's side of speculative decoding.

Before the forward, a draft model (when that is the method) fills in the draft tokens the
scheduler made room for; the step's layout scores every draft position
(`spec_sample_rows`); after the forward, the rejection sampler verifies the drafts and the
tokens each request gains go back in `ModelRunnerOutput.spec_tokens` (n-gram drafts arrive
already filled in by the engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..config import EngineConfig
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..worker.model_runner import ModelRunner
from ..worker.runner_output import ModelRunnerOutput, token_logprobs_at
from ..worker.step_buffers import copy_to_host
from .draft_model import DraftModelProposer
from .rejection import RejectionSampler, accepted_spans, spec_sample_rows


class SpecDecodeRunner:
    """Speculative decoding on a target's runner (the runner's `SpeculativeDecoder`).

    Args:
        config: The engine configuration (`config.speculative` set).
        runner: The target's model runner, which this is then handed to (`attach`).
    """

    @classmethod
    def attach(cls, config: EngineConfig, runner: ModelRunner) -> ModelRunner:
        """`runner` with speculative decoding when `config` asks for it."""
        if config.speculative is not None:
            runner.spec = cls(config, runner)
        return runner

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.runner = runner
        self.rejection = RejectionSampler(runner.generator)
        self.drafter = (
            DraftModelProposer(config, runner.device, runner.vocab_size)
            if config.speculative.method == "draft_model"
            else None
        )

    @property
    def draft_runner(self) -> ModelRunner | None:
        """The draft model's runner (None for ngram drafts): sleep mode frees and restores
        its memory with the target's."""
        return self.drafter.runner if self.drafter is not None else None

    @property
    def block_bytes(self) -> int:
        """KV bytes per block besides the target's (the draft's cache)."""
        return self.drafter.block_bytes if self.drafter is not None else 0

    def allocate_kv_cache(self, num_blocks: int, final: bool) -> None:
        """Follow the target's KV cache allocation (`final`: the engine's cache, after
        profiling, where the draft may capture its CUDA graphs)."""
        if self.drafter is None:
            return
        if final:
            self.drafter.runner.initialize_kv_cache(num_blocks)
            self.drafter.num_computed.clear()
        else:
            self.drafter.allocate_kv_cache(num_blocks)

    def before_forward(self, out: SchedulerOutput) -> None:
        if self.drafter is None:
            return
        self.drafter.forget(out.finished_request_ids)
        self.drafter.propose(
            out.scheduled,
            lambda r: self.runner.request_generators.get(r.request_id, r.sampling_params.seed),
            self.runner.generator,
        )

    def sample_rows(self, reqs: Sequence[ScheduledRequest], qsl: np.ndarray) -> np.ndarray:
        """The step's rows to score: each sampling request's last token and its drafts."""
        return spec_sample_rows(reqs, qsl)

    def verify(
        self,
        logits: torch.Tensor,  # [num_rows, vocab], rows as `spec_sample_rows`
        reqs: Sequence[ScheduledRequest],  # the requests that sample
        generators: dict[int, torch.Generator],  # request index → its own generator
        out: ModelRunnerOutput,
    ) -> None:
        """Verify the drafts; fill `out.sampled` (first token), `out.spec_tokens` (every
        token gained, for requests with drafts) and the logprobs of each token."""
        draft_probs = None
        if self.drafter is not None and self.drafter.draft_probs:
            draft_probs = {
                i: self.drafter.draft_probs[r.request_id]
                for i, r in enumerate(reqs)
                if r.request_id in self.drafter.draft_probs
            }
        rows = self.rejection(logits, reqs, generators, self.runner.vocab_size, draft_probs)
        named = {"ids": rows.token_ids, "accepted": rows.accepted}
        if rows.logprobs is not None:
            named["lp"], named["ranks"] = rows.logprobs, rows.ranks
        if rows.topk_token_ids is not None:
            named["top_ids"], named["top_lp"] = rows.topk_token_ids, rows.topk_logprobs
        host = {
            k: v.tolist() for k, v in zip(named, copy_to_host(list(named.values())), strict=True)
        }
        ids = host["ids"]
        for r, (first, n) in zip(reqs, accepted_spans(reqs, host["accepted"]), strict=True):
            rid = r.request_id
            tokens = ids[first : first + n]
            out.sampled[rid] = tokens[0]
            if r.spec_token_ids:
                out.spec_tokens[rid] = tokens
                if self.drafter is not None:
                    self.drafter.after_verify(r, n - 1)
            k = r.sampling_params.logprobs
            if k is None or "lp" not in host:
                continue
            entries = [token_logprobs_at(host, row, k) for row in range(first, first + n)]
            out.logprobs[rid] = entries[0]
            if r.spec_token_ids:
                out.spec_logprobs[rid] = entries
