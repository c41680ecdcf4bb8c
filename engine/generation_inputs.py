"""A generation call's inputs → validated requests: prompts normalised and tokenized in
one batched call, one `SamplingParams` and one priority per prompt, each checked against
the engine's limits before any request of the call enters the engine.

Errors name the prompt by index, say how to fix it, and contain vLLM's phrase for the
same error, so that code matching vLLM's messages keeps working.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidParamError, InvalidPromptError
from .inputs import MULTIMODAL_KEYS, PromptType, normalize_prompts
from .multimodal.image_pool import ImageBatch, ImageJob, process_job
from .multimodal.inputs import ImageInput, image_items
from .multimodal.mrope import MRopePositions, mrope_positions
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .llm_engine import LLMEngine


@dataclass
class GenerationRequest:
    """One prompt of a call, ready for `LLMEngine.add_request`."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int
    images: tuple[ImageInput, ...] = ()
    """The prompt's images, prepared (a vision-language model's)."""
    mrope_positions: MRopePositions | None = None
    """An M-RoPE model's positions of a prompt with images (None: token indices)."""


@dataclass
class PreparedCall:
    """A call's requests: those ready now, and those whose images worker processes are
    still preparing."""

    requests: list[GenerationRequest | None]
    """One per prompt, in order; None for a prompt in `pending`."""
    pending: PendingImagePrompts | None = None


class PendingImagePrompts:
    """The prompts of a call whose images the image workers prepare: each becomes its
    request (checked as any other) when its images are ready."""

    def __init__(
        self, batch: ImageBatch, fallback: Any, finish: Callable[[int, Any], GenerationRequest]
    ) -> None:
        self._batch = batch
        self._fallback = fallback
        self._finish = finish

    @property
    def done(self) -> bool:
        return self._batch.done

    def take(self, block: bool) -> list[tuple[int, GenerationRequest]]:
        """`(index, request)` of the prompts ready now (with `block`, at least one).

        Raises:
            InvalidPromptError, InvalidParamError: naming the first bad prompt found (the
                caller then `cancel`s the rest).
        """
        ready = self._batch.take(block, self._fallback)
        return [(i, self._finish(i, processed)) for i, processed in ready]

    def cancel(self) -> None:
        self._batch.cancel()


def prepare_requests(
    engine: LLMEngine,
    prompts: PromptType | Sequence[PromptType],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    priority: Sequence[int] | None,
    default_params: SamplingParams,
    wait: bool = True,
) -> PreparedCall:
    """Every prompt of a call, tokenized and checked (nothing is added to the engine).

    Where the call has many prompts with images and the engine's image workers are on
    (`multimodal/image_pool.py`), the workers prepare those prompts' images. With `wait`
    the call returns when all are ready; without, those prompts are left `pending`, to be
    added as they come (their errors surface then).

    Raises:
        InvalidPromptError, InvalidParamError: naming the first bad prompt or value.
    """
    prompt_dicts = normalize_prompts(prompts, multimodal=True)
    n = len(prompt_dicts)
    params_list = params_per_prompt(engine, sampling_params, n, default_params)
    priorities = priority_per_prompt(priority, n, engine.config.scheduler.policy)
    jobs = _image_jobs(engine, prompt_dicts)
    with_images = {job.index for job in jobs}
    pool = engine.image_workers.pool_for(len(jobs)) if jobs else None
    batch = pool.submit(jobs) if pool is not None else None
    try:
        processed: dict[int, Any] = {}
        if batch is None:
            processed = {job.index: process_job(engine.image_processor, job) for job in jobs}
        token_lists = _tokenize(engine, prompt_dicts, processed, with_images)

        def finish(i: int, prompt: Any) -> GenerationRequest:
            ids = prompt.prompt_token_ids if prompt is not None else token_lists[i]
            prompt_images = prompt.images if prompt is not None else ()
            if prompt_images and engine.scheduler.has_bidirectional_images:
                _check_whole_images_fit(engine, i, prompt_images)
            return _request(
                engine, i, prompt_dicts[i], ids, params_list[i], priorities[i], prompt_images
            )

        requests: list[GenerationRequest | None] = [
            None if batch is not None and i in with_images else finish(i, processed.get(i))
            for i in range(n)
        ]
        if batch is None:
            return PreparedCall(requests)
        pending = PendingImagePrompts(batch, engine.image_processor, finish)
        if not wait:
            return PreparedCall(requests, pending)
        while not pending.done:
            for i, request in pending.take(block=True):
                requests[i] = request
    except BaseException:
        if batch is not None:
            batch.cancel()
        raise
    return PreparedCall(requests)


