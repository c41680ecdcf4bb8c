"""The W4A16 GEMM against its reference (the weight dequantized in float32), for every form
of launch (matrix-vector, split-K, tl.dot tiles with the activations or the weight first,
dequantize + cuBLAS), contiguous groups and per-feature groups, activation order on and
off; its launch table; its argument checks."""

from __future__ import annotations

import json

import pytest
import torch

from batchlm.kernels import w4a16 as w4a16_module
from batchlm.kernels import w4a16_gemv
from batchlm.kernels.launch import device_name
from batchlm.kernels.w4a16 import (
    dequantize_int4,
    dequantize_int4_ref,
    new_split_k_locks,
    unpack_int4_ref,
    w4a16,
    w4a16_ref,
)
from batchlm.kernels.w4a16_launch import (
    CUBLAS,
    W4a16Launch,
    W4a16Shape,
    choose_w4a16_launch,
    load_w4a16_table,
    table_entry,
)

from .compile_sm90 import recording
from .helpers import ON_GPU, gpu_only

# The reference multiplies the float32 weight in float32; the kernel feeds tl.dot the
# weight rounded to the activation dtype (and sums in another order): about an ulp of the
# output in half precision.
TOLERANCE = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-2, 5e-3),
    torch.bfloat16: (1e-1, 2e-2),
}


