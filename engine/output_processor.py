"""Per-request output state: detokenized text, stop strings, logprobs, final RequestOutput."""

from __future__ import annotations

from typing import Any

from .core.request import Request, RequestStatus
from .outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from .tokenizer import IncrementalDetokenizer
from .worker.runner_output import ModelRunnerOutput, PromptLogprobsChunk, TokenLogprobs


class RequestState:
    """What the host keeps for one request until it finishes."""

    def __init__(self, request: Request, prompt: str | None, tokenizer: Any) -> None:
        self.request = request
        self.prompt = prompt
        params = request.sampling_params
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params)
            if tokenizer is not None
            else None
        )
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None
        if params.prompt_logprobs is not None:
            # Positions before the first scored one stay None (position 0 always does).
            num_unscored = max(params.prompt_logprobs_start, 1)
            self.prompt_logprobs = [None] * min(num_unscored, len(request.prompt_token_ids))
        self.sampling_mask: list[list[int]] | None = None
        """Filled once the runner sends masks (it does when return_sampling_mask is on)."""
        self.tokenizer = tokenizer


class OutputProcessor:
    """Turns each step's new tokens into text and finished `RequestOutput`s."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        self.states[request.request_id] = RequestState(request, prompt, self.tokenizer)

    def process(
        self, updated: list[Request], step: ModelRunnerOutput
    ) -> tuple[list[str], list[str]]:
        """Consume the step's new tokens.

        Args:
            updated: Requests that got a token this step.
            step: The runner's output: sampled-token logprobs, prompt-logprob chunks and
                sampling masks of this step.

        Returns:
            The ids of requests that are finished (build their outputs with `finish` once the
            scheduler has released them), and, among them, those that a stop string ended
            and that the scheduler does not know are finished yet.
        """
        finished: list[str] = []
        stopped_by_string: list[str] = []
        masks = step.sampling_masks
        for rid, chunk in step.prompt_logprobs.items():
            state = self.states.get(rid)
            if state is not None and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, chunk)
        for request in updated:
            rid = request.request_id
            state = self.states[rid]
            token_id = request.output_token_ids[-1]
            params = request.sampling_params
            entry = step.logprobs.get(rid)
            if state.logprobs is not None and entry is not None:
                state.logprobs.append(self._logprob_dict(token_id, entry, params.detokenize))
                state.cumulative_logprob += entry.logprob
            mask = masks.get(rid)
            if mask is not None:
                if state.sampling_mask is None:
                    state.sampling_mask = []
                state.sampling_mask.append(mask)
            # (A request its grammar ended stops after a token of its own text.)
            stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED and (
                token_id in request.eos_token_ids or token_id in params.stop_token_ids
            )
            if state.detokenizer is not None:
                skip = stopped_by_token and not params.include_stop_str_in_output
                stop = state.detokenizer.add_token(token_id, skip_text=skip)
                if stop is None and request.status.is_finished:
                    stop = state.detokenizer.flush()  # bytes of an unfinished last character
                if stop is not None:
                    request.stop_reason = stop
                    if not request.status.is_finished:
                        stopped_by_string.append(rid)
                    else:
                        request.status = RequestStatus.FINISHED_STOPPED
            if request.status.is_finished or rid in stopped_by_string:
                finished.append(rid)
        return finished, stopped_by_string

    def _add_prompt_logprobs(self, state: RequestState, chunk: PromptLogprobsChunk) -> None:
        """Append a chunk's positions; positions already there (recomputed after a
        preemption) are skipped."""
        out = state.prompt_logprobs
        assert out is not None
        prompt = state.request.prompt_token_ids
        for j, (logprob, rank) in enumerate(zip(chunk.logprobs, chunk.ranks, strict=True)):
            position = chunk.start + j
            if position < len(out):
                continue
            assert position == len(out), "prompt-logprob chunks arrive in prompt order"
            token_id = prompt[position]
            out.append(
                self._logprob_dict(
                    token_id,
                    TokenLogprobs(logprob, rank, chunk.top_ids[j], chunk.top_logprobs[j]),
                    state.request.sampling_params.detokenize,
                )
            )

    def _logprob_dict(
        self, token_id: int, entry: TokenLogprobs, detokenize: bool = True
    ) -> dict[int, Logprob]:
        """Token id → `Logprob`; `decoded_token` is None with `detokenize=False` (as in
        vLLM), which saves a tokenizer call per candidate when only the numbers count."""
        tokenizer = self.tokenizer if detokenize else None
        ids = [token_id, *entry.top_ids]
        values = [entry.logprob, *entry.top_logprobs]
        ranks = [entry.rank, *range(1, len(entry.top_ids) + 1)]
        out: dict[int, Logprob] = {}
        for tid, value, rank in zip(ids, values, ranks, strict=True):
            if tid not in out:
                decoded = tokenizer.decode([tid]) if tokenizer is not None else None
                out[tid] = Logprob(value, rank, decoded)
        return out

    def finish(self, request_id: str) -> RequestOutput:
        state = self.states.pop(request_id)
        request = state.request
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.text if state.detokenizer is not None else "",
            token_ids=list(request.output_token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            sampling_mask=state.sampling_mask,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[completion],
            finished=True,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=request.metrics,
            lora_request=request.lora_request,
        )
