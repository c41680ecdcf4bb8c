"""A step's images on the device: which placeholder tokens of the step each image fills
(`StepImages`, laid out on the host), the vision tower run for the images not encoded yet,
batched across requests, and its outputs kept by content hash (`EncoderCache`).

An image's rows stay cached while a request still has placeholder tokens of it to compute
(a prompt chunked through the image, across steps); once no request needs them they join a
least-recently-used queue bounded in rows, so that a later prompt with the same image
skips the tower. A finished or preempted request lets go of its images (a preempted one
takes them again when it runs, usually from that queue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention.backend import AttentionMetadata, BidirectionalSpans
from ..config import MultiModalConfig
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..host_copy import to_device
from ..models.base import VisionLanguageModel
from ..multimodal.inputs import ImageInput
from ..multimodal.mrope import step_mrope_positions


@dataclass
class StepImages:
    """The image rows of one step, on the host."""

    images: list[ImageInput]
    """The images the step reads, one per content hash, in order of first use."""
    dst_rows: np.ndarray  # [num_image_tokens] int64, the step's token rows they fill
    segments: list[tuple[int, int, int]]
    """Per run of `dst_rows` in order: (index in `images`, first row of its embedding,
    number of rows)."""
    uses: list[tuple[str, int, bool]] = field(default_factory=list)
    """(request id, content hash, whether the step computes the image's last placeholder
    token: the request then needs it no more)."""
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    """(sequence, first position, end position) of each image the step computes
    placeholder tokens of: the spans whose tokens attend both ways, for the models that
    ask for it (`bidirectional_spans`)."""


def step_images(reqs: Sequence[ScheduledRequest], query_start_loc: np.ndarray) -> StepImages | None:
    """Where the placeholder tokens that `reqs` compute in this step take their rows from;
    None when they compute none. A chunk may start or end inside an image: only its rows
    for the chunk's positions are read."""
    images: list[ImageInput] = []
    index_of: dict[int, int] = {}
    dst: list[np.ndarray] = []
    segments: list[tuple[int, int, int]] = []
    uses: list[tuple[str, int, bool]] = []
    spans: list[tuple[int, int, int]] = []
    for i, r in enumerate(reqs):
        if not r.images:
            continue
        start, end = r.start_pos, r.start_pos + len(r.token_ids)
        for image in r.images:
            lo, hi = max(start, image.offset), min(end, image.end)
            if lo >= hi:
                continue
            h = image.content_hash
            if h not in index_of:
                index_of[h] = len(images)
                images.append(image)
            row = int(query_start_loc[i]) + lo - start
            dst.append(np.arange(row, row + hi - lo, dtype=np.int64))
            segments.append((index_of[h], lo - image.offset, hi - lo))
            uses.append((r.request_id, h, hi == image.end))
            spans.append((i, image.offset, image.end))
    if not images:
        return None
    return StepImages(images, np.concatenate(dst), segments, uses, spans)


def bidirectional_spans(
    step: StepImages, query_start_loc: np.ndarray, seq_lens: np.ndarray, device: torch.device
) -> BidirectionalSpans:
    """The step's images as spans whose tokens attend both ways: each query token's key
    end (see `BidirectionalSpans`)."""
    num_tokens = int(query_start_loc[-1])
    query_lens = np.diff(query_start_loc)
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    first_pos = seq_lens - query_lens  # [num_seqs] position of each sequence's first query
    key_end = np.arange(num_tokens) - query_start_loc[seq_of_token] + first_pos[seq_of_token]
    key_end += 1
    for seq, offset, end in step.spans:
        start = int(first_pos[seq])
        lo, hi = max(offset, start), min(end, int(seq_lens[seq]))
        row = int(query_start_loc[seq]) + lo - start
        key_end[row : row + hi - lo] = end
    return BidirectionalSpans(
        spans_host=list(step.spans),
        key_end=to_device(key_end.astype(np.int32), device),
        key_end_host=key_end.tolist(),
    )


