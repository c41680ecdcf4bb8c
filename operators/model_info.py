"""`ModelInfo`: what the row contract's declared output schema needs to know about a model.

Read from the model's config (no weights), so that a job or an operator declares its output
columns before any engine loads.

Example:
    >>> ModelInfo.from_hf_config(AutoConfig.from_pretrained(path)).hidden_size
    384
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    """What the output schema needs to know about the model, read from its config."""

    hidden_size: int
    """The width of `embedding` (unless `dimensions` cuts it)."""
    num_labels: int | None = None
    """The width of `probs` for classifiers (None: not a classifier, 1 is assumed)."""
    id2label: Mapping[int, str] | None = None
    """Class index → `label`; None: `LABEL_<index>`."""

    @classmethod
    def from_llm(cls, llm: Any) -> ModelInfo:
        return cls.from_hf_config(llm.llm_engine.config.model.hf_config)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelInfo:
        id2label = getattr(hf_config, "id2label", None)
        num_labels = getattr(hf_config, "num_labels", None)
        return cls(
            hidden_size=int(hf_config.hidden_size),
            num_labels=int(num_labels) if num_labels is not None else None,
            id2label={int(k): str(v) for k, v in id2label.items()} if id2label else None,
        )


__all__ = ["ModelInfo"]
