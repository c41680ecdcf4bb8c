"""How each int4 checkpoint format stores a projection, and its unpacking into the plain
form every format shares (`Int4Part` of `models/layers/int4.py`: `q` `[K, N]` one value
0..15 per byte, `scales` / `zeros` `[G, N]`, `g_idx` `[K]`).

For a projection of `N` outputs and `K` inputs in groups of `group_size` (`G = K /
group_size` groups; one group of `K` for per-channel scales):

- GPTQ (`gptq`, `gptq_v2`): `qweight` int32 `[K / 8, N]`, input `8i + j` of output `n` in
  bits `4j` of word `(i, n)`; `qzeros` int32 `[G, N / 8]`, output `8c + j` in bits `4j` of
  word `(g, c)`, stored minus one in the `gptq` format (so a zero of 8 reads 7) and as is
  in `gptq_v2`; `scales` float16 `[G, N]`; `g_idx` int32 `[K]`, each input's group (read
  when present: the identity `k // group_size` without `desc_act`).
- AWQ (`awq`, AutoAWQ's gemm layout): `qweight` int32 `[K, N / 8]` and `qzeros` int32
  `[G, N / 8]` packed along the outputs in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7
  (bits `4i` of word `(r, c)` hold output `8c + order[i]`); `scales` float16 `[G, N]`.
- compressed-tensors (`pack-quantized`): `weight_packed` int32 `[N, K / 8]`, input
  `8w + j` of output `n` in bits `4j` of word `(n, w)`, as the signed value plus 8;
  `weight_scale` `[N, G]`; `weight_zero_point` (asymmetric) int32 `[N / 8, G]` packed the
  same way along the outputs (older versions: int8 `[N, G]` unpacked), signed plus 8;
  `weight_g_idx` int32 `[K]` with `actorder: group`; `weight_shape` `[2]` = `[N, K]`.

In every format `W[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]`. A tensor of
another shape or dtype than its format says is refused with both shapes named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..errors import UnsupportedModelError
from ..models.layers.int4 import MIDPOINT, PACK, Int4Part

__all__ = ["FORMATS", "Int4Format", "ProjectionShape"]

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble `i` of an AWQ word holds output `8c + _AWQ_ORDER[i]`."""
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class ProjectionShape(NamedTuple):
    """A projection as the checkpoint holds it (the whole model's, before any split)."""

    n: int
    """Output features."""
    k: int
    """Input features."""
    group_size: int
    """Inputs per group (`k` for per-channel scales)."""

    @property
    def num_groups(self) -> int:
        return self.k // self.group_size


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words → uint8 values, the 8 nibbles of each word expanded along `dim` (0 or 1)
    in bit order (nibble `j` from bits `4j`), one nibble position at a time."""
    rows, cols = words.shape
    shape = (rows * PACK, cols) if dim == 0 else (rows, cols * PACK)
    out = torch.empty(shape, dtype=torch.uint8, device=words.device)
    for j in range(PACK):
        nibble = ((words >> (4 * j)) & 0xF).to(torch.uint8)
        if dim == 0:
            out[j::PACK] = nibble
        else:
            out[:, j::PACK] = nibble
    return out


def _check(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    what: str,
) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise UnsupportedModelError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)} and dtype "
            f"{str(tensor.dtype).removeprefix('torch.')}; the {what} layout of this "
            f"projection expects shape {shape} and dtype {want}; the weights do not match "
            "config.json (its sizes or quantization_config)"
        )


def _g_idx(name: str, tensor: torch.Tensor, shape: ProjectionShape, what: str):
    """The checkpoint's group index, or None where it is the identity `k // group_size`."""
    _check(name, tensor, (shape.k,), (torch.int32, torch.int64), what)
    g_idx = tensor.to(torch.int32)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= shape.num_groups:
        raise UnsupportedModelError(
            f"checkpoint tensor {name!r} names groups {int(g_idx.min())}..{int(g_idx.max())}; "
            f"the projection has {shape.num_groups} (group_size {shape.group_size})"
        )
    counts = torch.bincount(g_idx.long(), minlength=shape.num_groups)
    if not bool((counts == shape.group_size).all()):
        raise UnsupportedModelError(
            f"checkpoint tensor {name!r} does not give every group {shape.group_size} inputs "
            f"(sizes from {int(counts.min())} to {int(counts.max())})"
        )
    identity = torch.arange(shape.k, device=g_idx.device, dtype=torch.int32) // shape.group_size
    return None if torch.equal(g_idx, identity) else g_idx


class Int4Format:
    """One format's tensor names and their unpacking."""

    name: str
    weight_leaf: str
    """The tensor that marks a projection as int4 in the checkpoint."""
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()

    def leaves(self) -> tuple[str, ...]:
        return (*self.required, *self.optional)

    def required_leaves(self, symmetric: bool, act_order: bool) -> tuple[str, ...]:
        """The tensors a projection must have under the checkpoint's settings."""
        return self.required

    def unpack(
        self, tensors: Mapping[str, tuple[str, torch.Tensor]], shape: ProjectionShape
    ) -> Int4Part:
        """The projection's tensors (leaf → (checkpoint name, tensor)) in the plain form."""
        raise NotImplementedError


