"""The LoRA kernels (shrink, expand, and both fused for a few rows) against their float32
PyTorch references: rows without an adapter left alone, adapters of different ranks in one
step (zero-padded to the slots' rank), merged layers of unequal slices, K split, unused
tiles of a fixed-size table, output rows with a stride (a view of a wider tensor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchlm.kernels.activation import silu_and_mul
from batchlm.kernels.lora_act_shrink import (
    silu_and_mul_lora_shrink,
    silu_and_mul_lora_shrink_ref,
)
from batchlm.kernels.lora_expand import column_blocks, lora_expand, lora_expand_ref
from batchlm.kernels.lora_fused import FUSED_MAX_ROWS, lora_fused, lora_fused_ref
from batchlm.kernels.lora_shrink import (
    lora_shrink,
    lora_shrink_ref,
    max_slot_tiles,
    slot_tiles,
)

from .helpers import ELEMENTWISE_TOLERANCE, assert_close, gpu_only

# The expand adds a float32 sum into a 16-bit output (one rounding), from shrink sums rounded
# to the adapter's dtype: one or two units in the last place of the output.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def make_slots(
    num_slots: int,
    slices: list[int],
    rank: int,
    k: int,
    ranks: list[int],
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B of `num_slots` adapters, each of rank `ranks[slot]` (<= `rank`), zero past it,
    as views of one flat buffer per slot (as the engine lays them out, with a gap)."""
    gen = torch.Generator().manual_seed(seed)
    num_s, num_n = len(slices), sum(slices)
    a_size, b_size = num_s * rank * k, num_n * rank
    flat = torch.zeros(num_slots, a_size + b_size + 8, dtype=dtype)
    a = flat[:, :a_size].view(num_slots, num_s, rank, k)
    b = flat[:, a_size + 8 :].view(num_slots, num_n, rank)
    for slot, r in enumerate(ranks):
        a[slot, :, :r] = (torch.randn(num_s, r, k, generator=gen) / k**0.5).to(dtype)
        b[slot, :, :r] = (torch.randn(num_n, r, generator=gen) / r**0.5).to(dtype)
    flat = flat.to(device)
    return (
        flat[:, :a_size].view(num_slots, num_s, rank, k),
        flat[:, a_size + 8 :].view(num_slots, num_n, rank),
    )


def starts_of(slices: list[int]) -> list[int]:
    return [0, *np.cumsum(slices).tolist()]


def test_rows_are_grouped_by_slot_into_tiles():
    slots = np.array([2, -1, 0, 2, 2, -1, 0, 2, 1])
    token_ids, tiles = slot_tiles(slots, tile_rows=2)
    assert token_ids.tolist() == [2, 6, 8, 0, 3, 4, 7]
    assert tiles.tolist() == [[0, 0, 2], [1, 2, 1], [2, 3, 2], [2, 5, 2]]
    assert len(tiles) <= max_slot_tiles(len(slots), 3, 2)
    token_ids, tiles = slot_tiles(np.full(5, -1), tile_rows=16)
    assert token_ids.shape == (0,) and tiles.shape == (0, 3)


