"""The wgmma W4A16 form (`w4a16_wgmma.py`): the operand its byte selection, reshapes and
permutations build, checked in PyTorch against the weight layout; when `w4a16` takes it
and with which tiles; on an sm_90 GPU, its products against the reference for every option
it takes, in CUDA graphs, and that `w4a16` ran it. (Triton's interpreter runs no Gluon:
`compile_sm90` compiles it for sm_90 on the CPU and checks that it multiplies with wgmma
from registers.)"""

from __future__ import annotations

import pytest
import torch

from batchlm.kernels import w4a16_wgmma
from batchlm.kernels.w4a16 import unpack_int4_ref, w4a16, w4a16_ref
from batchlm.kernels.w4a16_wgmma import WgmmaLaunch

from .helpers import ON_GPU
from .test_w4a16 import make_weight, record_form_launches

ON_SM90 = ON_GPU and torch.cuda.get_device_capability()[0] == 9
sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (wgmma)")


def prmt(a: torch.Tensor, b: torch.Tensor, selector: torch.Tensor) -> torch.Tensor:
    """PTX `prmt.b32 d, a, b, selector` (default mode, selectors below 8): byte `i` of d
    is byte `selector[4i .. 4i + 2]` of the 8 bytes `b:a` (a's bytes 0-3, b's 4-7)."""
    pool = torch.stack(
        [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    )
    out = torch.zeros_like(a)
    for i in range(4):
        index = (selector >> (4 * i)) & 0x7
        out |= torch.gather(pool, 0, index.unsqueeze(0)).squeeze(0) << (8 * i)
    return out


def operand_as_the_kernel_builds_it(qweight, k0, n0, block_k, nt, warps=4):
    """The kernel's step in PyTorch: words `[BLOCK_N, K8]` as TMA brings them, lane `t`'s
    register of each (`prmt` of the word and the word shifted by 4 with lane t's selector,
    then the `lop3` mask: low half nibble `2t`, high half `2t + 1`), reshaped and permuted
    into the operand `[BLOCK_N, BLOCK_K]` of nibbles; and each operand row's output."""
    block_n = 16 * warps * nt
    words = qweight[k0 // 8 : (k0 + block_k) // 8, n0 : n0 + block_n].t()  # [BLOCK_N, K8]
    t = torch.arange(4).view(1, 1, 4)
    selector = t | (t << 4) | ((t + 4) << 8) | ((t + 4) << 12)
    w = (words.long().unsqueeze(-1) & 0xFFFFFFFF).expand(-1, -1, 4)
    reg = prmt(w, w >> 4, selector.expand_as(w)) & 0x000F000F
    pairs = torch.stack([reg & 0xF, reg >> 16], dim=-1)  # [BLOCK_N, K8, T, E]
    if nt == 2:
        a = pairs.reshape(warps, 8, 2, 2, block_k).permute(2, 0, 3, 1, 4)
    else:
        a = pairs.reshape(warps, 8, 2, block_k).permute(0, 2, 1, 3)
    v = torch.arange(block_n)
    outputs = (
        n0 + 2 * nt * (8 * ((v // 16) % warps) + v % 8) + 2 * (v // (16 * warps)) + (v // 8) % 2
    )
    return a.reshape(block_n, block_k), outputs


@pytest.mark.parametrize(("block_k", "nt"), [(64, 2), (128, 1), (32, 1), (64, 1)])
def test_operand_rows_are_the_weights_of_their_outputs(block_k, nt):
    """Row `r` of the operand holds exactly the nibbles of the output it stands for, at
    their own features in order (TMA brings the activations unpermuted), and the rows
    cover the program's outputs once each."""
    gen = torch.Generator().manual_seed(0)
    num_k, num_n = 512, 512
    qweight = torch.randint(-(2**31), 2**31 - 1, (num_k // 8, num_n), generator=gen,
                            dtype=torch.int32)  # fmt: skip
    k0, n0 = 2 * block_k, 64 * nt
    a, outputs = operand_as_the_kernel_builds_it(qweight, k0, n0, block_k, nt)
    q = unpack_int4_ref(qweight)  # [K, N]
    assert torch.equal(a, q[k0 : k0 + block_k, outputs].t().long())
    assert sorted(outputs.tolist()) == list(range(n0, n0 + 64 * nt))


def test_not_taken_on_the_cpu():
    cpu = torch.device("cpu")
    assert w4a16_wgmma.wgmma_launch(256, 4096, 4096, 128, torch.bfloat16, cpu) is None
    assert not w4a16_wgmma.wgmma_available(cpu)


@pytest.mark.parametrize(
    ("rows", "n", "k", "group", "dtype", "launch"),
    [
        (64, 4096, 4096, 128, torch.bfloat16, None),  # below MIN_ROWS: the table's tiles
        (513, 4096, 4096, 128, torch.bfloat16, None),  # above MAX_ROWS: dequantize + cuBLAS
        (256, 4096, 4096, 128, torch.float32, None),  # float32 activations
        (256, 4000, 4096, 128, torch.bfloat16, None),  # N not a multiple of 64
        (256, 4096, 4096, 40, torch.bfloat16, None),  # groups not a multiple of 32
        (65, 4096, 4096, 128, torch.bfloat16, WgmmaLaunch(64, 64, 128, 4)),
        (256, 6144, 4096, 128, torch.bfloat16, WgmmaLaunch(64, 128, 128, 3)),
        (512, 4096, 14336, 128, torch.float16, WgmmaLaunch(64, 128, 128, 3)),
        (128, 28672, 4096, 128, torch.bfloat16, WgmmaLaunch(64, 128, 128, 3)),
        (256, 28672, 4096, 128, torch.bfloat16, WgmmaLaunch(64, 256, 64, 3)),
        (256, 4096, 4096, 32, torch.bfloat16, WgmmaLaunch(64, 128, 32, 3)),  # steps of 32
        (256, 4096, 3072, 96, torch.bfloat16, WgmmaLaunch(64, 128, 32, 3)),  # in groups of 96
        (256, 4096, 4096, 4096, torch.bfloat16, WgmmaLaunch(64, 128, 128, 3)),  # per channel
    ],
)
def test_where_the_form_applies_and_its_tiles(monkeypatch, rows, n, k, group, dtype, launch):
    """Rows 65-512 in 16-bit, the tiles measured fastest on the H200 (docs/performance.md),
    steps that stay within a scale group."""
    monkeypatch.setattr(w4a16_wgmma, "wgmma_available", lambda device: True)
    got = w4a16_wgmma.wgmma_launch(rows, n, k, group, dtype, torch.device("cuda"))
    assert got == launch


@pytest.mark.parametrize(
    ("rows", "form"), [(1, "mma"), (8, "mma"), (9, None), (64, None), (65, "wgmma"),
                       (512, "wgmma"), (513, None)],
)  # fmt: skip
def test_which_register_form_w4a16_takes(monkeypatch, rows, form):
    """mma.sync for 1-8 rows, wgmma for 65-512, neither in between or beyond."""
    from batchlm.kernels import w4a16_mma
    from batchlm.kernels.w4a16 import register_form_launch
    from batchlm.kernels.w4a16_launch import W4a16Launch

    monkeypatch.setattr(w4a16_mma, "mma_available", lambda device: True)
    monkeypatch.setattr(w4a16_mma, "num_sms", lambda device: 132)
    monkeypatch.setattr(w4a16_wgmma, "wgmma_available", lambda device: True)
    got = register_form_launch(rows, 4096, 4096, 128, torch.bfloat16, torch.device("cuda"))
    kind = "mma" if isinstance(got, W4a16Launch) else "wgmma" if got is not None else None
    assert kind == form
    if form == "wgmma":
        assert isinstance(got, WgmmaLaunch)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("BATCHLM_W4A16_WGMMA", "0")
    assert not w4a16_wgmma.wgmma_available(torch.device("cuda"))


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("zeros", [False, True], ids=["sym", "zeros"])
@pytest.mark.parametrize("group_size", [32, 64, 128, 2048])
@pytest.mark.parametrize("rows", [65, 128, 300, 512])
def test_matches_reference_on_the_gpu(monkeypatch, rows, group_size, zeros, act_order, dtype):
    ran = record_form_launches(monkeypatch, w4a16_wgmma, "launch_w4a16_wgmma")
    n = 28672 if rows == 300 else 384  # the wide layers' tiles too
    weight = make_weight(2048, n, group_size, zeros=zeros, act_order=act_order, dtype=dtype,
                         device="cuda")  # fmt: skip
    x = torch.randn(rows, 2048, device="cuda", dtype=dtype)
    got = w4a16(x, **weight)
    ref = w4a16_ref(x, **weight)
    rel = (got.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 1e-2, rel
    assert len(ran) == 1


@sm90
@pytest.mark.gpu
def test_extreme_nibbles_and_zeros_on_the_gpu():
    """All nibbles 0 or 15 and zero points 0 and 16: the halves' constants hold at both
    ends of the range."""
    for fill, zero in ((0, 16), (-1, 0)):
        weight = make_weight(1024, 256, 128, zeros=True, act_order=False, device="cuda")
        weight["qweight"].fill_(fill)
        weight["zeros"].fill_(zero)
        x = torch.randn(100, 1024, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(
            w4a16(x, **weight).float(), w4a16_ref(x, **weight).float(), atol=1e-1, rtol=2e-2
        )


@sm90
@pytest.mark.gpu
def test_activations_off_16_byte_boundaries_on_the_gpu(monkeypatch):
    """TMA reads rows at 16-byte boundaries: other activations are copied first."""
    ran = record_form_launches(monkeypatch, w4a16_wgmma, "launch_w4a16_wgmma")
    weight = make_weight(1024, 256, 128, zeros=False, act_order=False, device="cuda")
    flat = torch.randn(200 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    x = flat[1:].view(200, 1024)
    wide = torch.randn(200, 1024 + 4, device="cuda", dtype=torch.bfloat16)
    for xs in (x, wide[:, :1024]):
        ref = w4a16_ref(xs, **weight)
        rel = (w4a16(xs, **weight).float() - ref.float()).norm() / ref.float().norm()
        assert rel < 1e-2, rel
    assert len(ran) == 2


@sm90
@pytest.mark.gpu
def test_cuda_graph_replays_the_form():
    weight = make_weight(4096, 6144, 128, zeros=False, act_order=False, device="cuda")
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    w4a16(x, **weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16(x, **weight)
    for seed in range(3):
        x.copy_(torch.randn(256, 4096, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        ref = w4a16_ref(x, **weight)
        rel = (out.float() - ref.float()).norm() / ref.float().norm()
        assert rel < 1e-2, rel
