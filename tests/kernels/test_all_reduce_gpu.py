"""The peer-memory all-reduce on a GPU, with one GPU: two ranks as two processes on device 0.
Each maps the other's buffer through CUDA IPC (`PeerAllReduce`, as ranks on two GPUs do
over NVLink) and the device time-slices their waiting kernels. Every sum, eager and replayed
from a CUDA graph, equals the rank-order float32 sum bit for bit on both ranks; the kernel
with the RMSNorm equals the sum followed by the fused add + norm kernel, bit for bit."""

from __future__ import annotations

import io

import pytest
import torch
import torch.multiprocessing as multiprocessing

from batchlm.engine.distributed.parallel import connect_store, create_store
from batchlm.engine.distributed.peer_all_reduce import MAX_BYTES, PeerAllReduce
from batchlm.kernels.all_reduce import all_reduce_ref
from batchlm.kernels.rms_norm import fused_add_rms_norm

from .helpers import all_reduce_inputs

pytestmark = pytest.mark.gpu

EPS = 1e-5
# A decode step's mix (kind, shape, dtype): sums of one row and of a few, int64 sampled ids,
# and norms of Llama-8B-wide rows.
CALLS = [("sum", (4096,), torch.bfloat16), ("norm", (1, 4096), torch.bfloat16),
         ("sum", (3, 4096), torch.float16), ("norm", (5, 4096), torch.float16),
         ("sum", (7,), torch.int64), ("norm", (2, 896), torch.float32),
         ("sum", (1000,), torch.float32)]  # fmt: skip
GRAPH_CALLS = [("sum", (1, 4096), torch.bfloat16), ("norm", (1, 4096), torch.bfloat16)]
REPLAYS = 3
TIMEOUT_S = 120.0


def run(peer: PeerAllReduce, part, residual, weight) -> list[torch.Tensor]:
    if residual is None:
        return [peer(part)]
    return list(peer.add_rms_norm(part, residual, weight, EPS))


def run_calls(peer: PeerAllReduce, rank: int) -> list[list[torch.Tensor]]:
    """Every call's outputs on this rank (CPU): the eager calls, then each graph replay's."""
    device = peer.device
    results = []
    for part, residual, weight in all_reduce_inputs(rank, CALLS, 100):
        move = [t.to(device) if t is not None else None for t in (part, residual, weight)]
        results.append([t.cpu() for t in run(peer, *move)])
    # One graph of a sum and a norm, replayed over new inputs copied into its buffers.
    static = [
        [t.to(device) if t is not None else None for t in inputs]
        for inputs in all_reduce_inputs(rank, GRAPH_CALLS, 200)
    ]
    for inputs in static:  # compiled outside the capture (both ranks alike)
        run(peer, *[t.clone() if t is not None else None for t in inputs])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = [run(peer, *inputs) for inputs in static]
    for replay in range(REPLAYS):
        for buffers, new in zip(
            static, all_reduce_inputs(rank, GRAPH_CALLS, 300 + replay), strict=True
        ):
            for buf, t in zip(buffers, new, strict=True):
                if buf is not None:
                    buf.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        results.extend([t.cpu().clone() for t in o] for o in outs)
    assert peer.errors.item() == 0  # no program gave up on its peer
    return results


def _rank_one(port: int, queue) -> None:
    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        peer = PeerAllReduce(connect_store(port, 2, TIMEOUT_S), 1, 2, device, MAX_BYTES)
        try:
            buf = io.BytesIO()
            torch.save(run_calls(peer, 1), buf)
        finally:
            torch.cuda.synchronize()
            peer.close()
        queue.put(("ok", buf.getvalue()))
    except BaseException as e:  # reported by the test, not lost in this process
        queue.put(("error", repr(e)))


def expected_outputs() -> list[list[torch.Tensor]]:
    """The rank-order sum, and the fused add + norm kernel over it, computed on the GPU."""
    plan = [(CALLS, 100)] + [(GRAPH_CALLS, 300 + r) for r in range(REPLAYS)]
    out = []
    for calls, seed in plan:
        for a, b in zip(
            all_reduce_inputs(0, calls, seed), all_reduce_inputs(1, calls, seed), strict=True
        ):
            total = all_reduce_ref([a[0].cuda(), b[0].cuda()])
            if a[1] is None:
                out.append([total.cpu()])
            else:
                got = fused_add_rms_norm(total, a[1].cuda(), a[2].cuda(), EPS)
                out.append([t.cpu() for t in got])
    return out


def test_two_ranks_on_one_gpu_get_the_rank_order_sum_eager_and_in_a_graph():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    # Rank 0 hosts the store in this process; rank 1 learns its port before connecting.
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = create_store(2, TIMEOUT_S)
    peer_process = ctx.Process(target=_rank_one, args=(store.port, queue))
    peer_process.start()
    try:
        peer = PeerAllReduce(store, 0, 2, device, MAX_BYTES)
        try:
            results0 = run_calls(peer, 0)
        finally:
            torch.cuda.synchronize()
            peer.close()
        status, payload = queue.get(timeout=TIMEOUT_S)
        assert status == "ok", payload
        results1 = torch.load(io.BytesIO(payload))
    finally:
        peer_process.join(30)
        if peer_process.is_alive():
            peer_process.kill()
    expected = expected_outputs()
    assert len(results0) == len(results1) == len(expected)
    for i, (got0, got1, want) in enumerate(zip(results0, results1, expected, strict=True)):
        for a, b, w in zip(got0, got1, want, strict=True):
            assert torch.equal(a, b), i  # every rank holds the same bits
            assert torch.equal(a, w), i
