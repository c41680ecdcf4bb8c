"""Sampling parameters for text generation, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .errors import InvalidParamError

# Below this temperature sampling is greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to turn a prompt into completions.

    Example:
        >>> from batchlm.engine import LLM, SamplingParams
        >>> params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=0)
    """

    n: int = 1
    """Number of completions to return for the prompt."""
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
    detokenize: bool = True
    """Turn output token ids into text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between special tokens in the text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token's text) in the returned text."""

    # Derived, not user-facing.
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
        self._validate()

    @property
    def stop_strs(self) -> list[str]:
        """The stop strings as a list."""
        return self._stop_strs

    @property
    def is_greedy(self) -> bool:
        """True when decoding takes the argmax."""
        return self.temperature < SAMPLING_EPS

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
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
        for i, s in enumerate(self._stop_strs):
            if not isinstance(s, str) or not s:
                raise InvalidParamError(
                    f"stop[{i}]={s!r} must be a non-empty string; remove it or pass text"
                )
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

    def clone(self) -> SamplingParams:
        """A copy that can be changed without touching this one."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        for key in ("stop", "stop_token_ids"):
            if isinstance(kwargs[key], list):
                kwargs[key] = list(kwargs[key])
        return SamplingParams(**kwargs)


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


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if low is not None else f"<= {high}"


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""
