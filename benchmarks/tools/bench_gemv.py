"""One-row linear layers (a decode step at batch 1): `gpu_kernels/gemv.py` against `F.linear`
(cuBLAS) on the Llama-3.1-8B shapes of W3, bf16, over a sweep of launch configurations;
the `_tp2` shapes are one rank's share with tensor_parallel_size=2 (W3-tp2).

Each measurement replays a CUDA graph of back-to-back calls that cycle through enough
copies of the weight (>= 512 MiB) that none is served from L2, as in a real step where the
other layers' weights pass through in between. Outputs are checked against F.linear.

    python3 benchmarks/tools/bench_gemv.py --out $OUT/gemv.jsonl
    python3 benchmarks/tools/bench_gemv.py --defaults   # each shape at the launch gemv picks
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from batchlm.kernels.gemv import choose_gemv_launch, gemv

SHAPES = {  # name: (N, K)
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
    "qkv_proj_tp2": (3072, 4096),
    "o_proj_tp2": (4096, 2048),
    "gate_up_proj_tp2": (14336, 4096),
    "down_proj_tp2": (4096, 7168),
    "lm_head_tp2": (64128, 4096),
}
COPIES_BYTES = 512 << 20
CALLS = 24


def time_calls(fn, weights, x) -> float:
    """Microseconds per call, from a graph of CALLS calls cycling over `weights`."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w)  # compile / warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(x, weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (4 * CALLS))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", action="append", choices=list(SHAPES))
    ap.add_argument("--defaults", action="store_true", help="time only the launch gemv picks")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemv: needs a CUDA GPU")
        return 0
    dtype = torch.bfloat16
    configs = list(
        itertools.product([4, 8, 16, 32], [256, 512, 1024], [4, 8], [2, 3, 4])
    )  # block_n, block_k, num_warps, num_stages
    records = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shape or list(SHAPES):
        n, k = SHAPES[name]
        if args.defaults:
            configs = [tuple(choose_gemv_launch(n, k))]
        nbytes = n * k * 2
        copies = max(2, -(-COPIES_BYTES // nbytes))
        weights = [
            torch.empty(n, k, device="cuda", dtype=dtype).normal_(0, 0.02, generator=gen)
            for _ in range(copies)
        ]
        x = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
        ref = F.linear(x, weights[0]).float()
        cublas_us = time_calls(lambda a, w: F.linear(a, w), weights, x)
        rec = dict(shape=name, n=n, k=k, impl="F.linear", us=round(cublas_us, 2),
                   tb_per_s=round(nbytes / cublas_us / 1e6, 3))  # fmt: skip
        print(json.dumps(rec), flush=True)
        records.append(rec)
        best = None
        for block_n, block_k, warps, stages in configs:
            launch = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
            try:
                out = gemv(x, weights[0], **launch).float()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                us = time_calls(lambda a, w, launch=launch: gemv(a, w, **launch), weights, x)
            except Exception as e:  # a config that does not compile (shared memory, say)
                print(json.dumps(dict(shape=name, **launch, error=str(e)[:200])), flush=True)
                continue
            rec = dict(shape=name, n=n, k=k, impl="gemv", **launch, us=round(us, 2),
                       tb_per_s=round(nbytes / us / 1e6, 3), rel_err=err)  # fmt: skip
            records.append(rec)
            if best is None or us < best["us"]:
                best = rec
        print(json.dumps(dict(best=True, vs_cublas=round(cublas_us / best["us"], 3), **best)))
        del weights
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
