"""Lines of an OpenAI batch file → requests the engine runs, or that line's error.

Each line is `{"custom_id", "method": "POST", "url", "body"}` as `vllm run-batch` reads it.
`parse_line` checks the envelope and the body of its endpoint, and returns a `BatchLine`
whose `request` holds what the engine needs:

- `/v1/chat/completions` → `ChatRequest`: the conversation, `SamplingParams`, template options;
- `/v1/completions` → `CompletionRequest`: one or more prompts (text or token ids) and params;
- `/v1/embeddings` → `EmbeddingRequest`: texts or token ids, `dimensions`, `encoding_format`;
- `/v1/score` (any URL ending in `/score`) and `/v1/rerank` (`/rerank`) → `ScoreRequest`:
  the pairs to score (1↔1, 1↔N, N↔N; rerank: the query against each document).

Body fields follow vLLM's OpenAI protocol (`openai_fields.py` says which act, which are
accepted without effect, which are refused); an unknown field is refused with the valid
ones listed.

Example:
    >>> line = parse_line('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
    ...                   '"body": {"prompt": "Hi", "max_tokens": 4}}', 1, defaults)
    >>> line.request.prompts, line.request.params.max_tokens
    (['Hi'], 4)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchlm.engine.errors import InvalidParamError
from batchlm.engine.pooling_params import PoolingParams
from batchlm.engine.sampling_params import SamplingParams
from batchlm.operators.row_params import unknown_keys

from .openai_fields import (
    SAMPLING_FIELDS,
    BatchLineError,
    check_fields,
    max_tokens,
    pooling_params,
    prompts,
    sampling_params,
    texts,
)

CHAT, COMPLETION, EMBEDDING, SCORE, RERANK = "chat", "completion", "embedding", "score", "rerank"
GENERATION_KINDS = (CHAT, COMPLETION)
URLS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/embeddings": EMBEDDING,
}
"""Exact URLs; besides, a URL ending in `/score` is a score request and one ending in
`/rerank` a rerank request (as vLLM matches them)."""


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    params: SamplingParams
    options: dict[str, Any]
    """`chat_template`, `chat_template_kwargs`, `add_generation_prompt`,
    `continue_final_message`, `tools` for `LLM.enqueue_chat`."""
    top_logprobs: int | None
    """None: no logprobs; else alternatives per token (0: the token's own logprob only)."""
    return_token_ids: bool = False


@dataclass
class CompletionRequest:
    prompts: list[Any]
    """Each prompt: text, or `{"prompt_token_ids": [...]}`."""
    params: SamplingParams
    logprobs: int | None
    echo: bool = False
    return_token_ids: bool = False


@dataclass
class EmbeddingRequest:
    inputs: list[Any]
    params: PoolingParams
    truncate_prompt_tokens: int | None
    encoding_format: str = "float"


@dataclass
class ScoreRequest:
    left: list[str]
    right: list[str]
    """Pairs `(left[i], right[i])`: 1↔N inputs already broadcast."""
    truncate_prompt_tokens: int | None
    use_activation: bool | None
    top_n: int = 0
    """Rerank: the best `top_n` documents (0: all)."""
    documents: list[str] = field(default_factory=list)


@dataclass
class BatchLine:
    """One input line: its number, id and endpoint, and the request or its error."""

    line_no: int
    custom_id: str | None
    kind: str | None
    request: Any = None
    error: BatchLineError | None = None


def parse_line(
    text: str | bytes,
    line_no: int,
    defaults: Mapping[str, Any],
    served_names: Sequence[str] = (),
) -> BatchLine:
    """One line of the batch file; never raises for bad input (the line gets the error).

    Args:
        text: The line (without its newline).
        line_no: Its 1-based number, for messages.
        defaults: The model's default sampling values (generation config), by field.
        served_names: The model names a body's `model` may name (empty: any).
    """
    custom_id: str | None = None
    kind: str | None = None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise BatchLineError(f"line {line_no}: expected a JSON object, got {_kind(data)}")
        raw_id = data.get("custom_id")
        custom_id = raw_id if isinstance(raw_id, str) else None
        _check_envelope(data, line_no)
        kind = _kind_of_url(data["url"], line_no)
        body = data["body"]
        _check_model(body, served_names)
        request = _PARSERS[kind](body, defaults)
        return BatchLine(line_no, custom_id, kind, request)
    except json.JSONDecodeError as e:
        error = BatchLineError(f"line {line_no} is not valid JSON: {e.msg} at column {e.colno}")
        return BatchLine(line_no, custom_id, kind, error=error)
    except BatchLineError as e:
        return BatchLine(line_no, custom_id, kind, error=e)
    except (InvalidParamError, ValueError, TypeError) as e:
        return BatchLine(line_no, custom_id, kind, error=BatchLineError(str(e)))


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), repr(value))


