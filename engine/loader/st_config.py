"""Reads a sentence-transformers folder's pipeline (`modules.json`) into one frozen config.

A sentence-transformers model is the HF checkpoint (the `Transformer` module) followed by
modules that turn token states into the embedding. batchlm runs the pipelines it can
reproduce exactly — one `Pooling` (CLS, mean or last token), then any `Dense` projections,
then an optional `Normalize` — and refuses the rest (max / weighted pooling, Dense modules
with a residual connection or an activation outside `torch.nn`'s plain ones, custom modules)
rather than return embeddings that differ from the model's.

A pipeline with no `Pooling` whose `Dense` modules read every token's state (PyLate's
`pylate.models.Dense.Dense`, or a `Dense` with `module_input_name: token_embeddings`) is a
late-interaction (ColBERT) model: one vector per token, scored by MaxSim.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UnsupportedModelError
from ..models.layers.dense_head import dense_activation
from ..models.layers.pooler import PoolingType

__all__ = ["DenseModuleConfig", "SentenceTransformersConfig", "read_sentence_transformers_config"]

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


# PyLate's Dense module: sentence-transformers' Dense applied to every token's state.
_PYLATE_DENSE_TYPES = ("pylate.models.Dense.Dense", "pylate.models.Dense")
# sentence-transformers' Dense default activation, when its config names none.
_DEFAULT_DENSE_ACTIVATION = "torch.nn.modules.activation.Tanh"


@dataclass(frozen=True)
class DenseModuleConfig:
    """One `Dense` module of the pipeline: `activation(linear(x))`."""

    path: Path
    """The module's folder, holding `config.json` and the weights (`model.safetensors` or
    `pytorch_model.bin`, tensors `linear.weight` and `linear.bias`)."""
    in_features: int
    """Width of its input."""
    out_features: int
    """Width of its output."""
    bias: bool
    """Whether `linear` has a bias."""
    activation: str
    """The activation's `torch.nn` class path as saved (`torch.nn.modules.activation.Tanh`)."""
    is_per_token: bool
    """Applied to every token's state (late interaction) rather than to the pooled vector."""


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
    default_prompt: str | None = None
    """Text put before every input, as sentence-transformers' `encode` does: the prompt
    that `config_sentence_transformers.json` names as `default_prompt_name`."""
    dense_modules: tuple[DenseModuleConfig, ...] = ()
    """The `Dense` modules in pipeline order: after pooling, or on every token (late
    interaction), before the `Normalize` module when there is one."""

    @property
    def is_late_interaction(self) -> bool:
        """The pipeline projects every token (no pooling): a ColBERT-style model."""
        return any(d.is_per_token for d in self.dense_modules)


def read_sentence_transformers_config(folder: Path) -> SentenceTransformersConfig | None:
    """The pipeline of the sentence-transformers model in `folder`, or None without
    `modules.json` (a plain Hugging Face folder).

    Raises:
        UnsupportedModelError: the pipeline holds a module batchlm cannot reproduce (max /
            weighted-mean / sqrt-length pooling, several pooling modes, a Dense module with a
            residual or an unsupported activation, modules out of order, custom modules), or a
            file is unreadable.
    """
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise UnsupportedModelError(f"{modules_file} is not a list of modules")
    pooling_type: PoolingType | None = None
    has_pooling = False
    include_prompt = True
    normalize = False
    dense: list[DenseModuleConfig] = []
    transformer: dict[str, Any] = {}
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", ""))
        name = kind.rsplit(".", 1)[-1]
        path = folder / str(module.get("path", ""))
        is_pylate_dense = kind in _PYLATE_DENSE_TYPES
        is_ours = kind.startswith("sentence_transformers.")
        where = f"{modules_file} lists {kind!r} (path {module.get('path')!r})"
        if not is_pylate_dense and (
            not is_ours or name not in ("Transformer", "Pooling", "Dense", "Normalize")
        ):
            raise UnsupportedModelError(
                f"{where}; batchlm supports sentence-transformers pipelines of Transformer, "
                "Pooling, Dense and Normalize modules (and PyLate's Dense) only"
            )
        if normalize:
            raise UnsupportedModelError(
                f"{where} after Normalize; batchlm supports Normalize only as the last module"
            )
        if name == "Transformer":
            transformer = _transformer_config(path)
        elif name == "Pooling":
            if has_pooling or dense:
                raise UnsupportedModelError(
                    f"{where} after a Pooling or Dense module; batchlm supports one Pooling "
                    "module, right after the Transformer"
                )
            pooling = _read_json(path / "config.json")
            pooling_type = _pooling_type(pooling, path / "config.json")
            include_prompt = bool(pooling.get("include_prompt", True))
            has_pooling = True
        elif name == "Dense":
            dense.append(_dense_config(path, is_pylate_dense, has_pooling))
        else:
            normalize = True
    max_seq_length = transformer.get("max_seq_length")
    return SentenceTransformersConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        max_seq_length=int(max_seq_length) if max_seq_length is not None else None,
        do_lower_case=bool(transformer.get("do_lower_case", False)),
        include_prompt=include_prompt,
        default_prompt=_default_prompt(folder),
        dense_modules=tuple(dense),
    )


def _default_prompt(folder: Path) -> str | None:
    """The prompt `config_sentence_transformers.json` applies to every input, if any."""
    path = folder / "config_sentence_transformers.json"
    if not path.is_file():
        return None
    config = _read_json(path)
    name = config.get("default_prompt_name") if isinstance(config, dict) else None
    if name is None:
        return None
    prompts = config.get("prompts") or {}
    if name not in prompts or not isinstance(prompts[name], str):
        raise UnsupportedModelError(
            f"{path}: default_prompt_name={name!r} is not one of its prompts {sorted(prompts)}"
        )
    return prompts[name] or None


def _dense_config(path: Path, is_pylate: bool, has_pooling: bool) -> DenseModuleConfig:
    """A Dense module's settings; it reads the pooled vector after a Pooling module, and
    every token's state in a pipeline without one (PyLate, late interaction)."""
    source = path / "config.json"
    config = _read_json(source)
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{source} is not a JSON object")
    input_name = config.get("module_input_name") or (
        "token_embeddings" if is_pylate else "sentence_embedding"
    )
    output_name = config.get("module_output_name") or input_name
    is_per_token = input_name == "token_embeddings"
    if input_name not in ("token_embeddings", "sentence_embedding") or output_name != input_name:
        raise UnsupportedModelError(
            f"{source} reads {input_name!r} and writes {output_name!r}; batchlm supports Dense "
            "modules that transform sentence_embedding or token_embeddings in place"
        )
    if is_per_token == has_pooling:
        raise UnsupportedModelError(
            f"{source} projects {input_name!r} in a pipeline "
            + ("with" if has_pooling else "without")
            + " a Pooling module; batchlm supports Dense on the pooled vector after Pooling, "
            "or on every token (late interaction) without Pooling"
        )
    if config.get("use_residual", False):
        raise UnsupportedModelError(
            f"{source} sets use_residual=true; batchlm supports Dense modules without the "
            "residual connection only"
        )
    activation = str(config.get("activation_function") or _DEFAULT_DENSE_ACTIVATION)
    dense_activation(activation)  # raises naming the supported ones
    try:
        in_features, out_features = int(config["in_features"]), int(config["out_features"])
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(
            f"{source} needs integer in_features and out_features ({e})"
        ) from None
    return DenseModuleConfig(
        path=path,
        in_features=in_features,
        out_features=out_features,
        bias=bool(config.get("bias", True)),
        activation=activation,
        is_per_token=is_per_token,
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
