"""Many tokenized inputs of a pooling call back to back (`PackedInputs`): one flat id
array and offsets, no Python object per input; the runner packs its batches from it with
one gather."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class PoolingInput:
    """One tokenized input."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


@dataclass(slots=True)
class PackedInputs:
    """Many tokenized inputs back to back, with no Python object per input.

    Input i is `token_ids[offsets[i]:offsets[i + 1]]`. Ids arrive this way from the
    tokenizer worker processes, and the runner packs its batches from here with one gather.
    """

    token_ids: np.ndarray
    """[num_tokens] int32 or int64."""
    offsets: np.ndarray
    """[num_inputs + 1] int64, from 0 to num_tokens."""
    token_type_ids: np.ndarray | None = None
    """[num_tokens] int64 segment ids (pairs of a cross-encoder), or None for all zeros."""
    lists: list[list[int]] | None = None
    """The same ids as one list per input, where they were made that way (the in-process
    tokenizer, token-id prompts): outputs reuse them instead of slicing `token_ids`."""
    pool_start: np.ndarray | None = None
    """[num_inputs] int64: tokens at the start of each input that mean pooling leaves out
    (a sentence-transformers prompt with `include_prompt: false`); None: none."""

    @classmethod
    def from_lens(cls, token_ids: np.ndarray, lens: np.ndarray) -> PackedInputs:
        """Flat ids and the number of ids of each input."""
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return cls(token_ids, offsets)

    @classmethod
    def from_lists(
        cls, ids: list[list[int]], types: list[list[int] | None] | None = None
    ) -> PackedInputs:
        """One list of ids (and optionally of segment ids) per input."""
        lens = np.fromiter(map(len, ids), np.int64, len(ids))
        packed = cls.from_lens(
            np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lens.sum())), lens
        )
        packed.lists = ids
        if types is not None and any(t is not None for t in types):
            packed.token_type_ids = np.fromiter(
                itertools.chain.from_iterable(
                    t if t is not None else [0] * len(x) for x, t in zip(ids, types, strict=True)
                ),
                np.int64,
                len(packed.token_ids),
            )
        return packed

    @classmethod
    def of(cls, inputs: PackedInputs | Sequence[PoolingInput]) -> PackedInputs:
        if isinstance(inputs, PackedInputs):
            return inputs
        return cls.from_lists([x.token_ids for x in inputs], [x.token_type_ids for x in inputs])

    @classmethod
    def concat(cls, parts: Sequence[PackedInputs]) -> PackedInputs:
        """The inputs of `parts`, in order."""
        if len(parts) == 1:
            return parts[0]
        bases = np.cumsum([0] + [len(p.token_ids) for p in parts[:-1]])  # tokens before each
        offsets = np.concatenate(
            [np.zeros(1, np.int64)]
            + [p.offsets[1:] + base for p, base in zip(parts, bases, strict=True)]
        )
        types = None
        if any(p.token_type_ids is not None for p in parts):
            types = np.concatenate(
                [
                    p.token_type_ids
                    if p.token_type_ids is not None
                    else np.zeros(len(p.token_ids), np.int64)
                    for p in parts
                ]
            )
        lists = None
        if all(p.lists is not None for p in parts):
            lists = list(itertools.chain.from_iterable(p.lists for p in parts))  # type: ignore[arg-type]
        ids = np.concatenate([p.token_ids for p in parts])
        starts = None
        if any(p.pool_start is not None for p in parts):
            starts = np.concatenate(
                [
                    p.pool_start if p.pool_start is not None else np.zeros(len(p), np.int64)
                    for p in parts
                ]
            )
        return cls(ids, offsets, types, lists, starts)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lens(self) -> np.ndarray:
        """[num_inputs] int64: the number of ids of each input."""
        return np.diff(self.offsets)

    def prompt_token_ids(self) -> list[list[int]] | list[np.ndarray]:
        """Each input's ids for its output: the list where there is one, else a view of
        `token_ids` that the output turns into a list when it is read (most callers of a
        large embed call never read them, and 100k lists cost more than the forward)."""
        if self.lists is not None:
            return self.lists
        ids, bounds = self.token_ids, self.offsets.tolist()
        return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def gather(
        self, rows: np.ndarray, lens: np.ndarray, cu: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The inputs `rows` packed back to back: ids, positions and segment ids, each
        `[num_tokens]` int64, where `lens` are their lengths and `cu` their cumulative ones."""
        num_tokens = int(cu[-1])
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1], lens)
        index = positions + np.repeat(self.offsets[rows], lens)
        ids = self.token_ids[index].astype(np.int64, copy=False)
        types = self.token_type_ids[index] if self.token_type_ids is not None else None
        return ids, positions, types