def _check_envelope(data: dict[str, Any], line_no: int) -> None:
    valid = ("custom_id", "method", "url", "body")
    unknown = [k for k in data if k not in valid]
    if unknown:
        raise BatchLineError(f"line {line_no} has unknown key(s) {unknown_keys(unknown, valid)}")
    for key in valid:
        if key not in data:
            raise BatchLineError(f"line {line_no} lacks {key!r}; each line needs {list(valid)}")
    if not isinstance(data["custom_id"], str):
        raise BatchLineError(
            f"custom_id must be a string, got {data['custom_id']!r}", param="custom_id"
        )
    if data["method"] != "POST":
        raise BatchLineError(f"method {data['method']!r} is not supported; use POST", "method")
    if not isinstance(data["url"], str):
        raise BatchLineError(f"url must be a string, got {data['url']!r}", param="url")
    if not isinstance(data["body"], dict):
        raise BatchLineError(f"body must be a JSON object, got {_kind(data['body'])}", "body")


def _kind_of_url(url: str, line_no: int) -> str:
    if url in URLS:
        return URLS[url]
    if url.endswith("/score"):
        return SCORE
    if url.endswith("/rerank"):
        return RERANK
    raise BatchLineError(
        f"url {url!r} is not supported; use /v1/chat/completions, /v1/completions, "
        "/v1/embeddings, /v1/score or /v1/rerank",
        param="url",
        status_code=404,
    )


def _check_model(body: dict[str, Any], served_names: Sequence[str]) -> None:
    model = body.get("model")
    if model is not None and served_names and model not in served_names:
        raise BatchLineError(
            f"the model {model!r} is not served here (served: {', '.join(served_names)}); "
            "drop body.model, or pass --served-model-name",
            param="model",
            status_code=404,
        )


def _chat(body: dict[str, Any], defaults: Mapping[str, Any]) -> ChatRequest:
    options = (
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "tool_choice",
    )
    own = (
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "response_format",
        "structured_outputs",
        "return_token_ids",
        "echo",
        *SAMPLING_FIELDS,
        *options,
    )
    check_fields(body, own)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BatchLineError("messages must be a non-empty list of messages", "messages")
    if body.get("echo"):
        raise BatchLineError("echo is not supported for chat completions; drop it", "echo")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise BatchLineError(
            f"tool_choice={body['tool_choice']!r} is not supported (tool calls are not "
            "parsed); use auto or none",
            param="tool_choice",
        )
    top = body.get("top_logprobs") or 0
    wants_logprobs = bool(body.get("logprobs"))
    params = sampling_params(
        body,
        defaults,
        {
            "max_tokens": max_tokens(body, defaults, None),
            "logprobs": top if wants_logprobs else None,
        },
    )
    chat_options = {
        "chat_template": body.get("chat_template"),
        "chat_template_kwargs": body.get("chat_template_kwargs"),
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "tools": body.get("tools"),
    }
    return ChatRequest(
        messages,
        params,
        chat_options,
        top if wants_logprobs else None,
        bool(body.get("return_token_ids")),
    )


