"""The guidance backend: constraints compiled by llguidance (Lark grammars, GBNF converted
to Lark, JSON Schema with a `whitespace_pattern`).

llguidance computes each mask from the grammar on the fly (no compile step beyond
parsing), so the engine's cache holds the checked grammar text. Imported only when a
request first asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .backend import GrammarCompileError, GrammarMatcher
from .grammar_spec import GrammarSpec
from .lark import is_lark


class GuidanceBackend:
    """Args:
    tokenizer: The engine's Hugging Face tokenizer (a fast one; ValueError otherwise).
    vocab_size: The model's logits width.
    stop_token_ids: The engine's end-of-generation ids: what a complete grammar allows
        (llguidance takes them per tokenizer, not per request).
    """

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )
        self._executor = llguidance.LLExecutor()

    def compile(self, spec: GrammarSpec) -> Any:
        llg = self._llg
        try:
            if spec.kind == "json":
                options: dict[str, Any] = {"whitespace_flexible": spec.any_whitespace}
                if spec.whitespace_pattern is not None:
                    options["whitespace_pattern"] = spec.whitespace_pattern
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.text, defaults=options)
            elif spec.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.text)
            elif spec.kind == "grammar" and is_lark(spec.text):
                grammar = llg.grammar_from("lark", spec.text)
            else:  # grammar (GBNF, converted to Lark) or choice (a JSON list)
                grammar = llg.grammar_from(spec.kind, spec.text)
        except ValueError as e:
            raise GrammarCompileError(str(e)) from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise GrammarCompileError(messages[0] if messages else "invalid grammar")
        return grammar

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int]) -> GrammarMatcher:
        return _GuidanceMatcher(self._llg.LLMatcher(self._tokenizer, compiled, log_level=0))

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        pairs = [(m.matcher, row) for m, row in zip(matchers, rows, strict=True)]  # type: ignore[attr-defined]
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0]
        )


class _GuidanceMatcher:
    """An `LLMatcher` behind xgrammar's method names. A refused token leaves it unchanged
    (llguidance itself would enter an error state for good)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.validate_tokens([token_id]) == 1 and self.matcher.consume_token(
            token_id
        )

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()
