"""The pooling half of `LLM`: embed, classify, score and encode (a mixin of `LLM`)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import envs
from .errors import EngineDeadError, InvalidParamError, InvalidPromptError
from .inputs import PromptType, check_text, normalize_prompts
from .lora.request import refuse_lora_for_pooling
from .outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from .pooling_engine import PoolingEngine
from .pooling_params import PoolingParams
from .progress_bar import progress_bar
from .tokenize_pool import EncodedTexts, TokenizePool, TokenizePoolError

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .worker.pooling_runner import PackedInputs, PoolingRunner

logger = logging.getLogger(__name__)

# On CUDA, calls with more prompts than twice this are tokenized a chunk ahead of the device
# (and by the tokenizer worker processes, where they are on).
_TOKENIZE_CHUNK = 16384
# Automatic tokenizer workers: one per usable core beyond the two that the engine's own
# threads keep busy, at most this many (more would not keep up with the device any better).
_MAX_AUTO_TOKENIZE_WORKERS = 8


class PoolingMixin:
    """`LLM`'s pooling methods; they need `llm_engine`, `_next_id` and `_require_tokenizer`."""

    llm_engine: LLMEngine | PoolingEngine
    _tokenize_pool: TokenizePool | None = None
    _tokenize_pool_finalizer: weakref.finalize | None = None
    _is_tokenize_pool_failed: bool = False

    def _next_id(self) -> str:  # provided by LLM
        raise NotImplementedError

    def _require_tokenizer(self, what: str) -> Any:  # provided by LLM
        raise NotImplementedError

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order.

        Example:
            >>> llm = LLM("sentence-transformers/all-MiniLM-L6-v2")
            >>> vectors = [o.outputs.embedding for o in llm.embed(["hello", "world"])]
        """
        refuse_lora_for_pooling(lora_request, "embed")
        runner = self._pooling_runner("embed", "embed")
        with _gc_paused():
            # Host vectors: each output's list is made when it is read.
            inputs, vectors = self._pool(
                prompts, pooling_params, truncate_prompt_tokens, use_tqdm, runner, runner.embed
            )
            return [
                EmbeddingRequestOutput(self._next_id(), EmbeddingOutput(v), ids)
                for v, ids in zip(_rows(vectors), inputs.prompt_token_ids(), strict=True)
            ]

    def embed_matrix(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> np.ndarray:
        """The embeddings of `prompts` as one float32 `[len(prompts), dim]` array, row i
        for prompt i, with no object per prompt: what jobs and operators write to Arrow
        (batchlm's own; `embed` is vLLM's). Every prompt must give the same width; no
        prompts give a `[0, 0]` array.

        Example:
            >>> llm.embed_matrix(["hello", "world"]).shape
            (2, 384)
        """
        runner = self._pooling_runner("embed_matrix", "embed")
        with _gc_paused():
            _, vectors = self._pool(
                prompts, pooling_params, truncate_prompt_tokens, use_tqdm, runner, runner.embed
            )
        if isinstance(vectors, torch.Tensor):
            return vectors.numpy()
        if not vectors:
            return np.zeros((0, 0), np.float32)
        widths = sorted({len(v) for v in vectors})
        if len(widths) > 1:
            raise InvalidParamError(
                f"embed_matrix() needs one embedding width, but pooling_params ask for widths "
                f"{widths}; use embed() for vectors of different widths"
            )
        return torch.stack(vectors).numpy()

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (softmax; sigmoid for single-label models)."""
        refuse_lora_for_pooling(lora_request, "classify")
        runner = self._pooling_runner("classify", "classify")
        with _gc_paused():
            inputs, probs = self._pool(
                prompts, pooling_params, truncate_prompt_tokens, use_tqdm, runner, runner.classify
            )
            return [
                ClassificationRequestOutput(self._next_id(), ClassificationOutput(p.tolist()), ids)
                for p, ids in zip(probs, inputs.prompt_token_ids(), strict=True)
            ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair: 1↔1, 1↔N (data_1 is broadcast) or N↔N.

        A cross-encoder (a classifier with one label) reads each pair together and applies
        its sigmoid; an embedding model scores the cosine of the two embeddings; a
        late-interaction (ColBERT) model scores MaxSim: for each token of data_1 the best dot
        product with a token of data_2, summed (normalised token vectors).
        """
        from .worker.pooling_runner import PackedInputs

        refuse_lora_for_pooling(lora_request, "score")
        start = time.perf_counter()
        runner = self._pooling_runner("score", None)
        left, right = _score_pairs(data_1, data_2)
        params = pooling_params or PoolingParams()
        if runner.task == "classify":
            if runner.num_labels != 1:
                raise InvalidParamError(
                    f"score() needs a cross-encoder with one label; this classifier has "
                    f"{runner.num_labels} labels: use classify() instead"
                )
            tokenizer = self._require_tokenizer("score")
            max_len = self._max_input_len(truncate_prompt_tokens)
            encoded = tokenizer(
                list(left),
                list(right),
                truncation="longest_first" if max_len else False,
                max_length=max_len,
            )
            types = encoded.get("token_type_ids")
            token_lists = [list(ids) for ids in encoded["input_ids"]]
            for i, ids in enumerate(token_lists):
                self._check_pooling_input(i, ids, check_ids=False)
            inputs = PackedInputs.from_lists(
                token_lists, [list(t) for t in types] if types is not None else None
            )
            with self._progress(runner, use_tqdm, len(inputs)):
                values = [v[0].item() for v in runner.classify(inputs, [params] * len(inputs))]
            self._record_pooling(inputs, start)
            query_ids = inputs.prompt_token_ids()
        else:
            texts = list(dict.fromkeys([*left, *right]))
            # The caller's params (matryoshka dimensions, truncation); an embedding model
            # scores the cosine of unit vectors.
            unit = dataclasses.replace(params, normalize=True)
            text_inputs, text_params = self._pooling_inputs(texts, unit, truncate_prompt_tokens)
            row_of = {text: i for i, text in enumerate(texts)}
            with self._progress(runner, use_tqdm, len(text_inputs)):
                values = runner.score_pairs(
                    text_inputs, text_params, [row_of[a] for a in left], [row_of[b] for b in right]
                )
            self._record_pooling(text_inputs, start)
            by_text = dict(zip(texts, text_inputs.prompt_token_ids(), strict=True))
            query_ids = [by_text[a] for a in left]  # the query side's tokens
        return [
            ScoringRequestOutput(self._next_id(), ScoringOutput(v), ids)
            for v, ids in zip(values, query_ids, strict=True)
        ]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_task: str = "embed",
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """Raw pooling output (`outputs.data`, a tensor) for `pooling_task`: `embed`,
        `classify` or `token_embed` (every token's final hidden state; a late-interaction
        model's normalised projected token vectors)."""
        refuse_lora_for_pooling(lora_request, "encode")
        if pooling_task == "token_classify":
            raise InvalidParamError(
                "pooling_task='token_classify' (a label per token, for *ForTokenClassification "
                "checkpoints) is not supported; use 'token_embed' for every token's hidden "
                "state, or 'classify' for one label per prompt"
            )
        if pooling_task not in ("embed", "classify", "token_embed"):
            raise InvalidParamError(
                f"pooling_task={pooling_task!r} is unknown; use 'embed', 'classify' or "
                "'token_embed'"
            )
        runner = self._pooling_runner("encode", "classify" if pooling_task == "classify" else None)
        if pooling_task == "embed":
            run = runner.embed
        elif pooling_task == "classify":
            run = runner.classify
        else:
            run = runner.token_embed

        with _gc_paused():
            inputs, data = self._pool(
                prompts, pooling_params, truncate_prompt_tokens, use_tqdm, runner, run
            )
            return [
                PoolingRequestOutput(self._next_id(), PoolingOutput(d), ids)
                for d, ids in zip(
                    _rows(data, as_tensors=True), inputs.prompt_token_ids(), strict=True
                )
            ]

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool | Callable[..., Any],
        runner: PoolingRunner,
        run: Callable[[PackedInputs, list[PoolingParams]], Any],
    ) -> tuple[PackedInputs, Any]:
        """`run` (a task of `runner`) over the prompts, tokenized a chunk ahead where that
        pays, with the call's progress bar and metrics; the inputs and `run`'s results."""
        start = time.perf_counter()
        with self._progress(runner, use_tqdm, _num_prompts(prompts)):
            inputs, results = self._run_chunked(
                prompts, pooling_params, truncate_prompt_tokens, run
            )
        self._record_pooling(inputs, start)
        return inputs, results

    @contextlib.contextmanager
    def _progress(
        self, runner: PoolingRunner, use_tqdm: bool | Callable[..., Any], total: int
    ) -> Iterator[None]:
        """A bar of the call's inputs done (and inputs per second), moved as each batch of
        the runner is done."""
        bar = progress_bar(use_tqdm, total, "Processed prompts", "texts")
        try:
            with runner.reporting(bar.update):
                yield
        finally:
            bar.close()

    def _record_pooling(self, inputs: PackedInputs, start: float) -> None:
        """Count a finished pooling call in the metrics (each input is one request)."""
        metrics = self.llm_engine.metrics
        if metrics is not None:
            elapsed = time.perf_counter() - start
            metrics.record_pooling(inputs.lens.tolist(), elapsed)

    def _pooling_runner(self, method: str, task: str | None) -> PoolingRunner:
        if self.llm_engine.is_shut_down:
            raise EngineDeadError("this LLM was shut down; build a new one")
        if not isinstance(self.llm_engine, PoolingEngine):
            raise InvalidParamError(
                f"{method}() needs a pooling model, but this one was loaded to generate; "
                f"load it with LLM(model, runner='pooling') (a generative checkpoint pools its "
                "last token: convert='embed')"
            )
        runner = self.llm_engine.pooling_runner
        if task is not None and runner.task != task:
            if task == "classify":
                hint = "load a *ForSequenceClassification checkpoint"
            elif runner.task == "token_embed":
                hint = (
                    "this late-interaction model gives token vectors: use "
                    "encode(pooling_task='token_embed') or score()"
                )
            else:
                hint = "use classify() or score() with this classifier"
            raise InvalidParamError(
                f"{method}() needs a model that can {task}, but this one does {runner.task}; "
                + hint
            )
        return runner

    def _max_input_len(self, truncate_prompt_tokens: int | None) -> int | None:
        """Where inputs are cut: the explicit request, else sentence-transformers' length."""
        engine = self.llm_engine
        runner = engine.pooling_runner if isinstance(engine, PoolingEngine) else None
        max_len = engine.config.model.max_model_len
        t = truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise InvalidParamError(
                f"truncate_prompt_tokens={t!r} must be an integer >= 1, or -1 for the model's "
                "maximum (None keeps the whole input)"
            )
        if truncate_prompt_tokens is not None:
            keep = max_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            if keep > max_len:
                raise InvalidParamError(
                    f"truncate_prompt_tokens={keep} exceeds the model's maximum {max_len}"
                )
            return keep
        return runner.max_seq_length if runner is not None else None

    def _run_chunked(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        truncate_prompt_tokens: int | None,
        run: Callable[[PackedInputs, list[PoolingParams]], list[Any]],
    ) -> tuple[PackedInputs, list[Any]]:
        """Tokenizes the prompts and runs `run` over them; returns the inputs and results.

        On CUDA a large call is cut into chunks: a helper thread tokenizes the next chunk
        (the Rust tokenizer releases the GIL) while the device runs the current one. Where
        the tokenizer worker processes are on, that thread hands each chunk's texts to them,
        except the first chunk of the call that starts them (they are still loading).
        """
        from .worker.pooling_runner import PackedInputs

        n = len(prompts) if isinstance(prompts, Sequence) and not isinstance(prompts, str) else 1
        chunk = self._tokenize_chunk_size()
        is_pool_new = self._tokenize_pool is None
        pool = self._tokenize_pool_for(n, chunk or _TOKENIZE_CHUNK)
        if pool is not None and chunk is None:
            chunk = _TOKENIZE_CHUNK
        if chunk is None or n <= 2 * chunk:
            inputs, params = self._pooling_inputs(prompts, pooling_params, truncate_prompt_tokens)
            return inputs, run(inputs, params)
        per_prompt = isinstance(pooling_params, Sequence)
        if per_prompt and len(pooling_params) != n:
            raise InvalidParamError(
                f"pooling_params must be one PoolingParams or a list of {n} of them"
            )
        truncate = truncate_prompt_tokens
        if truncate is None and per_prompt:
            explicit = {p.truncate_prompt_tokens for p in pooling_params} - {None}
            truncate = max(explicit) if explicit else None

        def prepare(start: int) -> tuple[PackedInputs, list[PoolingParams]]:
            end = min(start + chunk, n)
            chunk_params = pooling_params[start:end] if per_prompt else pooling_params
            chunk_pool = None if start == 0 and is_pool_new else pool
            return self._pooling_inputs(
                prompts[start:end], chunk_params, truncate, start, chunk_pool
            )

        parts: list[PackedInputs] = []
        results: list[Any] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchlm-tokenize") as helper:
            future = helper.submit(prepare, 0)
            for start in range(0, n, chunk):
                chunk_inputs, chunk_params = future.result()
                if start + chunk < n:
                    future = helper.submit(prepare, start + chunk)
                parts.append(chunk_inputs)
                results.append(run(chunk_inputs, chunk_params))
        return PackedInputs.concat(parts), _join_results(results)

    def _tokenize_chunk_size(self) -> int | None:
        """Prompts per tokenization chunk, or None to tokenize a call at once (CPU: the
        tokenizer would compete with the model for the same cores)."""
        return _TOKENIZE_CHUNK if self.llm_engine.config.device.device.type == "cuda" else None

    def _tokenize_pool_for(self, num_prompts: int, chunk: int) -> TokenizePool | None:
        """The tokenizer worker processes for a call of `num_prompts`, started on first use,
        or None where they do not pay: calls of at most two chunks (no pipeline to hide the
        messaging in), at most two usable cores, CPU models (whose forward needs every core)
        unless BATCHLM_TOKENIZE_WORKERS asks for them, and tokenizers without a serialisable
        Rust backend."""
        if num_prompts <= 2 * chunk or self._is_tokenize_pool_failed:
            return None
        num_workers = envs.tokenize_workers()
        if num_workers == 0:
            return None
        if self._tokenize_pool is not None:
            return self._tokenize_pool
        if num_workers is None:
            is_cuda = self.llm_engine.config.device.device.type == "cuda"
            num_workers = min(_usable_cores() - 2, _MAX_AUTO_TOKENIZE_WORKERS) if is_cuda else 0
        backend = getattr(self.llm_engine.tokenizer, "backend_tokenizer", None)
        if num_workers < 1 or not sys.executable or not hasattr(backend, "encode_batch"):
            return None
        try:
            tokenizer_json = backend.to_str()
        except Exception:  # e.g. a custom Python pre-tokenizer cannot be serialised
            return None
        try:
            pool = TokenizePool(tokenizer_json, num_workers)
        except TokenizePoolError as e:
            self._drop_tokenize_pool(e)
            return None
        self._tokenize_pool = pool
        # Workers end with the LLM: on shutdown(), when it is garbage collected, or at exit.
        self._tokenize_pool_finalizer = weakref.finalize(self, pool.close)
        return pool

    def _drop_tokenize_pool(self, error: Exception) -> None:
        """Stop using the worker processes after `error`: later calls tokenize in process."""
        logger.warning("tokenizing in process from now on: %s", error)
        self._is_tokenize_pool_failed = True
        self._shutdown_pooling()

    def _shutdown_pooling(self) -> None:
        """End the tokenizer worker processes (idempotent); `LLM.shutdown` calls this."""
        if self._tokenize_pool_finalizer is not None:
            self._tokenize_pool_finalizer()
        self._tokenize_pool = None

    def _pooling_inputs(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        truncate_prompt_tokens: int | None,
        index_offset: int = 0,
        pool: TokenizePool | None = None,
    ) -> tuple[PackedInputs, list[PoolingParams]]:
        """The prompts tokenized, truncated and checked, with one params per prompt; errors
        name prompts by their index plus `index_offset`. Texts go to `pool` when given."""
        from .worker.pooling_runner import PackedInputs

        prompt_dicts = normalize_prompts(prompts)
        n = len(prompt_dicts)
        if pooling_params is None:
            params = [PoolingParams()] * n
        elif isinstance(pooling_params, PoolingParams):
            params = [pooling_params] * n
        else:
            params = list(pooling_params)
            if len(params) != n or not all(isinstance(p, PoolingParams) for p in params):
                raise InvalidParamError(
                    f"pooling_params must be one PoolingParams or a list of {n} of them"
                )
        truncate = truncate_prompt_tokens
        if truncate is None:
            explicit = {p.truncate_prompt_tokens for p in params} - {None}
            truncate = max(explicit) if explicit else None
        max_len = self._max_input_len(truncate)
        runner = self.llm_engine.pooling_runner
        # sentence-transformers puts its default prompt before every text.
        prompt = runner.default_prompt or ""
        texts = [
            (i, prompt + p["prompt"])
            for i, p in enumerate(prompt_dicts)
            if "prompt_token_ids" not in p
        ]
        ids: list[list[int] | None] = [p.get("prompt_token_ids") for p in prompt_dicts]
        packed: PackedInputs | None = None
        if texts:
            tokenizer = self._require_tokenizer(f"the text prompt at index {texts[0][0]}")
            lower = runner.do_lower_case
            flat = None
            if pool is not None:
                flat = self._encode_in_pool(pool, [t for _, t in texts], max_len, lower)
            if flat is not None and len(texts) == n:
                packed = PackedInputs.from_lens(flat.token_ids, flat.lens)
            else:
                if flat is not None:
                    views = PackedInputs.from_lens(flat.token_ids, flat.lens).prompt_token_ids()
                    encoded = [v.tolist() for v in views]
                else:
                    batch = [t.lower() if lower else t for _, t in texts]
                    encoded = _encode_batch(tokenizer, batch, max_len)
                for (i, _), tokens in zip(texts, encoded, strict=True):
                    ids[i] = tokens
        if len(texts) < n:  # token-id prompts: cut and check one by one
            for i, p in enumerate(prompt_dicts):
                if "prompt_token_ids" in p:
                    if truncate is not None and max_len is not None:
                        ids[i] = ids[i][-max_len:]
                    self._check_pooling_input(i + index_offset, ids[i])
        if packed is None:
            packed = PackedInputs.from_lists(ids)  # type: ignore[arg-type]
        # Ids the tokenizer produced are in the vocabulary by construction; their lengths
        # are checked at once.
        lens = packed.lens
        model_max = self.llm_engine.config.model.max_model_len
        bad = np.flatnonzero((lens == 0) | (lens > model_max))
        if len(bad):
            i = int(bad[0])
            bad_ids = packed.token_ids[packed.offsets[i] : packed.offsets[i + 1]].tolist()
            self._check_pooling_input(i + index_offset, bad_ids, check_ids=False)
        if prompt and texts and not runner.include_prompt:
            # Its tokens leave the mean: the prompt alone, without its closing special
            # token, as sentence-transformers counts them.
            text = prompt.lower() if runner.do_lower_case else prompt
            packed.pool_start = np.zeros(n, np.int64)
            packed.pool_start[[i for i, _ in texts]] = len(tokenizer(text)["input_ids"]) - 1
        return packed, params

    def _encode_in_pool(
        self, pool: TokenizePool, texts: list[str], max_len: int | None, lower: bool
    ) -> EncodedTexts | None:
        """`texts` tokenized by the worker processes, or None when one of them failed: the
        caller then tokenizes in process, which gives the same ids or raises the tokenizer's
        own error. A worker that died stops the workers for good."""
        try:
            return pool.encode(texts, max_len, lower)
        except TokenizePoolError as e:
            if pool.is_closed:
                self._drop_tokenize_pool(e)
            return None

    def _check_pooling_input(self, index: int, ids: list[int], check_ids: bool = True) -> None:
        max_len = self.llm_engine.config.model.max_model_len
        if not ids:
            raise InvalidPromptError(
                f"prompts[{index}] is empty; an input needs at least one token"
            )
        if len(ids) > max_len:
            raise InvalidPromptError(
                f"prompts[{index}] has {len(ids)} tokens, more than the model's maximum "
                f"{max_len}; shorten it or pass truncate_prompt_tokens"
            )
        if not check_ids:
            return
        vocab = self.llm_engine.vocab_size
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise InvalidPromptError(
                f"prompts[{index}] has token id {bad} outside the vocabulary [0, {vocab})"
            )


def _join_results(parts: list[Any]) -> Any:
    """The results of a call's chunks as one: a matrix when every chunk gave one of the
    same width (rows in input order), else a list with an item per input (chunks whose
    prompts ask for other `dimensions` give matrices of other widths)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        if len(parts) == 1:
            return parts[0]
        if len({p.shape[1:] for p in parts}) == 1:
            return torch.cat(parts)
    return [item for part in parts for item in part]


def _rows(results: torch.Tensor | list[Any], as_tensors: bool = False) -> Sequence[Any]:
    """One item per input: a matrix's rows as `(matrix, i)` (`as_tensors`: a
    `PoolingOutput` makes its tensor view when it is read) or numpy views (an
    `EmbeddingOutput` makes its list from one when it is read), else the list as it is."""
    if isinstance(results, torch.Tensor):
        if as_tensors:
            return list(zip(itertools.repeat(results), range(results.shape[0])))
        return list(results.numpy())
    return results


def _num_prompts(prompts: Any) -> int:
    """How many prompts a call's `prompts` argument holds (one string or dict is one)."""
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
        return 1
    return len(prompts)


