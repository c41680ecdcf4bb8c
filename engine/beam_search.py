"""Beam search on top of `LLM.generate`, shaped like vLLM's `LLM.beam_search`.

Each step sends every live beam of every prompt to ONE `generate` call that decodes a single
token and returns the top `2 * beam_width` log probabilities; the engine batches the beams and
its prefix cache serves the prefixes they share. The search itself is plain Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from .errors import InvalidParamError
from .inputs import PromptType, normalize_prompts
from .lora.request import lora_requests_per_prompt
from .outputs import Logprob
from .sampling_params import SamplingParams

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "beam_search",
    "get_beam_search_score",
]


@dataclass(frozen=True)
class BeamSearchParams:
    """How `beam_search` explores continuations (vLLM's names and defaults).

    Example:
        >>> from batchlm.engine.beam_search import BeamSearchParams, beam_search
        >>> params = BeamSearchParams(beam_width=4, max_tokens=32)
        >>> outputs = beam_search(llm, ["The capital of France is"], params)
        >>> print(outputs[0].sequences[0].text)
    """

    beam_width: int
    """Beams kept per prompt after every step, and sequences returned per prompt."""
    max_tokens: int
    """Most tokens to generate per beam (steps of the search)."""
    ignore_eos: bool = False
    """Keep extending beams past EOS instead of retiring them as finished."""
    temperature: float = 0.0
    """Temperature of the token each step samples besides the top-k; 0 is greedy. The
    candidates' scores are the model's raw log probabilities whatever the temperature."""
    length_penalty: float = 1.0
    """Final score is `cum_logprob / num_output_tokens ** length_penalty`; > 0 favours longer
    sequences, 0 ranks by cumulative log probability alone."""
    include_stop_str_in_output: bool = False
    """Keep the EOS token's text in `text` of a beam that ended on it."""

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidParamError(f"{name}={value!r} must be an integer >= 1")
            if value < 1:
                raise InvalidParamError(f"{name}={value} must be >= 1")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidParamError(f"{name}={value!r} must be a number")
            if not math.isfinite(value):
                raise InvalidParamError(f"{name}={value} must be a finite number")
        if self.temperature < 0:
            raise InvalidParamError(
                f"temperature={self.temperature} must be >= 0 (use 0 for greedy)"
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidParamError(f"{name}={value!r} must be True or False")


@dataclass
class BeamSearchSequence:
    """One beam: a prompt and the tokens the search appended to it."""

    tokens: list[int]
    """Prompt tokens followed by the generated ones (a trailing EOS included)."""
    logprobs: list[dict[int, Logprob]]
    """Per generated token, the candidates `generate` returned at that step."""
    cum_logprob: float = 0.0
    """Sum of the generated tokens' log probabilities."""
    text: str | None = None
    """The generated tokens decoded without special tokens; set on returned beams only."""
    finish_reason: str | None = None
    """'stop' (ended on EOS) or 'length' (max_tokens or max_model_len); set on returned
    beams only."""
    stop_reason: int | str | None = None
    """Always None: beam search stops on EOS or length only."""
    num_prompt_tokens: int = field(default=0, repr=False)
    """Where the generated tokens start in `tokens`."""

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The result for one prompt: at most `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _PromptSearch:
    """Search state of one prompt: the live beams and the retired ones."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def get_beam_search_score(
    sequence: BeamSearchSequence, length_penalty: float, ended_on_eos: bool
) -> float:
    """`cum_logprob / num_output_tokens ** length_penalty`, not counting a final EOS (as HF).

    Unlike vLLM's, the length counts generated tokens only, so the prompt's length does not
    dilute the penalty.
    """
    length = len(sequence.tokens) - sequence.num_prompt_tokens - int(ended_on_eos)
    return sequence.cum_logprob / (max(length, 1) ** length_penalty)


def beam_search(
    llm: Any,
    prompts: PromptType | Sequence[PromptType],
    params: BeamSearchParams,
    use_tqdm: bool = False,
    lora_request: Any = None,
) -> list[BeamSearchOutput]:
    """Beam search for every prompt, driven through `llm.generate` only.

    Args:
        llm: An `LLM` (anything with vLLM's `generate(prompts, sampling_params, use_tqdm)`
            and `get_tokenizer()`).
        prompts: A string, `{"prompt": str}`, `{"prompt_token_ids": [int, ...]}`, or a list
            of them. Text is tokenized with `llm.get_tokenizer()` as `generate` would.
        params: The search's width, length and scoring.
        use_tqdm: Show a progress bar over the steps.
        lora_request: A `LoRARequest` for every prompt, or one (or None) per prompt: each
            prompt's beams run its adapter.

    Returns:
        One `BeamSearchOutput` per prompt, in input order, with at most `beam_width`
        sequences sorted by `get_beam_search_score`, best first.

    Raises:
        InvalidParamError: `params` is not a `BeamSearchParams`.
        InvalidPromptError: a prompt has the wrong type, or `generate` rejects it (empty,
            longer than max_model_len, ids outside the vocabulary).
    """
    if not isinstance(params, BeamSearchParams):
        raise InvalidParamError(f"params is a {type(params).__name__}; pass a BeamSearchParams")
    tokenizer = llm.get_tokenizer()
    eos_token_ids = () if params.ignore_eos else _end_of_generation_ids(llm, tokenizer)
    searches = [
        _PromptSearch([BeamSearchSequence(ids, [], num_prompt_tokens=len(ids))])
        for ids in _prompt_token_ids(prompts, tokenizer)
    ]
    loras = lora_requests_per_prompt(lora_request, len(searches))
    lora_of = {id(search): lora for search, lora in zip(searches, loras, strict=True)}
    # ignore_eos is always on here: EOS is handled by the search, not by the engine.
    step_params = SamplingParams(
        max_tokens=1,
        logprobs=2 * params.beam_width,
        temperature=params.temperature,
        ignore_eos=True,
    )
    max_model_len = _max_model_len(llm)
    with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm) as bar:
        for _ in range(params.max_tokens):
            live: list[tuple[_PromptSearch, BeamSearchSequence]] = []
            for search in searches:
                for beam in search.beams:
                    if max_model_len is not None and len(beam.tokens) >= max_model_len:
                        beam.finish_reason = "length"
                        search.completed.append(beam)
                    else:
                        live.append((search, beam))
                search.beams = []
            if not live:
                break
            adapters = {}
            if any(loras):
                adapters["lora_request"] = [lora_of[id(search)] for search, _ in live]
            results = llm.generate(
                [{"prompt_token_ids": beam.tokens} for _, beam in live],
                step_params,
                use_tqdm=False,
                **adapters,
            )
            for (search, beam), result in zip(live, results, strict=True):
                _extend(search, beam, result.outputs[0].logprobs, eos_token_ids)
            for search in searches:
                # Live beams all have the same length: ranking by cum_logprob is ranking by
                # score, whatever the length penalty.
                search.beams.sort(key=lambda b: b.cum_logprob, reverse=True)
                del search.beams[params.beam_width :]
            bar.update(1)
    return [_finish(search, params, tokenizer) for search in searches]


def _extend(
    search: _PromptSearch,
    beam: BeamSearchSequence,
    step_logprobs: list[dict[int, Logprob]] | None,
    eos_token_ids: tuple[int, ...],
) -> None:
    """Add `beam` extended by each candidate token to `search` (live or, on EOS, completed)."""
    if not step_logprobs:  # the engine produced no token (the beam hit its length limit)
        beam.finish_reason = "length"
        search.completed.append(beam)
        return
    candidates = step_logprobs[0]
    for token_id, logprob in candidates.items():
        child = BeamSearchSequence(
            tokens=[*beam.tokens, token_id],
            logprobs=[*beam.logprobs, candidates],
            cum_logprob=beam.cum_logprob + logprob.logprob,
            num_prompt_tokens=beam.num_prompt_tokens,
        )
        if token_id in eos_token_ids:
            child.finish_reason = "stop"
            search.completed.append(child)
        else:
            search.beams.append(child)


def _end_of_generation_ids(llm: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a beam: the engine's end-of-generation ids when `llm` exposes them
    (the tokenizer's EOS and the generation config's), else the tokenizer's EOS."""
    engine = getattr(llm, "llm_engine", None)
    ids = getattr(engine, "eos_token_ids", None)
    if ids is not None:
        return tuple(ids)
    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)


def _max_model_len(llm: Any) -> int | None:
    """The engine's context limit when `llm` exposes it; beams reaching it are retired
    instead of being sent to `generate`, which would reject them."""
    try:
        return int(llm.llm_engine.config.model.max_model_len)
    except AttributeError:
        return None


def _prompt_token_ids(
    prompts: PromptType | Sequence[PromptType], tokenizer: Any
) -> list[list[int]]:
    out = []
    for p in normalize_prompts(prompts):
        ids = p.get("prompt_token_ids")
        out.append(list(ids) if ids is not None else list(tokenizer(p["prompt"])["input_ids"]))
    return out


def _finish(search: _PromptSearch, params: BeamSearchParams, tokenizer: Any) -> BeamSearchOutput:
    for beam in search.beams:
        beam.finish_reason = "length"
    pool = search.completed + search.beams
    # Stable sort: among equal scores, beams retired earlier come first.
    pool.sort(
        key=lambda b: get_beam_search_score(b, params.length_penalty, b.finish_reason == "stop"),
        reverse=True,
    )
    best = pool[: params.beam_width]
    for beam in best:
        beam.text = _decode(beam, params, tokenizer)
    return BeamSearchOutput(best)


def _decode(beam: BeamSearchSequence, params: BeamSearchParams, tokenizer: Any) -> str:
    ids = beam.output_token_ids
    ended_on_eos = beam.finish_reason == "stop"
    text = _decode_ids(tokenizer, ids[:-1] if ended_on_eos else ids, skip_special_tokens=True)
    if ended_on_eos and params.include_stop_str_in_output:
        text += _decode_ids(tokenizer, ids[-1:], skip_special_tokens=False)
    return text


def _decode_ids(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
