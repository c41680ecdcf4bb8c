"""Tokenizer loading, incremental detokenization and stop-string matching."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .sampling_params import SamplingParams

# Prompt tokens kept as decoding context so the first output token gets its leading space.
_CONTEXT_TOKENS = 5


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """A transformers tokenizer from a local folder (never from the network)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=trust_remote_code, local_files_only=True
    )


def rust_decoder(tokenizer: Any) -> Callable[..., str] | None:
    """The tokenizers library's own `decode` behind a fast transformers tokenizer whose
    `decode` only forwards to it (with `clean_up_tokenization_spaces=False`, as this module
    decodes): its class overrides neither `decode` nor `_decode`. The same text in about a
    third of the time per call, which counts at two calls per token of every request. None
    for any other tokenizer."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, PreTrainedTokenizerFast)
        or cls.decode is not PreTrainedTokenizerFast.decode
        or cls._decode is not PreTrainedTokenizerFast._decode
    ):
        return None
    return tokenizer._tokenizer.decode


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, a piece at a time.

    Each step decodes only a short window: the tokens since the last emitted piece plus a
    few before them, and emits the difference; a piece ending in an incomplete UTF-8
    sequence (U+FFFD) is held back until the next token completes it, or until `flush` at
    the end of the request. Stop strings are searched only in the region the new piece can
    affect.

    Args:
        tokenizer: A transformers tokenizer.
        prompt_token_ids: The prompt (its last tokens give decoding context).
        params: Detokenization options and stop strings.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.prompt_token_ids = prompt_token_ids
        self.is_context_checked = False
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.is_stopped = False
        """A stop string ended the text; nothing is added after it."""
        self.max_stop_len = max((len(s) for s in params.stop_strs), default=0)
        self._rust_decode = rust_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add_token(self, token_id: int, skip_text: bool = False) -> str | None:
        """Append one token; returns the stop string it completed, or None.

        Args:
            token_id: The new output token.
            skip_text: Do not add this token's text (a stop token that is not to be shown).
        """
        if not self.params.detokenize or skip_text:
            return None
        if not self.is_context_checked:
            self._start_context_at_a_character()
        self.ids.append(token_id)
        return self._emit(hold_incomplete=True)

    def _start_context_at_a_character(self) -> None:
        """Move the decoding context's start back to a character boundary (at most 3 more
        prompt tokens: a character has at most 4 bytes). Byte-fallback decoders (Llama 2,
        Mistral) decode a run of byte tokens all or nothing, so a context that starts inside
        a character would turn output bytes that continue the run into U+FFFD."""
        self.is_context_checked = True
        start = len(self.prompt_token_ids) - self.read_offset
        for _ in range(3):
            if start == 0 or not self._decode(self.ids[: self.read_offset]).startswith("\ufffd"):
                return
            start -= 1
            self.ids.insert(0, self.prompt_token_ids[start])
            self.read_offset += 1

    def flush(self) -> str | None:
        """The request ended: add the text of the tokens still held back, whose bytes end
        in an incomplete character (it decodes as U+FFFD, as in a one-shot decode of the
        output), so that the text equals that decode. Returns the stop string the added
        text completed, or None; a no-op once a stop string has ended the text."""
        if not self.params.detokenize or self.is_stopped or self.read_offset >= len(self.ids):
            return None
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str | None:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return None
        if hold_incomplete and full_text.endswith("\ufffd"):
            return None
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return self._check_stop(len(delta))

    def _check_stop(self, delta_len: int) -> str | None:
        if not self.max_stop_len:
            return None
        start = max(0, len(self.text) - delta_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop_strs:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.text = self.text[:end]
        self.is_stopped = True
        return stop
