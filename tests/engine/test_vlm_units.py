"""Exact tests of the image bookkeeping: placeholder ranges and content hashes."""

from __future__ import annotations

import torch

from batchlm.engine.multimodal.processor import content_hash, placeholder_ranges

IMG = 9


def test_placeholder_ranges():
    ids = [1, IMG, IMG, IMG, 5, IMG, IMG, IMG, 6]
    assert placeholder_ranges(ids, IMG, [3, 3]) == [(1, 3), (5, 3)]
    assert placeholder_ranges(ids[:5] + ids[5:], IMG, [2, 4]) is None  # 2nd not one run
    assert placeholder_ranges(ids, IMG, [3]) is None  # tokens left over
    adjacent = [1, IMG, IMG, IMG, IMG, 2]
    assert placeholder_ranges(adjacent, IMG, [2, 2]) == [(1, 2), (3, 2)]


def test_content_hash_covers_pixels_and_kwargs():
    pixels = {"pixel_values": torch.arange(12, dtype=torch.float32).view(1, 3, 2, 2)}
    same = {"pixel_values": pixels["pixel_values"].clone()}
    other = {"pixel_values": pixels["pixel_values"] + 1e-3}
    assert content_hash(pixels, {}) == content_hash(same, {})
    assert content_hash(pixels, {}) != content_hash(other, {})
    assert content_hash(pixels, {}) != content_hash(pixels, {"do_resize": False})
    assert content_hash(pixels, {"a": 1, "b": 2}) == content_hash(pixels, {"b": 2, "a": 1})
