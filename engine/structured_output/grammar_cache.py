"""Compiled grammars cached by their spec: a job of many rows with one schema compiles it
once, and a schema that does not compile fails once (its message is cached too)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .backend import GrammarCompileError
from .grammar_spec import GrammarSpec

MAX_CACHED_GRAMMARS = 512
"""Grammars kept; past this the least recently used is dropped (its running requests
keep theirs: a matcher holds its compiled grammar)."""


class GrammarCache:
    """Args:
    max_entries: How many compiled grammars (or compile errors) to keep.
    """

    def __init__(self, max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, GrammarSpec], Any] = OrderedDict()
        self.num_compiles = 0
        """Compilations run (cache misses), over the cache's lifetime."""

    def get(self, backend: str, spec: GrammarSpec, compile_fn: Callable[[], Any]) -> Any:
        """The compiled grammar of `spec` on `backend`, compiled by `compile_fn` on a miss.

        Raises:
            GrammarCompileError: the spec does not compile (now or when first tried).
        """
        key = (backend, spec)
        entry = self._entries.get(key)
        if entry is None:
            self.num_compiles += 1
            try:
                entry = compile_fn()
            except GrammarCompileError as e:
                entry = e
            self._entries[key] = entry
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        if isinstance(entry, GrammarCompileError):
            raise GrammarCompileError(str(entry))  # a fresh one: no traceback piles up
        return entry

    def __len__(self) -> int:
        return len(self._entries)
