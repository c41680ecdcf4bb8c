"""Attention over packed variable-length sequences without a KV cache, in plain PyTorch.

Encoders (and decoders run as encoders) see every token of every sequence in one forward:
sequence `i` is rows `cu_seqlens[i]:cu_seqlens[i + 1]` of `[num_tokens, heads, head_dim]`
tensors. Sequences are grouped by similar length, each group padded into a
`[num_seqs, heads, max_len, head_dim]` batch for one `scaled_dot_product_attention` call
(a key-padding mask when bidirectional, `is_causal` when causal), then unpadded. GQA repeats
key / value heads explicitly, which keeps SDPA on its fused paths. Bidirectional attention may
be local: each token then sees only the keys within `window` positions on either side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "VarlenGroup",
    "VarlenPlan",
    "flash_varlen_supported",
    "varlen_attention",
    "varlen_attention_ref",
]

# A group is closed when the next (shorter) sequence is below this fraction of the group's
# longest: padding then wastes at most 1 - ratio of each padded row.
_GROUP_LENGTH_RATIO = 0.75
# More groups waste less padding but issue more kernel calls; past this the rest share one.
_MAX_GROUPS = 8


@dataclass(frozen=True)
class VarlenGroup:
    """Sequences of similar length padded together: `num_seqs` rows of `max_len` slots."""

    num_seqs: int
    max_len: int
    gather_index: torch.Tensor
    """`[num_seqs * max_len]` int64: the packed row each padded slot reads (padding slots
    read the sequence's first row, so they stay finite and are never returned)."""
    token_index: torch.Tensor
    """`[num_group_tokens]` int64: packed rows of the group's tokens, ascending."""
    slot_index: torch.Tensor
    """`[num_group_tokens]` int64: the padded slot of each row of `token_index`."""
    key_mask: torch.Tensor | None
    """`[num_seqs, 1, 1, max_len]` bool, True on real keys; None when no slot is padding."""


class VarlenPlan:
    """How one packed batch is attended, computed once per forward and shared by every layer.

    On CUDA with half-precision activations the plan carries the cumulative lengths on the
    device and attention runs as one variable-length flash-attention call per layer, with no
    padding; elsewhere sequences are padded by length groups (built on first use).
    """

    def __init__(
        self,
        cu_seqlens: Sequence[int],
        device: torch.device | str,
        cu_seqlens_device: torch.Tensor | None = None,
    ) -> None:
        cu = [int(c) for c in cu_seqlens]
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
            raise ValueError(
                f"cu_seqlens={cu[:8]}... must start at 0 and be non-decreasing "
                "(cumulative sequence lengths)"
            )
        self.cu_seqlens = cu
        self.device = torch.device(device)
        self.num_tokens = cu[-1]
        self.max_len = max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=0)
        self.cu_seqlens_device = cu_seqlens_device
        """`[num_seqs + 1]` int32 on the device, for the flash path (None: not provided)."""
        self._groups: list[VarlenGroup] | None = None
        self._window_masks: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def build(
        cls,
        cu_seqlens: Sequence[int],
        device: torch.device | str,
        cu_seqlens_device: torch.Tensor | None = None,
    ) -> VarlenPlan:
        """Plan for sequences `cu_seqlens[i]:cu_seqlens[i + 1]`; empty sequences are skipped.

        Raises:
            ValueError: `cu_seqlens` does not start at 0 or is not non-decreasing.
        """
        return cls(cu_seqlens, device, cu_seqlens_device)

    @property
    def groups(self) -> list[VarlenGroup]:
        """Length groups padded for `scaled_dot_product_attention`."""
        if self._groups is None:
            self._groups = _groups(self.cu_seqlens, self.device)
        return self._groups

    @property
    def is_single_group(self) -> bool:
        """One group holds every token in packed order, so its output needs no scatter."""
        return len(self.groups) == 1

    def window_mask(self, group_index: int, window: int) -> torch.Tensor:
        """`[num_seqs, 1, max_len, max_len]` bool mask of group `group_index` for local
        attention: True where the key is real and at most `window` positions from the query.
        Padding query rows keep every real key, so no row is fully masked. Built once per plan
        and window, shared by the layers that use it."""
        key = (group_index, window)
        mask = self._window_masks.get(key)
        if mask is None:
            group = self.groups[group_index]
            slots = torch.arange(group.max_len, device=self.device)
            band = (slots[:, None] - slots[None, :]).abs() <= window  # [max_len, max_len]
            if group.key_mask is None:
                mask = band[None, None]
            else:
                is_real = group.key_mask[:, 0, 0, :]  # [num_seqs, max_len]
                mask = (band[None] | ~is_real[:, :, None]) & is_real[:, None, :]
                mask = mask[:, None]
            self._window_masks[key] = mask
        return mask


def _groups(cu: list[int], device: torch.device) -> list[VarlenGroup]:
    seqs = [i for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
    seqs.sort(key=lambda i: cu[i + 1] - cu[i], reverse=True)
    grouped: list[list[int]] = []
    for i in seqs:
        length = cu[i + 1] - cu[i]
        longest = cu[grouped[-1][0] + 1] - cu[grouped[-1][0]] if grouped else 0
        if not grouped or (length < _GROUP_LENGTH_RATIO * longest and len(grouped) < _MAX_GROUPS):
            grouped.append([])
        grouped[-1].append(i)
    return [_group(cu, sorted(g), device) for g in grouped]


def flash_varlen_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `varlen_attention` can take the one-call flash path for these activations."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and hasattr(torch.ops.aten, "_flash_attention_forward")
    )


