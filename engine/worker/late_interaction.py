"""MaxSim, the late-interaction (ColBERT) score, over packed token vectors on the device.

For a query `q` (`[len_q, dim]`) and a document `d` (`[len_d, dim]`), both L2-normalised per
token: `sum_i max_j q_i · d_j`, each query token matched with its best document token. Pairs
are scored in chunks: each chunk's queries and documents are gathered into padded
`[pairs, max_len, dim]` batches, multiplied in one batched matmul, padding keys masked to
-inf before the max and padding queries to 0 before the sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["maxsim", "maxsim_ref"]

# Similarity entries (pairs x query tokens x document tokens) of one chunk: bounds the
# `[pairs, len_q, len_d]` float32 product to 256 MiB.
MAX_SIMILARITY_ELEMENTS = 1 << 26


def maxsim(
    vectors: torch.Tensor,  # [num_tokens, dim]
    offsets: np.ndarray,  # [num_inputs + 1] int64
    query_rows: Sequence[int],
    doc_rows: Sequence[int],
    max_elements: int = MAX_SIMILARITY_ELEMENTS,
) -> torch.Tensor:  # [num_pairs] float32, on vectors' device
    """MaxSim of each pair `(query_rows[p], doc_rows[p])` of packed inputs.

    Args:
        vectors: Every input's token vectors back to back; input `i` is rows
            `offsets[i]:offsets[i + 1]` (at least one row each).
        offsets: Cumulative token counts of the inputs, from 0 to `num_tokens`.
        query_rows: The query input of each pair.
        doc_rows: The document input of each pair (same length as `query_rows`).
        max_elements: Largest similarity tensor of one chunk (pairs x query x document
            tokens); a single pair above it still runs alone.

    Returns:
        One score per pair, in pair order.
    """
    if len(query_rows) != len(doc_rows):
        raise ValueError(f"{len(query_rows)} query rows but {len(doc_rows)} document rows")
    lens = np.diff(offsets)
    q_rows = np.asarray(query_rows, np.int64)
    d_rows = np.asarray(doc_rows, np.int64)
    out = torch.empty(len(q_rows), dtype=torch.float32, device=vectors.device)
    start = 0
    while start < len(q_rows):
        # The longest run of pairs from `start` whose padded product fits the budget.
        end, max_q, max_d = start, 0, 0
        while end < len(q_rows):
            nq, nd = max(max_q, lens[q_rows[end]]), max(max_d, lens[d_rows[end]])
            if end > start and (end - start + 1) * nq * nd > max_elements:
                break
            end, max_q, max_d = end + 1, nq, nd
        out[start:end] = _maxsim_chunk(
            vectors, offsets, lens, q_rows[start:end], d_rows[start:end], int(max_q), int(max_d)
        )
        start = end
    return out


def _padded(
    vectors: torch.Tensor, offsets: np.ndarray, lens: np.ndarray, rows: np.ndarray, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n, max_len, dim]` vectors of inputs `rows` and the `[n, max_len]` mask of real slots
    (padding slots read each input's first row)."""
    slots = np.arange(max_len, dtype=np.int64)[None, :]  # [1, max_len]
    is_real = slots < lens[rows][:, None]  # [n, max_len]
    index = offsets[rows][:, None] + np.where(is_real, slots, 0)
    device = vectors.device
    gathered = vectors.index_select(0, torch.from_numpy(index.reshape(-1)).to(device))
    mask = torch.from_numpy(is_real).to(device)
    return gathered.view(len(rows), max_len, -1), mask


def _maxsim_chunk(
    vectors: torch.Tensor,
    offsets: np.ndarray,
    lens: np.ndarray,
    q_rows: np.ndarray,
    d_rows: np.ndarray,
    max_q: int,
    max_d: int,
) -> torch.Tensor:  # [n]
    queries, q_mask = _padded(vectors, offsets, lens, q_rows, max_q)  # [n, max_q, dim]
    docs, d_mask = _padded(vectors, offsets, lens, d_rows, max_d)  # [n, max_d, dim]
    sim = torch.bmm(queries.float(), docs.float().transpose(1, 2))  # [n, max_q, max_d]
    sim.masked_fill_(~d_mask[:, None, :], float("-inf"))
    best = sim.amax(dim=2).masked_fill_(~q_mask, 0.0)  # [n, max_q]
    return best.sum(dim=1)


def maxsim_ref(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """MaxSim of one `[len_q, dim]` query and one `[len_d, dim]` document (for tests)."""
    return (query.float() @ doc.float().T).amax(dim=1).sum()
