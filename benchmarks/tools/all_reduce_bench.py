"""The peer-memory all-reduce against NCCL on two GPUs: bit-exact sums, and microseconds per
call, launched one by one and replayed from a CUDA graph (as decode steps run them).

Two processes (GPU 0 and GPU 1) join one group. For each size (rows of a 4096-wide bf16
hidden state) every rank checks the peer kernel's sum against the float32 rank-order sum of
both ranks' inputs (gathered by NCCL), and that both ranks hold the same bits; then it times
`--calls` back-to-back calls of each method, eagerly and inside one CUDA graph. Rank 0
prints one JSON line per size and method.

    python3 benchmarks/tools/all_reduce_bench.py --out $OUT/all_reduce.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

HIDDEN = 4096
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MAX_BYTES = 256 * HIDDEN * 2


def time_calls(fn, x: torch.Tensor, calls: int, graph: bool) -> float:
    """Microseconds per call over `calls` calls (after a warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn(x)
        g.replay()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        if graph:
            g.replay()
        else:
            for _ in range(calls):
                fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def rank_main(rank: int, port: int, calls: int, out: str | None) -> None:
    from batchlm.engine.distributed.parallel import connect_store, create_tp_group
    from batchlm.engine.distributed.peer_all_reduce import PeerAllReduce
    from batchlm.kernels.all_reduce import all_reduce_ref

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = connect_store(port, 2, 120)
    tp = create_tp_group(store, rank, 2, device, 120, custom_all_reduce=False)
    peer = PeerAllReduce(store, rank, 2, device, MAX_BYTES)
    nccl = tp.all_reduce
    lines = []
    for rows in ROWS:
        gen = torch.Generator(device).manual_seed(rank)
        x = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
        parts = [torch.empty_like(x) for _ in range(2)]
        torch.distributed.all_gather(parts, x, group=tp.process_group)
        got = peer(x.clone())
        other = [torch.empty_like(got) for _ in range(2)]
        torch.distributed.all_gather(other, got, group=tp.process_group)
        exact = torch.equal(got, all_reduce_ref(parts))
        same = torch.equal(other[0], other[1])
        nccl_sum = nccl(x.clone())
        nccl_diff = (nccl_sum.float() - got.float()).abs().max().item()
        for method, fn in (("nccl", nccl), ("peer", peer)):
            for graph in (False, True):
                us = time_calls(fn, x.clone(), calls, graph)
                lines.append(dict(rows=rows, bytes=x.numel() * 2, method=method,
                                  graph=graph, us_per_call=round(us, 2)))  # fmt: skip
        lines.append(dict(rows=rows, exact=exact, ranks_equal=same,
                          max_abs_diff_vs_nccl=nccl_diff, errors=peer.errors.item()))  # fmt: skip
    torch.cuda.synchronize()
    if rank == 0:
        text = "\n".join(json.dumps(line) for line in lines)
        print(text, flush=True)
        if out:
            Path(out).write_text(text + "\n")
    peer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=64, help="calls per timing (one graph)")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("all_reduce_bench: needs 2 GPUs")
        return 0
    from batchlm.engine.distributed.parallel import create_store

    store = create_store(2, 120)  # both ranks join it as clients
    port = store.port
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port, args.calls, args.out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main())
