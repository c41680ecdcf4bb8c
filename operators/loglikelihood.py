"""Log-likelihood of a continuation after a context, from the engine's prompt logprobs.

Each (context, continuation) pair becomes one request: the prompt is the context's tokens
followed by the continuation's, with `SamplingParams(prompt_logprobs=0, max_tokens=1,
prompt_logprobs_start=<context tokens>)`. The engine scores only the continuation's
positions, so the context's whole blocks may come from the prefix cache: rows sharing a
context (the choices of a multiple-choice question) compute it once. From the scored
positions:

- `logprob`: the sum of the continuation tokens' log probabilities;
- `is_greedy`: every continuation token was the argmax at its position (rank 1);
- `num_tokens`: the continuation's token count;
- `num_input_tokens` / `num_cached_tokens`: the request's prompt tokens, and those the
  prefix cache served (the rest were computed).

Tokenisation follows evaluation harnesses (lm-evaluation-harness's `_encode_pair`): trailing
whitespace of the context moves to the continuation, the pair is tokenised whole and split
where the context's own tokens end, so the continuation's first token is the one the model
sees after that context. Text is tokenised as `LLM.generate` tokenises a prompt (with the
tokenizer's special tokens); an empty context is the tokenizer's BOS (EOS without one).
Lists of token ids are taken as they are.

Example:
    >>> pairs = encode_pairs(llm.get_tokenizer(), [("The sky is", " blue"), ("The sky is", " red")])
    >>> [s.logprob for s in score_pairs(llm, pairs)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchlm.engine.errors import InvalidPromptError
from batchlm.engine.outputs import RequestOutput
from batchlm.engine.sampling_params import SamplingParams

LOGLIKELIHOOD_FIELDS = [
    pa.field("logprob", pa.float64()),
    pa.field("is_greedy", pa.bool_()),
    pa.field("num_tokens", pa.int32()),
    pa.field("num_input_tokens", pa.int32()),
    pa.field("num_cached_tokens", pa.int32()),
]
"""The loglikelihood task's output columns (before `error`)."""


@dataclass(frozen=True)
class EncodedPair:
    """A context and its continuation as token ids."""

    context_ids: list[int]
    """At least one token: its last token's logits score the continuation's first."""
    continuation_ids: list[int]
    """The tokens whose log probabilities are summed."""

    @property
    def prompt_token_ids(self) -> list[int]:
        return [*self.context_ids, *self.continuation_ids]


@dataclass(frozen=True)
class ContinuationScore:
    """What the engine says about one continuation."""

    logprob: float
    """Sum of the continuation tokens' log probabilities (natural log)."""
    is_greedy: bool
    """Every continuation token was the most likely token at its position."""
    num_tokens: int
    """Continuation tokens."""
    num_input_tokens: int
    """Context + continuation tokens."""
    num_cached_tokens: int
    """Of `num_input_tokens`, those served from the prefix cache."""


def prefix_token_id(tokenizer: Any) -> int:
    """What an empty context is: the tokenizer's BOS, else its EOS (as evaluation harnesses
    do)."""
    token_id = getattr(tokenizer, "bos_token_id", None)
    if token_id is None:
        token_id = getattr(tokenizer, "eos_token_id", None)
    if token_id is None:
        raise InvalidPromptError(
            "the context is empty and the tokenizer has neither a BOS nor an EOS token to "
            "stand for it; give a context"
        )
    return int(token_id)


