"""int4 weight-only linear layers (W4A16): one in-memory layout for every checkpoint format.

GPTQ, AWQ and compressed-tensors checkpoints differ only in how their loaders
(`loader/int4_formats.py`) unpack them; each hands this module its projection as plain
tensors (`Int4Part`: one nibble per byte, the features in the checkpoint's order), and
`pack_int4` lays them out as `gpu_kernels/w4a16.py` reads them:

- `qweight` int32 `[K / 8, N]`, eight features per word along K;
- `scales` `[G, N]` in the activation dtype, `zeros` uint8 `[G, N]` (absent when every
  zero is the midpoint 8: symmetric checkpoints read no zero points);
- activation order (GPTQ's `desc_act`, compressed-tensors' `actorder: group`): the
  features are sorted by group at load, so that each step of the kernel reads one group
  and its scales once; `perm` `[K]` says which activation column each sorted feature
  multiplies (`x[:, perm]`, gathered inside the kernel). Where the groups cannot be made
  contiguous (a rank's slice of an activation-ordered layer under tensor parallelism),
  `g_idx` `[K]` gives each feature's group and the rank keeps every group's scales.

On CUDA the layer multiplies through `w4a16` (the launch table picks the matrix-vector
form, split-K tiles or wide tiles by the number of rows). On CPU the weight is
dequantized once at load (`dequantize_int4_ref`, features back in activation order) and
multiplied in the model dtype: the reference the tests compare against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from batchlm.kernels import use_triton_kernels

from ... import envs
from .linear import Linear, LinearMethod

__all__ = ["INT4_PARAMS", "Int4LinearMethod", "Int4Part", "pack_int4", "unpack_words"]

PACK = 8
"""4-bit values per int32 word."""
MIDPOINT = 8
"""The zero point of symmetric 4-bit weights."""
INT4_PARAMS = ("qweight", "scales", "zeros", "perm", "g_idx")
"""The tensors of an int4 layer (the last three may be absent)."""


class Int4Part(NamedTuple):
    """One projection (or several, side by side) unpacked: what a format's loader hands
    `pack_int4`. `W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]`."""

    q: torch.Tensor
    """`[K, N]` uint8 values 0..15, features in activation column order."""
    scales: torch.Tensor
    """`[G, N]` float."""
    zeros: torch.Tensor | None
    """`[G, N]` uint8 zero points (0..16), or None for the midpoint 8."""
    g_idx: torch.Tensor | None
    """`[K]` group of each feature, or None: `k // group_size` (contiguous groups)."""


def _set(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    if value is None:
        layer.register_parameter(name, None)
    else:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


def pack_words(q: torch.Tensor) -> torch.Tensor:
    """`[K, N]` values 0..15 → `[K / 8, N]` int32, feature `8i + j` in bits `4j` (one
    nibble position at a time: the temporaries stay the size of the words)."""
    words = torch.zeros(q.shape[0] // PACK, q.shape[1], dtype=torch.int32, device=q.device)
    for j in range(PACK):
        words |= q[j::PACK].to(torch.int32) << (4 * j)
    return words


def unpack_words(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_words`: `[K / 8, N]` int32 → `[K, N]` uint8."""
    shifts = torch.arange(0, 4 * PACK, 4, device=qweight.device, dtype=torch.int32)
    nibbles = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return nibbles.reshape(-1, qweight.shape[1]).to(torch.uint8)


