"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): each token of a prompt with images has three
positions (temporal, height, width), computed once on the host when the prompt is prepared;
the model runner slices them per step.

As transformers' `get_rope_index` lays them out: a run of text tokens continues one past the
largest position so far, in all three rows; an image's placeholder tokens, row-major over its
merged grid `(t, h, w)`, take `start + (t_index, h_index, w_index)`, and the text after it
starts at `start + max(h, w)`. Tokens past the prompt (generated ones) sit at their index
plus the prompt's `delta` (largest position + 1 - prompt length) in all three rows, so a
decode step needs one row of positions, like a text model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .inputs import ImageInput


@dataclass(frozen=True, eq=False)
class MRopePositions:
    """A prompt's M-RoPE positions."""

    positions: np.ndarray  # [3, prompt_len] int64
    delta: int
    """Position minus token index of every token past the prompt."""

    @property
    def prompt_len(self) -> int:
        return self.positions.shape[1]


def image_grid(image: ImageInput, spatial_merge_size: int) -> tuple[int, int, int]:
    """The image's placeholder grid `(t, h, w)`: its patch grid (`image_grid_thw`) with
    height and width merged `spatial_merge_size`-fold by the tower."""
    t, h, w = (int(v) for v in image.data["image_grid_thw"].reshape(3).tolist())
    return t, h // spatial_merge_size, w // spatial_merge_size


def mrope_positions(
    num_tokens: int, images: Sequence[ImageInput], spatial_merge_size: int
) -> MRopePositions:
    """M-RoPE positions of a prompt of `num_tokens` tokens whose images (by offset) cover
    their placeholder ranges."""
    positions = np.empty((3, num_tokens), np.int64)
    next_pos = 0  # one past the largest position so far
    done = 0  # tokens laid out
    for image in sorted(images, key=lambda im: im.offset):
        text_len = image.offset - done
        positions[:, done : image.offset] = np.arange(next_pos, next_pos + text_len)
        next_pos += text_len
        t, h, w = image_grid(image, spatial_merge_size)
        if t * h * w != image.length:
            raise ValueError(
                f"an image's grid {t}x{h}x{w} does not match its {image.length} placeholder tokens"
            )
        grid = np.indices((t, h, w)).reshape(3, -1)  # [3, t * h * w], row-major
        positions[:, image.offset : image.end] = grid + next_pos
        next_pos += max(h, w)
        done = image.end
    positions[:, done:] = np.arange(next_pos, next_pos + num_tokens - done)
    largest = int(positions.max()) if num_tokens else -1
    return MRopePositions(positions, largest + 1 - num_tokens)


def step_mrope_positions(
    positions: np.ndarray,
    query_start_loc: np.ndarray,
    starts: np.ndarray,
    prompts: Sequence[MRopePositions | None],
    with_rows: bool,
) -> tuple[np.ndarray, np.ndarray | None]:
    """A step's positions for an M-RoPE model, from its token indices.

    Args:
        positions: `[num_tokens]` each token's index in its sequence.
        query_start_loc: `[num_seqs + 1]` the step's first row of each sequence.
        starts: `[num_seqs]` the index of each sequence's first token in the step.
        prompts: Each sequence's prompt positions (None: a text prompt, whose positions
            are its token indices).
        with_rows: Also return the three rows (the step computes image tokens, whose rows
            differ).

    Returns:
        `[num_tokens]` the positions as one row (exact where the three rows are equal: every
        token but an image's), and `[3, num_tokens]` the three rows (None unless
        `with_rows`).
    """
    one_row = positions.copy()
    rows = np.broadcast_to(positions, (3, len(positions))).copy() if with_rows else None
    for i, prompt in enumerate(prompts):
        if prompt is None:
            continue
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        start, end = int(starts[i]), int(starts[i]) + hi - lo
        in_prompt = max(min(end, prompt.prompt_len) - start, 0)  # leading tokens of the prompt
        one_row[lo + in_prompt : hi] += prompt.delta
        if in_prompt:
            one_row[lo : lo + in_prompt] = prompt.positions[0, start : start + in_prompt]
        if rows is not None:
            rows[:, lo + in_prompt : hi] += prompt.delta
            if in_prompt:
                rows[:, lo : lo + in_prompt] = prompt.positions[:, start : start + in_prompt]
    return one_row, rows