def _score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]):
    """Expand score() inputs to two equal-length lists of texts."""
    sides = []
    for name, data in (("data_1", data_1), ("data_2", data_2)):
        if isinstance(data, str):
            data = [data]
        elif not isinstance(data, Sequence) or isinstance(data, (bytes, bytearray)):
            raise InvalidPromptError(
                f"{name} is a {type(data).__name__}; pass a string or a list of strings"
            )
        items = list(data)
        if not items:
            raise InvalidPromptError(f"{name} is empty; pass a string or a non-empty list")
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise InvalidPromptError(f"{name}[{i}] is a {type(item).__name__}, not a string")
            check_text(item, f"{name}[{i}]")
        sides.append(items)
    left, right = sides
    if len(left) == 1 and len(right) > 1:
        left = left * len(right)
    if len(left) != len(right):
        raise InvalidPromptError(
            f"score() got {len(left)} texts in data_1 and {len(right)} in data_2; pass one "
            "against many (1 and N) or equal-length lists (N and N)"
        )
    return left, right


def _usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector while building many small objects (token lists,
    outputs): its generational passes otherwise dominate large pooling calls."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _encode_batch(tokenizer: Any, texts: list[str], max_len: int | None) -> list[list[int]]:
    """Token ids of many texts, truncated (right) to `max_len` like the tokenizer's own
    `truncation=True`; through the Rust tokenizer directly when there is one, which skips
    transformers' per-text conversion of offsets, masks and type ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        out = tokenizer(texts, truncation=max_len is not None, max_length=max_len)["input_ids"]
        return [list(ids) for ids in out]
    truncation, padding = backend.truncation, backend.padding
    try:
        backend.no_padding()
        if max_len is None:
            backend.no_truncation()
        else:
            backend.enable_truncation(max_len)
        # `encode_batch_fast` (tokenizers >= 0.21) skips the character offsets.
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=True)]
    finally:
        if truncation is None:
            backend.no_truncation()
        else:
            backend.enable_truncation(**truncation)
        if padding is not None:
            backend.enable_padding(**padding)
