"""Parameters of the pooling tasks (embed, classify, score, encode), with vLLM's names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import PoolerConfig
from .errors import InvalidParamError

POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
"""vLLM's pooling tasks (`token_classify` is refused by the runner: no model serves it)."""


@dataclass
class PoolingParams:
    """How hidden states become an embedding, class probabilities or a score.

    Example:
        >>> from batchlm.engine import LLM, PoolingParams
        >>> llm = LLM("sentence-transformers/all-MiniLM-L6-v2")
        >>> out = llm.embed(["a sentence"], PoolingParams(normalize=True))
    """

    dimensions: int | None = None
    """Matryoshka truncation: keep the first `dimensions` values of the embedding (then
    normalise). Only for models that declare matryoshka dimensions."""
    normalize: bool | None = None
    """L2-normalise embeddings; None follows the model (sentence-transformers' Normalize
    module, else True as in vLLM)."""
    use_activation: bool | None = None
    """Apply the classifier's activation (softmax, or sigmoid for one label); None = True."""
    truncate_prompt_tokens: int | None = None
    """Truncate each input to this many tokens (-1: the model's maximum) instead of refusing
    inputs that are too long."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise InvalidParamError(f"dimensions={self.dimensions!r} must be an integer >= 1")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidParamError(f"{name}={value!r} must be True, False or None")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise InvalidParamError(
                f"truncate_prompt_tokens={t!r} must be an integer >= 1, or -1 for the model's maximum"
            )


POOLER_CONFIG_KEYS = ("task", "pooling_type", "seq_pooling_type", "use_activation", "dimensions")
"""The keys of vLLM's `PoolerConfig` that batchlm takes."""

_POOLER_CONFIG_UNSET = {
    "tok_pooling_type": ("ALL",),
    "enable_chunked_processing": (False,),
    "max_embed_len": (),
    "logit_mean": (),
    "logit_sigma": (),
    "step_tag_id": (),
    "returned_token_ids": (),
}
"""vLLM's other `PoolerConfig` keys → the values accepted for them besides None: the
defaults, under which they do nothing (step pooling, chunked long inputs and logit
calibration are not supported)."""

SEQ_POOLING_TYPES = ("CLS", "MEAN", "LAST")


def parse_pooler_config(value: Any) -> PoolerConfig | None:
    """`LLM(pooler_config=...)` (a dict, or an object with vLLM's `PoolerConfig` attributes)
    → the engine's `PoolerConfig`, or None when it sets nothing.

    Raises:
        InvalidParamError: an unknown key, a bad value, or a vLLM option batchlm does not
            support set to another value than its default.
    """
    if value is None or isinstance(value, PoolerConfig):
        return value
    if isinstance(value, Mapping):
        values = dict(value)
    else:
        names = POOLER_CONFIG_KEYS + tuple(_POOLER_CONFIG_UNSET) + ("normalize",)
        values = {n: getattr(value, n) for n in names if hasattr(value, n)}
    if "normalize" in values:
        raise InvalidParamError(
            "pooler_config: Parameter `normalize` was removed; use `use_activation` instead "
            "(use_activation=False gives unnormalised embeddings)"
        )
    unknown = sorted(set(values) - set(POOLER_CONFIG_KEYS) - set(_POOLER_CONFIG_UNSET))
    if unknown:
        raise InvalidParamError(
            f"pooler_config has unknown key(s) {unknown}; batchlm takes {list(POOLER_CONFIG_KEYS)}"
        )
    for key, accepted in _POOLER_CONFIG_UNSET.items():
        if values.get(key) is not None and values[key] not in accepted:
            raise InvalidParamError(
                f"pooler_config {key}={values[key]!r} is not supported (step pooling, chunked "
                "long inputs and logit calibration are not); drop it"
            )
    pooling_type = values.get("pooling_type")
    seq_type = values.get("seq_pooling_type")
    if pooling_type is not None and seq_type is not None:
        raise InvalidParamError(
            "pooler_config: Cannot set both `pooling_type` and `seq_pooling_type`"
        )
    pooling_type = pooling_type if pooling_type is not None else seq_type
    if pooling_type is not None:
        pooling_type = str(pooling_type).upper()
        if pooling_type not in SEQ_POOLING_TYPES:
            raise InvalidParamError(
                f"pooler_config pooling_type={pooling_type!r} is not supported; use one of "
                f"{list(SEQ_POOLING_TYPES)} (every token's vector: "
                "encode(pooling_task='token_embed'))"
            )
    task = values.get("task")
    if task is not None and task not in POOLING_TASKS:
        raise InvalidParamError(
            f"pooler_config task={task!r} is unknown; use one of {list(POOLING_TASKS)}"
        )
    # The request-level checks of the two request defaults.
    PoolingParams(dimensions=values.get("dimensions"), use_activation=values.get("use_activation"))
    config = PoolerConfig(
        task, pooling_type, values.get("use_activation"), values.get("dimensions")
    )
    return None if config == PoolerConfig() else config
