"""The mma.sync W4A16 form (`w4a16_mma.py`): the operand mapping its reshapes state, checked
in PyTorch against the weight layout; when `w4a16` takes it and with which split; on a GPU,
its products against the reference for every option it takes, in CUDA graphs, and that
`w4a16` ran it. (Triton's interpreter runs no Gluon: `compile_sm90` compiles it for sm_90
on the CPU and checks that it multiplies with mma.sync from registers.)"""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels import w4a16_mma, w4a16_mma_staging
from batchlm.kernels.w4a16 import new_split_k_locks, unpack_int4_ref, w4a16, w4a16_ref
from batchlm.kernels.w4a16_launch import MMA, W4a16Launch

from .helpers import ON_GPU
from .test_w4a16 import make_weight, record_form_launches

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def operands_as_the_kernel_builds_them(qweight, x, k0, n0, kt2, ntw, warps):
    """The kernel's steps in PyTorch: the words it loads at `[kt2, t, g, w, r]`, each
    word's 8 halves (half `2p + e` is nibble `p + 4e`), reshaped and permuted into the
    operand `[16 W NTW, 32 KT2]`; the activations `[kt2, t, j, m]` into `[32 KT2, M]`; and
    the output of each operand row."""
    kt, tt, gg, ww, rr = torch.meshgrid(
        torch.arange(kt2), torch.arange(4), torch.arange(8), torch.arange(warps),
        torch.arange(2 * ntw), indexing="ij",
    )  # fmt: skip
    words = qweight[k0 // 8 + kt * 4 + tt, n0 + ww * 16 * ntw + gg * 2 * ntw + rr]
    halves = torch.arange(8)
    nibbles = (words.unsqueeze(-1) >> ((halves // 2 + 4 * (halves % 2)) * 4)) & 0xF
    a = nibbles.reshape(kt2, 4, 8, warps, ntw, 2, 2, 2, 2).permute(4, 3, 5, 2, 0, 6, 7, 1, 8)
    a = a.reshape(16 * warps * ntw, 32 * kt2)
    kk, t2, jj = torch.meshgrid(torch.arange(kt2), torch.arange(4), torch.arange(8), indexing="ij")
    xs = x[:, k0 + kk * 32 + t2 * 8 + jj].permute(1, 2, 3, 0)  # [KT2, T, J, M]
    b = xs.reshape(kt2, 4, 2, 2, 2, -1).permute(0, 3, 4, 1, 2, 5).reshape(32 * kt2, -1)
    v = torch.arange(16 * warps * ntw)
    outputs = (
        n0 + ((v // 16) % warps) * 16 * ntw + (v % 8) * 2 * ntw + (v // (16 * warps)) * 2
        + (v // 8) % 2
    )  # fmt: skip
    return a, b, outputs


@pytest.mark.parametrize(("kt2", "ntw", "warps"), [(4, 2, 4), (1, 2, 4), (2, 1, 8)])
def test_operand_mapping_is_the_weight_times_the_activations(kt2, ntw, warps):
    """Summed over the step, the operand rows times the activation columns give exactly
    the step's share of `x W^T` for the outputs the rows stand for: every weight of the
    step's block is used once, at its own feature and output."""
    gen = torch.Generator().manual_seed(0)
    num_k, num_n, rows = 512, 512, 3
    qweight = torch.randint(-(2**31), 2**31 - 1, (num_k // 8, num_n), generator=gen,
                            dtype=torch.int32)  # fmt: skip
    x = torch.randint(-4, 5, (rows, num_k), generator=gen).double()
    k0, n0 = 64 * kt2, 16 * warps * ntw
    a, b, outputs = operands_as_the_kernel_builds_them(qweight, x, k0, n0, kt2, ntw, warps)
    q = unpack_int4_ref(qweight).double()  # [K, N]
    want = x[:, k0 : k0 + 32 * kt2] @ q[k0 : k0 + 32 * kt2, outputs]
    assert torch.equal((a.double() @ b).t(), want)
    assert sorted(outputs.tolist()) == list(range(n0, n0 + 16 * warps * ntw))


def test_not_taken_on_the_cpu():
    assert w4a16_mma.mma_launch(1, 4096, 4096, 128, torch.bfloat16, torch.device("cpu")) is None
    assert not w4a16_mma.mma_available(torch.device("cpu"))


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize(
    ("n", "k", "split_k"),
    [(6144, 4096, 8), (4096, 4096, 16), (28672, 4096, 2), (4096, 14336, 16)],
    ids=["qkv", "o", "gate_up", "down"],
)
def test_split_for_the_llama_8b_shapes_on_132_sms(monkeypatch, rows, n, k, split_k):
    """The splits measured fastest on the H200 (docs/performance.md): half as many ways
    for o and down from 4 rows on."""
    monkeypatch.setattr(w4a16_mma, "mma_available", lambda device: True)
    monkeypatch.setattr(w4a16_mma, "num_sms", lambda device: 132)
    if rows > 3:
        split_k = min(split_k, 8)
    launch = w4a16_mma.mma_launch(rows, n, k, 128, torch.bfloat16, torch.device("cuda"))
    assert launch is not None and launch.backend == MMA
    assert (launch.block_n, launch.block_k, launch.split_k) == (128, 128, split_k)


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize(
    ("n", "k", "staged", "row_staged"),
    [(6144, 4096, 4, 4), (4096, 4096, 2, 2), (28672, 4096, 0, 16), (4096, 14336, 8, 8)],
    ids=["qkv", "o", "gate_up", "down"],
)
def test_activations_staged_for_the_llama_8b_shapes(monkeypatch, rows, n, k, staged, row_staged):
    """At one row, the programs whose activations fit 16 KiB of shared memory stage them
    (down's 7 steps as 8); gate|up's 16 steps do not, nor do more rows (measured slower,
    docs/performance.md). Storing the row alone, gate|up's fit 8 KiB too."""
    monkeypatch.setattr(w4a16_mma, "mma_available", lambda device: True)
    monkeypatch.setattr(w4a16_mma, "num_sms", lambda device: 132)
    launch = w4a16_mma.mma_launch(rows, n, k, 128, torch.bfloat16, torch.device("cuda"))
    assert w4a16_mma_staging.staged_rows(launch) == 8
    assert w4a16_mma_staging.staged_steps(rows, k, launch, 2, gathered=False) == (
        staged if rows == 1 else 0
    )
    monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGE_ROW", "1")
    assert w4a16_mma_staging.staged_rows(launch) == 1
    want = row_staged if rows == 1 else 0
    assert w4a16_mma_staging.staged_steps(rows, k, launch, 2, gathered=False) == want
    monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGED", "0")
    assert w4a16_mma_staging.staged_steps(rows, k, launch, 2, gathered=False) == 0


def test_gathered_activations_staged_within_a_quarter(monkeypatch):
    """Activations gathered through `perm` stage within 4 KiB: the staging loads the indices
    too, in registers the steps need. The row alone stages within 8 KiB, gathered or not."""
    launch = W4a16Launch(8, 128, 32, 16, 4, 1, MMA)  # 4096 features: 8 steps of 32
    assert w4a16_mma_staging.staged_steps(1, 4096, launch, 2, gathered=True) == 8
    assert w4a16_mma_staging.staged_steps(1, 8192, launch, 2, gathered=True) == 0
    assert w4a16_mma_staging.staged_steps(1, 8192, launch, 2, gathered=False) == 16
    monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGE_ROW", "1")
    launch = W4a16Launch(8, 128, 128, 1, 4, 1, MMA)
    for gathered in (False, True):
        assert w4a16_mma_staging.staged_steps(1, 4096, launch, 2, gathered=gathered) == 32  # 8 KiB
        assert w4a16_mma_staging.staged_steps(1, 8192, launch, 2, gathered=gathered) == 0


@pytest.mark.parametrize(
    ("rows", "n", "k", "group", "dtype", "block_k"),
    [
        (9, 4096, 4096, 128, torch.bfloat16, None),  # more rows than the form holds
        (1, 4096, 4096, 128, torch.float32, None),  # float32 activations
        (1, 4000, 4096, 128, torch.bfloat16, None),  # N not a multiple of 128
        (1, 4096, 4096, 40, torch.bfloat16, None),  # groups not a multiple of 32
        (1, 4096, 4096, 64, torch.float16, 64),
        (1, 4096, 3072, 96, torch.bfloat16, 32),  # steps of 32 within groups of 96
        (1, 4096, 4096, 4096, torch.bfloat16, 128),  # one group per channel
    ],
)
def test_where_the_form_applies(monkeypatch, rows, n, k, group, dtype, block_k):
    monkeypatch.setattr(w4a16_mma, "mma_available", lambda device: True)
    monkeypatch.setattr(w4a16_mma, "num_sms", lambda device: 132)
    launch = w4a16_mma.mma_launch(rows, n, k, group, dtype, torch.device("cuda"))
    assert (launch and launch.block_k) == block_k


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("BATCHLM_W4A16_MMA", "0")
    assert not w4a16_mma.mma_available(torch.device("cuda"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("group_size", [32, 64, 128, 4096])
@pytest.mark.parametrize(
    ("rows", "staging"),
    [(1, "rows"), (1, "row"), (1, "off"), (3, "rows"), (5, "rows"), (8, "rows")],
)
def test_matches_reference_on_the_gpu(
    monkeypatch, rows, staging, group_size, zeros, act_order, dtype
):  # fmt: skip
    """At one row with the activations staged in shared memory where they fit (all operand
    columns, or the row alone, which gives the same sums; and once without), and from 2
    rows loaded a step ahead."""
    if staging == "off":
        monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGED", "0")
    ran = record_form_launches(monkeypatch, w4a16_mma, "launch_w4a16_mma")
    weight = make_weight(4096, 1024, group_size, zeros=zeros, act_order=act_order,
                         dtype=dtype, device="cuda")  # fmt: skip
    x = torch.randn(rows, 4096, device="cuda", dtype=dtype)
    locks = new_split_k_locks(x.device)
    got = w4a16(x, **weight, locks=locks)
    ref = w4a16_ref(x, **weight)
    rel = (got.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 1e-2, rel
    assert len(ran) == 1 and ran[0].backend == MMA
    assert int(locks.abs().sum()) == 0
    # No counters: one program per column, no split.
    torch.testing.assert_close(w4a16(x, **weight), got, atol=2e-2, rtol=2e-2)
    if staging == "row":  # the row in every operand column: column 0's sums unchanged
        monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGE_ROW", "1")
        torch.testing.assert_close(w4a16(x, **weight, locks=locks), got, atol=0, rtol=0)


@gpu
@pytest.mark.gpu
def test_extreme_nibbles_and_zeros_on_the_gpu():
    """All nibbles 0 or 15 and zero points 0 and 15: the halves' magic constants hold at
    both ends of the range."""
    for fill, zero in ((0, 15), (-1, 0)):
        weight = make_weight(1024, 256, 128, zeros=True, act_order=False, device="cuda")
        weight["qweight"].fill_(fill)
        weight["zeros"].fill_(zero)
        x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
        got = w4a16(x, **weight)
        ref = w4a16_ref(x, **weight)
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-1, rtol=2e-2)


@gpu
@pytest.mark.gpu
def test_cuda_graph_replays_the_form():
    weight = make_weight(4096, 28672, 128, zeros=False, act_order=False, device="cuda")
    locks = new_split_k_locks(torch.device("cuda"))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w4a16(x, **weight, locks=locks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16(x, **weight, locks=locks)
    for seed in range(3):
        x.copy_(torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        ref = w4a16_ref(x, **weight)
        rel = (out.float() - ref.float()).norm() / ref.float().norm()
        assert rel < 1e-2, rel
    assert int(locks.abs().sum()) == 0