def _request(
    engine: LLMEngine,
    i: int,
    p: dict[str, Any],
    ids: list[int],
    params: SamplingParams,
    priority: int,
    images: tuple[ImageInput, ...],
) -> GenerationRequest:
    """Prompt `i`'s request, its tokens checked against the engine's limits."""
    if images and params.truncate_prompt_tokens is not None:
        raise InvalidParamError(
            f"prompts[{i}] has images and truncate_prompt_tokens="
            f"{params.truncate_prompt_tokens}: a prompt with images is not truncated "
            "(it would cut placeholders); drop truncate_prompt_tokens for it"
        )
    ids = check_prompt(engine, i, ids, params)
    merge = engine.config.multimodal.mrope_merge_size if images else None
    mrope = mrope_positions(len(ids), images, merge) if merge else None
    return GenerationRequest(ids, params, p.get("prompt"), priority, images, mrope)


def _image_jobs(engine: LLMEngine, prompt_dicts: list[dict[str, Any]]) -> list[ImageJob]:
    """The prompts with images, each one's images and processor kwargs checked against
    the model (nothing is prepared yet).

    Raises:
        InvalidPromptError: naming the prompt: images for a text-only model, more than
            `limit_mm_per_prompt`, an image that cannot be read.
    """
    mm = engine.config.multimodal
    if mm is None:
        for i, p in enumerate(prompt_dicts):
            key = next((k for k in sorted(MULTIMODAL_KEYS) if k in p), None)
            if key is not None:
                raise _not_a_vision_model(engine, i, key)
        return []
    jobs = []
    processor = engine.image_processor
    for i, p in enumerate(prompt_dicts):
        kwargs = processor.merged_kwargs(p.get("mm_processor_kwargs"), i)
        if "multi_modal_data" in p:
            found = image_items(p["multi_modal_data"], i, mm.max_images_per_prompt)
            if found:
                text = None if "prompt_token_ids" in p else p["prompt"]
                jobs.append(ImageJob(i, text, p.get("prompt_token_ids"), found, kwargs))
    return jobs


def _not_a_vision_model(engine: LLMEngine, i: int, key: str) -> InvalidPromptError:
    from .models.registry import is_vision_language, runs_language_model_only

    arch = engine.config.model.architecture or "this model"
    if is_vision_language(arch):
        return InvalidPromptError(
            f"prompts[{i}] has the key {key!r}, but this engine serves {arch}'s "
            "language model alone, on text (images are not served with "
            "enable_lora=True); build the LLM without enable_lora for images, or pass "
            "text alone"
        )
    why = (
        "batchlm runs its language model alone, without its vision tower"
        if runs_language_model_only(arch)
        else "it has no vision tower"
    )
    return InvalidPromptError(
        f"prompts[{i}] has the key {key!r}: images, audio and video inputs need "
        f"a vision-language model, and {arch} is a text-only model ({why}); load "
        "one such as LlavaForConditionalGeneration, or pass text alone"
    )


def _check_whole_images_fit(engine: LLMEngine, index: int, images: Sequence[ImageInput]) -> None:
    """A model whose image tokens attend both ways computes each image in one step: each
    must fit the step's token budget."""
    budget = engine.config.scheduler.max_num_batched_tokens
    longest = max((image.length for image in images), default=0)
    if longest > budget:
        raise InvalidPromptError(
            f"prompts[{index}] has an image of {longest} placeholder tokens, more than "
            f"max_num_batched_tokens={budget}; {engine.config.model.architecture} computes "
            "each image's tokens in one step: raise max_num_batched_tokens to at least "
            f"{longest}"
        )


def priority_per_prompt(priority: Sequence[int] | None, n: int, policy: str) -> list[int]:
    """One priority per prompt (0 when none is given).

    Under `fcfs` a list of zeros (vLLM's default) is accepted and changes nothing; other
    values are refused, since only `scheduling_policy="priority"` orders by them.
    """
    if priority is None:
        return [0] * n
    if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
        raise InvalidParamError(
            f"priority={priority!r:.80} must be a list of ints, one per prompt (lower values "
            "are scheduled first)"
        )
    if len(priority) != n:
        raise InvalidParamError(
            f"priority has {len(priority)} values for {n} prompts: The lengths of prompts "
            f"({n}) and priority ({len(priority)}) must be the same."
        )
    for i, value in enumerate(priority):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidParamError(f"priority[{i}]={value!r} must be an int")
    if policy != "priority":
        bad = next((v for v in priority if v != 0), None)
        if bad is not None:
            raise InvalidParamError(
                f"priority={list(priority)!r:.80}: Got priority {bad} but Priority scheduling "
                "is not enabled. Build the LLM with scheduling_policy='priority' to order "
                "requests by priority, or leave priority=None"
            )
    return list(priority)