def _flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: VarlenPlan,
    scale: float,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    cu = plan.cu_seqlens_device
    # Flash attention's window bounds are inclusive, on each side of the query.
    sides = {} if window is None else {"window_size_left": window, "window_size_right": window}
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, plan.max_len, plan.max_len, 0.0, causal, False, scale=scale, **sides
    )[0]
    return out  # [num_tokens, num_heads, head_dim]


def _group(cu: list[int], seqs: list[int], device: torch.device | str) -> VarlenGroup:
    starts = np.asarray([cu[i] for i in seqs], dtype=np.int64)
    lens = np.asarray([cu[i + 1] - cu[i] for i in seqs], dtype=np.int64)
    n, max_len = len(seqs), int(lens.max())
    offsets = np.arange(max_len, dtype=np.int64)[None, :]  # [1, max_len]
    is_real = offsets < lens[:, None]  # [n, max_len]
    # Padding slots read the sequence's first row (finite, never returned).
    gather = np.where(is_real, starts[:, None] + offsets, starts[:, None]).reshape(-1)
    tokens = (starts[:, None] + offsets)[is_real]  # row-major: ascending within each row
    slots = (np.arange(n, dtype=np.int64)[:, None] * max_len + offsets)[is_real]
    order = np.argsort(tokens, kind="stable")
    key_mask = None
    if int(lens.min()) != max_len:
        key_mask = torch.from_numpy(is_real).to(device)[:, None, None, :]

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return VarlenGroup(
        num_seqs=n,
        max_len=max_len,
        gather_index=to_device(gather),
        token_index=to_device(tokens[order]),
        slot_index=to_device(slots[order]),
        key_mask=key_mask,
    )


def varlen_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cu_seqlens: Sequence[int] | VarlenPlan,
    scale: float,
    causal: bool,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Self-attention within each packed sequence.

    Args:
        q: Queries of all sequences back to back.
        k: Keys, same rows; `num_heads` must be a multiple of `num_kv_heads` (GQA).
        v: Values, same rows.
        cu_seqlens: `[num_seqs + 1]` cumulative lengths (sequence `i` is rows
            `cu_seqlens[i]:cu_seqlens[i + 1]`), or a `VarlenPlan` built from them once per
            forward so that layers share the padding indices.
        scale: Softmax scale, usually `head_dim ** -0.5`.
        causal: Token `j` attends to tokens `<= j` of its sequence; else to all of them.
        window: Bidirectional local attention: token `j` attends to the tokens `i` of its
            sequence with `|i - j| <= window` (ModernBERT's `local_attention // 2`). None: to
            all of them. Not combined with `causal`.

    Returns:
        The attention output, rows in the order of `q`.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if window is not None and (causal or window < 0):
        raise ValueError(f"window={window} needs causal=False and window >= 0")
    plan = (
        cu_seqlens if isinstance(cu_seqlens, VarlenPlan) else VarlenPlan.build(cu_seqlens, q.device)
    )
    if plan.num_tokens != num_tokens:
        raise ValueError(f"cu_seqlens covers {plan.num_tokens} tokens, q has {num_tokens}")
    group_size = num_heads // num_kv_heads
    k, v = k.to(q.dtype), v.to(q.dtype)
    if plan.cu_seqlens_device is not None and flash_varlen_supported(q.device, q.dtype, head_dim):
        if group_size > 1:
            k = k.repeat_interleave(group_size, dim=1)
            v = v.repeat_interleave(group_size, dim=1)
        return _flash_varlen(q, k, v, plan, scale, causal, window)
    if group_size > 1:
        k = k.repeat_interleave(group_size, dim=1)  # [num_tokens, num_heads, head_dim]
        v = v.repeat_interleave(group_size, dim=1)
    out = q.new_empty(q.shape)
    for group_index, g in enumerate(plan.groups):
        mask = None if causal else g.key_mask
        if window is not None and window < g.max_len - 1:  # else the band covers every key
            mask = plan.window_mask(group_index, window)
        attn = F.scaled_dot_product_attention(
            _pad(q, g),
            _pad(k, g),
            _pad(v, g),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
        )  # [num_seqs, num_heads, max_len, head_dim]
        rows = attn.transpose(1, 2).reshape(-1, num_heads, head_dim).index_select(0, g.slot_index)
        if plan.is_single_group:
            return rows
        out.index_copy_(0, g.token_index, rows)
    return out


def _pad(x: torch.Tensor, group: VarlenGroup) -> torch.Tensor:
    """`[num_tokens, heads, head_dim]` → `[num_seqs, heads, max_len, head_dim]` (a view)."""
    x = x.index_select(0, group.gather_index)
    return x.view(group.num_seqs, group.max_len, x.shape[1], x.shape[2]).transpose(1, 2)


def varlen_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Sequence[int],
    scale: float,
    causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    """`varlen_attention` one sequence at a time, with an explicit softmax (for tests)."""
    group_size = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1).float()  # [num_heads, len, head_dim]
        ks = k[start:end].repeat_interleave(group_size, dim=1).transpose(0, 1).float()
        vs = v[start:end].repeat_interleave(group_size, dim=1).transpose(0, 1).float()
        scores = qs @ ks.transpose(1, 2) * scale  # [num_heads, len, len]
        length = end - start
        if causal:
            future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if window is not None:
            slots = torch.arange(length, device=q.device)
            far = (slots[:, None] - slots[None, :]).abs() > window
            scores = scores.masked_fill(far, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out
