"""What a prompt's `multi_modal_data` may hold, checked before anything is processed, and
the per-image record (`ImageInput`) a request carries through the engine.

As in vLLM, `multi_modal_data={"image": ...}` holds one image or a list of them; an image
is a PIL image or a numpy array of height × width (× channels) uint8 values. Paths, URLs
and encoded bytes are refused here by name (they are read by the front ends that take
them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidPromptError

MODALITIES = ("image",)
"""The modalities a prompt may carry; vLLM's others (video, audio) are refused by name."""


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a request, prepared by the checkpoint's processor.

    Invariant: the prompt's tokens `[offset, offset + length)` are the image's placeholder
    tokens, and the model's vision tower turns `data` into exactly `length` embedding rows,
    row i standing for the token at `offset + i`.
    """

    data: Mapping[str, torch.Tensor]
    """The processor's tensors for this image alone, each with a leading dimension of 1
    (for LLaVA: `pixel_values` `[1, 3, H, W]`), on the host."""
    offset: int
    """Position of the image's first placeholder token in the prompt."""
    length: int
    """Placeholder tokens (= embedding rows) of the image."""
    content_hash: int
    """64-bit hash of the image's pixels and the processor kwargs that prepared it
    (`processor.content_hash`): equal for the same image prepared the same way, whatever
    the prompt (the vision tower's output cache and the prefix cache's block hashes key on
    it)."""

    @property
    def end(self) -> int:
        """Position just past the image's last placeholder token."""
        return self.offset + self.length


def image_items(data: Any, index: int, limit: int | None) -> list[Any]:
    """The images of a prompt's `multi_modal_data`, each checked (decodable, not empty) and
    as a PIL image or numpy array.

    Raises:
        InvalidPromptError: naming prompt `index`: not a dict, another modality, more
            images than `limit`, or an image that cannot be read.
    """
    where = f"prompts[{index}]['multi_modal_data']"
    if not isinstance(data, Mapping):
        raise InvalidPromptError(
            f"{where} is a {type(data).__name__}; pass a dict such as {{'image': image}}"
        )
    other = [k for k in data if k not in MODALITIES]
    if other:
        raise InvalidPromptError(
            f"{where} has the modality {other[0]!r}; only 'image' inputs are supported "
            "(a PIL image, a numpy HWC uint8 array, or a list of them)"
        )
    value = data.get("image")
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if limit is not None and len(items) > limit:
        raise InvalidPromptError(
            f"{where} has {len(items)} images, more than limit_mm_per_prompt={{'image': "
            f"{limit}}} allows; pass fewer, or build the LLM with a larger limit (At most "
            f"{limit} image(s) may be provided in one prompt.)"
        )
    return [
        checked_image(item, f"{where}['image']" + (f"[{i}]" if len(items) > 1 else ""))
        for i, item in enumerate(items)
    ]


def checked_image(item: Any, where: str) -> Any:
    """`item` itself when it is a readable, non-empty PIL image or numpy image array.

    Raises:
        InvalidPromptError: starting with `where`: not an image, empty, undecodable, or an
            array of another shape or dtype.
    """
    from PIL import Image

    if isinstance(item, Image.Image):
        if item.width == 0 or item.height == 0:
            raise InvalidPromptError(f"{where} is an empty image ({item.width}x{item.height})")
        try:
            item.load()  # a truncated or corrupt file fails here, not inside the processor
        except Exception as e:
            raise InvalidPromptError(f"{where} cannot be decoded: {e}") from None
        return item
    if isinstance(item, np.ndarray):
        shape = item.shape
        if item.ndim not in (2, 3) or (item.ndim == 3 and shape[2] not in (1, 3, 4)):
            raise InvalidPromptError(
                f"{where} is a numpy array of shape {shape}; an image array is height × "
                "width × channels (1, 3 or 4 channels) or height × width"
            )
        if item.dtype != np.uint8:
            raise InvalidPromptError(
                f"{where} is a numpy array of {item.dtype}; pass uint8 pixel values (0-255)"
            )
        if 0 in shape:
            raise InvalidPromptError(f"{where} is an empty image (shape {shape})")
        return item
    kind = type(item).__name__
    hint = ""
    if isinstance(item, (bytes, bytearray, str)):
        hint = " (decode it first, e.g. PIL.Image.open(io.BytesIO(data)) or Image.open(path))"
    raise InvalidPromptError(
        f"{where} is a {kind}, not an image; pass a PIL image or a numpy HWC uint8 array{hint}"
    )
