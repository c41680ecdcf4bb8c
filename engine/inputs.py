"""Prompt types accepted by `LLM.generate` and their normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from typing_extensions import NotRequired

from .errors import InvalidPromptError


class TextPrompt(TypedDict):
    """A prompt given as text; it is tokenized with the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids (not tokenized again)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


class PoolingTokensPrompt(TokensPrompt):
    """A cross-encoder's input as token ids with their segment ids (pooling calls only)."""

    token_type_ids: NotRequired[list[int]]


PromptType = str | TextPrompt | TokensPrompt | list[int]
"""A text, a prompt dict, or (as in vLLM) a bare list of token ids: one prompt."""

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
"""The keys a prompt dict may hold; vLLM's others (`cache_salt`, `prompt_embeds`, ...) are
refused rather than dropped. Pooling calls also take `token_type_ids` with
`prompt_token_ids`, generation calls `MULTIMODAL_KEYS`."""

MULTIMODAL_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs"})
"""A generation prompt's images (`{"image": ...}`) and its processor kwargs, as in vLLM;
checked against the model by `generation_inputs.py`."""

_UNSUPPORTED_KEYS = {
    "multi_modal_data": "images, audio and video inputs are not supported (text models only)",
    "mm_processor_kwargs": "multi-modal processing is not supported (text models only)",
    "prompt_embeds": "embedding inputs are not supported; pass text or token ids",
    "cache_salt": "per-request prefix-cache salts are not supported; prefix caching is "
    "shared by every request (disable it with enable_prefix_caching=False)",
}


def check_text(text: str, where: str, error: type[ValueError] = InvalidPromptError) -> None:
    """Raises `error` when `text` is not valid Unicode for a tokenizer: a lone surrogate
    (from a JSON escape such as "\\ud800", or bytes decoded with errors="surrogateescape")
    cannot be encoded as UTF-8. ASCII text returns at once."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise error(
            f"{where} has a character that is not valid UTF-8: the lone surrogate "
            f"{text[e.start]!r} at offset {e.start}; clean the text, e.g. "
            "text.encode('utf-8', 'replace').decode()"
        ) from None


def _check_prompt_keys(prompt: dict, index: int, token_types: bool, multimodal: bool) -> None:
    """A prompt dict holds only keys batchlm acts on: a key it would ignore is refused, so
    that no input is silently run as something else (an image prompt as its text alone)."""
    if "token_type_ids" in prompt and not token_types:
        raise InvalidPromptError(
            f"prompts[{index}] has token_type_ids, which only cross-encoders read (score / "
            "classify / embed); a generative model takes prompt_token_ids alone"
        )
    unknown = [
        k
        for k in prompt
        if k not in PROMPT_KEYS
        and k != "token_type_ids"
        and not (multimodal and k in MULTIMODAL_KEYS)
    ]
    if not unknown:
        return
    key = unknown[0]
    reason = _UNSUPPORTED_KEYS.get(key, "it is not a prompt key")
    raise InvalidPromptError(
        f"prompts[{index}] has the key {key!r}: {reason}; a prompt dict takes only "
        f"{sorted(PROMPT_KEYS)}"
    )


def _all_ints(ids: list | tuple) -> bool:
    """Every element an int (bools are not token ids). The common case, plain ints, is
    checked at C speed: it runs over every prompt token of a batch before it starts."""
    return set(map(type, ids)) <= {int} or all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    )


def normalize_prompts(
    prompts: PromptType | Sequence[PromptType],
    token_types: bool = False,
    multimodal: bool = False,
) -> list[dict[str, Any]]:
    """One dict per prompt with either `prompt` or `prompt_token_ids` (and, with
    `token_types`, a TokensPrompt's `token_type_ids`; with `multimodal`, its
    `MULTIMODAL_KEYS`, unchecked).

    As in vLLM, a string, a dict or a non-empty list of ints is one prompt; a list of them
    (lists of ints included) is many.

    Raises:
        InvalidPromptError: naming the index of a prompt of the wrong type.
    """
    if isinstance(prompts, (bytes, bytearray)):
        raise InvalidPromptError(
            f"prompts is {type(prompts).__name__} ({bytes(prompts)!r:.40}); decode it to a "
            "string first (prompts.decode('utf-8'))"
        )
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and _all_ints(prompts)
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise InvalidPromptError(
            f"prompts must be a string, a TextPrompt / TokensPrompt dict, or a list of them; "
            f"got {type(prompts).__name__}"
        )
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            check_text(p, f"prompts[{i}]")
            out.append({"prompt": p})
        elif isinstance(p, dict):
            refused = _UNSUPPORTED_KEYS.keys() - (MULTIMODAL_KEYS if multimodal else set())
            if PROMPT_KEYS.isdisjoint(p) and refused.isdisjoint(p):
                raise InvalidPromptError(
                    f"prompts[{i}] has keys {sorted(p)}; a prompt dict needs 'prompt' (text) "
                    "or 'prompt_token_ids'"
                )
            _check_prompt_keys(p, i, token_types, multimodal)
            if "prompt_token_ids" in p:
                ids = p["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not _all_ints(ids):
                    raise InvalidPromptError(
                        f"prompts[{i}]['prompt_token_ids'] must be a list of ints"
                    )
                prompt = {"prompt_token_ids": list(ids), "prompt": p.get("prompt")}
                if p.get("token_type_ids") is not None:
                    prompt["token_type_ids"] = _token_types(p["token_type_ids"], len(ids), i)
                out.append(prompt)
            elif "token_type_ids" in p:
                raise InvalidPromptError(
                    f"prompts[{i}] has token_type_ids without prompt_token_ids; pass both"
                )
            else:
                if not isinstance(p["prompt"], str):
                    raise InvalidPromptError(
                        f"prompts[{i}]['prompt']={p['prompt']!r} must be a string"
                    )
                check_text(p["prompt"], f"prompts[{i}]['prompt']")
                out.append({"prompt": p["prompt"]})
            if multimodal:
                out[-1].update((k, p[k]) for k in MULTIMODAL_KEYS if k in p)
        elif isinstance(p, (list, tuple)) and p and _all_ints(p):  # token ids, as in vLLM
            out.append({"prompt_token_ids": list(p), "prompt": None})
        else:
            raise InvalidPromptError(
                f"prompts[{i}] is a {type(p).__name__}; pass a string, a list of token ids, "
                "{'prompt': str} or {'prompt_token_ids': [int, ...]}"
            )
    return out


def prompt_list(prompts: PromptType | Sequence[PromptType]) -> Sequence[PromptType]:
    """`prompts` as a sequence of prompts (one string, dict or list of token ids is one),
    unchecked: for counting and slicing a call's prompts before `normalize_prompts`."""
    if isinstance(prompts, (str, dict, bytes, bytearray)) or not isinstance(prompts, Sequence):
        return [prompts]  # type: ignore[list-item]
    if prompts and _all_ints(prompts):
        return [prompts]  # type: ignore[list-item]
    return prompts


def _token_types(types: Any, num_tokens: int, index: int) -> list[int]:
    if not isinstance(types, (list, tuple)) or not _all_ints(types) or len(types) != num_tokens:
        raise InvalidPromptError(
            f"prompts[{index}]['token_type_ids'] must be a list of {num_tokens} ints, one per "
            "prompt token"
        )
    return list(types)