@pytest.mark.parametrize(
    ("dtype", "num_m", "slices", "k", "tile_rows", "split_k"),
    [
        (torch.float32, 37, [48, 16, 16], 96, 16, 1),  # q | k | v, three tiles for slot 1
        (torch.float32, 9, [40], 160, 16, 4),  # a plain layer, K split in 4 (ragged last)
        (torch.bfloat16, 21, [32, 32], 64, 16, 2),  # gate | up
        (torch.float16, 40, [48, 16, 16], 64, 32, 1),
        gpu_only(torch.bfloat16, 700, [4096, 1024, 1024], 4096, 64, 1),
        gpu_only(torch.bfloat16, 256, [14336, 14336], 4096, 16, 4),
    ],
)
def test_shrink_and_expand_match_their_references(
    dtype, num_m, slices, k, tile_rows, split_k, device
):
    num_slots, rank = 3, 16
    a, b = make_slots(num_slots, slices, rank, k, [16, 4, 8], dtype, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_m, k, generator=gen).to(dtype).to(device)
    # Rows of slot 1 outnumber a tile; rows without an adapter in between.
    pattern = [-1, 0, 1, 1, 2]
    slots = torch.tensor([pattern[i % 5] for i in range(num_m)], dtype=torch.int32)
    token_ids, tiles = slot_tiles(slots.numpy(), tile_rows)
    # A fixed-size table as a CUDA graph holds it: unused tiles at the end.
    table = np.zeros((max_slot_tiles(num_m, num_slots, tile_rows), 3), np.int32)
    table[: len(tiles)] = tiles
    token_ids_dev = torch.from_numpy(token_ids).to(device)
    tiles_dev = torch.from_numpy(table).to(device)
    slots_dev = slots.to(device)

    shrunk = lora_shrink(
        x, a, token_ids_dev, tiles_dev, tile_rows=tile_rows, split_k=split_k, block_k=32
    )
    expected_shrunk = lora_shrink_ref(x, a, slots_dev)
    adapted = slots_dev >= 0
    torch.testing.assert_close(
        shrunk.sum(0)[adapted], expected_shrunk[adapted], atol=1e-4, rtol=1e-4
    )

    # The output: a view of wider rows, as a merged layer's slice would be.
    wide = torch.randn(num_m, sum(slices) + 8, generator=gen).to(dtype).to(device)
    out = wide[:, 4 : 4 + sum(slices)]
    before = out.clone()
    expected = lora_expand_ref(expected_shrunk, b, out.clone(), slots_dev, starts_of(slices))
    blocks = column_blocks(starts_of(slices), 32, device)
    lora_expand(shrunk, b, out, token_ids_dev, tiles_dev, blocks, tile_rows=tile_rows, block_n=32)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(out[~adapted], before[~adapted])  # bit for bit
    assert torch.equal(wide[:, :4], wide[:, :4].clone()) and not torch.isnan(wide).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_m", [1, 3, FUSED_MAX_ROWS])