def make_weight(
    num_k: int,
    num_n: int,
    group_size: int,
    *,
    zeros: bool,
    act_order: bool,
    per_feature_groups: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict:
    """Random int4 tensors in the kernel's layout, weights of about unit spread."""
    gen = torch.Generator().manual_seed(seed)
    num_groups = num_k // group_size
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (num_k // 8, num_n), generator=gen, dtype=torch.int32
    )
    scales = (0.5 + torch.rand(num_groups, num_n, generator=gen)) / (4.6 * num_k**0.5)
    tensors = dict(qweight=qweight, scales=scales.to(dtype), group_size=group_size)
    tensors["zeros"] = (
        torch.randint(0, 17, (num_groups, num_n), generator=gen, dtype=torch.uint8)
        if zeros
        else None
    )
    if act_order:
        tensors["perm"] = torch.randperm(num_k, generator=gen).to(torch.int32)
    if per_feature_groups:
        tensors["g_idx"] = torch.randint(0, num_groups, (num_k,), generator=gen).to(torch.int32)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


def record_form_launches(monkeypatch, module, name: str) -> list:
    """The `launch` of each call `w4a16` makes to `name`, a register-operand form's launcher
    from `module`; the calls still run."""
    calls: list = []
    launcher = getattr(module, name)
    monkeypatch.setattr(
        f"batchlm.kernels.w4a16.{name}",
        lambda *a, **kw: calls.append(kw["launch"]) or launcher(*a, **kw),
    )
    return calls


def check(x: torch.Tensor, weight: dict, locks: torch.Tensor | None = None, **launch) -> None:
    ref = w4a16_ref(x, **weight)
    got = w4a16(x, **weight, locks=locks, **launch)
    assert got.shape == ref.shape and got.dtype == x.dtype
    atol, rtol = TOLERANCE[x.dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    if locks is not None:
        assert int(locks.abs().sum()) == 0  # the last program of each tile reset its counter


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_kernel_matches_reference(rows, group_size, act_order, device):
    """The default launch of each row count (the matrix-vector form at 1 row, split-K
    tiles at 7 and 64, wide tiles at 300), zero points on one group size in two."""
    weight = make_weight(256, 80, group_size, zeros=group_size != 64, act_order=act_order,
                         device=device, seed=rows + group_size)  # fmt: skip
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(device)
    check(x.to(torch.bfloat16), weight, new_split_k_locks(x.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "launch",
    [
        dict(block_m=1, block_n=32, block_k=32, split_k=4),  # matrix-vector, split
        dict(block_m=16, block_n=32, block_k=64, split_k=2),  # tiles, split
        dict(block_m=32, block_n=64, block_k=32, split_k=1),
        dict(block_m=16, block_n=64, block_k=32, split_k=2, swap_ab=True),
        dict(backend=CUBLAS),
    ],
    ids=["row-split4", "tile-split2", "tile", "swap-ab-split2", "cublas"],
)
def test_every_launch_form(launch, dtype, device):
    weight = make_weight(256, 72, 64, zeros=True, act_order=True, dtype=dtype, device=device)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    check(x, weight, new_split_k_locks(x.device), **launch)


@pytest.mark.parametrize(
    ("rows", "launch"), [(1, {}), (9, {}), (9, dict(block_m=16, swap_ab=True))],
    ids=["row", "tile", "swap-ab"],
)  # fmt: skip
def test_groups_given_per_feature(rows, launch, device):
    """`g_idx` (a rank's share of an activation-ordered layer): any group for any feature,
    every group's scales kept."""
    weight = make_weight(192, 48, 32, zeros=True, act_order=True, per_feature_groups=True,
                         device=device)  # fmt: skip
    weight["group_size"] = 64  # only bounds the step when groups are given per feature
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(2)).to(device)
    check(x.to(torch.bfloat16), weight, new_split_k_locks(x.device), split_k=2, **launch)


@pytest.mark.parametrize(
    ("rows", "group_size", "zeros", "act_order", "split_k", "dtype"),
    [
        (7, 32, True, True, 2, torch.bfloat16),
        (7, 64, False, False, 1, torch.float32),
        (64, 128, True, False, 2, torch.float32),
        (64, 32, False, True, 1, torch.bfloat16),
        (300, 64, True, True, 1, torch.bfloat16),  # activations gathered before the kernel
        (300, 128, False, False, 2, torch.float32),
    ],
    ids=str,
)
def test_swap_ab_matches_reference(rows, group_size, zeros, act_order, split_k, dtype, device):
    """The weight-first `tl.dot` form: every row count, group size, zero points, activation
    order, split and dtype at least once, over a partial tile of rows and of outputs."""
    weight = make_weight(256, 80, group_size, zeros=zeros, act_order=act_order, dtype=dtype,
                         device=device, seed=rows + group_size)  # fmt: skip
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x = x.to(device)
    launch = dict(block_m=16 if rows < 64 else 64, block_n=64, block_k=64, split_k=split_k)
    check(x, weight, new_split_k_locks(x.device), swap_ab=True, **launch)


def test_swap_ab_is_the_tables_choice_and_one_row_keeps_the_row_form():
    """A table's weight-first launch reaches the kernel; a one-row bucket, or an override of
    `block_m=1`, still takes the matrix-vector kernel (recorded, not run)."""
    table = {
        SHAPE: [
            (1, W4a16Launch(1, 32, 64, 4, 4, 3)),
            (64, W4a16Launch(16, 64, 64, 2, 4, 3, swap_ab=True)),
        ]
    }
    weight = make_weight(256, 80, 64, zeros=True, act_order=False)
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    locks = new_split_k_locks(x.device)
    with (
        recording(w4a16_module, "_w4a16_kernel") as tiles,
        recording(w4a16_gemv, "_w4a16_gemv_kernel") as rows,
    ):
        for num_m, launch in ((1, {}), (2, {}), (64, {}), (2, dict(block_m=1))):
            w4a16(x[:num_m], **weight, locks=locks, table=table, **launch)
    assert len(rows) == 2
    assert [t.kwargs["SWAP_AB"] for t in tiles] == [True, True]
    assert [t.kwargs["BLOCK_M"] for t in tiles] == [16, 16]


def test_rows_of_a_wider_batch(device):
    """x a slice of rows with a row stride wider than K; a split without counters runs
    unsplit."""
    weight = make_weight(128, 40, 32, zeros=False, act_order=False, device=device)
    xs = torch.randn(6, 160, generator=torch.Generator().manual_seed(3)).to(device)
    check(xs[1:4, :128].to(torch.float32), weight, None, split_k=4)


def test_reference_dequantizes_as_the_layout_says():
    """Word `(i, n)` holds feature `8i + j` in bits `4j`; W = (q - zero) * scale."""
    qweight = torch.tensor([[0x76543210, 0x0000000F]], dtype=torch.int32)  # K = 8, N = 2
    assert unpack_int4_ref(qweight)[:, 0].tolist() == list(range(8))
    assert unpack_int4_ref(qweight)[:, 1].tolist() == [15] + [0] * 7
    scales = torch.tensor([[0.5, 2.0]])
    zeros = torch.tensor([[3, 1]], dtype=torch.uint8)
    w = dequantize_int4_ref(qweight, scales, zeros, group_size=8)
    assert w[:, 0].tolist() == [(j - 3) * 0.5 for j in range(8)]
    assert w[:, 1].tolist() == [28.0] + [-2.0] * 7
    assert dequantize_int4_ref(qweight, scales, None, group_size=8)[0, 0] == -4.0  # zero 8


def test_dequantize_into_a_given_buffer(device):
    """`out` receives the weight (rows in activation order) that a fresh tensor would, at
    any launch; a buffer of the wrong shape or layout is refused by name."""
    weight = make_weight(128, 48, 32, zeros=True, act_order=True, device=device, seed=3)
    args = (weight["qweight"], weight["scales"], weight["zeros"], 32, weight["perm"], None)
    want = dequantize_int4(*args, torch.float32)
    ref = dequantize_int4_ref(weight["qweight"], weight["scales"], weight["zeros"], 32)
    unsorted = torch.empty_like(ref)
    unsorted[weight["perm"].long()] = ref
    torch.testing.assert_close(want, unsorted)
    buffer = torch.full((2 * 128 * 48,), float("nan"), device=want.device)
    out = buffer[: 128 * 48].view(128, 48)
    got = dequantize_int4(*args, torch.float32, block_n=16, block_k=16, num_warps=2, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    assert bool(buffer[128 * 48 :].isnan().all())  # nothing written past it
    with pytest.raises(ValueError, match="out has size 48 in dimension 0"):
        dequantize_int4(*args, torch.float32, out=buffer[: 128 * 48].view(48, 128))
    with pytest.raises(ValueError, match="out must be contiguous"):
        dequantize_int4(*args, torch.float32, out=buffer.view(128, 96)[:, :48])


def test_operands_are_checked(device):
    weight = make_weight(64, 16, 32, zeros=True, act_order=True, device=device)
    x = torch.randn(2, 64).to(device)
    with pytest.raises(ValueError, match="qweight has size 8 in dimension 0.*expected 4"):
        w4a16(x[:, :32], **weight)
    with pytest.raises(ValueError, match="scales has 2 groups of group_size=16"):
        w4a16(x, **{**weight, "group_size": 16})
    with pytest.raises(ValueError, match="zeros has dtype torch.int32"):
        w4a16(x, **{**weight, "zeros": weight["zeros"].int()})
    with pytest.raises(ValueError, match="perm has dtype torch.int64"):
        w4a16(x, **{**weight, "perm": weight["perm"].long()})
    with pytest.raises(ValueError, match="unknown launch options"):
        w4a16(x, **weight, block_q=4)
    with pytest.raises(ValueError, match="split_k=3 must be a power of two"):
        w4a16(x, **weight, split_k=3)
    with pytest.raises(ValueError, match="swap_ab='yes' must be True or False"):
        w4a16(x, **weight, swap_ab="yes")
    with pytest.raises(ValueError, match="swap_ab=True needs block_m >= 16"):
        w4a16(x, **weight, block_m=1, swap_ab=True)


# ---- the launch table ---------------------------------------------------------------

SHAPE = W4a16Shape("cpu", 80, 256, 64, "bfloat16")


def test_table_buckets_and_the_cublas_word(tmp_path, device):
    buckets = {
        1: W4a16Launch(1, 32, 64, 4, 4, 3),
        16: W4a16Launch(16, 64, 64, 2, 4, 3, swap_ab=True),
        64: W4a16Launch(16, 64, 64, 2, 4, 3),
        256: W4a16Launch(0, 0, 0, 1, 0, 0, CUBLAS),
    }
    path = tmp_path / "w4a16.json"
    path.write_text(json.dumps({"entries": [table_entry(SHAPE, buckets)]}))
    written = json.loads(path.read_text())["entries"][0]["launches"]
    # Six numbers as before; the weight-first form adds its word.
    assert written["1"] == [1, 32, 64, 4, 4, 3]
    assert written["16"] == [16, 64, 64, 2, 4, 3, "swap_ab"]
    table = load_w4a16_table(path)
    assert choose_w4a16_launch(16, SHAPE, 4, table) == buckets[16]
    assert choose_w4a16_launch(16, SHAPE, 4, table, block_m=1).swap_ab is False
    assert choose_w4a16_launch(1, SHAPE, 4, table) == buckets[1]
    assert choose_w4a16_launch(17, SHAPE, 4, table) == buckets[64]
    assert choose_w4a16_launch(5000, SHAPE, 4, table).backend == CUBLAS  # beyond the last
    # An override of a block size (or backend="triton") leaves the cuBLAS path.
    assert choose_w4a16_launch(300, SHAPE, 4, table, block_m=32).backend == "triton"
    # The table's launch runs (on a weight of that shape) and agrees with the reference.
    here = SHAPE._replace(device_name=device_name(torch.device(device)))
    table = {here: table[SHAPE]}
    weight = make_weight(256, 80, 64, zeros=True, act_order=False, device=device)
    x = torch.randn(300, 256).to(torch.bfloat16).to(device)
    ref = w4a16_ref(x, **weight)
    torch.testing.assert_close(w4a16(x, **weight, table=table).float(), ref.float(),
                               atol=1e-1, rtol=2e-2)  # fmt: skip


@pytest.mark.parametrize(
    ("launches", "match"),
    [
        ({"1": [1, 32, 64, 4, 4]}, "a launch is"),
        ({"1": [1, 32, 64, 3, 4, 3]}, "split_k=3"),
        ({"1": [8, 32, 64, 1, 4, 3]}, "block_m=8"),
        ({"x": [1, 32, 64, 1, 4, 3]}, "bucket 'x'"),
        ({"1": "cuda"}, "a launch is"),
        ({"1": [16, 32, 64, 1, 4, 3, "swapab"]}, "'swapab' after a launch's numbers"),
        ({"1": [16, 32, 64, 1, 4, 3, True]}, "True after a launch's numbers"),
        ({"1": [1, 32, 64, 1, 4, 3, "swap_ab"]}, "swap_ab=True needs block_m >= 16"),
        ({"1": [16, 32, 64, 1, 4, 3, "swap_ab", 1]}, "a launch is"),
    ],
)
def test_bad_table_entries_are_named(launches, match, tmp_path):
    entry = {**table_entry(SHAPE, {}), "launches": launches}
    path = tmp_path / "w4a16.json"
    path.write_text(json.dumps({"entries": [entry]}))
    with pytest.raises(ValueError, match=f"entry 0.*{match}"):
        load_w4a16_table(path)


def test_repository_table_is_valid():
    load_w4a16_table()  # absent or valid; each entry's launches are in range


# ---- the 8B model's shapes, on the GPU -----------------------------------------------

_LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.parametrize(
    ("num_n", "num_k"),
    [gpu_only(n, k) for n, k in _LLAMA_8B],
    ids=[f"{n}x{k}" for n, k in _LLAMA_8B],
)
@pytest.mark.parametrize("rows", [1, 16, 64, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama_8b_shapes_on_the_gpu(num_n, num_k, rows, dtype):
    weight = make_weight(num_k, num_n, 128, zeros=False, act_order=False, dtype=dtype,
                         device="cuda")  # fmt: skip
    x = torch.randn(rows, num_k, device="cuda", dtype=dtype)
    locks = new_split_k_locks(x.device)
    ref = w4a16_ref(x, **weight)
    got = w4a16(x, **weight, locks=locks)
    rel = (got.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 1e-2, rel
    assert int(locks.abs().sum()) == 0


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_graph_replays_the_split_k_launch():
    """A captured split-K call replays with new inputs (counters left zero each time)."""
    weight = make_weight(4096, 4096, 128, zeros=True, act_order=True, device="cuda")
    locks = new_split_k_locks(torch.device("cuda"))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w4a16(x, **weight, locks=locks, split_k=8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16(x, **weight, locks=locks, split_k=8)
    for seed in range(3):
        x.copy_(torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        ref = w4a16_ref(x, **weight)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-1, rtol=2e-2)
    assert int(locks.abs().sum()) == 0
