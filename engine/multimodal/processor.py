"""The checkpoint's Hugging Face processor on the host: a prompt with images becomes token
ids with each image's placeholder tokens expanded, and one `ImageInput` per image (its
prepared tensors, placeholder range and content hash).

Processors that pack the patches of all images into one tensor (Qwen2-VL's `pixel_values`
`[num_patches, patch_dim]`, with `image_grid_thw` `[num_images, 3]`) are split by each
image's `t * h * w` patch rows.

Text prompts go through the processor whole (it tokenizes them, expands each image token
and prepares the pixels). Token-id prompts hold each image either as one image token,
expanded here, or already expanded; each image then goes through the processor alone
(with only its image token as text) for its tensors and its number of placeholder tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import InvalidPromptError, UnsupportedModelError
from .inputs import ImageInput

_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


class ProcessedPrompt(NamedTuple):
    prompt_token_ids: list[int]
    images: tuple[ImageInput, ...]


def content_hash(image: Any, kwargs: Mapping[str, Any]) -> int:
    """64-bit hash of an image's pixels (a PIL image or a numpy array: the same pixels hash
    the same either way) and of the processor kwargs that prepare it. The processor is
    deterministic, so equal hashes mean equal prepared tensors; hashing its input rather
    than its output reads several times fewer bytes (a 640×480 image is 0.9 MB, Qwen2-VL's
    patches of it 7 MB)."""
    pixels = np.ascontiguousarray(np.asarray(image))
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{pixels.dtype}:{pixels.shape}".encode())
    h.update(pixels.reshape(-1).view(np.uint8).data)
    h.update(json.dumps(dict(kwargs), sort_keys=True, default=repr).encode())
    return int.from_bytes(h.digest(), "little")


def placeholder_ranges(
    token_ids: Sequence[int], image_token_id: int, lengths: Sequence[int]
) -> list[tuple[int, int]] | None:
    """`(offset, length)` of each image's placeholder tokens, the i-th image taking the
    next `lengths[i]` image tokens, which must be contiguous; None when the image tokens
    are not exactly that."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != sum(lengths):
        return None
    ranges, start = [], 0
    for length in lengths:
        first = positions[start]
        if positions[start + length - 1] != first + length - 1:
            return None  # the image's tokens are not one run
        ranges.append((first, length))
        start += length
    return ranges