def test_fused_kernel_matches_the_two_kernel_reference(dtype, num_m, device):
    slices = [48, 16, 16]
    k, rank = 80, 8  # a rank below 16 (padded in the kernel), K not a multiple of the tile
    a, b = make_slots(2, slices, rank, k, [8, 2], dtype, device)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(num_m, k, generator=gen).to(dtype).to(device)
    slots = torch.tensor([1, -1, 0, 1][:num_m], dtype=torch.int32, device=device)
    out = torch.randn(num_m, sum(slices), generator=gen).to(dtype).to(device)
    before = out.clone()
    expected = lora_fused_ref(x, a, b, out.clone(), slots, starts_of(slices))
    blocks = column_blocks(starts_of(slices), 32, device)
    lora_fused(x, a, b, out, slots, blocks, block_n=32, block_k=32)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(out[slots < 0], before[slots < 0])
    if num_m > 1:
        assert not torch.equal(out[slots >= 0], before[slots >= 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_m", [1, FUSED_MAX_ROWS])
def test_shrink_folded_into_the_activation_matches_the_reference(dtype, num_m, device):
    # down_proj after SiLU-and-mul: the activation stores the shrink's sums per column block
    # (the last block ragged), and the fused kernel adds them up instead of reading A.
    d, num_n, rank = 200, 48, 8
    a, b = make_slots(2, [num_n], rank, d, [8, 3], dtype, device)
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(num_m, 2 * d, generator=gen) * 3).to(dtype).to(device)
    slots = torch.tensor([1, -1, 0, 1][:num_m], dtype=torch.int32, device=device)
    act, partials = silu_and_mul_lora_shrink(gate_up, a, slots, block=64)
    expected_act, _ = silu_and_mul_lora_shrink_ref(gate_up, a, slots)
    expected_shrunk = lora_shrink_ref(act, a, slots)  # of the kernel's own activation
    assert partials.shape == (4, num_m, 16)  # 200 columns in blocks of 64, rank 8 padded
    assert torch.equal(act, silu_and_mul(gate_up))  # the activation kernel's bits
    assert_close(act, expected_act, ELEMENTWISE_TOLERANCE)
    torch.testing.assert_close(
        partials.sum(0)[:, :rank], expected_shrunk[:, 0], atol=1e-4, rtol=1e-4
    )
    assert not partials[:, :, rank:].any() and not partials[:, slots < 0].any()

    out = torch.randn(num_m, num_n, generator=gen).to(dtype).to(device)
    before = out.clone()
    expected = lora_fused_ref(act, a, b, out.clone(), slots, [0, num_n])
    blocks = column_blocks([0, num_n], 32, device)
    lora_fused(act, a, b, out, slots, blocks, block_n=32, block_k=32, partials=partials)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(out[slots < 0], before[slots < 0])
    assert not torch.equal(out[slots >= 0], before[slots >= 0])


def test_no_adapted_row_leaves_the_output_alone(device):
    a, b = make_slots(2, [32], 16, 32, [16, 16], torch.float32, device)
    x = torch.randn(3, 32, device=device)
    out = torch.randn(3, 32, device=device)
    before = out.clone()
    slots = torch.full((3,), -1, dtype=torch.int32, device=device)
    blocks = column_blocks([0, 32], 16, device)
    lora_fused(x, a, b, out, slots, blocks, block_n=16)
    table = torch.zeros((2, 3), dtype=torch.int32, device=device)  # every tile unused
    none = torch.zeros(0, dtype=torch.int32, device=device)
    shrunk = lora_shrink(x, a, none, table, tile_rows=16)
    lora_expand(shrunk, b, out, none, table, blocks, tile_rows=16, block_n=16)
    assert torch.equal(out, before)


def test_launchers_name_bad_arguments(device):
    a, b = make_slots(2, [32], 16, 32, [16, 16], torch.float32, device)
    x = torch.randn(5, 32, device=device)
    slots = torch.zeros(5, dtype=torch.int32, device=device)
    blocks = column_blocks([0, 32], 16, device)
    table = torch.zeros((1, 3), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="at most 4 rows"):
        lora_fused(x, a, b, torch.zeros(5, 32, device=device), slots, blocks, block_n=16)
    with pytest.raises(ValueError, match="lora_a has size 32 in dimension 3"):
        lora_shrink(torch.randn(5, 48, device=device), a, slots, table, tile_rows=16)
    with pytest.raises(ValueError, match="tile_rows=12"):
        lora_shrink(x, a, slots, table, tile_rows=12)
    with pytest.raises(ValueError, match="takes at most 4 rows, x has 5"):
        silu_and_mul_lora_shrink(torch.randn(5, 64, device=device), a, slots)
    merged_a, merged_b = make_slots(2, [16, 16], 16, 32, [16, 16], torch.float32, device)
    parts = torch.zeros(1, 2, 16, device=device)
    with pytest.raises(ValueError, match="lora_a has size 2 in dimension 1"):
        silu_and_mul_lora_shrink(torch.randn(2, 64, device=device), merged_a, slots[:2])
    with pytest.raises(ValueError, match="one-slice layers, lora_a has 2 slices"):
        lora_fused(
            x[:2],
            merged_a,
            merged_b,
            torch.zeros(2, 32, device=device),
            slots[:2],
            column_blocks([0, 16, 32], 16, device),
            block_n=16,
            partials=parts,
        )
    with pytest.raises(ValueError, match="partials has size 3 in dimension 1"):
        lora_fused(
            x[:2],
            a,
            b,
            torch.zeros(2, 32, device=device),
            slots[:2],
            blocks,
            block_n=16,
            partials=torch.zeros(1, 3, 16, device=device),
        )
