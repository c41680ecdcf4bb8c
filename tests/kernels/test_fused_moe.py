"""Mixture-of-experts kernels (routing, token grouping, grouped GEMMs with weights in the
activation dtype or in fp8) against the PyTorch references, and the launch table."""

from __future__ import annotations

import json

import pytest
import torch

from batchlm.kernels import moe_routing
from batchlm.kernels.fused_moe import FP8_WEIGHT_DTYPE, fused_moe, fused_moe_ref
from batchlm.kernels.moe_launch import (
    DEFAULT_TABLE_PATH,
    MoeLaunch,
    MoeLaunches,
    MoeShape,
    choose_moe_launch,
    load_launch_table,
    table_entry,
)
from batchlm.kernels.moe_routing import (
    align_tokens,
    align_tokens_ref,
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


@pytest.fixture(params=["one_program", "per_expert"])
def align_kernel(request, monkeypatch):
    """Each grouping test runs through both of `align_tokens`' kernels (up to 4,096 slots
    for the one-program kernel: its one-hot tile must fit one Triton tensor)."""
    threshold = 4096 if request.param == "one_program" else 0
    monkeypatch.setattr(moe_routing, "ONE_PROGRAM_MAX_SLOTS", threshold)
    return request.param


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
def test_align_tokens_groups_by_expert(
    num_tokens, num_experts, top_k, block_m, device, align_kernel
):
    gen = torch.Generator().manual_seed(num_tokens + 10 * num_experts)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    _check_grouping(ids.to(torch.int32).to(device), num_experts, block_m)


def test_align_tokens_special_routings(device, align_kernel):
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


@pytest.mark.parametrize(("num_tokens", "block_m"), [(1, 16), (256, 32), (300, 64), (1100, 128)])
def test_align_tokens_on_model_shapes(num_tokens, block_m, device, align_kernel):
    """128 experts, top 8 (Qwen3-MoE): a decode step of one token, a batch of 256, and
    more slots than one chunk of the kernel (1024) holds."""
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(128, generator=gen)[:8] for _ in range(num_tokens)])
    _check_grouping(ids.to(torch.int32).to(device), 128, block_m)


