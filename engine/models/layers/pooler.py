"""Pooling of packed hidden states into one vector per sequence (or per token)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch

__all__ = ["PoolingType", "pool"]


class PoolingType(str, Enum):
    """How a sequence's final hidden states become its embedding (vLLM's names).

    A `str` subclass, so `PoolingType.MEAN == "MEAN"` and either spelling may be passed.
    """

    CLS = "CLS"
    """The first token's state (BERT's [CLS], XLM-R's <s>)."""
    MEAN = "MEAN"
    """The average over every token of the sequence (the packed layout has no padding)."""
    LAST = "LAST"
    """The last token's state (decoders, which see the whole sequence only there)."""
    ALL = "ALL"
    """Every token's state: one `[len, hidden]` tensor per sequence."""

    @classmethod
    def parse(cls, value: PoolingType | str) -> PoolingType:
        """`value` as a member, accepting any case (`"mean"`)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"pooling_type={value!r} is not one of {names}") from None


def pool(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    cu_seqlens: Sequence[int],
    pooling_type: PoolingType | str,
    cu_seqlens_device: torch.Tensor | None = None,  # [num_seqs + 1] on hidden's device
    skip: torch.Tensor | None = None,  # [num_seqs] int64 on hidden's device
) -> torch.Tensor | list[torch.Tensor]:
    """Pool each packed sequence `cu_seqlens[i]:cu_seqlens[i + 1]` of `hidden`.

    Args:
        hidden: Final hidden states of all sequences back to back.
        cu_seqlens: `[num_seqs + 1]` cumulative lengths; every sequence has >= 1 token.
        pooling_type: A `PoolingType` or its name.
        cu_seqlens_device: `cu_seqlens` already on the device; when given, the indices are
            derived there and pooling issues no host-to-device copy.
        skip: MEAN only: tokens at the start of each sequence left out of its average (a
            prompt); a sequence left with none averages to zeros, as sentence-transformers'
            masked mean does.

    Returns:
        `[num_seqs, hidden_size]` in `hidden`'s dtype (MEAN sums in float32), or for ALL a
        list of `[len_i, hidden_size]` views.
    """
    kind = PoolingType.parse(pooling_type)
    cu = [int(c) for c in cu_seqlens]
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    if any(length < 1 for length in lens):
        raise ValueError(f"every sequence must have at least one token; lengths: {lens}")
    if cu[-1] != hidden.shape[0]:
        raise ValueError(f"cu_seqlens covers {cu[-1]} tokens, hidden has {hidden.shape[0]}")
    if kind is PoolingType.ALL:
        return list(hidden.split(lens))
    device = hidden.device
    if cu_seqlens_device is None:
        cu_seqlens_device = torch.tensor(cu, device=device)
    cu_t = cu_seqlens_device.long()
    if kind is PoolingType.CLS:
        return hidden.index_select(0, cu_t[:-1])
    if kind is PoolingType.LAST:
        return hidden.index_select(0, cu_t[1:] - 1)
    lens_t = cu_t[1:] - cu_t[:-1]  # [num_seqs]
    seq_ids = torch.repeat_interleave(
        torch.arange(len(lens), device=device), lens_t, output_size=hidden.shape[0]
    )
    sums = hidden.new_zeros(len(lens), hidden.shape[1], dtype=torch.float32)
    if skip is None:
        sums.index_add_(0, seq_ids, hidden.float())  # [num_seqs, hidden_size]
        return (sums / lens_t[:, None]).to(hidden.dtype)
    position = torch.arange(hidden.shape[0], device=device) - cu_t[:-1][seq_ids]  # [num_tokens]
    kept = position >= skip[seq_ids]
    sums.index_add_(0, seq_ids[kept], hidden[kept].float())
    counts = (lens_t - skip).clamp(min=1)
    return (sums / counts[:, None]).to(hidden.dtype)
