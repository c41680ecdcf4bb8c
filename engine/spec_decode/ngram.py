"""Prompt-lookup drafts: continue the sequence the way it continued before.

The sequence's last n tokens (n from `max_n` down to `min_n`, longest first) are searched
for earlier in the sequence (prompt and output); at the first match, the tokens that
followed it are the draft. Pure host work on token ids: no model, no device. The draft is
deterministic, so verification treats it as a point mass (`q(x) = 1`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Args:
    num_speculative_tokens: Longest draft.
    min_n: Shortest n-gram matched.
    max_n: Longest n-gram matched.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        """Draft tokens to follow `token_ids` (at most `max_num_tokens`, and at most
        `num_speculative_tokens`); empty when no n-gram matches."""
        limit = min(max_num_tokens, self.num_speculative_tokens)
        num_tokens = len(token_ids)
        if limit <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Windows starting at 0 .. num_tokens - n - 1: each is followed by a token.
            windows = sliding_window_view(tokens[:-1], n)  # [num_tokens - n, n]
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts):
                begin = int(starts[0]) + n
                return tokens[begin : begin + limit].tolist()
        return []
