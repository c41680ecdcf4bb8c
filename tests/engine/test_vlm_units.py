"""Exact tests of the image bookkeeping: placeholder ranges, content hashes, block hashes
with images, a step's image rows under chunking, and the vision-tower output cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from batchlm.engine.core.kv_cache import hash_block, image_keys
from batchlm.engine.core.scheduler import ScheduledRequest
from batchlm.engine.multimodal.inputs import ImageInput
from batchlm.engine.multimodal.processor import content_hash, placeholder_ranges
from batchlm.engine.sampling_params import SamplingParams
from batchlm.engine.worker.encoder_cache import EncoderCache, step_images

IMG = 9


def _image(offset: int, length: int, h: int) -> ImageInput:
    return ImageInput({}, offset, length, h)


def test_placeholder_ranges():
    ids = [1, IMG, IMG, IMG, 5, IMG, IMG, IMG, 6]
    assert placeholder_ranges(ids, IMG, [3, 3]) == [(1, 3), (5, 3)]
    assert placeholder_ranges(ids[:5] + ids[5:], IMG, [2, 4]) is None  # 2nd not one run
    assert placeholder_ranges(ids, IMG, [3]) is None  # tokens left over
    adjacent = [1, IMG, IMG, IMG, IMG, 2]
    assert placeholder_ranges(adjacent, IMG, [2, 2]) == [(1, 2), (3, 2)]


def test_content_hash_covers_pixels_and_kwargs():
    from PIL import Image

    pixels = np.arange(36, dtype=np.uint8).reshape(3, 4, 3)
    same = Image.fromarray(pixels.copy())  # the same pixels as a PIL image
    other = pixels.copy()
    other[2, 3, 1] += 1
    assert content_hash(pixels, {}) == content_hash(same, {})
    assert content_hash(pixels, {}) != content_hash(pixels[:, :3], {})  # another shape
    assert content_hash(pixels, {}) != content_hash(other, {})
    assert content_hash(pixels, {}) != content_hash(pixels, {"do_resize": False})
    assert content_hash(pixels, {"a": 1, "b": 2}) == content_hash(pixels, {"b": 2, "a": 1})


def test_block_hash_with_images():
    tokens = [3, IMG, IMG, IMG]
    plain = hash_block(None, tokens)
    assert hash_block(None, tokens, extra_keys=()) == plain  # text-only hashes unchanged
    a, b = _image(1, 3, 111), _image(1, 3, 222)
    assert image_keys([a], 0, 4) == ((111, 1),)
    assert image_keys([a], 4, 8) == ()
    ha = hash_block(None, tokens, extra_keys=image_keys([a], 0, 4))
    assert ha != plain
    assert ha != hash_block(None, tokens, extra_keys=image_keys([b], 0, 4))
    assert ha == hash_block(None, tokens, extra_keys=image_keys([_image(1, 3, 111)], 0, 4))


def _sched(rid: str, start: int, n: int, images: tuple) -> ScheduledRequest:
    return ScheduledRequest(rid, [0] * n, start, [], False, SamplingParams(), [], images=images)


def test_step_images_cut_by_chunks():
    a, b = _image(2, 4, 111), _image(8, 4, 222)
    # Request x computes positions 4..9 (a's last two rows, b's first two); y the whole of a.
    reqs = [_sched("x", 4, 6, (a, b)), _sched("y", 0, 7, (a,)), _sched("z", 0, 3, ())]
    qsl = np.array([0, 6, 13, 16])
    step = step_images(reqs, qsl)
    assert [i.content_hash for i in step.images] == [111, 222]
    assert step.segments == [(0, 2, 2), (1, 0, 2), (0, 0, 4)]
    assert step.dst_rows.tolist() == [0, 1, 4, 5, 8, 9, 10, 11]
    assert step.uses == [("x", 111, True), ("x", 222, False), ("y", 111, True)]
    assert step_images([reqs[2]], qsl[[0, 3]] - 13) is None


def test_encoder_cache_keeps_needed_rows_and_drops_lru():
    cache = EncoderCache(max_free_rows=5)
    rows = {h: torch.zeros(3, 2) for h in (1, 2, 3)}
    cache.acquire("r", 1)
    cache.put(1, rows[1])
    cache.put(2, rows[2])  # nobody needs it: free at once
    cache.put(3, rows[3])  # 6 free rows > 5: the older free one (2) goes
    assert 1 in cache and 3 in cache and 2 not in cache
    cache.acquire("s", 3)
    cache.forget_requests(["r"])  # 1 becomes free (3 rows)
    assert 1 in cache and cache.num_free_rows == 3
    cache.release("s", 3)  # 6 free rows: the least recently freed (1) goes
    assert 1 not in cache and 3 in cache
    assert cache.by_request == {} and cache.users == {}


def test_tower_mlp_width_padded_at_load_gives_the_same_outputs():
    """Qwen2.5-VL's gated tower MLP (7B: 3,420 wide) is padded to a multiple of 8 units
    once loaded, by `build_model`; zero units change no output."""
    from batchlm.engine.loader.weights import build_model
    from batchlm.engine.models.qwen2_5_vl import GatedVisionMLP

    for act in ("silu", "gelu_pytorch_tanh"):
        torch.manual_seed(0)
        mlp = GatedVisionMLP(32, 44, act)
        for p in mlp.parameters():
            torch.nn.init.normal_(p)
        x = torch.randn(9, 32)
        before = mlp(x)
        mlp.after_loading()
        assert mlp.down_proj.in_features == 48 and mlp.gate_up_proj.output_sizes == [48, 48]
        assert tuple(mlp.gate_up_proj.weight.shape) == (96, 32)
        torch.testing.assert_close(mlp(x), before)
        mlp.after_loading()  # once padded, left alone
        assert mlp.down_proj.in_features == 48

    built = build_model(
        GatedVisionMLP, Path("unused"), torch.float32, torch.device("cpu"),
        load_format="dummy", dim=32, hidden=44, act="silu",
    )  # fmt: skip
    assert built.down_proj.in_features == 48
