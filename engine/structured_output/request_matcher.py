"""`RequestMatcher`: one request's grammar matcher and the tokens it has accepted.

Invariant: the matcher's tokens are the request's output tokens, plus at most its token in
flight (async scheduling reads it before the step that sampled it is processed). Before
each use the matcher is brought to the request's tokens (`sync`): what it holds beyond
them, or what differs at their end (a token in flight whose step was rolled back), is
rolled back, and what is missing is accepted. So preemption, recompute and failed steps
never leave it ahead of the tokens, and nothing else has to tell it about them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backend import ALL_ALLOWED, GrammarBackend, GrammarMatcher


class RequestMatcher:
    """Args:
    matcher: The backend's matcher, at the start of the request's grammar.
    backend: The backend that made it (masks of a step are filled per backend).
    """

    def __init__(self, matcher: GrammarMatcher, backend: GrammarBackend) -> None:
        self.matcher = matcher
        self.backend = backend
        self.tokens: list[int] = []
        """The tokens the matcher has accepted, in order."""

    def sync(self, output: Sequence[int], in_flight: int | None = None) -> bool:
        """Bring the matcher to `output` followed by `in_flight` (when not None).

        Only the end of the accepted tokens can differ from the request's (see the module
        docstring), so the common prefix is found from the end.

        Returns:
            False when the grammar refuses one of the tokens; the matcher then stays at the
            longest prefix it accepts.
        """
        num = len(output) + (in_flight is not None)

        def token(i: int) -> int:
            return output[i] if i < len(output) else in_flight  # type: ignore[return-value]

        tokens = self.tokens
        common = min(len(tokens), num)
        while common and tokens[common - 1] != token(common - 1):
            common -= 1
        if common < len(tokens):
            self.matcher.rollback(len(tokens) - common)
            del tokens[common:]
        for i in range(common, num):
            token_id = token(i)
            if not self.matcher.accept_token(token_id):
                return False
            tokens.append(token_id)
        return True

    def num_valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading draft tokens the grammar allows after the accepted tokens (the
        matcher is left where it was)."""
        num = 0
        for token_id in drafts:
            if not self.matcher.accept_token(token_id):
                break
            num += 1
        if num:
            self.matcher.rollback(num)
        return num

    def fill_draft_rows(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> None:
        """Rows `first_row .. first_row + len(drafts)` of `bitmask`: row j allows what may
        follow the accepted tokens and `drafts[:j]` (speculative decoding verifies draft j
        at row j). Past a draft the grammar refuses, rows allow everything: verification
        rejects that draft first, so they are never read. The matcher is left where it was.
        """
        num_accepted = 0
        refused = False
        for j in range(len(drafts) + 1):
            if refused or self.matcher.is_terminated():
                bitmask[first_row + j] = ALL_ALLOWED
                refused = True
            else:
                self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
            if j < len(drafts) and not refused:
                refused = not self.matcher.accept_token(drafts[j])
                num_accepted += not refused
        if num_accepted:
            self.matcher.rollback(num_accepted)
