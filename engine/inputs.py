"""Prompt types accepted by `LLM.generate` and their normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from typing_extensions import NotRequired

from .errors import InvalidParamError, InvalidPromptError


class TextPrompt(TypedDict):
    """A prompt given as text; it is tokenized with the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids (not tokenized again)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
"""The keys a prompt dict may hold; vLLM's others (`multi_modal_data`, `mm_processor_kwargs`,
`cache_salt`, `prompt_embeds`, ...) are refused rather than dropped."""

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


def check_unsupported_options(lora_request: Any = None) -> None:
    """vLLM's per-call `lora_request`: None (its default) is accepted, so that vLLM code
    runs unchanged; anything else is refused, naming the value."""
    if lora_request is not None:
        raise InvalidParamError(
            f"lora_request={lora_request!r}: LoRA adapters are not supported; merge the "
            "adapter into the base weights (for example peft's merge_and_unload) and load "
            "the merged folder"
        )


def _check_prompt_keys(prompt: dict, index: int) -> None:
    """A prompt dict holds only keys batchlm acts on: a key it would ignore is refused, so
    that no input is silently run as something else (an image prompt as its text alone)."""
    unknown = [k for k in prompt if k not in PROMPT_KEYS]
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


def normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[dict[str, Any]]:
    """One dict per prompt with either `prompt` or `prompt_token_ids`.

    Raises:
        InvalidPromptError: naming the index of a prompt of the wrong type.
    """
    if isinstance(prompts, (bytes, bytearray)):
        raise InvalidPromptError(
            f"prompts is {type(prompts).__name__} ({bytes(prompts)!r:.40}); decode it to a "
            "string first (prompts.decode('utf-8'))"
        )
    if isinstance(prompts, (str, dict)):
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
            if PROMPT_KEYS.isdisjoint(p) and _UNSUPPORTED_KEYS.keys().isdisjoint(p):
                raise InvalidPromptError(
                    f"prompts[{i}] has keys {sorted(p)}; a prompt dict needs 'prompt' (text) "
                    "or 'prompt_token_ids'"
                )
            _check_prompt_keys(p, i)
            if "prompt_token_ids" in p:
                ids = p["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not _all_ints(ids):
                    raise InvalidPromptError(
                        f"prompts[{i}]['prompt_token_ids'] must be a list of ints"
                    )
                out.append({"prompt_token_ids": list(ids), "prompt": p.get("prompt")})
            else:
                if not isinstance(p["prompt"], str):
                    raise InvalidPromptError(
                        f"prompts[{i}]['prompt']={p['prompt']!r} must be a string"
                    )
                check_text(p["prompt"], f"prompts[{i}]['prompt']")
                out.append({"prompt": p["prompt"]})
        else:
            raise InvalidPromptError(
                f"prompts[{i}] is a {type(p).__name__}; pass a string, "
                "{'prompt': str} or {'prompt_token_ids': [int, ...]}"
            )
    return out
