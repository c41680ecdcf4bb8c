"""Batched sampling on the device, with no host sync per request.

Order: temperature → top-k → top-p → min-p → sample. Sampling uses the exponential race
(`argmax(probs / q)` with `q ~ Exp(1)`), which draws exactly from `probs`; a seeded request
draws its `q` from its own generator, so its tokens do not depend on the rest of the batch.
Logprobs are those of the raw model output (before temperature and truncation), as vLLM
reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams


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

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        greedy = [p.is_greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        use_top_k = any(0 < p.top_k < vocab_size for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        wanted = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=tensor(temperature, torch.float32),
            greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
            if use_top_k
            else None,
            top_p=tensor([p.top_p for p in params], torch.float32) if use_top_p else None,
            min_p=tensor([p.min_p for p in params], torch.float32) if use_min_p else None,
            generators=generators,
            max_num_logprobs=max(wanted) if wanted else None,
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    sampled_logprobs: torch.Tensor | None  # [num_rows] float32
    sampled_ranks: torch.Tensor | None  # [num_rows] int64, 1 = most likely
    topk_token_ids: torch.Tensor | None  # [num_rows, max_num_logprobs] int64
    topk_logprobs: torch.Tensor | None  # [num_rows, max_num_logprobs] float32


class Sampler:
    """Turns logits into next tokens for a whole batch.

    Args:
        generator: The engine's generator, used for rows without their own seed.
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """`logits`: `[num_rows, vocab_size]` float32."""
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        )
        greedy_ids = logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy_ids
        else:
            probs = self._probs(logits, meta)
            sampled = torch.where(meta.greedy, greedy_ids, self._race(probs, meta))
        out = SamplerOutput(sampled, None, None, None, None)
        if raw_logprobs is not None:
            out.sampled_logprobs = raw_logprobs.gather(1, sampled[:, None]).squeeze(1)
            out.sampled_ranks = (raw_logprobs > out.sampled_logprobs[:, None]).sum(-1) + 1
            if meta.max_num_logprobs:
                top = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)
                out.topk_logprobs, out.topk_token_ids = top.values, top.indices
        return out

    @staticmethod
    def _probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits / meta.temperature[:, None]
        if meta.top_k is not None or meta.top_p is not None:
            logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _race(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        q = torch.empty_like(probs)
        if len(meta.generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            q[row].exponential_(generator=gen)
        return probs.div(q).argmax(dim=-1)


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