class Gptq(Int4Format):
    """AutoGPTQ / GPTQModel's layout; `stored_minus_one` for the `gptq` format's zeros."""

    weight_leaf = "qweight"
    required = ("qweight", "qzeros", "scales")
    optional = ("g_idx",)

    def __init__(self, name: str, stored_minus_one: bool) -> None:
        self.name = name
        self.stored_minus_one = stored_minus_one

    def required_leaves(self, symmetric: bool, act_order: bool) -> tuple[str, ...]:
        return (*self.required, "g_idx") if act_order else self.required

    def unpack(self, tensors, shape):
        what = f"GPTQ ({self.name})"
        if shape.k % PACK or shape.n % PACK:
            raise UnsupportedModelError(
                f"{what}: a projection of {shape.n} outputs and {shape.k} inputs does not "
                f"pack 8 values per int32 word"
            )
        (qn, qweight), (zn, qzeros), (sn, scales) = (tensors[k] for k in self.required)
        g = shape.num_groups
        _check(qn, qweight, (shape.k // PACK, shape.n), (torch.int32,), what)
        _check(zn, qzeros, (g, shape.n // PACK), (torch.int32,), what)
        _check(sn, scales, (g, shape.n), _FLOATS, what)
        zeros = _nibbles(qzeros, dim=1)
        if self.stored_minus_one:
            zeros = zeros + 1  # 1..16: a stored 15 is a zero of 16, as the GPTQ kernels read it
        g_idx = _g_idx(*tensors["g_idx"], shape, what) if "g_idx" in tensors else None
        return Int4Part(_nibbles(qweight, dim=0), scales, zeros, g_idx)


class Awq(Int4Format):
    """AutoAWQ's gemm layout."""

    name = "awq"
    weight_leaf = "qweight"
    required = ("qweight", "qzeros", "scales")

    def unpack(self, tensors, shape):
        what = "AWQ (gemm)"
        if shape.k % PACK or shape.n % PACK:
            raise UnsupportedModelError(
                f"{what}: a projection of {shape.n} outputs and {shape.k} inputs does not "
                f"pack 8 values per int32 word"
            )
        (qn, qweight), (zn, qzeros), (sn, scales) = (tensors[k] for k in self.required)
        g = shape.num_groups
        _check(qn, qweight, (shape.k, shape.n // PACK), (torch.int32,), what)
        _check(zn, qzeros, (g, shape.n // PACK), (torch.int32,), what)
        _check(sn, scales, (g, shape.n), _FLOATS, what)
        return Int4Part(_awq_columns(qweight), scales, _awq_columns(qzeros), None)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """`[R, C]` AWQ words → `[R, 8C]` uint8, outputs in their own order."""
    nibbles = _nibbles(words, dim=1).reshape(words.shape[0], -1, PACK)  # [R, C, nibble]
    reverse = [_AWQ_ORDER.index(j) for j in range(PACK)]  # nibble of output 8c + j
    return nibbles[:, :, reverse].reshape(words.shape[0], -1)


class PackQuantized(Int4Format):
    """compressed-tensors' `pack-quantized` layout."""

    name = "pack-quantized"
    weight_leaf = "weight_packed"
    required = ("weight_packed", "weight_scale")
    optional = ("weight_zero_point", "weight_g_idx", "weight_shape")

    def required_leaves(self, symmetric: bool, act_order: bool) -> tuple[str, ...]:
        leaves = self.required + (() if symmetric else ("weight_zero_point",))
        return leaves + (("weight_g_idx",) if act_order else ())

    def unpack(self, tensors, shape):
        what = "compressed-tensors pack-quantized"
        if shape.k % PACK:
            raise UnsupportedModelError(
                f"{what}: {shape.k} inputs do not pack 8 values per int32 word"
            )
        (pn, packed), (sn, scale) = (tensors[k] for k in self.required)
        g = shape.num_groups
        _check(pn, packed, (shape.n, shape.k // PACK), (torch.int32,), what)
        _check(sn, scale, (shape.n, g), _FLOATS, what)
        if "weight_shape" in tensors:
            name, given = tensors["weight_shape"]
            if given.numel() != 2 or given.reshape(-1).tolist() != [shape.n, shape.k]:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} says the weight is {given.reshape(-1).tolist()}; "
                    f"the model's projection is {[shape.n, shape.k]}"
                )
        zeros = None
        if "weight_zero_point" in tensors:
            zn, zp = tensors["weight_zero_point"]
            if zp.dtype == torch.int32:
                _check(zn, zp, (-(-shape.n // PACK), g), (torch.int32,), what)
                zeros = _nibbles(zp, dim=0)[: shape.n].t()  # already signed + 8
            else:
                _check(zn, zp, (shape.n, g), (torch.int8,), what)
                zeros = (zp.to(torch.int16) + MIDPOINT).to(torch.uint8).t()
        g_idx = None
        if "weight_g_idx" in tensors:
            g_idx = _g_idx(*tensors["weight_g_idx"], shape, what)
        q = _nibbles(packed, dim=1).t()  # [K, N]
        return Int4Part(q, scale.t(), zeros, g_idx)


FORMATS: dict[str, Int4Format] = {
    "gptq": Gptq("gptq", stored_minus_one=True),
    "gptq_v2": Gptq("gptq_v2", stored_minus_one=False),
    "awq": Awq(),
    "pack-quantized": PackQuantized(),
}
"""`QuantizationConfig.weight_format` → its format."""
