"""The fields of an OpenAI batch line's body: which ones batchlm acts on, which it accepts
without effect, which it refuses, and how they become `SamplingParams` / `PoolingParams`.

Names and defaults are vLLM's (its OpenAI protocol types): a body that omits a sampling field
takes the model's generation-config value where vLLM's server does. A field that would change
the result but that batchlm does not act on is refused with the line's error, never ignored.

Example:
    >>> params = sampling_params({"temperature": 0, "stop": ["."]}, {}, {"max_tokens": 8})
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from batchlm.engine.pooling_params import PoolingParams
from batchlm.engine.sampling_params import SamplingParams
from batchlm.operators.row_params import unknown_keys

SAMPLING_FIELDS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "bad_words",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)
"""Body fields passed to `SamplingParams` under the same name (null: the default)."""
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""Fields a body may omit that take the model's generation config's value (vLLM's
`default_sampling_params`)."""
_NO_EFFECT = (
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "request_id",
    "parallel_tool_calls",
    "stream_options",
    "length_penalty",
)
"""Fields accepted and not acted on: they do not change an offline batch's results
(`model` is checked against the served names)."""
_REFUSED = {
    "use_beam_search": False,
    "logprob_token_ids": None,
    "return_tokens_as_token_ids": False,
    "cache_salt": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "vllm_xargs": None,
    "mm_processor_kwargs": None,
    "media_io_kwargs": None,
    "prompt_embeds": None,
    "suffix": None,
    "reasoning_effort": None,
    "thinking_token_budget": None,
    "repetition_detection": None,
    "documents": None,
    "priority": 0,
    "add_special_tokens": None,
    "truncation_side": None,
    "embed_dtype": None,
    "endianness": None,
}
"""Fields batchlm does not act on, with the only value it accepts for each (their
default): any other value is the line's error, since ignoring it would change the result."""


class BatchLineError(ValueError):
    """A line that cannot run; its output line carries the message (HTTP 400 unless
    `status_code` says otherwise)."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status_code = status_code


@functools.cache
def _valid_fields(own: tuple[str, ...]) -> frozenset[str]:
    return frozenset((*own, *_NO_EFFECT, *_REFUSED, "stream"))


def check_fields(body: dict[str, Any], own: tuple[str, ...]) -> None:
    """Unknown fields, and refused fields set to anything but their default, are errors."""
    valid = _valid_fields(own)
    unknown = [k for k in body if k not in valid]
    if unknown:
        raise BatchLineError(f"body has unknown field(s) {unknown_keys(unknown, own)}")
    for name in _REFUSED.keys() & body.keys():
        accepted = _REFUSED[name]
        if name in own:
            continue
        if body[name] != accepted and body[name] is not None:
            raise BatchLineError(
                f"body.{name}={body[name]!r} is not supported by batchlm; drop it", param=name
            )
    if body.get("stream"):
        raise BatchLineError("stream=true has no meaning in a batch file; drop it", "stream")


def sampling_params(
    body: dict[str, Any], defaults: Mapping[str, Any], extra: dict[str, Any]
) -> Any:
    values: dict[str, Any] = {}
    for name in _MODEL_DEFAULTS:
        if body.get(name) is None and name in defaults:
            values[name] = defaults[name]
    for name in SAMPLING_FIELDS:
        if body.get(name) is not None:
            values[name] = body[name]
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise BatchLineError("logit_bias must map token ids to biases", "logit_bias")
        try:
            values["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise BatchLineError(
                f"logit_bias keys must be token ids, got {list(bias)[:3]}", "logit_bias"
            ) from None
    structured = structured_outputs(body)
    if structured is not None:
        values["structured_outputs"] = structured
    values.update(extra)
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as e:
        raise BatchLineError(str(e)) from None


def structured_outputs(body: dict[str, Any]) -> dict[str, Any] | None:
    """`structured_outputs`, with `response_format` (`json_schema`, `json_object`) over it."""
    structured = body.get("structured_outputs")
    if structured is not None and not isinstance(structured, dict):
        raise BatchLineError("structured_outputs must be an object", "structured_outputs")
    out = dict(structured or {})
    fmt = body.get("response_format")
    if fmt is None:
        return out or None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return out or None
    if kind == "json_object":
        return {**out, "json_object": True}
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict) or "schema" not in schema:
            raise BatchLineError(
                "response_format json_schema needs json_schema.schema", "response_format"
            )
        return {**out, "json": schema["schema"]}
    raise BatchLineError(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        param="response_format",
    )


def max_tokens(body: dict[str, Any], defaults: Mapping[str, Any], fallback: Any) -> Any:
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return body[name]
    return defaults.get("max_tokens", fallback)


def prompts(value: Any, name: str) -> list[Any]:
    """Text, a list of texts, token ids, or a list of token-id lists → engine prompts."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [{"prompt_token_ids": list(value)}]
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(isinstance(v, list) and v and all(isinstance(t, int) for t in v) for v in value):
            return [{"prompt_token_ids": list(v)} for v in value]
    raise BatchLineError(
        f"{name} must be a string, a list of strings, token ids or lists of token ids",
        param=name,
    )


def pooling_params(dimensions: Any, normalize: Any) -> PoolingParams:
    """`PoolingParams(dimensions, normalize)`, one shared object per distinct plain pair."""
    if isinstance(dimensions, (int, type(None))) and isinstance(normalize, (bool, type(None))):
        return _shared_pooling_params(dimensions, normalize)
    return _build_pooling_params(dimensions, normalize)


def _build_pooling_params(dimensions: Any, normalize: Any) -> PoolingParams:
    try:
        return PoolingParams(dimensions=dimensions, normalize=normalize)
    except (TypeError, ValueError) as e:
        raise BatchLineError(str(e)) from None


@functools.lru_cache(maxsize=64)
def _shared_pooling_params(dimensions: int | None, normalize: bool | None) -> PoolingParams:
    """One (never changed) `PoolingParams` per distinct pair, shared by the lines."""
    return _build_pooling_params(dimensions, normalize)


def texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise BatchLineError(f"{name} must be a text or a non-empty list of texts", param=name)


__all__ = [
    "SAMPLING_FIELDS",
    "BatchLineError",
    "check_fields",
    "max_tokens",
    "pooling_params",
    "prompts",
    "sampling_params",
    "texts",
]
