"""`batchlm run-batch`: an OpenAI batch file through one `LLM`, as `vllm run-batch` does.

The input file (a local path or a store URI, `.gz` and other compressions read by their
extension) is read line by line and never held whole: a window of at most
`lines_in_flight` lines is in the engine or waiting to be written, and the output lines are
written in input order as soon as the head of the window is done. Generation lines
(chat, completions) are queued with `LLM.enqueue` / `enqueue_chat` as they arrive and the
engine is stepped, so requests of later lines fill the batches while earlier ones finish;
pooling lines (embeddings, score, rerank) are gathered into calls of up to
`POOLING_INPUTS_PER_CALL` inputs. A line that is malformed, asks for an endpoint the model
does not serve, or that the engine refuses gets its error line; the others run.

The output appears whole at the end (a temporary file renamed, or a temporary object the
store copies to its key): an interrupted run leaves no half-written output.

Example:
    >>> llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
    >>> summary = run_batch(llm, "requests.jsonl", "s3://bucket/results.jsonl")
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Any

from batchlm.engine.gc_freeze import freeze_gc_heap
from batchlm.engine.pooling_params import PoolingParams
from batchlm.engine.sampling_params import SamplingParams
from batchlm.operators.row_inputs import strip_index
from batchlm.operators.row_params import params_fields
from batchlm.operators.row_spec import ROW_ERRORS
from batchlm.operators.row_stream import forget_enqueued

from .batch_files import OutputLines, read_lines
from .openai_requests import (
    CHAT,
    COMPLETION,
    EMBEDDING,
    GENERATION_KINDS,
    RERANK,
    SCORE,
    BatchLine,
    BatchLineError,
    parse_line,
)
from .openai_responses import (
    chat_body,
    completion_body,
    embedding_body,
    error_line,
    output_line,
    rerank_body,
    score_body,
)

POOLING_INPUTS_PER_CALL = 8192
"""Inputs (texts, pairs) of consecutive pooling lines run as one engine call: enough for
full token budgets, few enough that output lines reach the file steadily."""


@dataclass
class BatchSummary:
    """What a run did."""

    output_path: str
    num_lines: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def format(self) -> str:
        rate = self.num_lines / self.seconds if self.seconds else 0.0
        return (
            f"batchlm run-batch: {self.num_lines} lines ({self.num_failed} failed) in "
            f"{self.seconds:.1f} s ({rate:.1f} lines/s); {self.prompt_tokens} prompt and "
            f"{self.completion_tokens} completion tokens -> {self.output_path}"
        )


class _Line:
    """A line in the window: parsed, then running, then done (its output line)."""

    __slots__ = ("parsed", "result", "outputs", "num_pending")

    def __init__(self, parsed: BatchLine) -> None:
        self.parsed = parsed
        self.result: dict[str, Any] | None = None
        self.outputs: list[Any] = []
        self.num_pending = 0


def supported_kinds(llm: Any) -> set[str]:
    """The endpoints the loaded model serves."""
    engine = llm.llm_engine
    if engine.config.model.runner_type != "pooling":
        return {CHAT, COMPLETION}
    task = engine.pooling_runner.task
    kinds = {SCORE, RERANK} if task in ("embed", "classify", "token_embed") else set()
    return kinds | ({EMBEDDING} if task == "embed" else set())


class _Engine:
    """The LLM seen by a batch: generation requests queued and stepped, pooling calls."""

    def __init__(self, llm: Any, model_name: str, summary: BatchSummary) -> None:
        self.llm = llm
        self.model_name = model_name
        self.summary = summary
        self.tokenizer = llm.get_tokenizer()
        self._owner: dict[str, tuple[_Line, int]] = {}  # request id -> (line, prompt index)

    @property
    def num_requests(self) -> int:
        return len(self._owner)

    # ---- generation ------------------------------------------------------------------

    def submit(self, lines: list[_Line]) -> None:
        """Queues the lines' requests, all at once where the engine accepts the whole call,
        else line by line (the engine checks a call before queueing any of it)."""
        completions = [line for line in lines if line.parsed.kind == COMPLETION]
        chats: dict[str, list[_Line]] = {}
        for line in lines:
            if line.parsed.kind == CHAT:
                key = json.dumps(line.parsed.request.options, sort_keys=True, default=str)
                chats.setdefault(key, []).append(line)
        for group in (completions, *chats.values()):
            if not group:
                continue
            try:
                self._enqueue(group)
            except ROW_ERRORS:
                for line in group:
                    try:
                        self._enqueue([line])
                    except ROW_ERRORS as e:
                        self._fail(line, BatchLineError(strip_index(str(e))))
        forget_enqueued(self.llm)

    def _enqueue(self, lines: list[_Line]) -> None:
        prompts: list[Any] = []
        params: list[SamplingParams] = []
        owners: list[tuple[_Line, int]] = []
        for line in lines:
            request = line.parsed.request
            items = request.prompts if line.parsed.kind == COMPLETION else [request.messages]
            for index, item in enumerate(items):
                prompts.append(item)
                params.append(request.params)
                owners.append((line, index))
        if lines[0].parsed.kind == CHAT:
            ids = self.llm.enqueue_chat(prompts, params, **lines[0].parsed.request.options)
        else:
            ids = self.llm.enqueue(prompts, params)
        for rid, (line, index) in zip(ids, owners, strict=True):
            self._owner[rid] = (line, index)
        for line in lines:
            line.num_pending = (
                len(line.parsed.request.prompts) if line.parsed.kind == COMPLETION else 1
            )
            line.outputs = [None] * line.num_pending

    def step(self) -> None:
        """One engine step; the lines whose last request finished get their output line."""
        for out in self.llm.llm_engine.step():
            owner = self._owner.pop(out.request_id, None)
            if owner is None:
                continue
            line, index = owner
            line.outputs[index] = out
            line.num_pending -= 1
            if line.num_pending == 0:
                self._finish_generation(line)

    def _finish_generation(self, line: _Line) -> None:
        request = line.parsed.request
        if line.parsed.kind == CHAT:
            body = chat_body(request, line.outputs[0], self.model_name, self.tokenizer)
        else:
            body = completion_body(request, line.outputs, self.model_name, self.tokenizer)
        self.summary.prompt_tokens += body["usage"]["prompt_tokens"]
        self.summary.completion_tokens += body["usage"]["completion_tokens"] or 0
        line.outputs = []
        line.result = output_line(line.parsed.custom_id, body)

    def abort(self) -> None:
        ids = list(self._owner)
        self._owner.clear()
        if ids and not self.llm.llm_engine.is_shut_down:
            self.llm.llm_engine.abort_requests(ids)

    # ---- pooling -----------------------------------------------------------------------

    def run_pooling(self, lines: list[_Line]) -> None:
        """Runs the pooling lines, in calls per kind and options; a call the engine
        refuses is halved until each refused line stands alone with its error."""
        groups: dict[tuple[Any, ...], list[_Line]] = {}
        for line in lines:
            request = line.parsed.request
            if line.parsed.kind == EMBEDDING:
                key: tuple[Any, ...] = (EMBEDDING, request.truncate_prompt_tokens)
            else:
                key = (SCORE, request.truncate_prompt_tokens, request.use_activation)
            groups.setdefault(key, []).append(line)
        for key, group in groups.items():
            run = self._embed if key[0] == EMBEDDING else self._score
            self._isolated(run, group)

    def _isolated(self, run: Any, lines: list[_Line]) -> None:
        try:
            run(lines)
        except ROW_ERRORS as e:
            if len(lines) == 1:
                self._fail(lines[0], BatchLineError(strip_index(str(e))))
                return
            mid = len(lines) // 2
            self._isolated(run, lines[:mid])
            self._isolated(run, lines[mid:])

    def _embed(self, lines: list[_Line]) -> None:
        inputs: list[Any] = []
        params: list[PoolingParams] = []
        for line in lines:
            inputs += line.parsed.request.inputs
            params += [line.parsed.request.params] * len(line.parsed.request.inputs)
        truncate = lines[0].parsed.request.truncate_prompt_tokens
        outs = self.llm.embed(inputs, params, truncate_prompt_tokens=truncate, use_tqdm=False)
        start = 0
        for line in lines:
            request = line.parsed.request
            mine = outs[start : start + len(request.inputs)]
            start += len(request.inputs)
            tokens = sum(len(o.prompt_token_ids) for o in mine)
            vectors = [o.outputs.embedding for o in mine]
            body = embedding_body(vectors, tokens, self.model_name, request.encoding_format)
            self.summary.prompt_tokens += tokens
            line.result = output_line(line.parsed.custom_id, body)

    def _score(self, lines: list[_Line]) -> None:
        left: list[str] = []
        right: list[str] = []
        for line in lines:
            left += line.parsed.request.left
            right += line.parsed.request.right
        first = lines[0].parsed.request
        pooling = PoolingParams(use_activation=first.use_activation)
        outs = self.llm.score(
            left,
            right,
            truncate_prompt_tokens=first.truncate_prompt_tokens,
            use_tqdm=False,
            pooling_params=pooling,
        )
        start = 0
        for line in lines:
            request = line.parsed.request
            mine = outs[start : start + len(request.left)]
            start += len(request.left)
            scores = [o.outputs.score for o in mine]
            tokens = sum(len(getattr(o, "prompt_token_ids", None) or ()) for o in mine)
            if line.parsed.kind == RERANK:
                body = rerank_body(request, scores, tokens, self.model_name)
            else:
                body = score_body(scores, tokens, self.model_name)
            self.summary.prompt_tokens += tokens
            line.result = output_line(line.parsed.custom_id, body)

    def _fail(self, line: _Line, error: BatchLineError) -> None:
        line.result = error_line(line.parsed.custom_id, error)


def run_batch(
    llm: Any,
    input_path: str,
    output_path: str,
    *,
    model_name: str,
    served_names: tuple[str, ...] = (),
    lines_in_flight: int | None = None,
    progress: bool = True,
    stream: IO[str] | None = None,
) -> BatchSummary:
    """Runs every line of `input_path` and writes the output lines to `output_path`.

    Args:
        llm: The engine.
        input_path / output_path: Local paths or store URIs.
        model_name: The `model` of the response bodies.
        served_names: Names a line's `body.model` may name (empty: any).
        lines_in_flight: Most lines read and not yet written (default: 8 x the engine's
            `max_num_seqs`, at least 4096; with pooling models 2 x `POOLING_INPUTS_PER_CALL`).
        progress: A progress bar of lines on `stream` (default stderr).
    """
    summary = BatchSummary(output_path)
    engine = _Engine(llm, model_name, summary)
    kinds = supported_kinds(llm)
    limit = lines_in_flight or _default_lines_in_flight(llm)
    defaults = _model_defaults(llm)
    start = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(unit="line", file=stream or sys.stderr, disable=not progress, mininterval=0.5)
    unfreeze = freeze_gc_heap()
    try:
        with OutputLines(output_path) as out:
            window: deque[_Line] = deque()
            pooling: list[_Line] = []
            num_pooling_inputs = 0
            lines = read_lines(input_path)
            is_exhausted = False
            while True:
                admitted: list[_Line] = []
                while not is_exhausted and len(window) < limit:
                    item = next(lines, None)
                    if item is None:
                        is_exhausted = True
                        break
                    line = _Line(parse_line(item[1], item[0], defaults, served_names))
                    window.append(line)
                    parsed = line.parsed
                    if parsed.error is None and parsed.kind not in kinds:
                        parsed.error = BatchLineError(
                            f"the model does not serve {parsed.kind} requests (it serves "
                            f"{', '.join(sorted(kinds))})",
                            param="url",
                        )
                    if parsed.error is not None:
                        line.result = error_line(parsed.custom_id, parsed.error)
                    elif parsed.kind in GENERATION_KINDS:
                        admitted.append(line)
                    else:
                        pooling.append(line)
                        num_pooling_inputs += _num_inputs(parsed)
                        if num_pooling_inputs >= POOLING_INPUTS_PER_CALL:
                            break
                if admitted:
                    engine.submit(admitted)
                if pooling and (
                    num_pooling_inputs >= POOLING_INPUTS_PER_CALL
                    or is_exhausted
                    or len(window) >= limit
                ):
                    engine.run_pooling(pooling)
                    pooling, num_pooling_inputs = [], 0
                num_written = 0
                while window and window[0].result is not None:
                    done = window.popleft()
                    out.write(done.result)
                    num_written += 1
                    summary.num_failed += done.result["error"] is not None
                summary.num_lines += num_written
                bar.update(num_written)
                if is_exhausted and not window:
                    break
                if engine.num_requests:
                    engine.step()
                elif is_exhausted or len(window) >= limit:
                    if not pooling:
                        raise RuntimeError("run-batch: the window's head has no work left")
        summary.seconds = time.perf_counter() - start
        return summary
    finally:
        unfreeze()
        engine.abort()
        bar.close()


def _num_inputs(parsed: BatchLine) -> int:
    request = parsed.request
    return len(request.inputs) if parsed.kind == EMBEDDING else len(request.left)


def _default_lines_in_flight(llm: Any) -> int:
    engine = llm.llm_engine
    if engine.config.model.runner_type == "pooling":
        return 2 * POOLING_INPUTS_PER_CALL
    return max(4096, 8 * engine.config.scheduler.max_num_seqs)


def _model_defaults(llm: Any) -> dict[str, Any]:
    """The sampling values the model's generation config sets (over `SamplingParams()`'s),
    which a request that omits them takes, as vLLM's server does."""
    if llm.llm_engine.config.model.runner_type == "pooling":
        return {}
    base = params_fields(SamplingParams())
    model = params_fields(llm.get_default_sampling_params())
    return {k: v for k, v in model.items() if base.get(k) != v}


__all__ = ["BatchSummary", "POOLING_INPUTS_PER_CALL", "run_batch", "supported_kinds"]
