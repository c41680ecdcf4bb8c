"""What a checkpoint's config brings: its config.json read (code shipped with it refused),
the options that change it, with vLLM's names and meanings (`hf_overrides` for config.json
values, `override_generation_config` for its default sampling values), and what the model
reports from it (the longest context, the embedding size)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import InvalidParamError, UnsupportedModelError

GENERATION_OVERRIDE_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
"""The generation-config keys `override_generation_config` sets, as vLLM reads them →
the `SamplingParams` field each becomes (Hugging Face's `max_new_tokens` is `max_tokens`)."""


def apply_hf_overrides(
    hf_config: Any, overrides: Mapping[str, Any] | Callable[[Any], Any] | None
) -> Any:
    """`hf_config` with vLLM's `hf_overrides` applied: a dict sets attributes (a dict value
    for an attribute that is itself a config updates that config), a callable takes the
    config and returns the one to use.

    Raises:
        InvalidParamError: `overrides` is neither, or the callable returns no config.
    """
    if overrides is None or (isinstance(overrides, Mapping) and not overrides):
        return hf_config
    if callable(overrides) and not isinstance(overrides, Mapping):
        updated = overrides(hf_config)
        if updated is None or not hasattr(updated, "to_dict"):
            raise InvalidParamError(
                f"hf_overrides={overrides!r} returned {updated!r}; a callable must return the "
                "(updated) transformers config it was given"
            )
        return updated
    if not isinstance(overrides, Mapping):
        raise InvalidParamError(
            f"hf_overrides={overrides!r:.80} must be a dict of config.json keys, or a "
            "callable that takes and returns the transformers config"
        )
    _update(hf_config, overrides)
    return hf_config


def _update(config: Any, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and hasattr(current, "to_dict"):
            _update(current, value)
        else:
            setattr(config, key, value)


def generation_overrides(values: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's `override_generation_config` → default `SamplingParams` values.

    Raises:
        InvalidParamError: not a dict, or a key that sets no sampling value.
    """
    if not isinstance(values, Mapping):
        raise InvalidParamError(
            f"override_generation_config={values!r:.80} must be a dict such as "
            "{'temperature': 0.5}"
        )
    unknown = sorted(set(values) - set(GENERATION_OVERRIDE_KEYS))
    if unknown:
        raise InvalidParamError(
            f"override_generation_config has key(s) {unknown} that set no sampling value; "
            f"valid keys: {sorted(GENERATION_OVERRIDE_KEYS)}"
        )
    return {GENERATION_OVERRIDE_KEYS[k]: v for k, v in values.items() if v is not None}


def embedding_size(path: Path, hf_config: Any, runner_type: str) -> int:
    """The width of the model's embeddings, as vLLM's `ModelConfig.embedding_size` reports
    it: config.json's `embedding_size` if set, else (pooling models) the output width of
    the sentence-transformers folder's last Dense module, else the hidden size."""
    override = getattr(hf_config, "embedding_size", None)
    if isinstance(override, int) and not isinstance(override, bool):
        return override
    if runner_type == "pooling":
        from .loader.st_config import read_sentence_transformers_config

        st = read_sentence_transformers_config(path)
        sentence = [d for d in st.dense_modules if not d.is_per_token] if st else []
        if sentence:
            return int(sentence[-1].out_features)
    return int(getattr(hf_config, "hidden_size", 0) or 0)


def load_hf_config(path: Path, trust_remote_code: bool) -> Any:
    """The transformers config, with a clear error for architectures that need remote code."""
    import json

    from transformers import AutoConfig

    from .models.registry import what_is_supported

    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(
            f"{path / 'config.json'} is not valid JSON ({e}); the model folder is damaged: "
            "copy it again or pass another model"
        ) from None
    if "auto_map" in raw and raw.get("model_type") not in _known_model_types():
        raise UnsupportedModelError(
            f"{path} declares its own modelling code (auto_map: {sorted(raw['auto_map'])}); "
            "batchlm never runs code shipped with a checkpoint"
            + ("" if trust_remote_code else " (trust_remote_code=True does not change that)")
            + f". {what_is_supported()}"
        )
    from .models.registry import text_config_of

    try:
        return text_config_of(AutoConfig.from_pretrained(str(path), local_files_only=True))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        # transformers' config classes raise all of these on values they do not take.
        raise UnsupportedModelError(
            f"cannot read {path / 'config.json'}: {str(e).rstrip('.')}. {what_is_supported()}"
        ) from e


def _known_model_types() -> set[str]:
    from transformers import CONFIG_MAPPING

    return set(CONFIG_MAPPING.keys())


def allows_longer_context(hf_config: Any) -> bool:
    """Whether the model's rotary scaling lets `max_model_len` exceed its
    `max_position_embeddings`."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    return bool(params) and (params.get("rope_type") or params.get("type")) not in (None, "default")
