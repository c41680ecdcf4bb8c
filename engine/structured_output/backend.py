"""What the engine needs of a grammar engine: compile a spec, make matchers, fill masks.

A backend wraps one library (`xgrammar_backend.py`, `guidance_backend.py`; `selector.py`
picks one). Its matchers follow a request's output token by token and say, for the next
token, which ids the grammar allows, as one row of a token bitmask: `int32 [num_rows,
ceil(vocab_size / 32)]`, bit `t % 32` of word `t // 32` set when token `t` is allowed (the
layout both libraries write).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .grammar_spec import GrammarSpec

ALL_ALLOWED = -1
"""A bitmask word with every bit set: the value of a row that constrains nothing."""


class GrammarCompileError(ValueError):
    """The backend cannot compile a spec; the message is the compiler's own."""


class GrammarMatcher(Protocol):
    """One request's position in its grammar (xgrammar's `GrammarMatcher` methods)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> Any:
        """Write the allowed next tokens into row `index` of a host `int32` bitmask."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing may follow."""
        ...


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer and vocabulary."""

    name: str
    """`xgrammar` or `guidance`: the name users pass as `backend`."""

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (opaque to the engine).

        Raises:
            GrammarCompileError: the spec is not one this backend can compile.
        """
        ...

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int]) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`; once the grammar is complete it
        allows only `stop_token_ids` (the request's end-of-generation ids)."""
        ...

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """Fill row `rows[i]` of `bitmask` with `matchers[i]`'s next-token mask (each a
        matcher of this backend), in parallel where the library can."""
        ...
