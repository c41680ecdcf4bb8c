"""Sampling parameters for text generation, with vLLM's names and defaults."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import InvalidParamError
from .inputs import check_text
from .structured_outputs_params import StructuredOutputsParams

# Below this temperature sampling is greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5

__all__ = ["SAMPLING_EPS", "SamplingParams", "StructuredOutputsParams"]


@dataclass
class SamplingParams:
    """How to turn a prompt into completions.

    Example:
        >>> from batchlm.engine import LLM, SamplingParams
        >>> params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=0)
    """

    n: int = 1
    """Number of completions to return for the prompt."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (in [-2, 2]); > 0
    favours new tokens, < 0 repetition. Prompt tokens do not count."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated so far (in [-2, 2]);
    > 0 favours new tokens, < 0 repetition. Prompt tokens do not count."""
    repetition_penalty: float = 1.0
    """Divides positive and multiplies negative logits of every token seen in the prompt or
    the output so far (> 0; 1 disables it); > 1 discourages repetition."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to at least top_p (0 < top_p <= 1)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times that of the most likely token."""
    seed: int | None = None
    """Seed of this request's own generator: the same seed gives the same tokens whatever
    else is in the batch."""
    stop: str | list[str] | None = None
    """Strings that end generation; they are not part of the returned text."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to EOS unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating after the EOS token (benchmarks, fixed-length outputs)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    min_tokens: int = 0
    """Tokens to generate before EOS or stop_token_ids may end the completion."""
    logprobs: int | None = None
    """Number of most likely tokens whose log probabilities are returned at each step, in
    addition to the sampled token; None returns none."""
    prompt_logprobs: int | None = None
    """Number of most likely tokens whose log probabilities are returned at each prompt
    position, in addition to the prompt token itself; None returns none. Such a request
    computes its whole prompt, bypassing the prefix cache (but see `prompt_logprobs_start`)."""
    prompt_logprobs_start: int = 0
    """With `prompt_logprobs`: the first prompt position scored; the earlier ones come back
    None. The prompt's first `prompt_logprobs_start - 1` tokens may then come from the prefix
    cache, so requests that share a context and score only what follows it (the continuations
    of a multiple-choice question) compute that context once. 0 or 1 scores every position.
    batchlm's own; vLLM has no such field."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (k >= 1); -1 keeps the last max_model_len; None
    keeps the whole prompt (which must then fit max_model_len)."""
    detokenize: bool = True
    """Turn output token ids into text (and logprobs' candidates into `decoded_token`)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between special tokens in the text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token's text) in the returned text."""
    logit_bias: dict[int, float] | None = None
    """Token id → value added to its logit before sampling, clamped to [-100, 100] (the
    OpenAI convention). Keys may be ints or strings of ints (as JSON gives them)."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated (a non-empty list); None allows all."""
    bad_words: list[str] | None = None
    """Words that may not be generated: the last token of a word's tokenization is banned
    whenever the tokens before it end the output so far (a one-token word is always
    banned). Each word is banned with and without a leading space."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON Schema, a regex, a choice or a grammar (a plain dict
    of its fields is read as `StructuredOutputsParams.from_dict`); None leaves it free."""

    # Derived, not user-facing.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)
    """Token ids of each banned word form, filled by `resolve_bad_words` (needs the tokenizer,
    so it runs when the request is added, not at construction)."""
    _stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_strs = [self.stop]
        elif self.stop is None:
            self._stop_strs = []
        else:
            self._stop_strs = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = {
                int(token): min(100.0, max(-100.0, float(bias)))
                for token, bias in self.logit_bias.items()
            }

    @property
    def stop_strs(self) -> list[str]:
        """The stop strings as a list."""
        return self._stop_strs

    @property
    def is_greedy(self) -> bool:
        """True when decoding takes the argmax."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def verify_token_ids(self, vocab_size: int) -> None:
        """Check that every token id in the params lies in the vocabulary, and that
        `logprobs` / `prompt_logprobs` ask for no more tokens than it has.

        Called when the request is added (the vocabulary is not known at construction).

        Raises:
            InvalidParamError: naming the field and the first id outside `[0, vocab_size)`.
        """
        groups: list[tuple[str, list[int]]] = [
            ("stop_token_ids", list(self.stop_token_ids or [])),
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", list(self.allowed_token_ids or [])),
            ("bad_words", [t for ids in self.bad_words_token_ids for t in ids]),
        ]
        for name, ids in groups:
            for token_id in ids:
                if not 0 <= token_id < vocab_size:
                    raise InvalidParamError(
                        f"{name} has token id {token_id}, outside the vocabulary "
                        f"[0, {vocab_size}); use ids below {vocab_size}"
                    )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise InvalidParamError(
                    f"{name}={value} asks for more tokens than the vocabulary has "
                    f"({vocab_size}); use at most {vocab_size}"
                )

    def resolve_bad_words(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` into `bad_words_token_ids` (a no-op without bad words).

        Each word is tokenized as written (leading spaces stripped) and with one leading
        space, so it is banned both at the start of the text and after a space; the spaced
        form is kept only when it is a different token sequence of the same length (vLLM's
        rule). Idempotent; clones carry the result.

        Args:
            tokenizer: A transformers tokenizer (`encode(text, add_special_tokens=False)`).

        Raises:
            InvalidParamError: a word tokenizes to no token at all.
        """
        resolved: list[list[int]] = []
        for word in self.bad_words or []:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                raise InvalidParamError(
                    f"bad_words has {word!r}, which tokenizes to no token; remove it"
                )
            resolved.append(plain)
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                resolved.append(spaced)
        self.bad_words_token_ids = resolved

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float(
            "repetition_penalty",
            self.repetition_penalty,
            low=0.0,
            low_open=True,
            hint="use 1 to disable it",
        )
        _check_float("temperature", self.temperature, low=0.0, hint="use 0 for greedy")
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0, hint="use 0 or -1 to keep every token")
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParamError(
                f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        _check_int("prompt_logprobs_start", self.prompt_logprobs_start, low=0)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=-1)
            if self.truncate_prompt_tokens == 0:
                raise InvalidParamError(
                    "truncate_prompt_tokens=0 must be >= 1, or -1 for max_model_len "
                    "(None keeps the whole prompt)"
                )
        self._validate_token_constraints()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidParamError(
                f"structured_outputs must be a StructuredOutputsParams (or a dict of its "
                f"fields), got {type(self.structured_outputs).__name__}"
            )
        for i, s in enumerate(self._stop_strs):
            if not isinstance(s, str) or not s:
                raise InvalidParamError(
                    f"stop[{i}]={s!r} must be a non-empty string; remove it or pass text"
                )
            check_text(s, f"stop[{i}]", InvalidParamError)
        for i, t in enumerate(self.stop_token_ids or []):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidParamError(f"stop_token_ids[{i}]={t!r} must be a token id (int >= 0)")
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidParamError(f"{name}={value!r} must be True or False")

    def _validate_token_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParamError(
                    f"logit_bias={self.logit_bias!r} must be a dict of token id -> bias"
                )
            for token, bias in self.logit_bias.items():
                if _as_token_id(token) is None:
                    raise InvalidParamError(
                        f"logit_bias has key {token!r}, which is not a token id (int >= 0)"
                    )
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias:
                    raise InvalidParamError(
                        f"logit_bias[{token!r}]={bias!r} must be a number (clamped to [-100, 100])"
                    )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise InvalidParamError(
                    f"allowed_token_ids={ids!r} must be a non-empty list of token ids "
                    "(None allows every token)"
                )
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise InvalidParamError(
                        f"allowed_token_ids[{i}]={t!r} must be a token id (int >= 0)"
                    )
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)):
                raise InvalidParamError(f"bad_words={self.bad_words!r} must be a list of strings")
            for i, w in enumerate(self.bad_words):
                if not isinstance(w, str) or not w.strip():
                    raise InvalidParamError(
                        f"bad_words[{i}]={w!r} must be a non-empty string; remove it"
                    )
                check_text(w, f"bad_words[{i}]", InvalidParamError)

    def clone(self) -> SamplingParams:
        """A copy that can be changed without touching this one."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        for key in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            if isinstance(kwargs[key], list):
                kwargs[key] = list(kwargs[key])
        if kwargs["logit_bias"] is not None:
            kwargs["logit_bias"] = dict(kwargs["logit_bias"])
        copy = SamplingParams(**kwargs)
        copy.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        return copy


def _check_int(
    name: str, value: object, low: int | None = None, high: int | None = None, hint: str = ""
) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError(f"{name}={value!r} must be an integer")
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidParamError(f"{name}={value} must be {_range(low, high)}{_hint(hint)}")


def _check_float(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    hint: str = "",
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParamError(f"{name}={value!r} must be a number")
    if math.isnan(value) or math.isinf(value):
        raise InvalidParamError(f"{name}={value} must be a finite number, {_range(low, high)}")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        lo = f"> {low}" if low_open else f">= {low}"
        rng = f"{lo} and <= {high}" if high is not None else lo
        raise InvalidParamError(f"{name}={value} must be {rng}{_hint(hint)}")


def _as_token_id(token: object) -> int | None:
    """`token` as a token id when it is an int >= 0 or a string of one, else None."""
    if isinstance(token, bool):
        return None
    if isinstance(token, str):
        token = token.strip()
        if not token.isdigit():
            return None
        return int(token)
    if isinstance(token, int) and token >= 0:
        return token
    return None


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if low is not None else f"<= {high}"


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""
