"""The matrix-vector form of the W4A16 GEMM (`gpu_kernels/w4a16_gemv.py`) against its reference:
one row, scale groups of 32, 64, 128 and one per channel, symmetric and not, activation
order on and off, K split and not, steps within a group and over whole groups, the weights
loaded a step ahead and not, widths that divide N and not; how launches are fitted to a
layer and the untuned one-row launch."""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels.w4a16 import fit_launch, new_split_k_locks, w4a16, w4a16_ref
from batchlm.kernels.w4a16_launch import W4a16Launch, W4a16Shape, choose_w4a16_launch

from .test_w4a16 import check, make_weight

NUM_K = 512

# (block_n, block_k, split_k, num_warps, num_stages) from the tuner's pool, on 160 outputs
# (block_n 32 divides it; the others leave a partial tile).
LAUNCHES = {
    "128x128-prefetch": (128, 128, 1, 4, 2),
    "256x128-split2": (256, 128, 2, 8, 2),
    "32x256-split4-no-prefetch": (32, 256, 4, 4, 1),
    "64x512-split2": (64, 512, 2, 8, 2),
}


@pytest.mark.parametrize("launch", list(LAUNCHES.values()), ids=list(LAUNCHES))
@pytest.mark.parametrize(
    ("group_size", "zeros", "act_order"),
    [(32, True, False), (64, False, True), (128, True, True), (NUM_K, False, False)],
    ids=["g32-asym", "g64-sym-act-order", "g128-asym-act-order", "channel-sym"],
)
def test_one_row_matches_reference(group_size, zeros, act_order, launch, device):
    weight = make_weight(NUM_K, 160, group_size, zeros=zeros, act_order=act_order,
                         device=device, seed=group_size)  # fmt: skip
    x = torch.randn(1, NUM_K, generator=torch.Generator().manual_seed(group_size)).to(device)
    block_n, block_k, split_k, num_warps, num_stages = launch
    check(x.to(torch.bfloat16), weight, new_split_k_locks(x.device), block_m=1,
          block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
          num_stages=num_stages)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_one_row_in_float32_and_float16(dtype, device):
    """Tolerances of a float32 reference: the per-group scale after the products costs no
    precision (the nibbles become floats exactly)."""
    weight = make_weight(NUM_K, 96, 64, zeros=True, act_order=True, dtype=dtype, device=device)
    x = torch.randn(1, NUM_K, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
    check(x, weight, new_split_k_locks(x.device), block_m=1, block_n=64, block_k=256,
          split_k=2, num_stages=2)  # fmt: skip


def test_one_row_extreme_nibbles(device):
    """Every nibble 0 or 15 against zero points 0 and 15: the largest weights each way."""
    weight = make_weight(256, 64, 32, zeros=True, act_order=False, device=device)
    gen = torch.Generator().manual_seed(6)
    full = torch.rand(weight["qweight"].shape, generator=gen) < 0.5
    weight["qweight"] = torch.where(full, -1, 0).to(torch.int32).to(device)  # 0xFFFFFFFF or 0
    extreme = torch.randint(0, 2, weight["zeros"].shape, generator=gen, dtype=torch.uint8) * 15
    weight["zeros"] = extreme.to(device)
    x = torch.randn(1, 256, generator=gen).to(device)
    check(x.to(torch.float32), weight, None, block_m=1, block_n=64, block_k=64)


def test_steps_may_span_whole_groups_in_one_row_only():
    """The matrix-vector form keeps a `block_k` that is a multiple of the group (whole
    groups per step); the tl.dot form halves it to the group. Either halves it until it
    divides K."""
    one_row = W4a16Launch(1, 128, 512, 8, 4, 2)
    tiles = W4a16Launch(16, 64, 512, 8, 4, 3)
    assert fit_launch(one_row, 4096, 128, False, 32).block_k == 512
    assert fit_launch(tiles, 4096, 128, False, 32).block_k == 128
    assert fit_launch(one_row, 4096, 4096, False, 32).block_k == 512  # one group per channel
    assert fit_launch(one_row, 768, 96, False, 32).block_k == 32  # 96 is no power of two
    assert fit_launch(one_row, 1536, 128, False, 32) == one_row._replace(block_k=512, split_k=1)


def test_untuned_one_row_launch_is_the_matrix_vector_form():
    """128 outputs by 128 features a step, loaded a step ahead, K split until the programs
    number about four per SM (gate|up of Llama-3.1-8B on 132 SMs: 224 tiles, split 2)."""
    shape = W4a16Shape("untuned", 28672, 4096, 128, "bfloat16")
    assert choose_w4a16_launch(1, shape, 132, table={}) == W4a16Launch(1, 128, 128, 2, 4, 2)
    down = W4a16Shape("untuned", 4096, 14336, 128, "bfloat16")
    assert choose_w4a16_launch(1, down, 132, table={}).split_k == 16


def test_one_row_of_a_wider_batch_through_the_row_form(device):
    """Rows a stride apart, each its own program, K split; the counters end at zero."""
    weight = make_weight(256, 48, 64, zeros=True, act_order=True, device=device)
    xs = torch.randn(5, 320, generator=torch.Generator().manual_seed(7)).to(device)
    x = xs[1:4, :256].to(torch.float16)
    locks = new_split_k_locks(x.device)
    got = w4a16(x, **weight, locks=locks, block_m=1, block_n=16, block_k=64, split_k=4)
    ref = w4a16_ref(x, **weight)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=5e-3)
    assert int(locks.abs().sum()) == 0
