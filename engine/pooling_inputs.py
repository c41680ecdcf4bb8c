"""How a pooling call's prompts become the runner's packed inputs: text tokenized in one
batched call (large calls in worker processes, a chunk ahead of the device on CUDA), token
ids taken in every form vLLM accepts, inputs truncated and checked against the model's
limits, one `PoolingParams` per prompt. A mixin of `LLM`, under `llm_pooling.py`'s methods.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import envs
from .errors import InvalidParamError, InvalidPromptError
from .inputs import PromptType, normalize_prompts, prompt_list
from .pooling_engine import PoolingEngine
from .pooling_params import PoolingParams
from .tokenize_pool import BatchEncoder, EncodedTexts, TokenizePool, TokenizePoolError

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .worker.pooling_runner import PackedInputs

logger = logging.getLogger(__name__)

# On CUDA, calls with more prompts than twice this are tokenized a chunk ahead of the device
# (and by the tokenizer worker processes, where they are on).
_TOKENIZE_CHUNK = 16384
# Automatic tokenizer workers: one per usable core beyond the two that the engine's own
# threads keep busy, at most this many. On an H200 host of 16 cores, 13 workers tokenized the
# vLLM comparison's texts in 1.4 s per 100,000 against 2.1 s for 8, while the device needs
# about 0.6 s for them (docs/performance.md, W4).
_MAX_AUTO_TOKENIZE_WORKERS = 16


class PoolingInputsMixin:
    """The inputs of `LLM`'s pooling calls; needs `llm_engine` and `_require_tokenizer`."""

    llm_engine: LLMEngine | PoolingEngine
    _tokenize_pool: TokenizePool | None = None
    _tokenize_pool_finalizer: weakref.finalize | None = None
    _is_tokenize_pool_failed: bool = False
    # (the tokenizer's Rust backend, an encoder of its copy, None where it has no JSON form)
    _batch_encoder: tuple[Any, BatchEncoder | None] | None = None

    def _require_tokenizer(self, what: str) -> Any:  # provided by LLM
        raise NotImplementedError

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

        prompts = prompt_list(prompts)
        n = len(prompts)
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
            num_workers = min(envs.usable_cores() - 2, _MAX_AUTO_TOKENIZE_WORKERS) if is_cuda else 0
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

        prompt_dicts = normalize_prompts(prompts, token_types=True)
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
            if flat is None:
                flat = self._encode_in_process(tokenizer, [t for _, t in texts], max_len, lower)
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
        types: list[list[int] | None] = [p.get("token_type_ids") for p in prompt_dicts]
        if len(texts) < n:  # token-id prompts: cut and check one by one
            for i, p in enumerate(prompt_dicts):
                if "prompt_token_ids" in p:
                    if truncate is not None and max_len is not None:
                        ids[i] = ids[i][-max_len:]
                        if types[i] is not None:
                            types[i] = types[i][-max_len:]
                    self._check_pooling_input(i + index_offset, ids[i])
        if packed is None:
            with_types = types if any(t is not None for t in types) else None
            packed = PackedInputs.from_lists(ids, with_types)  # type: ignore[arg-type]
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

    def _encode_in_process(
        self, tokenizer: Any, texts: list[str], max_len: int | None, lower: bool
    ) -> EncodedTexts | None:
        """`texts` tokenized here by a `BatchEncoder` of the tokenizer's Rust backend (copied
        on first use, as the worker processes copy it), or None when it has none that can
        be serialised: the caller then calls the tokenizer itself."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            return None
        if self._batch_encoder is None or self._batch_encoder[0] is not backend:
            try:
                encoder: BatchEncoder | None = BatchEncoder(backend.to_str())
            except Exception:  # e.g. a custom Python pre-tokenizer cannot be serialised
                encoder = None
            self._batch_encoder = (backend, encoder)
        encoder = self._batch_encoder[1]
        if encoder is None:
            return None
        return EncodedTexts(*encoder.encode(texts, max_len, lower))

    def _check_pooling_input(self, index: int, ids: list[int], check_ids: bool = True) -> None:
        max_len = self.llm_engine.config.model.max_model_len
        if not ids:
            raise InvalidPromptError(
                f"prompts[{index}] is empty; an input needs at least one token (The decoder "
                "prompt cannot be empty)"
            )
        if len(ids) > max_len:
            raise InvalidPromptError(
                f"prompts[{index}] has {len(ids)} tokens, more than the model's maximum "
                f"{max_len}; shorten it or pass truncate_prompt_tokens (This model's maximum "
                f"context length is {max_len} tokens, and your prompt contains {len(ids)} "
                "input tokens)"
            )
        if not check_ids:
            return
        vocab = self.llm_engine.vocab_size
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise InvalidPromptError(
                f"prompts[{index}] has token id {bad} outside the vocabulary [0, {vocab}) "
                f"(Token id {bad} is out of vocabulary)"
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
