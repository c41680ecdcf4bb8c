"""The int4 product of one token fused with its neighbours, on the mma.sync W4A16 form
(`w4a16_mma.py`): `w4a16_rotary_into_cache` and `w4a16_silu_mul`.

`w4a16_rotary_into_cache` is the q|k|v projection, its rotary embedding and the cache
write in one kernel: the form with the epilogue (`w4a16_mma_rotary.py`) that
`gemv_rotary.py` gives the bf16 product.

Each program of the form owns 128 consecutive outputs, whole heads of 64 or 128 channels,
so the program that finishes a column (the last of its split, or the only one) holds every
channel pair `(c, c + D / 2)` of its heads. It rounds each output to the activations' dtype
(as `w4a16` stores it), rotates the pairs of query and key heads in float32 as
`rotary.rotate_pair` does, and stores the queries to the returned tensor and the keys and
values into the paged cache at the token's slot (none for a negative slot). So the outputs
are those of `w4a16` followed by `rotary_embedding_into_cache`, without the second launch
and without the q|k|v tensor in between.

`w4a16_silu_mul` is the MLP's down projection taking `[gate | up]` itself: where the form
stages the row's activations in shared memory before its first step (`staged_steps`), it
computes `silu(gate) * up` as it stages them, rounded as `activation.silu_and_mul` rounds
it, so the SiLU-and-mul kernel and its output go.

The `_ref` functions are the two steps' plain-PyTorch references.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .activation import silu_and_mul_ref
from .gemv_rotary import check_token_rotary, split_heads
from .launch import check_tensor
from .pdl import launch_options
from .rotary import rotary_embedding_into_cache_ref
from .w4a16 import _check_operands, _mma_split, _split_k_parts, _w4a16_kernel, w4a16_ref
from .w4a16_launch import W4a16Launch
from .w4a16_mma import launch_w4a16_mma, mma_launch
from .w4a16_mma_rotary import RotaryCache
from .w4a16_mma_staging import staged_steps

__all__ = [
    "W4a16Weight",
    "w4a16_rotary_into_cache",
    "w4a16_rotary_into_cache_ref",
    "w4a16_silu_mul",
    "w4a16_silu_mul_ref",
]


class W4a16Weight(NamedTuple):
    """An int4 layer's operands as `w4a16` takes them."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    perm: torch.Tensor | None
    g_idx: torch.Tensor | None
    locks: torch.Tensor | None


