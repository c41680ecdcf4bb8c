"""The pooling half of `LLM`: embed, classify, score and encode (a mixin of `LLM`)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import EngineDeadError, InvalidParamError, InvalidPromptError
from .inputs import PromptType, check_text, prompt_list
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
from .pooling_inputs import PoolingInputsMixin
from .pooling_params import PoolingParams
from .progress_bar import progress_bar

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .worker.pooling_runner import PackedInputs, PoolingRunner

logger = logging.getLogger(__name__)


class PoolingMixin(PoolingInputsMixin):
    """`LLM`'s pooling methods; they need `llm_engine`, `_next_id` and `_require_tokenizer`."""

    llm_engine: LLMEngine | PoolingEngine

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
        """Raw pooling output (`outputs.data`, a tensor) for `pooling_task`, the task the
        model serves (as in vLLM): `embed`, `classify`, or `token_embed` (every token's
        vector: a late-interaction model's, or an embedding model's built with
        `pooler_config={"task": "token_embed"}`). Another task raises vLLM's error."""
        refuse_lora_for_pooling(lora_request, "encode")
        if pooling_task == "token_classify":
            runner = self._pooling_runner("encode", None)
            phrase = (
                ""
                if "classify" in runner.supported_tasks
                else " (Classification API is not supported by this model.)"
            )
            raise InvalidParamError(
                "pooling_task='token_classify' (a label per token, for *ForTokenClassification "
                "checkpoints) is not supported; use 'token_embed' for every token's vector, "
                f"or 'classify' for one label per prompt{phrase}"
            )
        if pooling_task not in ("embed", "classify", "token_embed"):
            raise InvalidParamError(
                f"pooling_task={pooling_task!r} is unknown; use 'embed', 'classify' or "
                "'token_embed'"
            )
        runner = self._pooling_runner("encode", pooling_task)
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
        """The runner, once the call can run: the engine open and awake, a pooling model
        that serves `task` (None: any)."""
        if self.llm_engine.is_shut_down:
            raise EngineDeadError("this LLM was shut down; build a new one")
        self.llm_engine.sleep_state.check_awake(f"{method}()")
        if not isinstance(self.llm_engine, PoolingEngine):
            raise InvalidParamError(
                f"{method}() needs a pooling model, but this one was loaded to generate; "
                f"load it with LLM(model, runner='pooling') (a generative checkpoint pools its "
                f"last token: convert='embed') (LLM.{method}() is only supported for pooling "
                "models. Try passing `--runner pooling` to use the model as a pooling model.)"
            )
        runner = self.llm_engine.pooling_runner
        if task is not None:
            _check_task(runner, method, task)
        return runner


def _check_task(runner: PoolingRunner, method: str, task: str) -> None:
    """`task` is the one the model serves, or an error as vLLM's: a task the model cannot
    serve at all, or one it serves only when built for it (`pooler_config`)."""
    if task == runner.task:
        return
    supported = runner.supported_tasks
    if task not in supported:
        if task in ("embed", "token_embed"):
            if runner.task == "token_embed":
                hint = (
                    "this late-interaction model gives token vectors: use "
                    "encode(pooling_task='token_embed') or score()"
                )
            else:
                hint = "use classify() or score() with this classifier"
            phrase = "Embedding API is not supported by this model."
        else:
            hint = "load a *ForSequenceClassification checkpoint"
            phrase = "Classification API is not supported by this model."
        raise InvalidParamError(
            f"{method}() needs a model that can {task}, but this one does {runner.task}; "
            f"{hint} ({phrase})"
        )
    raise InvalidParamError(
        f"{method}() asks for {task}, but this model is built to {runner.task}; build it "
        f"with LLM(..., pooler_config={{'task': {task!r}}}) to serve {task} (Try switching "
        f'the model\'s pooling_task via `PoolerConfig(task="{task}")`)'
    )


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
    """How many prompts a call's `prompts` argument holds (one string, dict or list of
    token ids is one)."""
    return len(prompt_list(prompts))


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