class ImagePromptProcessor:
    """Prepares the prompts with images of one model (its processor loaded on first use).

    Args:
        path: The checkpoint folder (its processor files: `processor_config.json`,
            `preprocessor_config.json`, the tokenizer).
        image_token_id: The placeholder token id of config.json (`image_token_index`).
        default_kwargs: `LLM(mm_processor_kwargs=...)`, under each prompt's own.
        pixel_dtype: The model's dtype: `pixel_values` are cast to it here, as every
            vision tower's first step casts them (the same rounding, on the host: half the
            bytes to hold and to copy in bfloat16). None: as the processor makes them.
    """

    def __init__(
        self,
        path: str,
        image_token_id: int,
        default_kwargs: Mapping[str, Any] | None = None,
        pixel_dtype: torch.dtype | None = None,
    ) -> None:
        self.path = path
        self.image_token_id = image_token_id
        self.default_kwargs = dict(default_kwargs or {})
        self.pixel_dtype = pixel_dtype
        self._processor: Any = None

    @property
    def processor(self) -> Any:
        if self._processor is None:
            from transformers import AutoProcessor

            try:
                self._processor = AutoProcessor.from_pretrained(self.path, local_files_only=True)
            except ImportError:
                # Qwen2-VL's processor also builds a video processor, which needs torchvision;
                # images alone do not.
                self._processor = GridImageProcessor.load(self.path)
            except Exception as e:
                raise UnsupportedModelError(
                    f"cannot load the image processor of {self.path} ({e}); the folder needs "
                    "its processor files (processor_config.json, preprocessor_config.json) "
                    "as the model's save_pretrained / the processor's save_pretrained write them"
                ) from None
            if getattr(self._processor, "image_processor", None) is None:
                raise UnsupportedModelError(
                    f"{Path(self.path).name}: AutoProcessor loads a "
                    f"{type(self._processor).__name__}, which prepares no images; add the "
                    "checkpoint's processor files"
                )
        return self._processor

    @property
    def image_token(self) -> str:
        """The placeholder's text (`<image>` for LLaVA)."""
        return self.processor.image_token

    def merged_kwargs(self, prompt_kwargs: Mapping[str, Any] | None, index: int) -> dict:
        """The engine's `mm_processor_kwargs` updated with the prompt's."""
        if prompt_kwargs is None:
            return dict(self.default_kwargs)
        if not isinstance(prompt_kwargs, Mapping):
            raise InvalidPromptError(
                f"prompts[{index}]['mm_processor_kwargs'] is a {type(prompt_kwargs).__name__}; "
                "pass a dict of the processor's keyword arguments"
            )
        return {**self.default_kwargs, **prompt_kwargs}

    def process_text(
        self, index: int, text: str, images: list[Any], kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        """Tokenize `text`, expand its image tokens and prepare `images` in one call."""
        token = self.image_token
        num_placeholders = text.count(token)
        if num_placeholders != len(images):
            raise InvalidPromptError(
                f"prompts[{index}] has {num_placeholders} image placeholder(s) {token!r} for "
                f"{len(images)} image(s); put one {token!r} in the text where each image goes"
            )
        out = self._call(index, kwargs, text=[text], images=images)
        ids = [int(t) for t in out["input_ids"][0]]
        per_image = self._split(index, out, len(images))
        runs = _runs(ids, self.image_token_id)
        if len(runs) == len(images):
            lengths = [length for _, length in runs]
        else:  # adjacent images make one run: as many tokens each
            lengths = [sum(r[1] for r in runs) // max(len(images), 1)] * len(images)
        ranges = placeholder_ranges(ids, self.image_token_id, lengths)
        if ranges is None:
            raise InvalidPromptError(
                f"prompts[{index}]: the processor's image tokens cannot be assigned to its "
                f"{len(images)} image(s)"
            )
        return ProcessedPrompt(ids, self._inputs(images, per_image, ranges, kwargs))

    def process_tokens(
        self, index: int, token_ids: list[int], images: list[Any], kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        """Prepare `images` one by one; expand the prompt's image tokens (one per image)
        or check them (already expanded)."""
        per_image, lengths = [], []
        for image in images:
            out = self._call(index, kwargs, text=[self.image_token], images=[image])
            per_image.extend(self._split(index, out, 1))
            lengths.append(sum(1 for t in out["input_ids"][0] if int(t) == self.image_token_id))
        num_tokens = token_ids.count(self.image_token_id)
        if num_tokens == len(images) and lengths != [1] * len(images):
            expanded: list[int] = []
            lengths_left = iter(lengths)
            for t in token_ids:
                expanded.extend([t] * next(lengths_left) if t == self.image_token_id else [t])
            token_ids = expanded
        ranges = placeholder_ranges(token_ids, self.image_token_id, lengths)
        if ranges is None:
            raise InvalidPromptError(
                f"prompts[{index}] has {num_tokens} image token(s) (id {self.image_token_id}) "
                f"for {len(images)} image(s); give one image token per image, or each "
                f"image's {lengths} tokens expanded in one run"
            )
        return ProcessedPrompt(token_ids, self._inputs(images, per_image, ranges, kwargs))

    def _call(self, index: int, kwargs: Mapping[str, Any], **inputs: Any) -> Mapping[str, Any]:
        try:
            return self.processor(**inputs, return_tensors="pt", **kwargs)
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise InvalidPromptError(
                f"prompts[{index}]: the model's processor refused its images or "
                f"mm_processor_kwargs={dict(kwargs)!r:.120}: {e}"
            ) from None

    def _split(
        self, index: int, out: Mapping[str, Any], num_images: int
    ) -> list[dict[str, torch.Tensor]]:
        """The processor's image tensors, one dict per image (leading dimension 1, or the
        image's patch rows of a tensor that packs them)."""
        per_image: list[dict[str, torch.Tensor]] = [{} for _ in range(num_images)]
        grids = out.get("image_grid_thw")
        patch_rows = grids.prod(-1).tolist() if isinstance(grids, torch.Tensor) else None
        for key, value in out.items():
            if key in _TEXT_KEYS:
                continue
            if key == "pixel_values" and self.pixel_dtype is not None:
                value = value.to(self.pixel_dtype)
            if (
                patch_rows is not None
                and isinstance(value, torch.Tensor)
                and value.shape[:1] == (sum(patch_rows),)
                and key != "image_grid_thw"
            ):
                for i, rows in enumerate(value.split(patch_rows)):
                    per_image[i][key] = rows
                continue
            if not isinstance(value, torch.Tensor) or value.shape[:1] != (num_images,):
                raise InvalidPromptError(
                    f"prompts[{index}]: the processor's {key!r} is not one tensor row per "
                    f"image ({getattr(value, 'shape', type(value).__name__)} for {num_images})"
                )
            for i in range(num_images):
                per_image[i][key] = value[i : i + 1]
        return per_image

    @staticmethod
    def _inputs(
        images: list[Any],
        per_image: list[dict[str, torch.Tensor]],
        ranges: list[tuple[int, int]],
        kwargs: Mapping[str, Any],
    ) -> tuple[ImageInput, ...]:
        return tuple(
            ImageInput(data, offset, length, content_hash(image, kwargs))
            for image, data, (offset, length) in zip(images, per_image, ranges, strict=True)
        )


def _runs(token_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """`(start, length)` of each run of `token_id`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(token_ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class GridImageProcessor:
    """A grid processor's image part and tokenizer, called as its processor is for images:
    each image token of the text becomes `t * h * w / merge_size**2` of them (its merged
    patch grid, `image_grid_thw`), as Qwen2-VL's processor expands it."""

    def __init__(self, image_processor: Any, tokenizer: Any, image_token: str) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = image_token

    @classmethod
    def load(cls, path: str) -> GridImageProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        if not hasattr(image_processor, "merge_size"):
            raise UnsupportedModelError(
                f"{Path(path).name}: the processor cannot be loaded and its image processor "
                f"({type(image_processor).__name__}) has no patch grid to expand placeholders "
                "by; install the processor's dependencies (torchvision)"
            )
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(image_processor, tokenizer, getattr(tokenizer, "image_token", "<|image_pad|>"))

    def __call__(
        self, text: list[str], images: list[Any], return_tensors: str = "pt", **kwargs: Any
    ) -> dict[str, Any]:
        out = dict(self.image_processor(images, return_tensors=return_tensors, **kwargs))
        merge = kwargs.get("merge_size") or self.image_processor.merge_size
        counts = iter((out["image_grid_thw"].prod(-1) // merge**2).tolist())
        expanded = []
        for t in text:
            parts = t.split(self.image_token)
            pieces = [parts[0]]
            for part in parts[1:]:
                pieces += [self.image_token * next(counts), part]
            expanded.append("".join(pieces))
        out["input_ids"] = self.tokenizer(expanded, return_tensors=return_tensors)["input_ids"]
        return out
