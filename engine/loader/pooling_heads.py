"""The projections that run after the encoder, with their weights.

- sentence-transformers `Dense` modules after `Pooling`: applied in order to each pooled
  vector, before normalisation and matryoshka truncation.
- Late interaction (ColBERT), recognised in two ways:
  - `architectures: ["HF_ColBERT"]` (Stanford ColBERT, `colbert-ir/colbertv2.0`): a BERT
    checkpoint whose `linear.weight` (`[dim, hidden]`, no bias) projects every token;
  - a sentence-transformers folder with no `Pooling` module whose `Dense` modules read every
    token (PyLate's folders: a Transformer module, then `pylate.models.Dense.Dense`).
  Either way each token's state goes through the projections and is L2-normalised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UnsupportedModelError
from ..models.layers.dense_head import DenseHead
from .st_config import DenseModuleConfig, SentenceTransformersConfig
from .weights import iter_checkpoint

__all__ = ["COLBERT_ARCHITECTURES", "PoolingHeads", "load_pooling_heads"]

COLBERT_ARCHITECTURES = ("HF_ColBERT",)
"""Architectures whose checkpoint carries the token projection as `linear.weight`."""
_COLBERT_PROJECTION = "linear."
_DENSE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class PoolingHeads:
    """The projections of one pooling model (empty lists: none)."""

    sentence: list[DenseHead] = field(default_factory=list)
    """Applied in order to each pooled vector."""
    tokens: list[DenseHead] = field(default_factory=list)
    """Applied in order to every token's state; non-empty only for late-interaction models."""

    @property
    def is_late_interaction(self) -> bool:
        return bool(self.tokens)


def load_pooling_heads(
    folder: Path,
    architecture: str,
    task: str,
    hidden_size: int,
    st: SentenceTransformersConfig | None,
    device: torch.device,
) -> PoolingHeads:
    """The projections of the model in `folder`, loaded onto `device` in float32.

    Args:
        folder: The model folder.
        architecture: `config.json`'s `architectures[0]`.
        task: What the body does (`embed`, `classify` or `token_embed`).
        hidden_size: Width of the encoder's states (the first projection's input).
        st: The folder's sentence-transformers pipeline, if it has one.
        device: Where the heads run.

    Raises:
        UnsupportedModelError: a projection does not fit the encoder or the one before it,
            its weights are missing or do not match its config, or Dense modules come with a
            model they cannot apply to (a classifier, an `HF_ColBERT` checkpoint).
    """
    dense = st.dense_modules if st is not None else ()
    if architecture in COLBERT_ARCHITECTURES:
        if dense:
            raise UnsupportedModelError(
                f"{folder} is an {architecture} checkpoint (token projection in linear.weight) "
                "and also lists sentence-transformers Dense modules; keep one of the two"
            )
        return PoolingHeads(tokens=[_colbert_projection(folder, hidden_size, device)])
    if dense and task == "classify":
        raise UnsupportedModelError(
            f"{folder} lists sentence-transformers Dense modules, which apply to embeddings; "
            f"{architecture} is a classifier: remove modules.json or load an embedding model"
        )
    heads = PoolingHeads()
    width = hidden_size
    for spec in dense:
        if spec.in_features != width:
            raise UnsupportedModelError(
                f"{spec.path / 'config.json'} has in_features={spec.in_features}, but its "
                f"input has {width} values; the module does not belong to this model"
            )
        head = DenseHead(spec.in_features, spec.out_features, spec.bias, spec.activation)
        _load_dense_weights(head, spec)
        (heads.tokens if spec.is_per_token else heads.sentence).append(head.to(device))
        width = spec.out_features
    return heads


def _load_dense_weights(head: DenseHead, spec: DenseModuleConfig) -> None:
    path = next((spec.path / n for n in _DENSE_WEIGHT_FILES if (spec.path / n).is_file()), None)
    if path is None:
        raise UnsupportedModelError(
            f"the Dense module in {spec.path} has no weights: expected "
            f"{' or '.join(_DENSE_WEIGHT_FILES)} there"
        )
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        head.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise UnsupportedModelError(
            f"cannot load the Dense module weights {path} into in_features={spec.in_features}, "
            f"out_features={spec.out_features}, bias={spec.bias}: {e}"
        ) from e


def _colbert_projection(folder: Path, hidden_size: int, device: torch.device) -> DenseHead:
    """ColBERT's `linear` token projection, read from the main checkpoint."""
    tensors = {
        name[len(_COLBERT_PROJECTION) :]: tensor.read().float()
        for name, tensor in iter_checkpoint(folder)
        if name.startswith(_COLBERT_PROJECTION)
    }
    weight = tensors.get("weight")
    if weight is None or weight.dim() != 2 or weight.shape[1] != hidden_size:
        found = "none" if weight is None else f"shape {tuple(weight.shape)}"
        raise UnsupportedModelError(
            f"{folder} is an HF_ColBERT checkpoint but has no usable token projection "
            f"linear.weight of shape [dim, {hidden_size}] (found {found})"
        )
    head = DenseHead(hidden_size, weight.shape[0], "bias" in tensors, "torch.nn.Identity")
    head.load_state_dict({f"linear.{k}": v for k, v in tensors.items()}, strict=True)
    return head.to(device)
