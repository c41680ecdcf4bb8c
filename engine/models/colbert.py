"""Stanford ColBERT (`HF_ColBERT`): a BERT encoder under `bert.` whose every token is
projected for late interaction.

The checkpoint's projection (`linear.weight`) is not part of this module: the loader reads it
as the model's token head (`loader/pooling_heads.py`), like the `Dense` module of a PyLate
folder, so both kinds of ColBERT model run the same way after the encoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..attention.varlen import VarlenPlan
from .bert import BertModel
from .layers.pooler import PoolingType

__all__ = ["ColBertModel"]


class ColBertModel(nn.Module):
    """The BERT body of an `HF_ColBERT` checkpoint: packed token ids → final hidden states."""

    packed_modules: ClassVar[dict[str, list[str]]] = BertModel.packed_modules
    default_pooling_type = PoolingType.ALL

    def __init__(self, config: Any, **unused: Any) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.max_positions = self.bert.max_positions
        self.ignored_checkpoint_prefixes = (
            *(f"bert.{p}" for p in self.bert.ignored_checkpoint_prefixes),
            "linear.",  # the token projection, loaded as a head
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        cu_seqlens: Sequence[int] | VarlenPlan,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.bert(input_ids, positions, token_type_ids, cu_seqlens)
