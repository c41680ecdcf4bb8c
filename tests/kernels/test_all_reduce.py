"""The peer-memory all-reduce kernels' protocol: two ranks in two processes sharing memory
(on CPU, Triton's interpreter over shared-memory tensors), every call's sum (and, for the
kernel with the RMSNorm, every normalised row and residual) against the float32 rank-order
reference, and the ways a program gives up on a peer that never comes."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as multiprocessing

from batchlm.kernels.all_reduce import (
    GRID,
    all_reduce_ref,
    all_reduce_rms_norm_ref,
    one_shot_all_reduce,
    one_shot_all_reduce_rms_norm,
)
from batchlm.kernels.rms_norm import fused_add_rms_norm

from .helpers import ELEMENTWISE_TOLERANCE, ON_GPU, all_reduce_inputs, assert_close

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU protocol test; on GPUs the TP tests run it")

SLOT = 8192  # elements of the widest dtype in one rank's slot of a data buffer
CALLS = [(4096, torch.float16), (3000, torch.float32), (8192, torch.float16), (1, torch.float32),
         (2500, torch.float16), (7, torch.int64)]  # fmt: skip


class Ranks:
    """Both ranks' shared buffers, and one rank's own state."""

    def __init__(self) -> None:
        self.data = [torch.zeros(2 * 2 * SLOT * 4, dtype=torch.uint8).share_memory_() for _ in "ab"]
        self.flags = [torch.zeros(GRID * 2, dtype=torch.int32).share_memory_() for _ in "ab"]

    def state(self):
        """This process's addresses of the shared buffers, and fresh per-rank counters."""
        data_addrs = torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64)
        flag_addrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)
        epochs = torch.zeros(GRID, dtype=torch.int32)
        errors = torch.zeros(1, dtype=torch.int32)
        abort = torch.zeros(1, dtype=torch.int32)
        return data_addrs, flag_addrs, epochs, errors, abort


def inputs(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randint(-(2**40), 2**40, (n,), generator=gen)  # sampled ids, broadcast as sums
        if dtype == torch.int64
        else torch.randn(n, generator=gen).to(dtype) * 4
        for n, dtype in CALLS
    ]


def run_rank(rank: int, ranks: Ranks) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    data_addrs, flag_addrs, epochs, errors, abort = ranks.state()
    outs = []
    for x in inputs(rank):
        slot = SLOT * 4 // x.element_size()
        outs.append(
            one_shot_all_reduce(x, rank, data_addrs, flag_addrs, epochs, errors, abort, slot)
        )
    return outs, epochs, errors


def _rank_one(ranks: Ranks, queue) -> None:
    outs, epochs, errors = run_rank(1, ranks)
    # Plain values: tensors would be shared through this process, which exits first.
    queue.put(([o.tolist() for o in outs], epochs.tolist(), errors.item()))


def test_two_ranks_get_the_rank_order_sum_of_every_call():
    ranks = Ranks()
    queue = multiprocessing.get_context("spawn").Queue()
    peer = multiprocessing.get_context("spawn").Process(target=_rank_one, args=(ranks, queue))
    peer.start()
    try:
        outs0, epochs0, errors0 = run_rank(0, ranks)
        outs1, epochs1, errors1 = queue.get(timeout=300)
        outs1 = [torch.tensor(o, dtype=dtype) for o, (_, dtype) in zip(outs1, CALLS, strict=True)]
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()
    for i, (a, b) in enumerate(zip(inputs(0), inputs(1), strict=True)):
        expected = all_reduce_ref([a, b])
        assert torch.equal(outs0[i], expected), CALLS[i]
        assert torch.equal(outs1[i], expected), CALLS[i]
    assert errors0.item() == errors1 == 0
    assert epochs0.tolist() == epochs1 == [len(CALLS)] * GRID


# A decode step's mix: norm calls (rows, hidden) between plain sums, over the same buffers.
# 20 rows: some programs own two; 1 row: one program works and the others only signal.
MIXED = [("norm", (1, 64), torch.float16), ("sum", (4096,), torch.float16),
         ("norm", (20, 64), torch.bfloat16), ("norm", (3, 96), torch.float32),
         ("sum", (7,), torch.int64), ("norm", (2, 4, 64), torch.float16)]  # fmt: skip
EPS = 1e-5


def mixed_inputs(rank: int):
    """This rank's parts, and the residual and weight that every rank shares."""
    return all_reduce_inputs(rank, MIXED, 200)


def run_mixed_rank(rank: int, ranks: Ranks):
    data_addrs, flag_addrs, epochs, errors, abort = ranks.state()
    outs = []
    for part, residual, weight in mixed_inputs(rank):
        slot = SLOT * 4 // part.element_size()
        state = (rank, data_addrs, flag_addrs, epochs, errors, abort, slot)
        if residual is None:
            outs.append((one_shot_all_reduce(part, *state),))
        else:
            before = part.clone()
            got = one_shot_all_reduce_rms_norm(part, residual, weight, EPS, *state)
            assert torch.equal(part, before)  # the part is left as it was
            outs.append(tuple(got))
    return outs, epochs, errors


def _mixed_rank_one(ranks: Ranks, queue) -> None:
    outs, epochs, errors = run_mixed_rank(1, ranks)
    queue.put(([[t.tolist() for t in o] for o in outs], epochs.tolist(), errors.item()))


