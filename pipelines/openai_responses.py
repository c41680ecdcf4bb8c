"""Engine outputs → the bodies and output lines of an OpenAI batch file, shaped as vLLM's.

An output line is `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`: on success `body` is the endpoint's response (`chat.completion`,
`text_completion`, an embedding list, a score list, a rerank result) and `error` null; on
failure `status_code` is the HTTP code, `body` null and `error` vLLM's `ErrorResponse`
(`{"error": {"message", "type", "param", "code"}}`).

Example:
    >>> output_line("req-1", chat_body(request, output, "my-model"))
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .openai_requests import BatchLineError, ChatRequest, CompletionRequest, ScoreRequest

MIN_LOGPROB = -9999.0
"""What a `-inf` logprob is written as (JSON has no infinity), as OpenAI and vLLM write it."""


def _uid() -> str:
    """32 random hex digits, as vLLM's `random_uuid()` (without building a UUID object)."""
    return os.urandom(16).hex()


def output_line(custom_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """The output line of a line that ran."""
    return {
        "id": f"batchlm-{_uid()}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"batchlm-batch-{_uid()}", "body": body},
        "error": None,
    }


def error_line(custom_id: str | None, error: BatchLineError) -> dict[str, Any]:
    """The output line of a line that could not run."""
    kind = "NotFoundError" if error.status_code == 404 else "BadRequestError"
    return {
        "id": f"batchlm-{_uid()}",
        "custom_id": custom_id,
        "response": {
            "status_code": error.status_code,
            "request_id": f"batchlm-batch-{_uid()}",
            "body": None,
        },
        "error": {
            "error": {
                "message": str(error),
                "type": kind,
                "param": error.param,
                "code": error.status_code,
            }
        },
    }


def _usage(prompt_tokens: int, completion_tokens: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + (completion_tokens or 0),
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def _token_text(tokenizer: Any, token_id: int, logprob: Any) -> str:
    decoded = getattr(logprob, "decoded_token", None)
    if decoded is not None:
        return decoded
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _clamp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _ranked(position: dict[int, Any], count: int) -> list[tuple[int, Any]]:
    """The `count` most likely candidates of one position, best first."""
    ranked = sorted(position.items(), key=lambda item: (item[1].rank or 1 << 30, item[0]))
    return ranked[:count]


def _chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, Any]], top: int, tokenizer: Any
) -> dict[str, Any]:
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=False):
        own = position.get(token_id)
        token = _token_text(tokenizer, token_id, own)
        content.append(
            {
                "token": token,
                "logprob": _clamp(own.logprob) if own is not None else MIN_LOGPROB,
                "bytes": list(token.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {
                        "token": (text := _token_text(tokenizer, tid, lp)),
                        "logprob": _clamp(lp.logprob),
                        "bytes": list(text.encode("utf-8", errors="replace")),
                    }
                    for tid, lp in _ranked(position, top)
                ],
            }
        )
    return {"content": content}


def chat_body(request: ChatRequest, output: Any, model: str, tokenizer: Any) -> dict[str, Any]:
    """A `chat.completion` body from the request's `RequestOutput`."""
    choices = []
    num_generated = 0
    for completion in output.outputs:
        num_generated += len(completion.token_ids)
        logprobs = None
        if request.top_logprobs is not None and completion.logprobs is not None:
            logprobs = _chat_logprobs(
                completion.token_ids, completion.logprobs, request.top_logprobs, tokenizer
            )
        choices.append(
            {
                "index": completion.index,
                "message": {
                    "role": "assistant",
                    "content": completion.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
                "token_ids": list(completion.token_ids) if request.return_token_ids else None,
            }
        )
    prompt_tokens = len(output.prompt_token_ids)
    return {
        "id": f"chatcmpl-{_uid()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(prompt_tokens, num_generated),
        "prompt_logprobs": None,
        "prompt_token_ids": list(output.prompt_token_ids) if request.return_token_ids else None,
        "kv_transfer_params": None,
    }


def _completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Any] | None],
    top: int,
    tokenizer: Any,
    text_offset: int,
) -> dict[str, Any]:
    out: dict[str, list[Any]] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    offset = text_offset
    for token_id, position in zip(token_ids, logprobs, strict=False):
        own = position.get(token_id) if position is not None else None
        token = _token_text(tokenizer, token_id, own)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if position is None:  # the first prompt token has no logprob
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_clamp(own.logprob) if own is not None else MIN_LOGPROB)
        # The token itself and the `top` best, as OpenAI's `logprobs` counts them.
        candidates = dict(_ranked(position, top))
        if own is not None:
            candidates.setdefault(token_id, own)
        out["top_logprobs"].append(
            {_token_text(tokenizer, tid, lp): _clamp(lp.logprob) for tid, lp in candidates.items()}
        )
    return out


