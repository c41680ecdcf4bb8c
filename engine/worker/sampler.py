"""Batched sampling on the device, with no host sync per request.

Order: penalties (repetition, then frequency / presence) → logit bias → allowed token ids →
bad words and min_tokens bans → temperature → top-k → top-p → min-p → sample. Each step of
the logits processing runs only on the rows that use it, and not at all when no row does.
Sampling uses the exponential race (`argmax(probs / q)` with `q ~ Exp(1)`), which draws
exactly from `probs`; a seeded request draws its `q` from its own generator, so its tokens
do not depend on the rest of the batch. Logprobs are those of the raw model output (before
any processing, temperature and truncation), as vLLM reports them by default; a structured
output's grammar mask comes before all of it (`grammar_mask.py`), so its logprobs are those
of the constrained distribution, as in vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..sampling_params import SamplingParams


@dataclass
class LogitsProcessing:
    """Per-step tensors of the logits processors, only for the rows that use them."""

    penalty_rows: torch.Tensor | None = None  # [num_pen] int64
    output_token_ids: torch.Tensor | None = None
    """`[num_pen, max_output_len]` int64, padded with `vocab_size` (a column dropped after
    counting)."""
    prompt_token_ids: torch.Tensor | None = None
    """`[num_pen, max_prompt_len]` int64, padded with `vocab_size`; None when no row has a
    repetition penalty."""
    repetition_penalty: torch.Tensor | None = None  # [num_pen] float32
    frequency_penalty: torch.Tensor | None = None  # [num_pen] float32
    presence_penalty: torch.Tensor | None = None  # [num_pen] float32
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) `[num_biases]` int64 each, of the logit biases."""
    bias_values: torch.Tensor | None = None  # [num_biases] float32
    allowed_rows: torch.Tensor | None = None  # [num_allowed_rows] int64
    allowed_index: tuple[torch.Tensor, torch.Tensor] | None = None
    """(index into `allowed_rows`, token id) of each allowed token."""
    banned_index: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) set to -inf: bad words that would complete, and EOS / stop tokens
    of rows below `min_tokens`."""


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, as device tensors."""

    temperature: torch.Tensor  # [num_rows] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [num_rows] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [num_rows] int64, vocab size where unused
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 where unused
    min_p: torch.Tensor | None  # [num_rows] float32, 0.0 where unused
    generators: dict[int, torch.Generator]
    """Row → the request's own generator, for seeded requests."""
    max_num_logprobs: int | None
    """Largest `logprobs` asked for in the batch; None when no row wants logprobs."""
    processing: LogitsProcessing | None = None
    """Penalties, bias, allowed and banned tokens; None when no row uses any."""
    return_sampling_mask: bool = False
    """Also return, per row, the tokens that survive the filtering (see SamplerOutput)."""
    any_greedy: bool = True
    """Some row is greedy: its argmax is taken (a full pass over the logits, skipped when
    no row needs it)."""

    @property
    def is_argmax_only(self) -> bool:
        """Every row greedy with nothing else reading the logits: an argmax, which gives
        the same token in the model's dtype as in float32 (the upcast is exact)."""
        return self.all_greedy and self.max_num_logprobs is None and self.processing is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
        output_token_ids: Sequence[list[int]] | None = None,
        prompt_token_ids: Sequence[list[int]] | None = None,
        eos_token_ids: Sequence[Sequence[int]] | None = None,
        return_sampling_mask: bool = False,
    ) -> SamplingMetadata:
        """Gather the rows' settings into device tensors.

        Args:
            params: One SamplingParams per row.
            generators: Row → generator of seeded rows.
            vocab_size: Logits width.
            device: Where the tensors go.
            output_token_ids: Per row, the tokens generated so far (penalties, bad words,
                min_tokens); None means none yet.
            prompt_token_ids: Per row, the prompt (repetition penalty).
            eos_token_ids: Per row, the end-of-generation ids banned below min_tokens.
            return_sampling_mask: See `SamplingMetadata.return_sampling_mask`.
        """
        greedy = [p.is_greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        use_top_k = any(0 < p.top_k < vocab_size for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(greedy)
        if all_greedy:  # filled on the device: nothing to copy
            temperature_t = torch.ones(len(params), dtype=torch.float32, device=device)
            greedy_t = torch.ones(len(params), dtype=torch.bool, device=device)
        else:
            temperature_t = _to_device(temperature, torch.float32, device)
            greedy_t = _to_device(greedy, torch.bool, device)
        tensor = functools.partial(_to_device, device=device)

        return cls(
            temperature=temperature_t,
            greedy=greedy_t,
            all_greedy=all_greedy,
            top_k=tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
            if use_top_k
            else None,
            top_p=tensor([p.top_p for p in params], torch.float32) if use_top_p else None,
            min_p=tensor([p.min_p for p in params], torch.float32) if use_min_p else None,
            generators=generators,
            max_num_logprobs=max(wanted) if wanted else None,
            processing=_build_processing(
                params, vocab_size, device, output_token_ids, prompt_token_ids, eos_token_ids
            ),
            return_sampling_mask=return_sampling_mask,
            any_greedy=any(greedy),
        )


def _uses_processing(p: SamplingParams, num_outputs: int) -> bool:
    return (
        p.has_penalties
        or bool(p.logit_bias)
        or p.allowed_token_ids is not None
        or bool(p.bad_words)
        or num_outputs < p.min_tokens
    )


def _build_processing(
    params: list[SamplingParams],
    vocab_size: int,
    device: torch.device,
    output_token_ids: Sequence[list[int]] | None,
    prompt_token_ids: Sequence[list[int]] | None,
    eos_token_ids: Sequence[Sequence[int]] | None,
) -> LogitsProcessing | None:
    """The logits-processing tensors of a step; None (and no work) when no row needs them."""
    outputs: Sequence[list[int]] = output_token_ids or [[] for _ in params]
    if not any(_uses_processing(p, len(o)) for p, o in zip(params, outputs, strict=True)):
        return None
    prompts: Sequence[list[int]] = prompt_token_ids or [[] for _ in params]
    eos_ids: Sequence[Sequence[int]] = eos_token_ids or [()] * len(params)
    tensor = functools.partial(_to_device, device=device)

    proc = LogitsProcessing()
    pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
    if pen_rows:
        proc.penalty_rows = tensor(pen_rows, torch.int64)
        proc.output_token_ids = tensor(
            _pad([outputs[i] for i in pen_rows], vocab_size), torch.int64
        )
        if any(params[i].repetition_penalty != 1.0 for i in pen_rows):
            proc.prompt_token_ids = tensor(
                _pad([prompts[i] for i in pen_rows], vocab_size), torch.int64
            )
        proc.repetition_penalty = tensor(
            [params[i].repetition_penalty for i in pen_rows], torch.float32
        )
        proc.frequency_penalty = tensor(
            [params[i].frequency_penalty for i in pen_rows], torch.float32
        )
        proc.presence_penalty = tensor(
            [params[i].presence_penalty for i in pen_rows], torch.float32
        )

    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    allowed_rows: list[int] = []
    allowed_local: list[int] = []
    allowed_ids: list[int] = []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row, (p, out) in enumerate(zip(params, outputs, strict=True)):
        if p.logit_bias:
            bias_rows += [row] * len(p.logit_bias)
            bias_ids += p.logit_bias.keys()
            bias_values += p.logit_bias.values()
        if p.allowed_token_ids is not None:
            allowed_local += [len(allowed_rows)] * len(p.allowed_token_ids)
            allowed_ids += p.allowed_token_ids
            allowed_rows.append(row)
        if p.bad_words:
            if not p.bad_words_token_ids:
                raise RuntimeError(
                    "bad_words were not tokenized: call SamplingParams.resolve_bad_words("
                    "tokenizer) before the request enters the engine"
                )
            for token_id in _completing_bad_tokens(p.bad_words_token_ids, out):
                banned_rows.append(row)
                banned_ids.append(token_id)
        if len(out) < p.min_tokens:
            stop_ids = [*(p.stop_token_ids or []), *eos_ids[row]]
            banned_rows += [row] * len(stop_ids)
            banned_ids += stop_ids
    if bias_rows:
        proc.bias_index = (tensor(bias_rows, torch.int64), tensor(bias_ids, torch.int64))
        proc.bias_values = tensor(bias_values, torch.float32)
    if allowed_rows:
        proc.allowed_rows = tensor(allowed_rows, torch.int64)
        proc.allowed_index = (tensor(allowed_local, torch.int64), tensor(allowed_ids, torch.int64))
    # A token outside the logits (a tokenizer's added token, say) can never be generated.
    banned = [(r, t) for r, t in zip(banned_rows, banned_ids, strict=True) if t < vocab_size]
    if banned:
        proc.banned_index = (
            tensor([r for r, _ in banned], torch.int64),
            tensor([t for _, t in banned], torch.int64),
        )
    return proc


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting: staged in pinned memory on CUDA, so
    the copy is asynchronous."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _pad(rows: list[list[int]], pad_id: int) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0) or 1
    return [r + [pad_id] * (width - len(r)) for r in rows]


def _completing_bad_tokens(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end `output` (one-token words always)."""
    banned = []
    for ids in bad_words:
        prefix_len = len(ids) - 1
        if prefix_len > len(output):
            continue
        if prefix_len == 0 or output[-prefix_len:] == ids[:-1]:
            banned.append(ids[-1])
    return banned


def apply_logits_processing(logits: torch.Tensor, proc: LogitsProcessing) -> torch.Tensor:
    """Apply penalties, bias, allowed tokens and bans in place.

    Args:
        logits: `[num_rows, vocab_size]` float32, modified in place.
        proc: The step's tensors (see LogitsProcessing).

    Returns:
        `logits`.
    """
    vocab = logits.shape[-1]
    if proc.penalty_rows is not None:
        rows = proc.penalty_rows
        sub = logits[rows]  # [num_pen, vocab]
        counts = _bin_counts(proc.output_token_ids, vocab)  # [num_pen, vocab] int32
        output_mask = counts > 0
        if proc.prompt_token_ids is not None:
            seen = output_mask | (_bin_counts(proc.prompt_token_ids, vocab) > 0)
            penalty = torch.where(seen, proc.repetition_penalty[:, None], 1.0)
            sub = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = sub - proc.frequency_penalty[:, None] * counts
        sub = sub - proc.presence_penalty[:, None] * output_mask
        logits.index_copy_(0, rows, sub)
    if proc.bias_index is not None:
        logits.index_put_(proc.bias_index, proc.bias_values, accumulate=True)
    if proc.allowed_rows is not None:
        disallowed = torch.ones(
            (len(proc.allowed_rows), vocab), dtype=torch.bool, device=logits.device
        )
        disallowed[proc.allowed_index] = False
        sub = logits[proc.allowed_rows].masked_fill_(disallowed, float("-inf"))
        logits.index_copy_(0, proc.allowed_rows, sub)
    if proc.banned_index is not None:
        logits.index_put_(proc.banned_index, logits.new_full((), float("-inf")))
    return logits


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[rows, len]` ids padded with `vocab_size` → `[rows, vocab_size]` int32 occurrence
    counts (the padding lands in an extra column, dropped)."""
    counts = torch.zeros(
        (token_ids.shape[0], vocab_size + 1), dtype=torch.int32, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    sampled_logprobs: torch.Tensor | None  # [num_rows] float32
    sampled_ranks: torch.Tensor | None  # [num_rows] int64, 1 = most likely
    topk_token_ids: torch.Tensor | None  # [num_rows, max_num_logprobs] int64
    topk_logprobs: torch.Tensor | None  # [num_rows, max_num_logprobs] float32
    sampling_mask_bits: torch.Tensor | None = None
    """`[num_rows, ceil(vocab_size / 8)]` uint8: bit `t % 8` (little-endian) of byte `t // 8`
    is set when token `t` survived the filtering (greedy rows: the argmax alone). None when
    no mask was asked for, or when every row is greedy (the mask is then the sampled token)."""


_ARGMAX_CHUNKS = (1024, 768, 512, 384, 256, 128)
"""Chunk widths `row_argmax` cuts a row into (the first that divides the vocabulary)."""


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of a `[rows, vocab]` tensor (the first index of the maximum), in two
    passes for a few rows over a wide vocabulary: each row's reduction otherwise runs as
    one slow pass (timed in docs/performance.md), where chunks of the row
    reduce side by side and a second argmax picks the first chunk holding the maximum."""
    rows, width = x.shape
    chunk = next((c for c in _ARGMAX_CHUNKS if width % c == 0), 0)
    if rows > 8 or width < 16 * 1024 or not chunk or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    parts = x.reshape(rows, width // chunk, chunk)
    local = parts.argmax(dim=-1)  # [rows, chunks]: the first maximum of each chunk
    best = parts.gather(-1, local[..., None])[..., 0].argmax(dim=-1)  # its first chunk
    return best * chunk + local.gather(-1, best[:, None])[:, 0]


class Sampler:
    """Turns logits into next tokens for a whole batch.

    Args:
        generator: The engine's generator, used for rows without their own seed.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """`logits`: `[num_rows, vocab_size]` float32 (left unchanged); the model's dtype
        is enough when `meta.is_argmax_only`."""
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        )
        if meta.processing is not None:
            logits = apply_logits_processing(logits.clone(), meta.processing)
        # Each pass over the `[num_rows, vocab]` logits runs only when a row needs it: the
        # argmax for greedy rows, the surviving-token mask for `return_sampling_mask`.
        keep = None
        if meta.all_greedy:
            sampled = row_argmax(logits)
        else:
            probs, keep = self.filtered_probs(logits, meta, meta.return_sampling_mask)
            sampled = self._race(probs, meta)
            if meta.any_greedy:
                greedy_ids = row_argmax(logits)
                sampled = torch.where(meta.greedy, greedy_ids, sampled)
                if keep is not None:
                    one_hot = torch.zeros_like(keep).scatter_(1, greedy_ids[:, None], True)
                    keep = torch.where(meta.greedy[:, None], one_hot, keep)
        out = SamplerOutput(sampled, None, None, None, None)
        if keep is not None:
            out.sampling_mask_bits = _pack_bits(keep)
        if raw_logprobs is not None:
            (
                out.sampled_logprobs,
                out.sampled_ranks,
                out.topk_token_ids,
                out.topk_logprobs,
            ) = chosen_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return out

    @staticmethod
    def filtered_probs(
        logits: torch.Tensor, meta: SamplingMetadata, with_keep: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The distribution to sample from, and the mask of tokens that survive filtering
        (`[num_rows, vocab_size]` each; the mask only `with_keep`, else None)."""
        logits = logits / meta.temperature[:, None]
        if meta.top_k is not None or meta.top_p is not None:
            logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        keep = logits > float("-inf") if with_keep else None
        if meta.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p[:, None]
            below = probs < threshold
            probs = probs.masked_fill(below, 0.0)
            if keep is not None:
                keep &= ~below
        return probs, keep

    def _race(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        q = torch.empty_like(probs)
        if len(meta.generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        return probs.div(q).argmax(dim=-1)


def chosen_logprobs(
    raw_logprobs: torch.Tensor,  # [num_rows, vocab]
    token_ids: torch.Tensor,  # [num_rows]
    max_num_logprobs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each row's chosen token: its logprob, its rank among all tokens (1 = most likely),
    and the row's top `max_num_logprobs` ids and logprobs (None when 0)."""
    logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (raw_logprobs > logprobs[:, None]).sum(-1) + 1
    if not max_num_logprobs:
        return logprobs, ranks, None, None
    top = raw_logprobs.topk(max_num_logprobs, dim=-1)
    return logprobs, ranks, top.indices, top.values


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """`[rows, n]` bool → `[rows, ceil(n / 8)]` uint8, little-endian bit order (eight
    times less to copy to the host than the bool mask)."""
    rows, n = mask.shape
    pad = -n % 8
    if pad:
        mask = torch.cat([mask, mask.new_zeros((rows, pad))], dim=1)
    # 1, 2, 4, ..., 128, made on the device (no host copy)
    weights = torch.pow(2, torch.arange(8, device=mask.device)).to(torch.uint8)
    return (mask.view(rows, -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def unpack_sampling_masks(bits: np.ndarray, vocab_size: int) -> list[list[int]]:
    """`_pack_bits`'s output on the host → each row's sorted surviving token ids."""
    rows = np.unpackbits(bits, axis=1, bitorder="little")
    return [np.flatnonzero(row[:vocab_size]).tolist() for row in rows]


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor | None,  # [num_rows]
    top_p: torch.Tensor | None,  # [num_rows]
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (one sort for both)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        rank = torch.arange(vocab, device=logits.device)[None, :]
        remove |= rank >= top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        remove |= mass_before >= top_p[:, None]
        remove[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class RequestGenerators:
    """Each seeded request's own generator on the device, made at its first sample (as in
    vLLM, a request's seed alone decides its draws, whatever else is in the batch).

    Args:
        device: Where the generators draw.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_request: dict[str, torch.Generator] = {}

    def get(self, request_id: str, seed: int | None) -> torch.Generator | None:
        """The request's generator (None without a seed: the engine's generator draws)."""
        if seed is None:
            return None
        gen = self._by_request.get(request_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(seed % 2**64)
            self._by_request[request_id] = gen
        return gen

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the generators of finished requests."""
        for rid in request_ids:
            self._by_request.pop(rid, None)

    def __iter__(self) -> Iterator[str]:
        """The ids of the requests holding a generator."""
        return iter(self._by_request)
