"""Structured outputs on the device: a step's token bitmask applied to the logits.

The engine's grammar matchers (`structured_output/`, on the host) fill one bitmask row per
constrained logits row; the runner asks for it once the step's forward is launched (so on
CUDA the host fills it while the device runs), copies it to the device and sets every
disallowed token's logit to -inf before the sampler: penalties, temperature, top-k / top-p
and the reported logprobs all see the constrained distribution, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..host_copy import to_device


@dataclass(frozen=True)
class GrammarBitmask:
    """The allowed next tokens of a step's constrained rows."""

    rows: np.ndarray  # [num_masked] int64
    """Rows of the step's sampled logits (as the runner lays them out: one per sampling
    request, or `1 + num_drafts` with speculative decoding) that the bitmask constrains."""
    bitmask: torch.Tensor  # [num_masked, ceil(vocab_size / 32)] int32, on the host
    """Bit `t % 32` of word `t // 32` of row i is set when token `t` is allowed at
    `rows[i]` (pinned memory on CUDA, so that the copy does not wait)."""


GrammarMaskSource = Callable[[], GrammarBitmask]
"""Fills a step's bitmask when called (it may wait for the step before, whose tokens the
matchers need first)."""


def apply_grammar(logits: torch.Tensor, source: GrammarMaskSource | None) -> None:
    """Fill the step's bitmask (`source`, when the step has constrained rows) and apply it
    to `logits` `[num_rows, vocab_size]` in place."""
    if source is None:
        return
    mask = source()
    allowed = unpack_bitmask(  # [num_masked, vocab_size] bool
        mask.bitmask.to(logits.device, non_blocking=True), logits.shape[-1]
    )
    if len(mask.rows) == logits.shape[0]:  # every row constrained: in place, no gather
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = to_device(mask.rows, logits.device)
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, masked)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[rows, words]` int32 bitmask → `[rows, vocab_size]` bool, True where allowed.

    Works on the bytes (a little-endian int32's byte b holds its bits 8b .. 8b + 7), so the
    intermediate is one byte per token.
    """
    num_rows, num_words = bitmask.shape
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [rows, words * 4]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [rows, words * 4, 8] uint8
    return bits.view(num_rows, num_words * 32)[:, :vocab_size].bool()
