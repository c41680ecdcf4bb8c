"""The xgrammar backend: JSON Schema, regex, EBNF and choices compiled by xgrammar.

Lark grammars are converted to EBNF first, as vLLM converts them (`lark.py`); structural
tags compile through xgrammar's own format (or vLLM's older one). xgrammar precomputes, per grammar, which tokens each state allows, so a step's mask is a
cheap lookup; its matchers roll back any number of tokens (speculative decoding, the
engine's resynchronisation after a step that did not happen). Imported only when a request
first asks for structured outputs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from .backend import GrammarCompileError, GrammarMatcher
from .grammar_spec import GrammarSpec
from .lark import LarkConversionError, is_lark, lark_to_ebnf

MIN_PARALLEL_ROWS = 32
"""From this many rows on, a step's masks are filled by xgrammar's thread pool; below,
one by one (the pool's start costs more than it saves)."""

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class XgrammarBackend:
    """Args:
    tokenizer: The engine's Hugging Face tokenizer.
    vocab_size: The model's logits width (may exceed the tokenizer's vocabulary: the
        extra ids are never allowed).
    stop_token_ids: The engine's end-of-generation ids.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        threads = max(1, min(8, os.cpu_count() or 1))
        # The engine's grammar cache keys on the spec; xgrammar's own would grow unbounded.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, spec: GrammarSpec) -> Any:
        if spec.whitespace_pattern is not None:
            raise GrammarCompileError(
                "xgrammar has no whitespace_pattern; use the guidance backend for it"
            )
        compiler = self._compiler
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_ebnf(spec.choices))
            if spec.kind == "structural_tag":
                return self._compile_structural_tag(spec.text)
            return compiler.compile_grammar(ebnf_of(spec.text))
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise GrammarCompileError(_LOG_PREFIX.sub("", str(e)).strip()) from None

    def _compile_structural_tag(self, text: str) -> Any:
        """xgrammar's structural tag format as it is, or vLLM's older one (`structures`
        of begin / schema / end, and `triggers`) through xgrammar's items."""
        tag = json.loads(text)
        if "structures" not in tag:
            return self._compiler.compile_structural_tag(text)
        items = [
            self._xgr.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
            )
            for s in tag["structures"]
        ]
        return self._compiler.compile_structural_tag(items, tag["triggers"])

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int]) -> GrammarMatcher:
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        if len(matchers) < MIN_PARALLEL_ROWS:
            for matcher, row in zip(matchers, rows, strict=True):
                matcher.fill_next_token_bitmask(bitmask, row)
            return
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, list(rows))


def ebnf_of(grammar: str) -> str:
    """A grammar as xgrammar reads it: EBNF as given, Lark converted as vLLM converts it."""
    if not is_lark(grammar):
        return grammar
    try:
        return lark_to_ebnf(grammar)
    except LarkConversionError as e:
        raise GrammarCompileError(f"Failed to convert the grammar from Lark to EBNF: {e}") from None


def choice_ebnf(choices: Sequence[str]) -> str:
    """`root ::= "a" | "b"`: the grammar of exactly one of `choices` (JSON string escapes,
    which xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
