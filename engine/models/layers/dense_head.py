"""A projection after the encoder: sentence-transformers' `Dense` module, `act(linear(x))`.

It maps pooled embeddings to another width (a sentence-transformers pipeline's `Dense`), or
every token's state to its late-interaction vector (ColBERT's projection). Weights stay in
float32 whatever the encoder's dtype: the head is small and its output is the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UnsupportedModelError

__all__ = ["DENSE_ACTIVATIONS", "DenseHead", "dense_activation"]

# sentence-transformers saves the activation as the module's class path
# (`torch.nn.modules.activation.Tanh`); these classes take no arguments.
DENSE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "Sigmoid": torch.sigmoid,
    "ReLU": F.relu,
    "GELU": F.gelu,
    "SiLU": F.silu,
}


def dense_activation(path: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of a saved activation class path.

    Raises:
        UnsupportedModelError: not one of the `torch.nn` classes in `DENSE_ACTIVATIONS`.
    """
    module, _, name = str(path).rpartition(".")
    if not module.startswith("torch.nn") or name not in DENSE_ACTIVATIONS:
        supported = ", ".join(f"torch.nn.{n}" for n in DENSE_ACTIVATIONS)
        raise UnsupportedModelError(
            f"activation_function={path!r} is not supported in a Dense module; supported: "
            f"{supported}"
        )
    return DENSE_ACTIVATIONS[name]


class DenseHead(nn.Module):
    """`activation(linear(x))` over the last dimension.

    Args:
        in_features: Width of the input (the encoder's hidden size, or the previous head's).
        out_features: Width of the output.
        bias: Whether `linear` has a bias.
        activation: The saved activation class path (see `dense_activation`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = activation
        self.act = dense_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out], float32
        return self.act(self.linear(x.to(self.linear.weight.dtype)))