def test_norm_calls_between_sums_give_the_sum_then_the_norm():
    ranks = Ranks()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    peer = ctx.Process(target=_mixed_rank_one, args=(ranks, queue))
    peer.start()
    try:
        outs0, epochs0, errors0 = run_mixed_rank(0, ranks)
        outs1, epochs1, errors1 = queue.get(timeout=300)
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()
    assert errors0.item() == errors1 == 0
    assert epochs0.tolist() == epochs1 == [len(MIXED)] * GRID
    for i, (a, b) in enumerate(zip(mixed_inputs(0), mixed_inputs(1), strict=True)):
        (part0, residual, weight), (part1, _, _) = a, b
        dtype = MIXED[i][2]
        got1 = [torch.tensor(t, dtype=dtype) for t in outs1[i]]
        total = all_reduce_ref([part0, part1])
        if residual is None:
            expected = (total,)
        else:
            # Bit for bit what the sum followed by the fused add + norm kernel gives ...
            expected = tuple(fused_add_rms_norm(total, residual, weight, EPS))
            # ... which is the PyTorch reference up to the norm's rounding.
            ref = all_reduce_rms_norm_ref([part0, part1], residual, weight, EPS)
            assert_close(outs0[i][0], ref.out, ELEMENTWISE_TOLERANCE)
            assert_close(outs0[i][1], ref.residual, ELEMENTWISE_TOLERANCE)
        for got0, got, want in zip(outs0[i], got1, expected, strict=True):
            assert torch.equal(got, got0.view(got.shape)), MIXED[i]  # every rank alike
            if dtype == torch.bfloat16:
                # The interpreter rounds float32 to bfloat16 its own way where PyTorch
                # rounds to nearest; on GPUs the TP tests compare whole generations.
                assert_close(got0, want, ELEMENTWISE_TOLERANCE)
            else:
                assert torch.equal(got0, want), MIXED[i]


@pytest.mark.parametrize("how", ["abort", "max_spins"])
def test_a_peer_that_never_comes_is_given_up_on(how):
    ranks = Ranks()  # alive while its addresses are used
    data_addrs, flag_addrs, epochs, errors, abort = ranks.state()
    if how == "abort":
        abort.fill_(1)
    x = torch.ones(64)
    one_shot_all_reduce(x, 0, data_addrs, flag_addrs, epochs, errors, abort, SLOT, max_spins=1024)
    assert errors.item() == GRID  # every program waited for the one peer, and gave up
    assert epochs.tolist() == [1] * GRID


def test_launcher_names_bad_arguments():
    ranks = Ranks()  # alive while its addresses are used
    data_addrs, flag_addrs, epochs, errors, abort = ranks.state()
    with pytest.raises(ValueError, match="contiguous"):
        one_shot_all_reduce(torch.ones(8, 4).t(), 0, data_addrs, flag_addrs, epochs, errors,
                            abort, SLOT)  # fmt: skip
    with pytest.raises(ValueError, match="peer buffers hold"):
        one_shot_all_reduce(torch.ones(SLOT + 1), 0, data_addrs, flag_addrs, epochs, errors,
                            abort, SLOT)  # fmt: skip
    with pytest.raises(ValueError, match="rank 2 of 2"):
        one_shot_all_reduce(torch.ones(8), 2, data_addrs, flag_addrs, epochs, errors, abort, SLOT)
    with pytest.raises(ValueError, match="epochs"):
        one_shot_all_reduce(torch.ones(8), 0, data_addrs, flag_addrs, epochs[:3], errors, abort,
                            SLOT)  # fmt: skip
    with pytest.raises(ValueError, match="hidden size 32768"):
        one_shot_all_reduce_rms_norm(torch.ones(1, 32768), torch.ones(1, 32768),
                                     torch.ones(32768), EPS, 0, data_addrs, flag_addrs, epochs,
                                     errors, abort, 1 << 16)  # fmt: skip
    with pytest.raises(ValueError, match="residual has shape"):
        one_shot_all_reduce_rms_norm(torch.ones(2, 64), torch.ones(1, 64), torch.ones(64), EPS,
                                     0, data_addrs, flag_addrs, epochs, errors, abort, SLOT)  # fmt: skip
    with pytest.raises(ValueError, match="eps=0"):
        one_shot_all_reduce_rms_norm(torch.ones(2, 64), torch.ones(2, 64), torch.ones(64), 0.0,
                                     0, data_addrs, flag_addrs, epochs, errors, abort, SLOT)  # fmt: skip
    with pytest.raises(ValueError, match="peer buffers hold"):
        one_shot_all_reduce_rms_norm(torch.ones(SLOT + 64), torch.ones(SLOT + 64),
                                     torch.ones(SLOT + 64), EPS, 0, data_addrs, flag_addrs,
                                     epochs, errors, abort, SLOT)  # fmt: skip


def test_fused_norm_switch_is_off_by_default(monkeypatch):
    from batchlm.engine import envs

    monkeypatch.delenv("BATCHLM_FUSED_ALL_REDUCE_NORM", raising=False)
    assert envs.fused_all_reduce_norm() is False
    monkeypatch.setenv("BATCHLM_FUSED_ALL_REDUCE_NORM", " on ")
    assert envs.fused_all_reduce_norm() is True
    monkeypatch.setenv("BATCHLM_FUSED_ALL_REDUCE_NORM", "maybe")
    with pytest.raises(ValueError, match=r"FUSED_ALL_REDUCE_NORM='maybe'.*0 \(off, the default\)"):
        envs.fused_all_reduce_norm()