def _completion(body: dict[str, Any], defaults: Mapping[str, Any]) -> CompletionRequest:
    own = (
        "prompt",
        "max_tokens",
        "logprobs",
        "echo",
        "best_of",
        "logit_bias",
        "response_format",
        "structured_outputs",
        "return_token_ids",
        *SAMPLING_FIELDS,
    )
    check_fields(body, own)
    items = prompts(body.get("prompt"), "prompt")
    logprobs = body.get("logprobs")
    n = body.get("n") or 1
    if body.get("best_of") not in (None, n):
        raise BatchLineError(f"best_of={body['best_of']!r} is not supported; drop it", "best_of")
    echo = bool(body.get("echo"))
    extra: dict[str, Any] = {"max_tokens": body.get("max_tokens", 16), "logprobs": logprobs}
    if "max_tokens" in body and body["max_tokens"] is None:
        extra["max_tokens"] = defaults.get("max_tokens")
    if echo and logprobs is not None and body.get("prompt_logprobs") is None:
        extra["prompt_logprobs"] = logprobs  # the echoed prompt's logprobs, as vLLM
    params = sampling_params(body, defaults, extra)
    return CompletionRequest(
        items, params, logprobs, echo=echo, return_token_ids=bool(body.get("return_token_ids"))
    )


def _embedding(body: dict[str, Any], defaults: Mapping[str, Any]) -> EmbeddingRequest:
    own = ("input", "dimensions", "encoding_format", "truncate_prompt_tokens", "use_activation")
    check_fields(body, own)
    if "input" not in body:
        raise BatchLineError("body.input is required: a text, texts or token ids", "input")
    inputs = prompts(body["input"], "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise BatchLineError(
            f"encoding_format={fmt!r} is not supported; use float or base64", "encoding_format"
        )
    # For embeddings vLLM's `use_activation` is the normalisation.
    params = pooling_params(body.get("dimensions"), body.get("use_activation"))
    return EmbeddingRequest(inputs, params, body.get("truncate_prompt_tokens"), fmt)


def _score(body: dict[str, Any], defaults: Mapping[str, Any]) -> ScoreRequest:
    sides = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"))
    sides += (("data_1", "data_2"),)
    own = (*sorted({name for pair in sides for name in pair}), "truncate_prompt_tokens")
    own += ("use_activation",)
    own += ("max_tokens_per_query", "max_tokens_per_doc", "instruction", "chat_template_kwargs")
    check_fields(body, own)
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        if body.get(name):
            raise BatchLineError(f"{name} is not supported; drop it", param=name)
    if body.get("instruction") is not None or body.get("chat_template_kwargs") is not None:
        raise BatchLineError(
            "score templates (instruction, chat_template_kwargs) are not supported"
        )
    pair = next((p for p in sides if p[0] in body and p[1] in body), None)
    if pair is None:
        raise BatchLineError(
            "a score body needs queries and documents (or text_1 and text_2, data_1 and data_2)"
        )
    left, right = texts(body[pair[0]], pair[0]), texts(body[pair[1]], pair[1])
    if len(left) == 1:
        left = left * len(right)
    elif len(right) == 1:
        right = right * len(left)
    elif len(left) != len(right):
        raise BatchLineError(
            f"{pair[0]} has {len(left)} texts and {pair[1]} {len(right)}: pass 1 and N, or N and N"
        )
    return ScoreRequest(left, right, body.get("truncate_prompt_tokens"), body.get("use_activation"))


def _rerank(body: dict[str, Any], defaults: Mapping[str, Any]) -> ScoreRequest:
    own = ("query", "documents", "top_n", "truncate_prompt_tokens", "use_activation")
    own += ("max_tokens_per_query", "max_tokens_per_doc", "instruction", "chat_template_kwargs")
    check_fields(body, own)
    if not isinstance(body.get("query"), str):
        raise BatchLineError("query must be a text", param="query")
    documents = texts(body.get("documents"), "documents")
    top_n = body.get("top_n") or 0
    if not isinstance(top_n, int) or top_n < 0:
        raise BatchLineError(f"top_n={top_n!r} must be an integer >= 0", param="top_n")
    return ScoreRequest(
        [body["query"]] * len(documents),
        documents,
        body.get("truncate_prompt_tokens"),
        body.get("use_activation"),
        top_n,
        documents,
    )


_PARSERS = {
    CHAT: _chat,
    COMPLETION: _completion,
    EMBEDDING: _embedding,
    SCORE: _score,
    RERANK: _rerank,
}


__all__ = [
    "BatchLine",
    "BatchLineError",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "ScoreRequest",
    "GENERATION_KINDS",
    "CHAT",
    "COMPLETION",
    "EMBEDDING",
    "SCORE",
    "RERANK",
    "parse_line",
]
