"""Linear and embedding layers, merged (q|k|v, gate|up) and tensor-parallel.

Tensor parallelism follows the usual split: projections that fan out (q|k|v, gate|up) are
column-parallel (each rank holds a slice of every merged projection's output rows, and its
output stays sharded), the projections that fan back in (o_proj, down_proj) are
row-parallel (each rank holds a slice of the input columns; the partial outputs are summed
by an all-reduce), and the vocabulary is split in contiguous ranges across ranks for the
embedding and the LM head. Each layer records which part of the checkpoint tensor it holds
(`tp_rank`, `tp_size`); the loader reads that part.

With one rank the factories below return the plain layers, so a single-device model runs
exactly the code it would without tensor parallelism.

Quantization: the decoder's projections are `Linear` layers, whose matmul a quantization
method (`models/layers/quant.py`) may take over; the embedding and the LM head are other
classes and always stay in full precision.

LoRA: a layer's `lora` (set when the engine serves adapters, `engine/lora/`) adds the step's
adapters' products to the output of its matmul, whichever method computed it.

Batch invariance (`make_batch_invariant`): every `Linear` and LM head then multiplies
through `batch_invariant_linear`, whose rows do not depend on the other rows of the step
(quantized weights included: they are converted inside the product, with their scales).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from batchlm.kernels import use_triton_kernels

if TYPE_CHECKING:
    from ...distributed.parallel import TPGroup


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear`, or for one half-precision row on CUDA (a decode step at batch 1) the
    Triton matrix-vector kernel, which reads the weight faster than cuBLAS there."""
    if x.shape[0] == 1 and x.dim() == 2 and x.dtype in _GEMV_DTYPES and use_triton_kernels(x):
        from batchlm.kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


_GEMV_DTYPES = (torch.float16, torch.bfloat16)


