"""Launches of the int4 dequantization kernel (`dequantize_int4`, the first half of the
`cublas` launch that W1-int4's 256-row decode steps take) over the Llama-3.1-8B layers:
microseconds and the bytes moved per second (int4 and scales read, bf16 written), for each
`block_n` x `block_k` x `num_warps`, against the current defaults.

Each measurement replays a CUDA graph of calls that cycle through enough copies of the
weight (>= 512 MiB of int4) that none is read from L2; every launch's output is compared
bit for bit with the default launch's first.

    python3 benchmarks/tools/tune_dequant.py --out $OUT/tune_dequant.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_w4a16 import GROUP_SIZE, copies, int4_bytes, random_int4, shapes_for, time_calls  # noqa: E402


def sweep_shape(name: str, num_n: int, num_k: int, tp: int, grid: list, gen) -> list[str]:
    """JSON lines for one layer: the summary (printed too), then each launch, fastest first."""
    from batchlm.kernels.w4a16 import dequantize_int4

    dtype = torch.bfloat16
    weights = copies(lambda: random_int4(num_n, num_k, dtype, gen), num_n * num_k // 2)
    out = torch.empty(num_k, num_n, dtype=dtype, device="cuda")
    moved = int4_bytes(weights[0]) + out.numel() * out.element_size()

    def call(w, **launch):
        dequantize_int4(
            w["qweight"], w["scales"], None, GROUP_SIZE, None, None, dtype, out=out, **launch
        )

    call(weights[0])
    want = out.clone()
    default_us = time_calls(call, weights)
    rows = []
    for block_n, block_k, num_warps in grid:
        launch = dict(block_n=block_n, block_k=block_k, num_warps=num_warps)
        try:
            out.zero_()
            call(weights[0], **launch)
        except Exception as e:  # a launch the device cannot run (resources)
            print(name, launch, "failed:", type(e).__name__, str(e)[:100])
            continue
        if not torch.equal(out, want):
            raise AssertionError(f"{name} {launch}: output differs from the default launch's")
        us = time_calls(lambda w, launch=launch: call(w, **launch), weights)
        rows.append(dict(launch, us=round(us, 2), tb_per_s=round(moved / us / 1e6, 3)))
    rows.sort(key=lambda r: r["us"])
    head = dict(
        shape=name, n=num_n, k=num_k, tp=tp, bytes_moved=moved,
        default_us=round(default_us, 2), default_tb_per_s=round(moved / default_us / 1e6, 3),
        best=rows[0] if rows else None, device=torch.cuda.get_device_name(),
    )  # fmt: skip
    print(json.dumps(head), flush=True)
    return [json.dumps(head)] + [json.dumps(dict(shape=name, **r)) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--shape", action="append")
    ap.add_argument("--block-n", type=int, action="append")
    ap.add_argument("--block-k", type=int, action="append")
    ap.add_argument("--num-warps", type=int, action="append")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tune_dequant: needs a CUDA GPU")
        return 0
    gen = torch.Generator("cuda").manual_seed(0)
    grid = list(
        itertools.product(
            args.block_n or [64, 128, 256, 512],
            args.block_k or [32, 64, 128],
            args.num_warps or [2, 4, 8],
        )
    )
    lines = []
    for name, (num_n, num_k) in shapes_for(args.tp).items():
        if not args.shape or name in args.shape:
            lines += sweep_shape(name, num_n, num_k, args.tp, grid, gen)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
