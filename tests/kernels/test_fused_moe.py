"""Mixture-of-experts kernels (routing, token grouping, grouped GEMMs) against the PyTorch
references."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.fused_moe import (
    align_tokens,
    align_tokens_ref,
    choose_moe_launch,
    fused_moe,
    fused_moe_ref,
    max_padded_slots,
    route,
    route_ref,
)

# Small tiles keep the interpreter quick.
SMALL = dict(block_m=16, block_n=16, block_k=16)
MOE_TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    # Every intermediate is rounded to bfloat16 (gate|up, silu, the product, each expert's
    # output) and the interpreter truncates when it rounds: a few ulps apart.
    torch.bfloat16: (6e-2, 6e-2),
}


def _assert_route(logits, top_k, renormalize):
    weights, ids = route(logits, top_k, renormalize)
    ref_weights, ref_ids = route_ref(logits.cpu(), top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_reference(num_tokens, num_experts, top_k, renormalize, device):
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(device)
    _assert_route(logits, top_k, renormalize)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_many_experts(renormalize, device):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 128, generator=gen).to(device)
    _assert_route(logits, 8, renormalize)
    _assert_route(torch.randn(2, 100, generator=gen).to(device), 6, renormalize)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_route_half_logits(dtype, device):
    gen = torch.Generator().manual_seed(2)
    _assert_route(torch.randn(7, 8, generator=gen).to(dtype).to(device), 2, True)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_ties_go_to_the_lower_expert(renormalize, device):
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [1.0, 2.0, 2.0, 0.5, 2.0, 1.0],
            [-1.0, 3.0, -1.0, 3.0, -1.0, -1.0],
            [5.0, 1.0, 1.0, 1.0, 1.0, 5.0],
        ],
        device=device,
    )
    for top_k in (1, 2, 3, 6):
        _assert_route(logits, top_k, renormalize)
    _, ids = route(logits, 3, renormalize)
    assert ids.cpu().tolist() == [[0, 1, 2], [1, 2, 4], [1, 3, 0], [0, 5, 1]]


def _check_grouping(topk_ids, num_experts, block_m):
    sorted_slots, expert_of_block, num_padded = align_tokens(topk_ids, num_experts, block_m)
    ref = align_tokens_ref(topk_ids, num_experts, block_m)
    for got, want in zip((sorted_slots, expert_of_block, num_padded), ref, strict=True):
        assert got.dtype == torch.int32
        assert torch.equal(got.cpu(), want.cpu())
    # The properties themselves, independently of the reference.
    flat = topk_ids.reshape(-1).long().cpu()
    num_slots = flat.numel()
    slots, experts = sorted_slots.cpu().long(), expert_of_block.cpu().long()
    total = int(num_padded)
    assert slots.numel() == max_padded_slots(num_slots, num_experts, block_m)
    assert slots.numel() % block_m == 0 and experts.numel() == slots.numel() // block_m
    assert total % block_m == 0 and total <= slots.numel()
    real = slots[slots < num_slots]
    assert sorted(real.tolist()) == list(range(num_slots))  # each slot exactly once
    assert torch.all(slots[total:] == num_slots)
    assert torch.all(experts[total // block_m :] == -1)
    used = experts[: total // block_m]
    assert torch.all(used[1:] >= used[:-1])  # groups in expert order
    for b, expert in enumerate(used.tolist()):
        block = slots[b * block_m : (b + 1) * block_m]
        mine = block[block < num_slots]
        assert mine.numel() > 0  # padding is less than a block
        assert torch.all(flat[mine] == expert)
        assert torch.all(mine[1:] > mine[:-1])
        # Padding only at the end of a block.
        n = mine.numel()
        assert torch.all(block[:n] < num_slots) and torch.all(block[n:] == num_slots)
    for expert in range(num_experts):
        blocks = (used == expert).sum().item()
        assert blocks == -(-(flat == expert).sum().item() // block_m)
    return sorted_slots, expert_of_block, num_padded


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_tokens_groups_by_expert(num_tokens, num_experts, top_k, block_m, device):
    gen = torch.Generator().manual_seed(num_tokens + 10 * num_experts)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    _check_grouping(ids.to(torch.int32).to(device), num_experts, block_m)


def test_align_tokens_special_routings(device):
    # Experts that receive no token.
    ids = torch.tensor([[0, 5], [5, 0], [0, 5]], dtype=torch.int32, device=device)
    _check_grouping(ids, 8, 4)
    # One expert receives every token.
    _, experts, total = _check_grouping(torch.full((20, 1), 3, device=device), 8, 16)
    assert experts.tolist()[:2] == [3, 3] and int(total) == 32
    # A token naming one expert twice (int64 ids, as a caller might pass).
    ids = torch.tensor([[3, 3], [1, 3]], dtype=torch.int64, device=device)
    slots, experts, total = _check_grouping(ids, 4, 4)
    assert slots.tolist()[:8] == [2, 4, 4, 4, 0, 1, 3, 4] and experts.tolist()[:2] == [1, 3]
    # No tokens at all.
    slots, experts, total = align_tokens(torch.zeros(0, 2, dtype=torch.int32, device=device), 4, 4)
    assert slots.numel() == experts.numel() == 0 and int(total) == 0
    # A non-contiguous view.
    _check_grouping(torch.tensor([[2, 0, 1], [1, 2, 0]], device=device)[:, ::2], 4, 2)


def test_align_tokens_sizes_do_not_depend_on_the_routing(device):
    spread = torch.arange(16, device=device).reshape(8, 2) % 8
    same = torch.zeros(8, 2, dtype=torch.int64, device=device)
    a, b = align_tokens(spread, 8, 16), align_tokens(same, 8, 16)
    assert [t.shape for t in a] == [t.shape for t in b]


def _moe_inputs(num_tokens, num_experts, hid, inter, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hid, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hid, generator=gen) / hid**0.5
    w2 = torch.randn(num_experts, hid, inter, generator=gen) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return (
        hidden.to(dtype).to(device),
        w13.to(dtype).to(device),
        w2.to(dtype).to(device),
        logits.to(device),
    )


def _assert_moe(hidden, w13, w2, weights, ids, **launch):
    out = fused_moe(hidden, w13, w2, weights, ids, **launch)
    ref = fused_moe_ref(hidden.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert out.shape == ref.shape and out.dtype == hidden.dtype
    atol, rtol = MOE_TOLERANCE[hidden.dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
def test_fused_moe_matches_reference(num_tokens, num_experts, top_k, device):
    inter = 16 if num_experts == 4 else 24
    hidden, w13, w2, logits = _moe_inputs(
        num_tokens, num_experts, 32, inter, torch.float32, device, seed=num_tokens
    )
    weights, ids = route(logits, top_k, renormalize=top_k > 1)
    _assert_moe(hidden, w13, w2, weights, ids, **SMALL)


@pytest.mark.parametrize(
    "ids",
    [
        [[3, 3], [1, 3], [3, 3]],  # a token naming one expert twice
        [[2, 0]] * 3,  # experts 1 and 3 receive nothing
        [[1, 1]] * 3,  # one expert receives everything
    ],
)
def test_fused_moe_special_routings(ids, device):
    hidden, w13, w2, _ = _moe_inputs(3, 4, 32, 16, torch.float32, device, seed=3)
    ids = torch.tensor(ids, dtype=torch.int64, device=device)
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.1, 0.9]], device=device)
    _assert_moe(hidden, w13, w2, weights, ids, **SMALL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_moe_half(dtype, device):
    hidden, w13, w2, logits = _moe_inputs(5, 4, 32, 24, dtype, device, seed=4)
    weights, ids = route(logits, 2, renormalize=True)
    _assert_moe(hidden, w13, w2, weights, ids, **SMALL)


def test_fused_moe_default_launch_and_odd_sizes(device):
    # Sizes that are no multiple of the tiles; the default launch for one token.
    hidden, w13, w2, logits = _moe_inputs(1, 8, 40, 20, torch.float32, device, seed=5)
    weights, ids = route(logits, 2, renormalize=False)
    _assert_moe(hidden, w13, w2, weights, ids)
    _assert_moe(hidden, w13, w2, weights, ids, block_m=16, block_n=32, block_k=16)


def test_fused_moe_no_tokens(device):
    hidden, w13, w2, logits = _moe_inputs(0, 4, 32, 16, torch.float32, device)
    weights, ids = route(logits, 2, renormalize=True)
    assert ids.shape == (0, 2)
    assert fused_moe(hidden, w13, w2, weights, ids).shape == (0, 32)


def test_choose_moe_launch():
    assert choose_moe_launch(1, 4096, 1024).block_m == 16
    assert choose_moe_launch(4096, 4096, 1024).block_m == 64
    assert choose_moe_launch(1, 32, 16).block_k == 16
    with pytest.raises(ValueError, match="block_m=24"):
        choose_moe_launch(1, 32, 16, block_m=24)
    with pytest.raises(ValueError, match="num_stages"):
        choose_moe_launch(1, 32, 16, num_stages=0)


def test_launchers_reject_bad_arguments(device):
    hidden, w13, w2, logits = _moe_inputs(3, 4, 32, 16, torch.float32, device)
    weights, ids = route(logits, 2, renormalize=True)
    with pytest.raises(ValueError, match="router_logits has dtype torch.int32"):
        route(logits.int(), 2, True)
    with pytest.raises(ValueError, match="router_logits must have 2 dimensions"):
        route(logits[0], 2, True)
    with pytest.raises(ValueError, match="top_k=5"):
        route(logits, 5, True)
    with pytest.raises(ValueError, match="top_k=0"):
        route(logits, 0, True)
    with pytest.raises(ValueError, match="renormalize"):
        route(logits, 2, 1)
    with pytest.raises(ValueError, match="topk_ids has dtype torch.float32"):
        align_tokens(weights, 4, 16)
    with pytest.raises(ValueError, match="block_m=3"):
        align_tokens(ids, 4, 3)
    with pytest.raises(ValueError, match="num_experts=0"):
        align_tokens(ids, 0, 16)
    with pytest.raises(ValueError, match="hidden has dtype torch.int32"):
        fused_moe(hidden.int(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="w13 has dtype torch.float16"):
        fused_moe(hidden, w13.half(), w2, weights, ids)
    with pytest.raises(ValueError, match="w13 has size 31 in dimension 2"):
        fused_moe(hidden, w13[..., :31], w2, weights, ids)
    with pytest.raises(ValueError, match="w13 must have an even dimension 1"):
        fused_moe(hidden, w13[:, :31], w2, weights, ids)
    with pytest.raises(ValueError, match="w2 has size 3 in dimension 0"):
        fused_moe(hidden, w13, w2[:3], weights, ids)
    with pytest.raises(ValueError, match="w2 has size 8 in dimension 2"):
        fused_moe(hidden, w13, w2[..., :8], weights, ids)
    with pytest.raises(ValueError, match="w2 must have stride 1"):
        fused_moe(hidden, w13, w2.transpose(1, 2).contiguous().transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="topk_weights has dtype torch.float16"):
        fused_moe(hidden, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match="topk_weights has size 1 in dimension 1"):
        fused_moe(hidden, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="topk_ids has size 2 in dimension 0"):
        fused_moe(hidden, w13, w2, weights, ids[:2])
    with pytest.raises(ValueError, match="topk_ids has dtype torch.float32"):
        fused_moe(hidden, w13, w2, weights, weights)
    with pytest.raises(ValueError, match="block_n=20"):
        fused_moe(hidden, w13, w2, weights, ids, block_n=20)