def encode_pairs(
    tokenizer: Any, pairs: Sequence[tuple[str | list[int], str | list[int]]]
) -> list[EncodedPair | InvalidPromptError]:
    """Each (context, continuation) as token ids, or the error that makes the row invalid.

    Texts are tokenised in two batched calls (contexts, then contexts + continuations).
    """
    out: list[EncodedPair | InvalidPromptError | None] = [None] * len(pairs)
    texts: list[tuple[int, str, str]] = []
    for i, (context, continuation) in enumerate(pairs):
        if isinstance(context, list) and isinstance(continuation, list):
            if not continuation:
                out[i] = InvalidPromptError("the continuation has no tokens; nothing to score")
            elif not context:
                out[i] = _after_prefix(tokenizer, continuation)
            else:
                out[i] = EncodedPair(context, continuation)
        elif isinstance(context, str) and isinstance(continuation, str):
            if not continuation:
                out[i] = InvalidPromptError("the continuation is empty; nothing to score")
            elif tokenizer is None:
                out[i] = InvalidPromptError(
                    "text needs a tokenizer, but the engine was built with "
                    "skip_tokenizer_init=True; give token ids"
                )
            else:
                texts.append((i, *_move_trailing_space(context, continuation)))
        else:
            out[i] = InvalidPromptError(
                "the context and the continuation must both be text or both token ids, got "
                f"{type(context).__name__} and {type(continuation).__name__}"
            )
    if texts:
        contexts = _encode(tokenizer, [c for _, c, _ in texts])
        wholes = _encode(tokenizer, [c + d for _, c, d in texts])
        for (i, _, continuation), context_ids, whole in zip(texts, contexts, wholes, strict=True):
            if not context_ids:  # an empty (or all-space) context
                ids = _encode(tokenizer, [continuation], add_special_tokens=False)[0]
                out[i] = _after_prefix(tokenizer, ids)
            else:
                out[i] = EncodedPair(context_ids, whole[len(context_ids) :])
    return out  # type: ignore[return-value]


def _after_prefix(tokenizer: Any, ids: list[int]) -> EncodedPair | InvalidPromptError:
    """A continuation after an empty context: scored after the prefix token, unless it
    starts with that token itself."""
    try:
        prefix = prefix_token_id(tokenizer)
    except InvalidPromptError as e:
        return e
    return EncodedPair(ids[:1], ids[1:]) if ids[:1] == [prefix] else EncodedPair([prefix], ids)


def _move_trailing_space(context: str, continuation: str) -> tuple[str, str]:
    """Trailing whitespace of the context goes to the continuation: `"Answer: "` + `"4"` is
    scored as `"Answer:"` + `" 4"`, the way the text would have been tokenised."""
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + continuation


def _encode(tokenizer: Any, texts: list[str], **kwargs: Any) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, **kwargs)["input_ids"]]


def loglikelihood_params(num_context_tokens: int) -> SamplingParams:
    """Params that score the prompt's tokens from `num_context_tokens` on and generate one
    throwaway token."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=1,
        prompt_logprobs=0,
        prompt_logprobs_start=num_context_tokens,
        detokenize=False,
    )


def continuation_score(output: RequestOutput, num_context_tokens: int) -> ContinuationScore:
    """The score of the continuation that follows the first `num_context_tokens` tokens of
    the request's prompt."""
    prompt = output.prompt_token_ids
    scored = output.prompt_logprobs or []
    logprob = 0.0
    is_greedy = True
    for position in range(num_context_tokens, len(prompt)):
        entry = scored[position][prompt[position]]
        logprob += entry.logprob
        is_greedy = is_greedy and entry.rank == 1
    return ContinuationScore(
        logprob=logprob,
        is_greedy=is_greedy,
        num_tokens=len(prompt) - num_context_tokens,
        num_input_tokens=len(prompt),
        num_cached_tokens=output.num_cached_tokens,
    )


def score_pairs(
    llm: Any, pairs: Sequence[EncodedPair], use_tqdm: bool | Callable[..., Any] = False
) -> list[ContinuationScore]:
    """Every pair's score, from one `LLM.generate` call (continuous batching and the prefix
    cache see them all at once)."""
    if not pairs:
        return []
    outputs = llm.generate(
        [{"prompt_token_ids": p.prompt_token_ids} for p in pairs],
        [loglikelihood_params(len(p.context_ids)) for p in pairs],
        use_tqdm=use_tqdm,
    )
    return [continuation_score(o, len(p.context_ids)) for o, p in zip(outputs, pairs, strict=True)]


def loglikelihood_arrays(scores: list[ContinuationScore | None]) -> list[pa.Array]:
    """The columns of `LOGLIKELIHOOD_FIELDS`, one cell per score (null where None)."""
    names = [f.name for f in LOGLIKELIHOOD_FIELDS]
    return [
        pa.array([None if s is None else getattr(s, name) for s in scores], f.type)
        for name, f in zip(names, LOGLIKELIHOOD_FIELDS, strict=True)
    ]


__all__ = [
    "LOGLIKELIHOOD_FIELDS",
    "EncodedPair",
    "ContinuationScore",
    "encode_pairs",
    "prefix_token_id",
    "loglikelihood_params",
    "continuation_score",
    "score_pairs",
]
