"""Rotary embedding from the model's cos / sin table against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine.models.layers.rotary import RopeSpec, RotaryEmbedding
from batchlm.kernels.rotary import (
    rotary_embedding,
    rotary_embedding_into_cache,
    rotary_embedding_into_cache_ref,
    rotary_embedding_ref,
)

from .helpers import DTYPES, ELEMENTWISE_TOLERANCE, assert_close, gpu_only

SCALINGS = {
    "default": {},
    "linear": {"factor": 2.0},
    "llama3": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
}


def _table(rope_type: str, rotary_dim: int, max_position: int) -> torch.Tensor:
    spec = RopeSpec(rope_type, 10000.0, rotary_dim, SCALINGS[rope_type], 256)
    return RotaryEmbedding(spec, rotary_dim, max_position).cos_sin


def _qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device):
    """Query and key as strided views of a fused qkv projection, like the models pass them."""
    gen = torch.Generator().manual_seed(0)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    return q, k.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("num_tokens", [7, gpu_only(8192)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matches_reference(num_tokens, group, head_dim, dtype, device):
    _check("default", num_tokens, group, head_dim, dtype, device)


@pytest.mark.parametrize("rope_type", list(SCALINGS))
def test_every_scaling_table(rope_type, device):
    _check(rope_type, 7, 4, 64, torch.float32, device)


def _check(rope_type, num_tokens, group, head_dim, dtype, device):
    max_position = 8192 if num_tokens > 100 else 256
    cos_sin = _table(rope_type, head_dim, max_position).to(device)
    q, k = _qk(num_tokens, 2 * group, 2, head_dim, dtype, device)
    positions = torch.randint(0, max_position, (num_tokens,), device=device)
    out = rotary_embedding(positions, q, k, cos_sin)
    ref = rotary_embedding_ref(positions, q, k, cos_sin)
    assert_close(out.query, ref.query, ELEMENTWISE_TOLERANCE)
    assert_close(out.key, ref.key, ELEMENTWISE_TOLERANCE)


def test_partial_rotary_passes_the_rest_through(device):
    cos_sin = _table("default", 32, 64).to(device)
    q, k = _qk(5, 4, 2, 64, torch.float32, device)
    positions = torch.arange(5, device=device) * 7
    out = rotary_embedding(positions, q, k, cos_sin)
    ref = rotary_embedding_ref(positions, q, k, cos_sin)
    assert_close(out.query, ref.query, ELEMENTWISE_TOLERANCE)
    assert torch.equal(out.key[..., 32:], k[..., 32:])


def test_matches_the_model_layer(device):
    """The layer's own PyTorch path (on CPU) agrees with the kernel."""
    spec = RopeSpec("llama3", 500000.0, 64, SCALINGS["llama3"], 256)
    layer = RotaryEmbedding(spec, 64, 256)
    q, k = _qk(9, 8, 2, 64, torch.float32, torch.device("cpu"))
    positions = torch.randint(0, 256, (9,))
    q_layer, k_layer = layer(positions, q, k)
    out = rotary_embedding(
        positions.to(device), q.to(device), k.to(device), layer.cos_sin.to(device)
    )
    torch.testing.assert_close(out.query.cpu(), q_layer, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.key.cpu(), k_layer, atol=1e-5, rtol=1e-5)


def test_launcher_rejects_bad_arguments(device):
    cos_sin = _table("default", 64, 64).to(device)
    q, k = _qk(5, 4, 2, 64, torch.float32, device)
    positions = torch.arange(5, device=device)
    with pytest.raises(ValueError, match="cos_sin has dtype torch.float16"):
        rotary_embedding(positions, q, k, cos_sin.half())
    with pytest.raises(ValueError, match="key has dtype torch.float16"):
        rotary_embedding(positions, q, k.half(), cos_sin)
    with pytest.raises(ValueError, match="positions has size 4 in dimension 0"):
        rotary_embedding(positions[:4], q, k, cos_sin)
    with pytest.raises(ValueError, match="rotary_dim=64; it must be even and <= head_dim=32"):
        rotary_embedding(positions, q[..., :32], k[..., :32], cos_sin)