def test_align_tokens_skewed_routing(device, align_kernel):
    """Most slots on a few experts (several chunks of one expert's slots, many blocks of
    one expert), most experts empty."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 3, (700, 4), generator=gen) * 5
    _check_grouping(ids.to(device), 64, 16)


def test_align_tokens_sizes_do_not_depend_on_the_routing(device, align_kernel):
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


def _quantize_fp8(weight):
    """`[E, rows, cols]` → e4m3 values and `[E, rows]` float32 scales (each row's largest
    magnitude maps to 448)."""
    scale = weight.float().abs().amax(dim=-1).clamp(min=1e-12) * (1.0 / 448.0)
    return (weight.float() / scale[..., None]).to(FP8_WEIGHT_DTYPE), scale


def _assert_fp8_moe(hidden, w13, w2, weights, ids, **launch):
    """fp8 weights: the kernel against the reference (which dequantises), both from the
    same e4m3 values and scales."""
    q13, s13 = _quantize_fp8(w13)
    q2, s2 = _quantize_fp8(w2)
    out = fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, **launch)
    cpu = [t.cpu() for t in (hidden, q13, q2, weights, ids)]
    ref = fused_moe_ref(*cpu, w13_scale=s13.cpu(), w2_scale=s2.cpu())
    assert out.shape == ref.shape and out.dtype == hidden.dtype
    atol, rtol = MOE_TOLERANCE[hidden.dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_fp8_weights_match_reference(num_tokens, dtype, device):
    hidden, w13, w2, logits = _moe_inputs(num_tokens, 8, 32, 24, dtype, device, seed=num_tokens)
    weights, ids = route(logits, 2, renormalize=True)
    out = _assert_fp8_moe(hidden, w13, w2, weights, ids, **SMALL)
    # And close to the unquantized layer: e4m3 keeps 3 mantissa bits (~3% per weight).
    full = fused_moe_ref(hidden.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu()).float()
    rel = (out.cpu().float() - full).norm() / full.norm()
    assert rel < 0.06, rel


@pytest.mark.parametrize(
    "ids",
    [
        [[3, 3], [1, 3], [3, 3]],  # a token naming one expert twice
        [[2, 0]] * 3,  # experts 1 and 3 receive nothing
        [[1, 1]] * 3,  # one expert receives everything
    ],
)
def test_fused_moe_fp8_special_routings(ids, device):
    hidden, w13, w2, _ = _moe_inputs(3, 4, 32, 16, torch.float16, device, seed=3)
    ids = torch.tensor(ids, dtype=torch.int32, device=device)
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.1, 0.9]], device=device)
    _assert_fp8_moe(hidden, w13, w2, weights, ids, **SMALL)


def test_fused_moe_fp8_one_token_default_launch_odd_sizes(device):
    hidden, w13, w2, logits = _moe_inputs(1, 8, 40, 20, torch.bfloat16, device, seed=6)
    weights, ids = route(logits, 3, renormalize=False)
    _assert_fp8_moe(hidden, w13, w2, weights, ids)


def test_fused_moe_fp8_rejects_bad_scales(device):
    hidden, w13, w2, logits = _moe_inputs(3, 4, 32, 16, torch.float32, device)
    weights, ids = route(logits, 2, renormalize=True)
    (q13, s13), (q2, s2) = _quantize_fp8(w13), _quantize_fp8(w2)
    with pytest.raises(ValueError, match="weights need w13_scale"):
        fused_moe(hidden, q13, q2, weights, ids)
    with pytest.raises(ValueError, match="w2 has dtype torch.float32"):
        fused_moe(hidden, q13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="pass no scales"):
        fused_moe(hidden, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="w13_scale has size 16 in dimension 1"):
        fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13[:, :16], w2_scale=s2)
    with pytest.raises(ValueError, match="w2_scale has dtype torch.float16"):
        fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2.half())
    with pytest.raises(ValueError, match="not both"):
        fused_moe(hidden, w13, w2, weights, ids, launch=_pair(16, 16, 16), block_m=16)


# The W6 expert shape (Qwen3-30B-A3B): 128 experts of width 768 over hidden 2048, top 8.
W6_EXPERTS, W6_HIDDEN, W6_INTER, W6_TOP_K = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def w6_weights():
    gen = torch.Generator("cuda").manual_seed(0)
    w13 = torch.randn(W6_EXPERTS, 2 * W6_INTER, W6_HIDDEN, device="cuda", generator=gen)
    w2 = torch.randn(W6_EXPERTS, W6_HIDDEN, W6_INTER, device="cuda", generator=gen)
    return (w13 / W6_HIDDEN**0.5).bfloat16(), (w2 / W6_INTER**0.5).bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 64, 333])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_moe_w6_shape_on_gpu(num_tokens, fp8, w6_weights):
    """The default launches (the repository's table on this device) at the W6 expert shape,
    against the reference run on the same GPU."""
    w13, w2 = w6_weights
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, W6_HIDDEN, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(num_tokens, W6_EXPERTS, device="cuda", generator=gen)
    weights, ids = route(logits, W6_TOP_K, renormalize=True)
    scales = {}
    if fp8:
        (w13, s13), (w2, s2) = _quantize_fp8(w13), _quantize_fp8(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    out = fused_moe(hidden, w13, w2, weights, ids, **scales)
    ref = fused_moe_ref(hidden, w13, w2, weights, ids, **scales)
    atol, rtol = MOE_TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _shape(hidden=4096, inter=1024, device_name="cpu", weight_dtype="float32"):
    return MoeShape(device_name, 8, hidden, inter, "float32", weight_dtype)


def test_choose_moe_launch_defaults():
    assert choose_moe_launch(1, _shape(), table={}).block_m == 16
    assert choose_moe_launch(4096, _shape(), table={}).block_m == 64
    narrow = choose_moe_launch(1, _shape(32, 16), table={})
    assert narrow.gate_up.block_k == 32 and narrow.down.block_k == 16  # K: hidden, inter
    assert narrow.gate_up.block_n == 16 and narrow.down.block_n == 32  # N: inter, hidden
    forced = choose_moe_launch(1, _shape(), table={}, block_m=32, num_stages=None)
    assert forced.gate_up.block_m == forced.down.block_m == 32
    with pytest.raises(ValueError, match="block_m=24"):
        choose_moe_launch(1, _shape(), table={}, block_m=24)
    with pytest.raises(ValueError, match="num_stages"):
        choose_moe_launch(1, _shape(), table={}, num_stages=0)
    with pytest.raises(ValueError, match="unknown launch options.*'block_q'"):
        choose_moe_launch(1, _shape(), table={}, block_q=16)


def _write_table(path, shape, buckets):
    path.write_text(json.dumps({"entries": [table_entry(shape, buckets)]}))
    return load_launch_table(path)


def _pair(block_m, gate_up_n, down_n):
    return MoeLaunches(
        MoeLaunch(block_m, gate_up_n, 32, 4, 2), MoeLaunch(block_m, down_n, 16, 2, 3)
    )


def test_launch_table_picks_the_smallest_bucket_that_holds_the_tokens(tmp_path):
    shape = _shape(32, 16)
    buckets = {1: _pair(16, 16, 32), 8: _pair(32, 32, 16), 64: _pair(64, 16, 16)}
    table = _write_table(tmp_path / "t.json", shape, buckets)
    got = [choose_moe_launch(n, shape, table) for n in (1, 2, 8, 9, 64, 65, 10_000)]
    assert got == [buckets[n] for n in (1, 8, 8, 64, 64, 64, 64)]
    # gate|up and down keep their own launches; overrides apply to both.
    assert got[0].gate_up.block_n == 16 and got[0].down.block_n == 32
    assert choose_moe_launch(1, shape, table, num_warps=8).down.num_warps == 8
    # Another device, size or weight dtype: the defaults.
    for other in (
        shape._replace(device_name="NVIDIA H100"),
        shape._replace(inter=32),
        shape._replace(weight_dtype="float8_e4m3fn"),
    ):
        assert choose_moe_launch(1, other, table) == choose_moe_launch(1, other, table={})
    assert load_launch_table(tmp_path / "t.json") is table  # read once
    assert load_launch_table(tmp_path / "missing.json") == {}


def test_repository_table_covers_w6_on_the_h200():
    """The committed table loads and holds W6's layer (Qwen3-30B-A3B) in bf16 and fp8,
    every bucket from one token to a prefill chunk."""
    table = load_launch_table(DEFAULT_TABLE_PATH)
    for weight_dtype in ("bfloat16", "float8_e4m3fn"):
        shape = MoeShape("NVIDIA H200", 128, 2048, 768, "bfloat16", weight_dtype)
        buckets = [n for n, _ in table[shape]]
        assert buckets[0] == 1 and buckets[-1] >= 8192
        assert choose_moe_launch(1, shape, table) == table[shape][0][1]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda e: e.update(colour="red"), "expected the keys"),
        (lambda e: e.update(num_experts=0), "num_experts=0"),
        (lambda e: e["launches"].update({"x": e["launches"]["1"]}), "bucket 'x'"),
        (lambda e: e["launches"]["1"].pop("down"), "bucket 1: expected"),
        (lambda e: e["launches"]["1"].update(down=[32, 16, 16, 4, 3]), "must be equal"),
        (lambda e: e["launches"]["1"].update(down=[16, 24, 16, 4, 3]), "block_n=24"),
        (lambda e: e["launches"]["1"].update(down=[16, 16, 16, 4]), "bucket 1"),
    ],
)
def test_launch_table_is_validated(tmp_path, edit, match):
    entry = table_entry(_shape(), {1: _pair(16, 16, 16)})
    edit(entry)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"entries": [entry]}))
    with pytest.raises(ValueError, match=match):
        load_launch_table(path)


def test_fused_moe_runs_the_tables_launch(tmp_path, device, monkeypatch):
    """`fused_moe` looks its launch up by device name, sizes and dtypes (Python values:
    nothing it reads synchronises), and gives the reference's result with it."""
    from batchlm.kernels import fused_moe as module
    from batchlm.kernels.moe_launch import device_name

    hidden, w13, w2, logits = _moe_inputs(5, 4, 32, 16, torch.float32, device, seed=9)
    shape = MoeShape(device_name(device), 4, 32, 16, "float32", "float32")
    table = _write_table(tmp_path / "t.json", shape, {8: _pair(32, 16, 32)})
    chosen = []
    original = module.choose_moe_launch

    def choose(num_tokens, shape, **overrides):
        assert type(num_tokens) is int
        chosen.append(original(num_tokens, shape, table, **overrides))
        return chosen[-1]

    monkeypatch.setattr(module, "choose_moe_launch", choose)
    weights, ids = route(logits, 2, renormalize=True)
    _assert_moe(hidden, w13, w2, weights, ids)
    assert chosen == [_pair(32, 16, 32)]


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