def params_per_prompt(
    engine: LLMEngine,
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    n: int,
    default_params: SamplingParams,
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt, each distinct object checked once against the
    vocabulary, the engine's `max_logprobs` and the grammar engine."""
    if sampling_params is None:
        params_list = [default_params] * n
    elif isinstance(sampling_params, SamplingParams):
        params_list = [sampling_params] * n
    elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
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
        params_list = list(sampling_params)
    else:
        raise InvalidParamError(
            f"sampling_params must be a SamplingParams or a list of them, "
            f"got {type(sampling_params).__name__}"
        )
    # Vocabulary-dependent checks and grammars, once per distinct params object (named
    # by the first prompt that uses it).
    vocab = engine.vocab_size
    first_use: dict[int, tuple[int, SamplingParams]] = {}
    for index, params in enumerate(params_list):
        first_use.setdefault(id(params), (index, params))
    for index, params in first_use.values():
        if params.bad_words:
            params.resolve_bad_words(require_tokenizer(engine, "bad_words"))
        params.verify_token_ids(vocab)
        check_max_logprobs(params, engine.config.model.max_logprobs, vocab)
        engine.structured.validate(params, index)
    return params_list


def check_max_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """`logprobs` / `prompt_logprobs` within the engine's `max_logprobs` (-1: the vocabulary)."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise InvalidParamError(
                f"{name}={value} exceeds the engine's max_logprobs={max_logprobs}: Requested "
                f"{kind} logprobs of {value}, which is greater than max allowed: {limit}. "
                f"Ask for fewer, or build the LLM with max_logprobs={value} (or -1)"
            )


def require_tokenizer(engine: Any, what: str) -> Any:
    """The engine's tokenizer, or an error saying that `what` needs one."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidPromptError(
            f"{what} needs a tokenizer, but the engine was built with "
            "skip_tokenizer_init=True; pass TokensPrompt inputs or drop that option"
        )
    return tokenizer


def _tokenize(
    engine: LLMEngine,
    prompt_dicts: list[dict[str, Any]],
    processed: dict[int, Any],
    with_images: set[int],
) -> list[list[int] | None]:
    """Each prompt's token ids: those of a prompt with images as its processor made them
    (`processed`; None while the image workers prepare it); the text prompts tokenized in
    one batched call. On a vision-language model, a prompt without images must hold no
    image placeholder."""
    texts = [
        (i, p["prompt"])
        for i, p in enumerate(prompt_dicts)
        if "prompt_token_ids" not in p and i not in with_images
    ]
    out: list[list[int] | None] = [
        processed[i].prompt_token_ids
        if i in processed
        else None
        if i in with_images
        else p.get("prompt_token_ids")
        for i, p in enumerate(prompt_dicts)
    ]
    if texts:
        tokenizer = require_tokenizer(engine, f"the text prompt at index {texts[0][0]}")
        encoded = tokenizer([t for _, t in texts])["input_ids"]
        for (i, _), ids in zip(texts, encoded, strict=True):
            out[i] = list(ids)
    mm = engine.config.multimodal
    if mm is not None:
        for i, ids in enumerate(out):
            if i not in with_images and mm.image_token_id in ids:
                raise InvalidPromptError(
                    f"prompts[{i}] has {ids.count(mm.image_token_id)} image placeholder "
                    f"token(s) (id {mm.image_token_id}) but no images; pass them as "
                    "multi_modal_data={'image': ...}, or remove the placeholders"
                )
    return out


def check_prompt(engine: Any, index: int, ids: list[int], params: SamplingParams) -> list[int]:
    """Checks one prompt against the engine's limits; returns its (truncated) token ids."""
    max_len = engine.config.model.max_model_len
    keep = params.truncate_prompt_tokens
    if keep is not None:
        keep = max_len if keep == -1 else keep
        if keep > max_len:
            raise InvalidParamError(
                f"truncate_prompt_tokens={keep} exceeds max_model_len={max_len}"
            )
        ids = ids[-keep:]
    if not ids:
        raise InvalidPromptError(
            f"prompts[{index}] is empty; a prompt needs at least one token (The decoder "
            "prompt cannot be empty)"
        )
    if len(ids) > max_len:
        raise InvalidPromptError(
            f"prompts[{index}] has {len(ids)} tokens, more than max_model_len={max_len}; "
            "shorten it, raise max_model_len, or set truncate_prompt_tokens (This model's "
            f"maximum context length is {max_len} tokens, and your prompt contains "
            f"{len(ids)} input tokens)"
        )
    vocab = engine.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:  # C speed; then the first bad id, for the message
        bad = next(t for t in ids if t < 0 or t >= vocab)
        raise InvalidPromptError(
            f"prompts[{index}] has token id {bad} outside the vocabulary [0, {vocab}) "
            f"(Token id {bad} is out of vocabulary)"
        )
    return ids
