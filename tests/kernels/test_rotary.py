"""Rotary embedding from the model's cos / sin table against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine.models.layers.rotary import RopeSpec, RotaryEmbedding
from batchlm.kernels.rotary import rotary_embedding, rotary_embedding_ref

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