def pack_int4(layer: Linear, part: Int4Part, group_size: int, dtype: torch.dtype) -> None:
    """Give `layer` its int4 tensors from `part` (on the layer's device), sorting the
    features by group when they are activation-ordered.

    Args:
        layer: An int4 layer (`Int4LinearMethod.create_weights`), `[N, K]` on this rank.
        part: The whole projection on this rank.
        group_size: Features per group (the layer's K for one group per output channel).
        dtype: The scales' dtype (the activations').
    """
    num_k, num_n = part.q.shape
    perm = g_idx = None
    scales, zeros, q = part.scales, part.zeros, part.q
    if part.g_idx is not None:
        order = torch.sort(part.g_idx.long(), stable=True)
        groups = order.values
        expected = torch.arange(num_k, device=groups.device) // group_size
        if num_k % group_size == 0 and torch.equal(groups - groups[0], expected):
            first = int(groups[0])  # contiguous groups: this rank's scales only
            scales = scales[first : first + num_k // group_size]
            zeros = None if zeros is None else zeros[first : first + num_k // group_size]
        else:
            g_idx = groups.to(torch.int32)
        if not torch.equal(order.indices, torch.arange(num_k, device=groups.device)):
            perm = order.indices.to(torch.int32)
            q = q[order.indices]
    if zeros is not None and bool((zeros == MIDPOINT).all()):
        zeros = None
    device = layer.int4_device
    _set(layer, "qweight", pack_words(q.to(device)))
    _set(layer, "scales", scales.to(device=device, dtype=dtype).contiguous())
    _set(layer, "zeros", None if zeros is None else zeros.to(device, torch.uint8).contiguous())
    _set(layer, "perm", None if perm is None else perm.to(device))
    _set(layer, "g_idx", None if g_idx is None else g_idx.to(device))
    layer.group_size = group_size


def random_int4(
    layer: Linear, group_size: int, symmetric: bool, act_order: bool, dtype: torch.dtype,
    gen: torch.Generator, std: float = 0.02,
) -> None:  # fmt: skip
    """Seeded random int4 tensors for `layer` (`load_format="dummy"`): uniform nibbles,
    scales around `std / 4.6` (so the weights' spread is about `std`, as the dense layers'
    random weights), zeros near the midpoint when asymmetric, a random feature order when
    activation-ordered."""
    device = layer.int4_device
    num_n, num_k = layer.out_features, layer.in_features
    num_groups = num_k // group_size
    words = torch.randint(
        -(2**31), 2**31 - 1, (num_k // PACK, num_n), generator=gen, device=device,
        dtype=torch.int32,
    )  # fmt: skip
    base = std / 4.6  # the standard deviation of a uniform nibble around 8 is about 4.6
    scales = base * (0.75 + 0.5 * torch.rand(num_groups, num_n, generator=gen, device=device))
    zeros = None
    if not symmetric:
        zeros = torch.randint(
            6, 11, (num_groups, num_n), generator=gen, device=device, dtype=torch.uint8
        )
    perm = None
    if act_order:
        perm = torch.randperm(num_k, generator=gen, device=device).to(torch.int32)
    _set(layer, "qweight", words)
    _set(layer, "scales", scales.to(dtype))
    _set(layer, "zeros", zeros)
    _set(layer, "perm", perm)
    _set(layer, "g_idx", None)
    layer.group_size = group_size


def dequantized_weight(layer: Linear, dtype: torch.dtype) -> torch.Tensor:
    """`[N, K]` in `dtype`, features in activation column order: the weight the layer's
    int4 tensors stand for."""
    from batchlm.kernels.w4a16 import dequantize_int4_ref

    weight = dequantize_int4_ref(
        layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.g_idx
    )  # [K, N], sorted features
    if layer.perm is not None:
        unsorted = torch.empty_like(weight)
        unsorted[layer.perm.long()] = weight
        weight = unsorted
    return weight.t().contiguous().to(dtype)


class Int4LinearMethod(LinearMethod):
    """Weight-only int4 with scale groups along the input features (see the module
    docstring): the `w4a16` kernel on CUDA, the dequantized weight elsewhere.

    Args:
        device: Where the layers live.
        dtype: The activation dtype.
        group_size: Features per scale group (None: one group per output channel).
        symmetric: The checkpoint stores no zero points (the midpoint 8).
        act_order: The checkpoint's groups follow an order of the features of its own.
    """

    name = "int4"
    weight_dtype = torch.int32
    supports_batch_invariance = False

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        group_size: int | None = None,
        symmetric: bool = True,
        act_order: bool = False,
    ) -> None:
        super().__init__(device, dtype)
        self.group_size = group_size
        self.symmetric = symmetric
        self.act_order = act_order
        self._locks: torch.Tensor | None = None

    def layer_group_size(self, layer: Linear) -> int:
        """The group of `layer` on this rank: the configured one, or its input features for
        one group per output channel."""
        return layer.in_features if self.group_size is None else self.group_size

    def create_weights(self, layer: Linear) -> None:
        """Drop the full-precision weight (before the model is materialised, so that it is
        never allocated): the loader (`pack_int4`) or `random_int4` gives the layer its
        int4 tensors on the method's device."""
        layer.int4_device = self.device
        del layer.weight
        for name in INT4_PARAMS:
            layer.register_parameter(name, None)
        layer.group_size = self.layer_group_size(layer)

    def quantize_weights(self, layer: Linear) -> None:
        raise NotImplementedError(
            "int4 weights load from GPTQ, AWQ or compressed-tensors checkpoints; batchlm "
            "does not quantise full-precision checkpoints to int4"
        )

    def process_weights(self, layer: Linear) -> None:
        if layer.qweight is None:
            raise ValueError(f"{type(layer).__name__} has no int4 tensors (not loaded)")
        if not use_triton_kernels(layer.qweight):
            # The reference path: the dequantized weight in a plain matmul.
            _set(layer, "weight", dequantized_weight(layer, self.dtype))
            for name in INT4_PARAMS:
                delattr(layer, name)
            layer.quant_method = None
            return
        if self._locks is None:
            from batchlm.kernels.w4a16 import new_split_k_locks

            self._locks = new_split_k_locks(layer.qweight.device)
        layer.quant_method = self

    def operands(self, layer: Linear):  # -> batchlm.kernels.w4a16_fused.W4a16Weight | None
        """The layer's int4 operands as the fused one-token kernels take them
        (`w4a16_fused.w4a16_rotary_into_cache`), or None (the layer's product runs alone)
        unless `BATCHLM_W4A16_FUSIONS` is `1`."""
        from batchlm.kernels.w4a16_fused import W4a16Weight

        if not envs.w4a16_fusions():
            return None
        return W4a16Weight(
            layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.perm,
            layer.g_idx, self._locks,
        )  # fmt: skip

    def apply_silu_mul(self, layer: Linear, gate_up: torch.Tensor) -> torch.Tensor | None:
        """`apply(layer, silu(gate) * up)` in one kernel where `w4a16_silu_mul` takes it (one
        row) and `operands` gives them, else None."""
        from batchlm.kernels.w4a16_fused import w4a16_silu_mul

        weight = self.operands(layer)
        if weight is None or gate_up.dim() != 2:
            return None
        return w4a16_silu_mul(gate_up, weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from batchlm.kernels.w4a16 import w4a16

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [n, in]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = w4a16(
            x2,
            layer.qweight,
            layer.scales,
            layer.zeros,
            group_size=layer.group_size,
            perm=layer.perm,
            g_idx=layer.g_idx,
            locks=self._locks,
        )
        return out.reshape(*shape[:-1], out.shape[-1])
