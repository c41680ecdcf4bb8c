"""`StructuredOutputManager`: the engine's side of structured outputs (host only).

It compiles each request's constraint (cached by spec), keeps one matcher per constrained
request (rank 0's: only rank 0 samples), and per step:

- `mask_source`: the step's bitmask, filled when the runner asks for it, after the step's
  forward is launched. With async scheduling a request's token in flight is then read
  from the previous step's output (which that wait brings to the host while this step's
  forward runs) and accepted ahead of the engine's processing of it; see `RequestMatcher`
  for why that never leaves a matcher wrong.
- `advance`: once a step's tokens are appended, each matcher follows its request; a
  request whose grammar is complete (its stop token accepted) or that got a token the
  grammar refuses is to be ended (finish reason `stop`).
- `trim_drafts`: speculative decoding's drafts cut at the first token the grammar refuses
  (verification would reject it anyway; the positions after it would be wasted).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..config import StructuredOutputsConfig
from ..core.request import Request
from ..core.scheduler import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from ..errors import InvalidParamError
from ..sampling_params import SamplingParams
from ..worker.grammar_mask import GrammarBitmask, GrammarMaskSource
from ..worker.runner_output import PendingOutput
from .backend import ALL_ALLOWED, GrammarBackend, GrammarCompileError
from .grammar_cache import GrammarCache
from .grammar_spec import grammar_spec
from .request_matcher import RequestMatcher
from .selector import backend_for, create_backend

logger = logging.getLogger(__name__)

_Job = tuple[int, ScheduledRequest, RequestMatcher]
"""A constrained request of a step: its first logits row, its share of the step, its
matcher."""


class StructuredOutputManager:
    """Args:
    config: The engine's structured-outputs options.
    tokenizer: The engine's tokenizer (None: structured outputs are refused).
    vocab_size: The model's logits width.
    eos_token_ids: The engine's end-of-generation ids.
    pin_memory: Stage bitmasks in pinned memory (CUDA), so their copy does not wait.
    speculative_method: The engine's speculative decoding method, if any.
    """

    def __init__(
        self,
        config: StructuredOutputsConfig,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        pin_memory: bool = False,
        speculative_method: str | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.pin_memory = pin_memory
        self.speculative_method = speculative_method
        self.cache = GrammarCache()
        self._backends: dict[str, GrammarBackend] = {}
        self._matchers: dict[str, RequestMatcher] = {}
        self.num_words = -(-vocab_size // 32)
        """Width of a bitmask row in int32 words."""

    @property
    def num_requests(self) -> int:
        """Constrained requests in the engine (each holds a matcher)."""
        return len(self._matchers)

    # ---- requests ---------------------------------------------------------------------

    def validate(self, params: SamplingParams, index: int) -> None:
        """Compile `params`' constraint now (cached), before any request of the call runs.

        Raises:
            InvalidParamError: naming `prompts[index]`, why, and the compiler's message.
        """
        if params.structured_outputs is None:
            return
        try:
            self._compile(params)
        except InvalidParamError as e:
            raise InvalidParamError(f"prompts[{index}] has {e}") from None

    def add_request(self, request: Request) -> None:
        """Give a constrained request its matcher (a no-op for a free request).

        Raises:
            InvalidParamError: the constraint does not compile (when not validated first).
        """
        params = request.sampling_params
        if params.structured_outputs is None:
            return
        try:
            backend, compiled = self._compile(params)
        except InvalidParamError as e:
            raise InvalidParamError(f"request {request.request_id!r} has {e}") from None
        stop_token_ids = [*request.eos_token_ids, *(params.stop_token_ids or [])]
        self._matchers[request.request_id] = RequestMatcher(
            backend.matcher(compiled, stop_token_ids), backend
        )

    def finish(self, request_ids: Iterable[str]) -> None:
        """Drop the matchers of finished or aborted requests."""
        if self._matchers:
            for rid in request_ids:
                self._matchers.pop(rid, None)

    def _compile(self, params: SamplingParams) -> tuple[GrammarBackend, Any]:
        if self.tokenizer is None:
            raise InvalidParamError(
                "structured_outputs, which need the tokenizer, and the engine was built with "
                "skip_tokenizer_init=True; drop one of the two"
            )
        if self.speculative_method == "draft_model":
            raise InvalidParamError(
                "structured_outputs, which speculative decoding with method='draft_model' "
                "does not support (its drafts are drawn on the device, unchecked by the "
                "grammar); use method='ngram' or no speculative decoding"
            )
        spec = grammar_spec(params.structured_outputs, self.config)
        name = backend_for(self.config, spec, params.structured_outputs.backend)
        try:
            backend = self._backend(name)
            return backend, self.cache.get(name, spec, lambda: backend.compile(spec))
        except GrammarCompileError as e:
            raise InvalidParamError(
                f"structured_outputs whose {spec.describe()} {name} cannot compile: {e}; fix "
                f"the {spec.describe()}"
            ) from None

    def _backend(self, name: str) -> GrammarBackend:
        backend = self._backends.get(name)
        if backend is None:
            try:
                backend = create_backend(name, self.tokenizer, self.vocab_size, self.eos_token_ids)
            except (ValueError, RuntimeError, TypeError, AttributeError) as e:
                raise GrammarCompileError(f"{name} cannot read this tokenizer ({e})") from None
            self._backends[name] = backend
        return backend

    # ---- steps ------------------------------------------------------------------------

    def advance(self, requests: Iterable[Request]) -> list[str]:
        """Let each constrained request's matcher follow its output tokens (after a step's
        tokens are appended); the ids of the unfinished requests to end now."""
        ended = []
        for request in requests:
            matcher = self._matchers.get(request.request_id)
            if matcher is None or request.status.is_finished:
                continue
            if not matcher.sync(request.output_token_ids):
                logger.warning(
                    "request %s: token %d is not allowed by its grammar; ending it",
                    request.request_id,
                    request.output_token_ids[len(matcher.tokens)],
                )
                ended.append(request.request_id)
            elif matcher.matcher.is_terminated():
                ended.append(request.request_id)
        return ended

    def trim_drafts(self, requests: Iterable[Request]) -> None:
        """Cut each constrained request's draft tokens at the first the grammar refuses."""
        for request in requests:
            matcher = self._matchers.get(request.request_id)
            if matcher is None or not request.spec_token_ids:
                continue
            if not matcher.sync(request.output_token_ids) or matcher.matcher.is_terminated():
                request.spec_token_ids = []
                continue
            num_valid = matcher.num_valid_drafts(request.spec_token_ids)
            request.spec_token_ids = request.spec_token_ids[:num_valid]

    def mask_source(
        self, sched_out: SchedulerOutput, in_flight: PendingOutput | None = None
    ) -> GrammarMaskSource | None:
        """What fills the step's bitmask (None when no constrained request samples in it).

        Args:
            sched_out: The step.
            in_flight: The output of the step launched before it and not yet processed
                (async scheduling), where the tokens it reads on the device come from.
        """
        if not self._matchers:
            return None
        jobs: list[_Job] = []
        row = 0
        for sched in sched_out.scheduled:
            if not sched.needs_sample:
                continue
            matcher = self._matchers.get(sched.request_id)
            if matcher is not None:
                jobs.append((row, sched, matcher))
            row += 1 + len(sched.spec_token_ids)
        if not jobs:
            return None
        return functools.partial(self._fill, jobs, in_flight)

    def _fill(self, jobs: list[_Job], in_flight: PendingOutput | None) -> GrammarBitmask:
        sampled: dict[str, int] = {}
        if in_flight is not None and any(_reads_token_in_flight(s) for _, s, _ in jobs):
            sampled = in_flight.result().sampled
        num_rows = sum(1 + len(sched.spec_token_ids) for _, sched, _ in jobs)
        bitmask = torch.empty(
            (num_rows, self.num_words), dtype=torch.int32, pin_memory=self.pin_memory
        )
        logits_rows: list[int] = []
        groups: dict[int, tuple[GrammarBackend, list[Any], list[int]]] = {}
        row = 0
        for first, sched, matcher in jobs:
            num = 1 + len(sched.spec_token_ids)
            logits_rows.extend(range(first, first + num))
            token = sampled.get(sched.request_id) if _reads_token_in_flight(sched) else None
            if not matcher.sync(sched.output_token_ids, token) or matcher.matcher.is_terminated():
                # The request ends once its tokens are processed; this row is never used.
                bitmask[row : row + num] = ALL_ALLOWED
            elif sched.spec_token_ids:
                matcher.fill_draft_rows(bitmask, row, sched.spec_token_ids)
            else:
                group = groups.setdefault(id(matcher.backend), (matcher.backend, [], []))
                group[1].append(matcher.matcher)
                group[2].append(row)
            row += num
        for backend, matchers, rows in groups.values():
            backend.fill_bitmasks(matchers, bitmask, rows)
        return GrammarBitmask(np.asarray(logits_rows, dtype=np.int64), bitmask)


def _reads_token_in_flight(sched: ScheduledRequest) -> bool:
    """Whether the step reads the request's last token from the previous step's samples
    (its last token before the drafts is the scheduler's placeholder)."""
    return sched.token_ids[-1 - len(sched.spec_token_ids)] == PLACEHOLDER_TOKEN