def batch_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x W^T (* weight_scale) (+ bias)`, `[..., in]` → `[..., out]`, where each row is
    computed the same way whatever the other rows: the Triton kernel on CUDA, elsewhere its
    reference, which multiplies fixed chunks of rows (`gpu_kernels/matmul.py`)."""
    from batchlm.kernels.matmul import matmul, matmul_ref

    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    product = matmul if use_triton_kernels(rows) else matmul_ref
    out = product(rows, weight, bias, weight_scale)
    return out.reshape(*shape[:-1], weight.shape[0])


def _divide(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={tp_size}")
    return total // tp_size


class LinearMethod(ABC):
    """How a quantized `Linear` stores its weight and multiplies by it (the methods are in
    `models/layers/quant.py`).

    Lifecycle: either `create_weights` (before a quantized checkpoint is loaded into the
    layer) or `quantize_weights` (after a full-precision one was), then `process_weights`
    once the quantized weight and scales are in place; `apply` at run time.
    """

    name: str
    weight_dtype: torch.dtype
    supports_batch_invariance: bool = True
    """Whether `make_batch_invariant` may route the layer through `batch_invariant_linear`
    (its weight a plain tensor, with per-channel `weight_scale` if any)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        """The activation dtype."""

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Replace the layer's weight by an empty quantized one and add its scales."""

    @abstractmethod
    def quantize_weights(self, layer: Linear) -> None:
        """Quantise the layer's full-precision weight in place."""

    def process_weights(self, layer: Linear) -> None:
        """Make the layer run with this method (called once its weights are quantized)."""
        layer.quant_method = self

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """`x @ W^T` without the bias: `[..., in]` → `[..., out]` in `x.dtype`."""


class LinearLoRA(Protocol):
    """A projection's LoRA adapters (`engine/lora/layers.py`): `(x, out)` → `out` with the
    step's adapters' products added in place (the rows that run none left as they are)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Linear):
    """`y = x W^T + b`, where a quantization method, once set, does the matmul (`W` is then
    stored quantized, with its scales, as the method lays it out)."""

    quant_method: LinearMethod | None = None
    batch_invariant: bool = False
    """Multiply through `batch_invariant_linear` (set by `make_batch_invariant`)."""
    lora: LinearLoRA | None = None
    """The layer's LoRA adapters (set when the engine serves them): applied to the output
    of the matmul, whichever method computed it (before a row-parallel all-reduce)."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] → [n, out], no bias
        if self.batch_invariant:
            return batch_invariant_linear(x, self.weight, None, self._weight_scale())
        if self.quant_method is None:
            return linear(x, self.weight)
        return self.quant_method.apply(self, x)

    def _weight_scale(self) -> torch.Tensor | None:
        return None if self.quant_method is None else self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] → [n, out]
        out = self.base_forward(x)
        return out if self.lora is None else self.lora(x, out)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """`self(silu(gate) * up)` from `gate_up = [gate | up]` (`[n, 2 in]`) where the
        method multiplies `[gate | up]` itself, computing the activation on the way
        (`Int4LinearMethod.apply_silu_mul`); else None: apply the activation, then the
        layer. Not with LoRA adapters (they read the activation) or batch invariance."""
        apply = getattr(self.quant_method, "apply_silu_mul", None)
        if apply is None or self.lora is not None or self.batch_invariant:
            return None
        out = apply(self, gate_up)
        return None if out is None else self.finish(out)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """The matmul's output (`matmul`) as the layer's: the bias added."""
        return out if self.bias is None else out + self.bias

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] → [n, out]
        if self.batch_invariant:
            return batch_invariant_linear(x, self.weight, self.bias, self._weight_scale())
        if self.quant_method is None:
            return linear(x, self.weight, self.bias)
        out = self.quant_method.apply(self, x)
        return out if self.bias is None else out + self.bias


class MergedLinear(Linear):
    """One matmul for several projections that read the same input.

    With tensor parallelism each projection is split by output rows: this rank holds rows
    `[tp_rank * n / tp_size, (tp_rank + 1) * n / tp_size)` of each, side by side.

    Args:
        in_features: Input width.
        output_sizes: Width of each merged projection (whole model), in checkpoint order.
        bias: Whether the projections have biases.
        tp: The tensor-parallel group (None: one rank).
    """

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup | None = None
    ) -> None:
        self.tp_rank = tp.rank if tp is not None else 0
        self.tp_size = tp.world_size if tp is not None else 1
        local = [_divide(n, self.tp_size, "output size") for n in output_sizes]
        super().__init__(in_features, sum(local), bias=bias)
        self.output_sizes = local
        """Width of each projection on this rank."""

    def shard_slice(self, shard: int) -> slice:
        """Rows of this rank's weight that hold projection number `shard`."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def checkpoint_rows(self, shard: int) -> slice:
        """Rows of the checkpoint's projection `shard` that this rank holds."""
        n = self.output_sizes[shard]
        return slice(self.tp_rank * n, (self.tp_rank + 1) * n)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.output_sizes, dim=-1))


class RowParallelLinear(Linear):
    """`y = x W^T + b` where this rank holds a slice of W's input columns and `x` arrives
    sharded the same way; the partial products are summed over ranks. The bias is whole on
    every rank and added once, after the sum.

    Args:
        in_features: Input width of the whole layer.
        out_features: Output width.
        bias: Whether the layer has a bias.
        tp: The tensor-parallel group.
        reduce_output: False: return this rank's partial sum and leave the all-reduce to
            the consumer (an `RMSNorm` with `sum_over`); bias-free layers only.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        reduce_output: bool = True,
    ) -> None:
        if bias and not reduce_output:
            raise ValueError("a row-parallel layer with a bias must reduce its own output")
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        super().__init__(_divide(in_features, tp.world_size, "input size"), out_features, bias)
        self.tp = tp
        self.reduce_output = reduce_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in / tp] → [n, out]
        out = self.matmul(x)
        if self.lora is not None:  # this rank's part, summed by the all-reduce
            out = self.lora(x, out)
        return self.finish(out)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's partial product as the layer's output: summed over the ranks (unless
        `reduce_output` is False), then the bias added."""
        if not self.reduce_output:
            return out
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class _VocabShard:
    """This rank's contiguous range of the (padded) vocabulary."""

    def _init_shard(self, vocab_size: int, tp: TPGroup) -> int:
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.org_vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.rows_per_rank
        """First token id this rank holds; rows past the vocabulary are zero padding."""
        return self.rows_per_rank

    @property
    def num_checkpoint_rows(self) -> int:
        """Real (not padding) vocabulary rows on this rank."""
        return max(0, min(self.rows_per_rank, self.org_vocab_size - self.vocab_start))


class VocabParallelEmbedding(nn.Embedding, _VocabShard):
    """Token embedding with the vocabulary split across ranks: each rank looks up the ids
    in its range, zeros the others, and an all-reduce assembles every row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        rows = self._init_shard(vocab_size, tp)
        nn.Embedding.__init__(self, rows, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] → [n, hidden]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class LMHead(nn.Linear):
    """The LM head of one rank (an `nn.Linear`, not a `Linear`: never quantized)."""

    batch_invariant: bool = False
    """Multiply through `batch_invariant_linear` (set by `make_batch_invariant`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] → [n, vocab]
        if self.batch_invariant:
            return batch_invariant_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


class ParallelLMHead(nn.Linear, _VocabShard):
    """LM head with the vocabulary split across ranks: each rank scores its token range, an
    all-gather puts the ranges side by side, and the padding columns are dropped."""

    batch_invariant: bool = False
    """Multiply through `batch_invariant_linear` (set by `make_batch_invariant`)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        rows = self._init_shard(vocab_size, tp)
        nn.Linear.__init__(self, hidden_size, rows, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] → [n, vocab]
        if self.batch_invariant:
            local = batch_invariant_linear(x, self.weight)
        else:
            local = linear(x, self.weight)
        logits = self.tp.all_gather_last_dim(local)
        return logits[:, : self.org_vocab_size]


def make_batch_invariant(model: nn.Module) -> None:
    """Make every linear layer and LM head of `model` compute each row the same way
    whatever the other rows of its step (`batch_invariant_linear`); norms that carry a
    `batch_invariant` switch get it too.

    Raises:
        ValueError: `model` has layers whose rows depend on the batch and have no such
            path (the routed experts of mixture-of-experts models).
    """
    for name, module in model.named_modules():
        if type(module).__name__ == "FusedMoE":
            raise ValueError(
                f"batch_invariant=True does not cover mixture-of-experts layers ({name}: "
                "their routed matmuls group rows by expert); use a dense model or "
                "batch_invariant=False"
            )
        method = getattr(module, "quant_method", None)
        if method is not None and not method.supports_batch_invariance:
            raise ValueError(
                f"batch_invariant=True does not cover {method.name} weights ({name}); "
                "load a full-precision checkpoint or use batch_invariant=False"
            )
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = True


def _is_parallel(tp: TPGroup | None) -> bool:
    return tp is not None and tp.world_size > 1


def row_parallel_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    tp: TPGroup | None,
    reduce_output: bool = True,
) -> Linear:
    """A row-parallel layer (see `RowParallelLinear` for `reduce_output`), or a plain
    `Linear` on one rank."""
    if _is_parallel(tp):
        return RowParallelLinear(in_features, out_features, bias, tp, reduce_output)
    return Linear(in_features, out_features, bias=bias)


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TPGroup | None) -> nn.Embedding:
    """A vocabulary-parallel embedding, or a plain `nn.Embedding` on one rank."""
    if _is_parallel(tp):
        return VocabParallelEmbedding(vocab_size, hidden_size, tp)
    return nn.Embedding(vocab_size, hidden_size)


def lm_head(hidden_size: int, vocab_size: int, tp: TPGroup | None) -> nn.Linear:
    """A vocabulary-parallel LM head, or a plain bias-free one on one rank."""
    if _is_parallel(tp):
        return ParallelLMHead(hidden_size, vocab_size, tp)
    return LMHead(hidden_size, vocab_size, bias=False)
