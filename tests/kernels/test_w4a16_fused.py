"""The int4 q|k|v product + rotary + cache write (`w4a16_fused.py`): its reference against
the bf16 path's on the dequantized weight; on a GPU, the fused kernel against `w4a16`
then `rotary_embedding_into_cache` (the same bits) and the reference."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels import w4a16_mma, w4a16_mma_staging
from batchlm.kernels.activation import silu_and_mul
from batchlm.kernels.gemv_rotary import gemv_rotary_into_cache_ref, split_heads
from batchlm.kernels.rotary import rotary_embedding_into_cache
from batchlm.kernels.w4a16 import dequantize_int4_ref, new_split_k_locks, w4a16
from batchlm.kernels.w4a16_fused import (
    W4a16Weight,
    w4a16_rotary_into_cache,
    w4a16_rotary_into_cache_ref,
    w4a16_silu_mul,
    w4a16_silu_mul_ref,
)

from .helpers import ON_GPU
from .test_w4a16 import make_weight, record_form_launches

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def _case(heads, kv_heads, head_dim, hidden, group, dtype, device, *, zeros=False,
          act_order=False, seed=0):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    rows = (heads + 2 * kv_heads) * head_dim
    tensors = make_weight(hidden, rows, group, zeros=zeros, act_order=act_order, dtype=dtype,
                          device=device)  # fmt: skip
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(device)
    max_position = 64
    angles = torch.rand(max_position, head_dim // 2, generator=gen) * 6.0
    angles = torch.cat([angles, angles], dim=-1)
    cos_sin = torch.stack([angles.cos(), angles.sin()]).to(device)
    cache = torch.randn(2, 4, 4, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    positions = torch.tensor([37], device=device)
    slots = torch.tensor([9], device=device)
    return x, tensors, positions, cos_sin, cache, slots


def _weight(tensors, locks=None):
    return W4a16Weight(
        tensors["qweight"], tensors["scales"], tensors.get("zeros"), tensors["group_size"],
        tensors.get("perm"), tensors.get("g_idx"), locks,
    )  # fmt: skip


@pytest.mark.parametrize("zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_reference_is_the_bf16_paths_on_the_dequantized_weight(zeros, act_order):
    heads, kv_heads, head_dim, hidden = 4, 2, 16, 128
    x, tensors, positions, cos_sin, cache, slots = _case(
        heads, kv_heads, head_dim, hidden, 32, torch.float32, "cpu", zeros=zeros,
        act_order=act_order,
    )  # fmt: skip
    dense_cache = cache.clone()
    query = w4a16_rotary_into_cache_ref(
        x, _weight(tensors), positions, cos_sin, cache[0], cache[1], slots, heads
    )
    weight = dequantize_int4_ref(tensors["qweight"], tensors["scales"], tensors.get("zeros"),
                                 tensors["group_size"], tensors.get("g_idx"))  # fmt: skip
    xs = x if tensors.get("perm") is None else x[:, tensors["perm"].long()]
    dense_query = gemv_rotary_into_cache_ref(
        xs, weight.t().contiguous(), None, positions, cos_sin, dense_cache[0], dense_cache[1],
        slots, heads,
    )  # fmt: skip
    torch.testing.assert_close(query, dense_query, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, dense_cache, atol=1e-5, rtol=1e-5)


def test_not_taken_on_the_cpu():
    """Where the mma.sync form does not run, the caller takes the two steps."""
    x, tensors, positions, cos_sin, cache, slots = _case(4, 2, 32, 256, 128, torch.bfloat16, "cpu")
    assert (
        w4a16_rotary_into_cache(
            x, _weight(tensors), positions, cos_sin, cache[0], cache[1], slots, 4
        )  # fmt: skip
        is None
    )


def test_outputs_not_the_heads_name_both():
    x, tensors, positions, cos_sin, cache, slots = _case(4, 2, 32, 256, 128, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="qweight has 256 outputs; 5 query"):
        w4a16_rotary_into_cache(
            x, _weight(tensors), positions, cos_sin, cache[0], cache[1], slots, 5
        )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "hidden", "group"),
    [(32, 8, 128, 4096, 128), (14, 2, 64, 896, 128), (8, 4, 128, 2048, 32)],
    ids=["llama-8b", "qwen-0.5b", "groups-32"],
)
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-program"])
@pytest.mark.parametrize("zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("stage_row", ["0", "1"], ids=["rows-staged", "row-staged"])
def test_equals_w4a16_then_rotary_into_cache_on_the_gpu(
    monkeypatch, heads, kv_heads, head_dim, hidden, group, split, zeros, act_order, dtype,
    stage_row,
):  # fmt: skip
    monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGE_ROW", stage_row)
    ran = record_form_launches(monkeypatch, w4a16_mma, "launch_w4a16_mma")
    x, tensors, positions, cos_sin, cache, slots = _case(
        heads, kv_heads, head_dim, hidden, group, dtype, "cuda", zeros=zeros,
        act_order=act_order,
    )  # fmt: skip
    locks = new_split_k_locks(x.device) if split else None
    two_cache, ref_cache = cache.clone(), cache.clone()
    qkv = w4a16(x, **tensors, locks=locks)
    q, k, v = split_heads(qkv, heads, kv_heads, head_dim)
    expected = rotary_embedding_into_cache(
        positions, q, k, v, cos_sin, two_cache[0], two_cache[1], slots
    )
    weight = _weight(tensors, locks)
    query = w4a16_rotary_into_cache(x, weight, positions, cos_sin, cache[0], cache[1], slots, heads)
    assert len(ran) == 1  # w4a16 took the mma.sync form, as the fused call does
    # The same sums, rounded where w4a16 stores them, rotated as the rotary kernel does.
    assert query.shape == (1, heads, head_dim) and query.dtype == dtype
    assert torch.equal(query, expected)
    assert torch.equal(cache, two_cache)
    if locks is not None:
        assert int(locks.abs().sum()) == 0
    ref_query = w4a16_rotary_into_cache_ref(
        x, weight, positions, cos_sin, ref_cache[0], ref_cache[1], slots, heads
    )
    torch.testing.assert_close(query.float(), ref_query.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=3e-2, rtol=2e-2)


@gpu
@pytest.mark.gpu
def test_negative_slot_leaves_the_cache_on_the_gpu():
    x, tensors, positions, cos_sin, cache, _ = _case(32, 8, 128, 4096, 128, torch.bfloat16,
                                                     "cuda")  # fmt: skip
    before = cache.clone()
    slots = torch.tensor([-1], device="cuda")
    query = w4a16_rotary_into_cache(
        x, _weight(tensors, new_split_k_locks(x.device)), positions, cos_sin, cache[0],
        cache[1], slots, 32,
    )  # fmt: skip
    assert query is not None and torch.equal(cache, before)


@gpu
@pytest.mark.gpu
def test_cuda_graph_replays_the_fused_form():
    x, tensors, positions, cos_sin, cache, slots = _case(32, 8, 128, 4096, 128, torch.bfloat16,
                                                         "cuda")  # fmt: skip
    weight = _weight(tensors, new_split_k_locks(x.device))
    args = (positions, cos_sin, cache[0], cache[1], slots, 32)
    w4a16_rotary_into_cache(x, weight, *args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        query = w4a16_rotary_into_cache(x, weight, *args)
    for seed in range(3):
        x.copy_(torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)).cuda())
        positions.fill_(seed + 3)
        graph.replay()
        ref_cache = cache.clone()
        ref = w4a16_rotary_into_cache_ref(x, weight, positions, cos_sin, ref_cache[0],
                                          ref_cache[1], slots, 32)  # fmt: skip
        torch.testing.assert_close(query.float(), ref.float(), atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(cache.float(), ref_cache.float(), atol=3e-2, rtol=2e-2)


def test_silu_mul_not_taken_on_the_cpu_and_checks_its_input():
    tensors = make_weight(256, 128, 128, zeros=False, act_order=False)
    gate_up = torch.randn(1, 512).to(torch.bfloat16)
    assert w4a16_silu_mul(gate_up, _weight(tensors)) is None
    with pytest.raises(ValueError, match="even width"):
        w4a16_silu_mul(torch.randn(1, 511).to(torch.bfloat16), _weight(tensors))
    with pytest.raises(ValueError, match="gate_up has 768 columns; the weight's 256"):
        w4a16_silu_mul(torch.randn(1, 768).to(torch.bfloat16), _weight(tensors))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hidden", "inter", "group", "split"),
    [(4096, 14336, 128, True), (896, 4864, 32, True), (512, 1536, 64, True),
     (512, 1536, 64, False)],
    ids=["llama-8b", "qwen-0.5b", "groups-64", "groups-64-one-program"],
)  # fmt: skip
@pytest.mark.parametrize(("zeros", "act_order"), [(False, False), (True, True)],
                         ids=["sym", "zeros-act-order"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("stage_row", ["0", "1"], ids=["rows-staged", "row-staged"])
def test_silu_mul_equals_the_two_kernels_on_the_gpu(
    monkeypatch, hidden, inter, group, split, zeros, act_order, dtype, stage_row
):  # fmt: skip
    """The 8B and 0.5B downs with their splits, a small one with and without. Storing the
    row alone, each case stages (`staged_steps`); storing every operand column, those
    gathered through `perm` and the small one unsplit (32 KiB) do not, and the call is
    then left to the caller."""
    monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGE_ROW", stage_row)
    tensors = make_weight(inter, hidden, group, zeros=zeros, act_order=act_order, dtype=dtype,
                          device="cuda")  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    gate_up = (2 * torch.randn(1, 2 * inter, generator=gen)).to(dtype).cuda()
    locks = new_split_k_locks(gate_up.device) if split else None
    launch = w4a16_mma.mma_launch(1, hidden, inter, group, dtype, gate_up.device)
    if locks is None:
        launch = launch._replace(split_k=1)
    staged = w4a16_mma_staging.staged_steps(1, inter, launch, gate_up.element_size(), act_order)
    assert staged or stage_row == "0"
    got = w4a16_silu_mul(gate_up, _weight(tensors, locks))
    if not staged:
        assert got is None
        return
    assert got is not None
    # The activation rounded as silu_and_mul rounds it, the same sums: the same bits.
    assert torch.equal(got, w4a16(silu_and_mul(gate_up), **tensors, locks=locks))
    ref = w4a16_silu_mul_ref(gate_up, _weight(tensors))
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
    if locks is not None:
        assert int(locks.abs().sum()) == 0


@gpu
@pytest.mark.gpu
def test_silu_mul_left_to_the_caller_where_not_staged(monkeypatch):
    tensors = make_weight(14336, 4096, 128, zeros=False, act_order=False, device="cuda")
    gate_up = torch.randn(2, 2 * 14336, device="cuda").to(torch.bfloat16)
    assert w4a16_silu_mul(gate_up, _weight(tensors)) is None  # two rows
    monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGED", "0")
    assert w4a16_silu_mul(gate_up[:1], _weight(tensors)) is None
