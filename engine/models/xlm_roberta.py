"""XLM-RoBERTa encoders: BERT layers with positions counted from `pad_token_id + 1` and
RoBERTa's classification head (`classifier.dense` + tanh + `classifier.out_proj`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..attention.varlen import VarlenPlan
from .bert import BertModel
from .layers.pooler import PoolingType

__all__ = ["XLMRobertaForSequenceClassification", "XLMRobertaModel"]


class XLMRobertaModel(BertModel):
    """The XLM-R encoder; same layers and checkpoint names as `BertModel`.

    Positions are 0-based per sequence as for BERT; like Hugging Face, the model looks up
    `position + pad_token_id + 1` (the packed layout has no padding tokens to skip).
    """

    @staticmethod
    def position_offset_of(config: Any) -> int:
        return int(config.pad_token_id) + 1


class XLMRobertaClassificationHead(nn.Module):
    """`out_proj(tanh(dense(cls_state)))`: HF's RoBERTa sequence-classification head."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:  # [B, hidden] → [B, labels]
        return self.out_proj(torch.tanh(self.dense(cls_states)))


class XLMRobertaForSequenceClassification(nn.Module):
    """An XLM-R encoder with its classification head (rerankers, cross-encoders).

    `forward` returns hidden states; the runner pools the CLS (`<s>`) token and calls
    `classify`, which returns logits without activation.
    """

    packed_modules: ClassVar[dict[str, list[str]]] = BertModel.packed_modules
    default_pooling_type = PoolingType.CLS

    def __init__(self, config: Any, **unused: Any) -> None:
        super().__init__()
        self.config = config
        # HF builds no pooler here; a checkpoint that carries one anyway has it skipped.
        self.roberta = XLMRobertaModel(config, add_pooling_layer=False)
        self.num_labels = int(config.num_labels)
        self.classifier = XLMRobertaClassificationHead(config)
        self.max_positions = self.roberta.max_positions
        self.ignored_checkpoint_prefixes = tuple(
            f"roberta.{p}" for p in self.roberta.ignored_checkpoint_prefixes
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        cu_seqlens: Sequence[int] | VarlenPlan,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.roberta(input_ids, positions, token_type_ids, cu_seqlens)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[B, hidden]` CLS states → `[B, num_labels]` logits."""
        return self.classifier(pooled)
