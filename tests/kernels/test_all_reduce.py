"""The peer-memory all-reduce kernel's protocol: two ranks in two processes sharing memory
(on CPU, Triton's interpreter over shared-memory tensors), every call's sum against the
float32 rank-order reference, and the ways a program gives up on a peer that never comes."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as multiprocessing

from batchlm.kernels.all_reduce import GRID, all_reduce_ref, one_shot_all_reduce

from .helpers import ON_GPU

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
