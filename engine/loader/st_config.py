"""Reads a sentence-transformers folder's pipeline (`modules.json`) into one frozen config.

A sentence-transformers model is the HF checkpoint (the `Transformer` module) followed by
modules that turn token states into the embedding. batchlm runs the pipelines it can
reproduce exactly — one `Pooling` (CLS, mean or last token) and an optional `Normalize` —
and refuses the rest (`Dense` projections, max / weighted pooling, custom modules) rather
than return embeddings that differ from the model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UnsupportedModelError
from ..models.layers.pooler import PoolingType

__all__ = ["SentenceTransformersConfig", "read_sentence_transformers_config"]

# Names the Transformer module's settings file has had across sentence-transformers versions.
_TRANSFORMER_CONFIG_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)

# Pooling modes: the current `pooling_mode` values and the legacy boolean keys.
_SUPPORTED_MODES = {"cls": PoolingType.CLS, "mean": PoolingType.MEAN, "lasttoken": PoolingType.LAST}
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """What a sentence-transformers folder adds on top of its Hugging Face checkpoint."""

    pooling_type: PoolingType | None
    """From the `Pooling` module; None when the pipeline has none (the model's default
    pooling then applies)."""
    normalize: bool
    """The pipeline ends in a `Normalize` module: embeddings are L2-normalised."""
    max_seq_length: int | None
    """Inputs are truncated to this many tokens (`sentence_bert_config.json`); None: the
    tokenizer's / model's own limit."""
    do_lower_case: bool
    """Text is lower-cased before tokenization."""
    include_prompt: bool
    """Prompt tokens take part in pooling (False for INSTRUCTOR-style models)."""


def read_sentence_transformers_config(folder: Path) -> SentenceTransformersConfig | None:
    """The pipeline of the sentence-transformers model in `folder`, or None without
    `modules.json` (a plain Hugging Face folder).

    Raises:
        UnsupportedModelError: the pipeline holds a module batchlm cannot reproduce (`Dense`,
            max / weighted-mean / sqrt-length pooling, several pooling modes, custom modules),
            or a file is unreadable.
    """
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise UnsupportedModelError(f"{modules_file} is not a list of modules")
    pooling_type: PoolingType | None = None
    include_prompt = True
    normalize = False
    transformer: dict[str, Any] = {}
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", ""))
        name = kind.rsplit(".", 1)[-1]
        path = folder / str(module.get("path", ""))
        is_ours = kind.startswith("sentence_transformers.")
        if is_ours and name == "Dense":
            raise UnsupportedModelError(
                f"{modules_file} has a Dense module ({kind!r} at {module.get('path')!r}); "
                "batchlm does not support sentence-transformers Dense projections yet"
            )
        if not is_ours or name not in ("Transformer", "Pooling", "Normalize"):
            raise UnsupportedModelError(
                f"{modules_file} lists module {kind!r} (path {module.get('path')!r}); batchlm "
                "supports sentence-transformers pipelines of Transformer, Pooling and "
                "Normalize modules only"
            )
        if name == "Transformer":
            transformer = _transformer_config(path)
        elif name == "Pooling":
            pooling = _read_json(path / "config.json")
            pooling_type = _pooling_type(pooling, path / "config.json")
            include_prompt = bool(pooling.get("include_prompt", True))
        else:
            normalize = True
    max_seq_length = transformer.get("max_seq_length")
    return SentenceTransformersConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        max_seq_length=int(max_seq_length) if max_seq_length is not None else None,
        do_lower_case=bool(transformer.get("do_lower_case", False)),
        include_prompt=include_prompt,
    )


def _transformer_config(path: Path) -> dict[str, Any]:
    for name in _TRANSFORMER_CONFIG_FILES:
        if (path / name).is_file():
            config = _read_json(path / name)
            return config if isinstance(config, dict) else {}
    return {}


def _pooling_type(config: dict[str, Any], source: Path) -> PoolingType:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [m for key, m in _LEGACY_MODE_KEYS.items() if config.get(key, False)]
        modes = modes or ["mean"]  # sentence-transformers' default
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in _SUPPORTED_MODES:
        raise UnsupportedModelError(
            f"{source} asks for pooling mode {modes[0] if len(modes) == 1 else modes!r}; "
            f"batchlm supports exactly one of {sorted(_SUPPORTED_MODES)}"
        )
    return _SUPPORTED_MODES[modes[0]]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"cannot read sentence-transformers file {path}: {e}") from e