def _into_cache_case(num_tokens, group, head_dim, dtype, block_size, device, seed=0):
    """Inputs of `rotary_embedding_into_cache`: q / k / v as views of one qkv row, caches
    with random content, distinct shuffled slots, a few of them negative (padding)."""
    gen = torch.Generator().manual_seed(seed)
    max_position = 8192 if num_tokens > 100 else 256
    cos_sin = _table("llama3", head_dim, max_position).to(device)
    num_kv_heads = 2
    width = (num_kv_heads * group + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)
    q_size, kv_size = num_kv_heads * group * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, -1, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    num_blocks = -(-num_tokens // block_size) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = torch.randn(2, *shape, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    return positions.to(device), q, k, v, cos_sin, caches, slots.to(device)


@pytest.mark.parametrize("num_tokens", [11, gpu_only(4096)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_into_cache_matches_reference(num_tokens, group, head_dim, block_size, dtype, device):
    positions, q, k, v, cos_sin, caches, slots = _into_cache_case(
        num_tokens, group, head_dim, dtype, block_size, device
    )
    expected = caches.clone()
    ref_q = rotary_embedding_into_cache_ref(
        positions, q, k, v, cos_sin, expected[0], expected[1], slots
    )
    out_q = rotary_embedding_into_cache(positions, q, k, v, cos_sin, caches[0], caches[1], slots)
    assert_close(out_q, ref_q, ELEMENTWISE_TOLERANCE)
    # Every slot: rotated keys and values where written, the old content elsewhere
    # (negative slots write nothing).
    assert_close(caches, expected, ELEMENTWISE_TOLERANCE)
    written = torch.zeros(caches.shape[1] * caches.shape[2], dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = caches.flatten(1, 2)[:, ~written.to(device)]
    assert torch.equal(untouched, expected.flatten(1, 2)[:, ~written.to(device)])
    # The values are copied bit for bit.
    kept = slots >= 0
    flat = caches[1].flatten(0, 1)
    assert torch.equal(flat[slots[kept]], v[kept])


def test_into_cache_equals_rotary_then_write(device):
    """The fused kernel stores what the two-kernel path stores, bit for bit."""
    from batchlm.kernels.write_kv_cache import write_kv_cache

    positions, q, k, v, cos_sin, caches, slots = _into_cache_case(
        9, 4, 64, torch.float16, 16, device
    )
    two_kernels = caches.clone()
    rotated = rotary_embedding(positions, q, k, cos_sin)
    write_kv_cache(rotated.key, v, two_kernels[0], two_kernels[1], slots)
    out_q = rotary_embedding_into_cache(positions, q, k, v, cos_sin, caches[0], caches[1], slots)
    assert torch.equal(out_q, rotated.query)
    assert torch.equal(caches, two_kernels)


def test_into_cache_rejects_bad_arguments(device):
    positions, q, k, v, cos_sin, caches, slots = _into_cache_case(
        5, 2, 64, torch.float32, 16, device
    )
    args = (caches[0], caches[1], slots)
    with pytest.raises(ValueError, match="cos_sin rotates 32 channels of heads of 64; partial"):
        rotary_embedding_into_cache(positions, q, k, v, cos_sin[..., :32].contiguous(), *args)
    with pytest.raises(ValueError, match="key_cache has dtype torch.float16"):
        rotary_embedding_into_cache(
            positions, q, k, v, cos_sin, caches[0].half(), caches[1].half(), slots
        )
    with pytest.raises(ValueError, match="value has size 3 in dimension 0"):
        rotary_embedding_into_cache(positions, q, k, v[:3], cos_sin, *args)
    with pytest.raises(ValueError, match="slot_mapping has size 4 in dimension 0"):
        rotary_embedding_into_cache(positions, q, k, v, cos_sin, caches[0], caches[1], slots[:4])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_token_angles_match_the_vision_layer(dtype, device):
    """A vision tower's rotation (each patch its own row of angles, head_dim 80 as in
    Qwen2.5-VL's tower): the kernel, with the tokens as the table's rows, against the
    layer's PyTorch path."""
    from batchlm.engine.models.layers.rotary import rotate_per_token
    from batchlm.engine.models.qwen2_vl import VisionRotary, patch_positions

    cos_sin = VisionRotary(80)(patch_positions([[1, 4, 6]], 2))  # [2, 24, 80]
    q, k = _qk(24, 4, 4, 80, dtype, torch.device("cpu"))
    q_ref, k_ref = rotate_per_token(q, k, cos_sin)
    out = rotary_embedding(
        torch.arange(24, device=device), q.to(device), k.to(device), cos_sin.to(device)
    )
    assert_close(out.query.cpu(), q_ref, ELEMENTWISE_TOLERANCE)
    assert_close(out.key.cpu(), k_ref, ELEMENTWISE_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mrope_token_table_into_cache_matches_the_layer(dtype, device):
    """A step with image tokens (M-RoPE, `[3, num_tokens]` positions): the fused kernel
    with the step's table of each token's angles stores what the layer's PyTorch path
    rotates, and the table is built once for the step's positions."""
    from batchlm.engine.models.layers.rotary import MRotaryEmbedding
    from batchlm.kernels.write_kv_cache import write_kv_cache_ref

    spec = RopeSpec("default", 10000.0, 64, {}, 256)
    rotary = MRotaryEmbedding(spec, 64, 256, [8, 12, 12])
    positions = torch.stack(  # text, then a 2 × 3 image grid, then text
        [
            torch.tensor([0, 1, 2, 2, 2, 2, 2, 2, 5, 6]),
            torch.tensor([0, 1, 2, 2, 2, 3, 3, 3, 5, 6]),
            torch.tensor([0, 1, 2, 3, 4, 2, 3, 4, 5, 6]),
        ]
    )
    _, q, k, v, _, caches, slots = _into_cache_case(10, 4, 64, dtype, 16, device)
    q_ref, k_ref = rotary(positions, q.cpu().float(), k.cpu().float())
    expected = caches.clone().cpu().float()
    write_kv_cache_ref(k_ref, v.cpu().float(), expected[0], expected[1], slots.cpu())

    rotary = rotary.to(device)
    on_device = positions.to(device)
    index, table = rotary.token_table(on_device)
    assert rotary.token_table(on_device)[1] is table  # once per step
    assert table.shape == (2, 10, 64) and table.dtype == torch.float32
    out_q = rotary_embedding_into_cache(index, q, k, v, table, caches[0], caches[1], slots)
    assert_close(out_q.cpu(), q_ref.to(dtype), ELEMENTWISE_TOLERANCE)
    assert_close(caches.cpu(), expected.to(dtype), ELEMENTWISE_TOLERANCE)
