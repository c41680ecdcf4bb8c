"""What a checkpoint's `generation_config.json` brings besides weights, read as vLLM reads it
(`generation_config="auto"`): every end-of-generation id, and the sampling values that
become the defaults of calls that pass no `SamplingParams`.

`generation_config` is `"auto"` (the model folder's file; without one, the generation
values of `config.json`), `"vllm"` (ignore both: `SamplingParams()`'s defaults and the
tokenizer's EOS alone) or a folder holding a `generation_config.json`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import GenerationDefaults
from ..errors import InvalidParamError, UnsupportedModelError

GENERATION_CONFIG_FILE = "generation_config.json"

SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config key → the `SamplingParams` field it is the default of (vLLM's set)."""


def read_generation_defaults(option: str, model_path: Path, hf_config: Any) -> GenerationDefaults:
    """The generation defaults `option` asks for.

    Raises:
        InvalidParamError: `option` is neither "auto", "vllm" nor a folder with the file.
        UnsupportedModelError: the file is not valid JSON or holds values of the wrong type.
    """
    if not isinstance(option, str) or not option:
        raise InvalidParamError(
            f"generation_config={option!r} must be 'auto', 'vllm' or a folder holding "
            f"{GENERATION_CONFIG_FILE}"
        )
    if option == "vllm":
        return GenerationDefaults()
    if option == "auto":
        path = model_path / GENERATION_CONFIG_FILE
        if not path.is_file():
            return _from_values(_model_config_values(hf_config), "config.json")
    else:
        folder = Path(option).expanduser()
        path = folder / GENERATION_CONFIG_FILE if folder.is_dir() else folder
        if not path.is_file():
            raise InvalidParamError(
                f"generation_config={option!r}: no {GENERATION_CONFIG_FILE} there; pass a "
                "folder that holds one, 'auto' (the model's own) or 'vllm' (none)"
            )
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"{path} is not a readable JSON file: {e}") from None
    if not isinstance(values, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object, not {type(values).__name__}")
    return _from_values(values, str(path))


def _model_config_values(hf_config: Any) -> dict[str, Any]:
    """The generation values a `config.json` carries (what transformers'
    `GenerationConfig.from_model_config` takes from it)."""
    names = ("eos_token_id", *SAMPLING_KEYS)
    return {k: getattr(hf_config, k) for k in names if getattr(hf_config, k, None) is not None}


def _from_values(values: Mapping[str, Any], source: str) -> GenerationDefaults:
    eos = values.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
        raise UnsupportedModelError(
            f"{source}: eos_token_id={eos!r} must be a token id or a list of them"
        )
    sampling = {
        field_name: values[key]
        for key, field_name in SAMPLING_KEYS.items()
        if values.get(key) is not None
    }
    return GenerationDefaults(tuple(dict.fromkeys(eos_ids)), sampling, source)


def end_of_generation_ids(
    tokenizer: Any, hf_config: Any, defaults: GenerationDefaults
) -> tuple[int, ...]:
    """Every id that ends a request: the tokenizer's EOS (else `config.json`'s first), then,
    where the generation config was read, every id it and `config.json` list."""
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    config_eos = getattr(hf_config, "eos_token_id", None)
    config_ids = [config_eos] if isinstance(config_eos, int) else list(config_eos or [])
    if primary is None and config_ids:
        primary = config_ids[0]
    ids = [] if primary is None else [int(primary)]
    if defaults.source is not None:
        ids += [*defaults.eos_token_ids, *config_ids]
    return tuple(dict.fromkeys(int(t) for t in ids))