def completion_body(
    request: CompletionRequest, outputs: Sequence[Any], model: str, tokenizer: Any
) -> dict[str, Any]:
    """A `text_completion` body from the `RequestOutput` of each of the request's prompts;
    choice `i * n + j` is prompt i's j-th sample."""
    choices = []
    prompt_tokens = 0
    num_generated = 0
    for output in outputs:
        prompt_tokens += len(output.prompt_token_ids)
        prompt_text = output.prompt or ""
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            text = completion.text
            token_ids = list(completion.token_ids)
            token_logprobs = completion.logprobs
            if request.echo:
                text = prompt_text + text
                token_ids = list(output.prompt_token_ids) + token_ids
                if token_logprobs is not None:
                    token_logprobs = list(output.prompt_logprobs or []) + list(token_logprobs)
            logprobs = None
            if request.logprobs is not None and token_logprobs is not None:
                logprobs = _completion_logprobs(
                    token_ids, token_logprobs, request.logprobs, tokenizer, 0
                )
            choices.append(
                {
                    "index": len(choices),
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "token_ids": list(completion.token_ids) if request.return_token_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": (
                        list(output.prompt_token_ids) if request.return_token_ids else None
                    ),
                }
            )
    return {
        "id": f"cmpl-{_uid()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(prompt_tokens, num_generated),
        "kv_transfer_params": None,
    }


def embedding_body(
    vectors: Sequence[Any], num_tokens: int, model: str, encoding_format: str
) -> dict[str, Any]:
    """An embedding list: one item per input (a list of floats or an array), in order."""
    data = []
    for index, vector in enumerate(vectors):
        embedding: Any = vector
        if encoding_format == "base64":  # float32, little-endian, as OpenAI's clients read it
            values = np.asarray(vector, dtype="<f4")
            embedding = base64.b64encode(values.tobytes()).decode()
        elif not isinstance(vector, list):
            embedding = np.asarray(vector, dtype=np.float32).tolist()
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    return {
        "id": f"embd-{_uid()}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _usage(num_tokens, 0),
    }


def score_body(scores: Sequence[float], num_tokens: int, model: str) -> dict[str, Any]:
    """A score list: one item per pair, in input order."""
    return {
        "id": f"score-{_uid()}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
        "usage": _usage(num_tokens, 0),
    }


def rerank_body(
    request: ScoreRequest, scores: Sequence[float], num_tokens: int, model: str
) -> dict[str, Any]:
    """Documents by relevance, best first, the best `top_n` (all when 0)."""
    results = [
        {"index": i, "document": {"text": doc, "multi_modal": None}, "relevance_score": float(s)}
        for i, (doc, s) in enumerate(zip(request.documents, scores, strict=True))
    ]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)
    if request.top_n:
        results = results[: request.top_n]
    return {
        "id": f"rerank-{_uid()}",
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }


__all__ = [
    "chat_body",
    "completion_body",
    "embedding_body",
    "error_line",
    "output_line",
    "rerank_body",
    "score_body",
]