def w4a16_rotary_into_cache(
    x: torch.Tensor,
    weight: W4a16Weight,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor | None:
    """`w4a16(x, *weight)` split into query, key and value heads, then
    `rotary_embedding_into_cache` on them, in one launch; or None where the mma.sync form
    does not take the call (`w4a16_mma.mma_launch`; `g_idx`; heads that do not divide its
    128 outputs a program), and the caller takes the two steps.

    Args:
        x: `[1, K]` half-precision activations of one token, unit stride.
        weight: the q|k|v layer's int4 operands, `(num_heads + 2 * num_kv_heads) *
            head_dim` outputs.
        positions, cos_sin, key_cache, value_cache, slot_mapping, num_heads: as for
            `gemv_rotary.gemv_rotary_into_cache`.

    Returns:
        The rotated queries, a new `[1, num_heads, head_dim]` tensor.
    """
    check_token_rotary(x, positions, cos_sin, key_cache, value_cache, slot_mapping)
    if x.stride(1) != 1:
        x = x.contiguous()
    num_kv_heads, head_dim = key_cache.shape[2:]
    num_m, num_n, num_k = _check_operands(
        x, weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.perm,
        weight.g_idx,
    )  # fmt: skip
    num_rows = (num_heads + 2 * num_kv_heads) * head_dim
    if num_n != num_rows:
        raise ValueError(
            f"qweight has {num_n} outputs; {num_heads} query and {num_kv_heads} key and value "
            f"heads of {head_dim} are {num_rows}"
        )
    launch = _form_launch(num_m, num_n, num_k, x, weight)
    if launch is None or launch.block_n % head_dim or head_dim % 2:
        return None
    query = torch.empty((1, num_heads, head_dim), dtype=x.dtype, device=x.device)
    cache = RotaryCache(positions, slot_mapping, cos_sin, key_cache, value_cache, num_heads)
    _run(x, weight, launch, query.view(1, num_heads * head_dim), num_n, rotary=cache)
    return query


def w4a16_rotary_into_cache_ref(
    x: torch.Tensor,
    weight: W4a16Weight,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """`w4a16_rotary_into_cache` as `w4a16_ref`, then `rotary_embedding_into_cache_ref`."""
    qkv = w4a16_ref(
        x, weight.qweight, weight.scales, weight.zeros, group_size=weight.group_size,
        perm=weight.perm, g_idx=weight.g_idx,
    )  # fmt: skip
    q, k, v = split_heads(qkv, num_heads, *key_cache.shape[2:])
    return rotary_embedding_into_cache_ref(
        positions, q, k, v, cos_sin, key_cache, value_cache, slot_mapping
    )


def w4a16_silu_mul(gate_up: torch.Tensor, weight: W4a16Weight) -> torch.Tensor | None:
    """`w4a16(silu_and_mul(gate_up), *weight)` in one launch, or None where the mma.sync
    form does not stage the call's activations (`staged_steps`; `g_idx`), and the caller
    takes the two steps.

    Args:
        gate_up: `[M, 2K]` half-precision `[gate | up]`, unit stride.
        weight: the down projection's int4 operands, K input features.

    Returns:
        `[M, N]` in gate_up's dtype.
    """
    check_tensor("gate_up", gate_up, ndim=2, dtypes=(torch.float16, torch.bfloat16))
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even width, got shape {tuple(gate_up.shape)}")
    if gate_up.shape[1] != 2 * 8 * weight.qweight.shape[0]:
        raise ValueError(
            f"gate_up has {gate_up.shape[1]} columns; the weight's {8 * weight.qweight.shape[0]} "
            "input features take twice as many ([gate | up])"
        )
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    num_m, num_n, num_k = _check_operands(
        gate_up[:, : gate_up.shape[1] // 2], weight.qweight, weight.scales, weight.zeros,
        weight.group_size, weight.perm, weight.g_idx,
    )  # fmt: skip
    launch = _form_launch(num_m, num_n, num_k, gate_up, weight)
    gathered = weight.perm is not None
    if launch is None or not staged_steps(num_m, num_k, launch, gate_up.element_size(), gathered):
        return None
    y = torch.empty((num_m, num_n), dtype=gate_up.dtype, device=gate_up.device)
    _run(gate_up, weight, launch, y, num_n, silu_mul=True)
    return y


def w4a16_silu_mul_ref(gate_up: torch.Tensor, weight: W4a16Weight) -> torch.Tensor:
    """`w4a16_silu_mul` as `silu_and_mul_ref`, then `w4a16_ref`."""
    return w4a16_ref(
        silu_and_mul_ref(gate_up), weight.qweight, weight.scales, weight.zeros,
        group_size=weight.group_size, perm=weight.perm, g_idx=weight.g_idx,
    )  # fmt: skip


def _form_launch(
    num_m: int, num_n: int, num_k: int, x: torch.Tensor, weight: W4a16Weight
) -> W4a16Launch | None:  # fmt: skip
    """The mma.sync form's launch for the call, as `w4a16` would take it (unsplit without
    enough counters), or None where it does not take it (nor `g_idx`)."""
    launch = mma_launch(num_m, num_n, num_k, weight.group_size, x.dtype, x.device)
    if launch is None or weight.g_idx is not None:
        return None
    return _mma_split(launch, weight.locks, num_n)


def _run(
    x: torch.Tensor, weight: W4a16Weight, launch: W4a16Launch, out: torch.Tensor, num_n: int,
    **fusion: object,
) -> None:  # fmt: skip
    """`launch_w4a16_mma` into `out` with its split-K workspace, and the `fusion` keyword."""
    parts = _split_k_parts(launch.split_k, weight.locks, out, num_n)
    launch_w4a16_mma(
        x, weight.qweight, weight.scales, weight.zeros, weight.perm, out, parts, weight.locks,
        group_size=weight.group_size, launch=launch,
        pdl=launch_options(_w4a16_kernel, x.device)["PDL"], **fusion,
    )  # fmt: skip