class EncoderCache:
    """Vision-tower outputs by content hash, with the requests that still need each.

    Args:
        max_free_rows: Rows kept for images no request needs (least recently used dropped
            first past it); images some request needs are never dropped.
    """

    def __init__(self, max_free_rows: int) -> None:
        self.max_free_rows = max_free_rows
        self.entries: dict[int, torch.Tensor] = {}
        """Content hash → `[num_tokens, hidden_size]` rows."""
        self.users: dict[int, set[str]] = {}
        self.by_request: dict[str, set[int]] = {}
        self.free: OrderedDict[int, None] = OrderedDict()
        """Entries no request needs, least recently used first."""
        self.num_free_rows = 0
        self.num_encoded = 0
        """Images run through the tower, over the cache's lifetime."""

    def __contains__(self, content_hash: int) -> bool:
        return content_hash in self.entries

    def put(self, content_hash: int, rows: torch.Tensor) -> None:
        self.entries[content_hash] = rows
        self.num_encoded += 1
        if not self.users.get(content_hash):
            self._make_free(content_hash)

    def acquire(self, request_id: str, content_hash: int) -> None:
        users = self.users.setdefault(content_hash, set())
        if not users and content_hash in self.free:
            del self.free[content_hash]
            self.num_free_rows -= len(self.entries[content_hash])
        users.add(request_id)
        self.by_request.setdefault(request_id, set()).add(content_hash)

    def release(self, request_id: str, content_hash: int) -> None:
        users = self.users.get(content_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        held = self.by_request.get(request_id)
        if held is not None:
            held.discard(content_hash)
            if not held:
                del self.by_request[request_id]
        if not users:
            del self.users[content_hash]
            if content_hash in self.entries:
                self._make_free(content_hash)

    def forget_requests(self, request_ids: Sequence[str] | set[str]) -> None:
        """The requests need none of their images any more (finished or preempted)."""
        for rid in request_ids:
            for content_hash in list(self.by_request.get(rid, ())):
                self.release(rid, content_hash)

    def clear(self) -> None:
        self.entries.clear()
        self.users.clear()
        self.by_request.clear()
        self.free.clear()
        self.num_free_rows = 0

    def _make_free(self, content_hash: int) -> None:
        self.free[content_hash] = None
        self.free.move_to_end(content_hash)
        self.num_free_rows += len(self.entries[content_hash])
        while self.num_free_rows > self.max_free_rows and self.free:
            oldest, _ = self.free.popitem(last=False)
            self.num_free_rows -= len(self.entries.pop(oldest))


class ImageEmbedder:
    """Turns a step's token ids and images into the language model's input embeddings;
    the runner's part for a vision-language model (its steps' images, their M-RoPE
    positions, the cache's lifetime).

    Args:
        device: The model's device.
        config: The engine's image options (`encoder_cache_rows`: see `EncoderCache`).
    """

    def __init__(self, device: torch.device, config: MultiModalConfig) -> None:
        self.device = device
        self.cache = EncoderCache(config.encoder_cache_rows)
        self._released: list[str] = []
        self.uses_mrope = bool(config.mrope_merge_size)
        """Positions of prompts with images are M-RoPE's (`multimodal/mrope.py`): sliced
        from each request's, three rows in steps with image tokens (eager), one row (token
        index + the prompt's delta past it) in every other step."""

    def forget(self, out: SchedulerOutput, for_other_ranks: bool = False) -> None:
        """Let go of the images of the step's finished and preempted requests; with
        `for_other_ranks` (rank 0 under tensor parallelism), keep their ids for the next
        step the other ranks get (`take_released`)."""
        self.cache.forget_requests(out.finished_request_ids)
        self.cache.forget_requests(out.preempted_request_ids)
        if for_other_ranks:
            self._released += [*out.finished_request_ids, *out.preempted_request_ids]

    def take_released(self) -> tuple[str, ...]:
        """The requests let go of since the last call."""
        released, self._released = tuple(self._released), []
        return released

    def step(
        self,
        reqs: Sequence[ScheduledRequest],
        query_start_loc: np.ndarray,
        starts: np.ndarray,
        positions: np.ndarray,
    ) -> tuple[StepImages | None, np.ndarray, np.ndarray | None]:
        """A step's image rows, its positions (M-RoPE's one row where its model has them)
        and, in steps with image tokens, M-RoPE's three rows (else None)."""
        images = step_images(reqs, query_start_loc)
        if not self.uses_mrope or all(r.mrope_positions is None for r in reqs):
            return images, positions, None
        prompts = [r.mrope_positions for r in reqs]
        positions, rows = step_mrope_positions(
            positions, query_start_loc, starts, prompts, with_rows=images is not None
        )
        return images, positions, rows

    def model_inputs(
        self,
        model: VisionLanguageModel,
        input_ids: torch.Tensor,
        step: StepImages,
        metadata: AttentionMetadata,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
    ) -> dict[str, torch.Tensor]:
        """The model's extra inputs in a step with image rows (`inputs_embeds`), and each
        image's span set in `metadata` where the model's image tokens attend both ways."""
        if model.has_bidirectional_images:
            metadata.bidirectional = bidirectional_spans(
                step, query_start_loc, seq_lens, self.device
            )
        return {"inputs_embeds": self.embed(model, input_ids, step)}

    def embed(
        self, model: VisionLanguageModel, input_ids: torch.Tensor, step: StepImages
    ) -> torch.Tensor:
        """`[num_tokens]` ids → `[num_tokens, hidden_size]` embeddings: the text embedding
        of each token, the image's row at its placeholder tokens (`model`'s tower,
        projector and text embedding; the runner's model of the moment, which a reload
        replaces)."""
        cache = self.cache
        for rid, content_hash, _ in step.uses:  # before encoding: nothing needed is dropped
            cache.acquire(rid, content_hash)
        missing = [image for image in step.images if image.content_hash not in cache]
        for batch in _batches(missing):
            data = {
                key: self._to_device([image.data[key] for image in batch]) for key in batch[0].data
            }
            for image, rows in zip(batch, model.encode_images(data), strict=True):
                if len(rows) != image.length:
                    raise RuntimeError(
                        f"the vision tower gave {len(rows)} rows for an image with "
                        f"{image.length} placeholder tokens"
                    )
                cache.put(image.content_hash, rows)
        embeds = model.embed_input_ids(input_ids)  # [num_tokens, hidden_size]
        rows = torch.cat(
            [
                cache.entries[step.images[i].content_hash][first : first + n]
                for i, first, n in step.segments
            ]
        )
        dst = to_device(step.dst_rows, self.device)
        embeds[dst] = rows.to(embeds.dtype)
        for rid, content_hash, done in step.uses:
            if done:
                cache.release(rid, content_hash)
        return embeds

    def _to_device(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """`parts` concatenated on the device (floating point) or on the host (integers:
        `encode_images` reads grids there); on CUDA through pinned memory, so the host goes
        on while the pixels travel (the caching host allocator keeps each block until its
        copy is done). Parts already pinned (the image workers' answers) go one copy each
        into their rows; others are gathered into one pinned block first."""
        if not parts[0].is_floating_point():
            return torch.cat(parts)
        if self.device.type != "cuda":
            return torch.cat(parts).to(self.device)
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        if all(p.is_pinned() for p in parts):
            out = torch.empty(shape, dtype=parts[0].dtype, device=self.device)
            first = 0
            for p in parts:
                out[first : first + p.shape[0]].copy_(p, non_blocking=True)
                first += p.shape[0]
            return out
        staged = torch.empty(shape, dtype=parts[0].dtype, pin_memory=True)
        torch.cat(parts, out=staged)
        return staged.to(self.device, non_blocking=True)


def _batches(images: list[ImageInput]) -> list[list[ImageInput]]:
    """Images whose tensors can be concatenated (same names, same shapes past dim 0)."""
    groups: dict[tuple, list[ImageInput]] = {}
    for image in images:
        key = tuple((k, tuple(t.shape[1:]), t.dtype) for k, t in sorted(image.data.items()))
        groups.setdefault(key, []).append(image)
    return list(groups.values())
