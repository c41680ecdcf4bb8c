"""Parameters of the pooling tasks (embed, classify, score, encode), with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidParamError


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
