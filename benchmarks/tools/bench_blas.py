"""The 8B model's linear layers through the BLAS paths torch offers, at a decode step's
rows (W1: 256) and a prefill step's (16,384): `F.linear` on the default library, the same on
cuBLASLt (`torch.backends.cuda.preferred_blas_library`), and the weight-first product
`(W @ x^T)^T`, each timed by `bench_gemv.time_calls` (a CUDA graph cycling over weight
copies that L2 cannot hold) and checked against the default's output.

`--workspace-mib M` (repeatable) times `F.linear` again with cuBLAS's and cuBLASLt's
workspaces set to M MiB (0: torch's default), in this process, the handles' workspaces
dropped between sizes.

`--sustained S` then replays the prefill-sized gate|up product for S seconds and prints its
TFLOP/s per replay window, to show whether the rate holds under a long load (clock or power
limits) as it must in a W1 run's prefill phase.

    python3 benchmarks/tools/bench_blas.py --out $OUT/blas.jsonl
    python3 benchmarks/tools/bench_blas.py --workspace-mib 0 --workspace-mib 256 --no-variants
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemv import COPIES_BYTES, time_calls  # noqa: E402
from bench_gemv import SHAPES as GEMV_SHAPES  # noqa: E402

SHAPES = {name: nk for name, nk in GEMV_SHAPES.items() if not name.endswith("_tp2")}


def _weight_first(x, w):
    return torch.mm(w, x.t()).t()


def _variants():
    backend = torch.backends.cuda.preferred_blas_library()
    yield "linear", F.linear, backend
    yield "linear_lt", F.linear, "cublaslt"
    yield "weight_first", _weight_first, backend
    yield "weight_first_lt", _weight_first, "cublaslt"


def set_workspace(mib: int) -> int:
    """cuBLAS's and cuBLASLt's workspace in bytes for handles used from now on (0: torch's
    default), the current ones dropped; returns the size in effect."""
    if not hasattr(torch._C, "_cuda_setCublasWorkspaceSize"):
        raise SystemExit(
            f"torch {torch.__version__} cannot size the workspace in a running process; "
            "set CUBLAS_WORKSPACE_CONFIG and CUBLASLT_WORKSPACE_SIZE per process instead"
        )
    if mib:
        torch._C._cuda_setCublasWorkspaceSize(mib << 20)
        torch._C._cuda_setCublasLtWorkspaceSize(mib << 20)
    else:
        torch._C._cuda_resetCublasWorkspaceSize()
        torch._C._cuda_resetCublasLtWorkspaceSize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch._C._cuda_getCublasWorkspaceSize()


def sustained(seconds: float, rows: int) -> list[float]:
    n, k = SHAPES["gate_up_proj"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    F.linear(x, w)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(10):
            F.linear(x, w)
    flops = 2 * rows * n * k * 10
    rates = []
    end_at = time.perf_counter() + seconds
    while time.perf_counter() < end_at:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        rates.append(flops / (start.elapsed_time(end) * 1e-3) / 1e12)
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default="default", help="names this process's environment")
    ap.add_argument("--rows", type=int, action="append")
    ap.add_argument("--shape", action="append", choices=list(SHAPES))
    ap.add_argument("--no-variants", action="store_true", help="F.linear only")
    ap.add_argument("--workspace-mib", type=int, action="append", default=[])
    ap.add_argument("--sustained", type=float, default=0.0, metavar="S")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_blas: needs a CUDA GPU")
        return 0
    rows_list = args.rows or [256, 16384]
    records = []
    variants = list(_variants())[:1] if args.no_variants else list(_variants())
    sizes = args.workspace_mib or [None]
    for name, (n, k) in SHAPES.items():
        if args.shape and name not in args.shape:
            continue
        copies = max(2, -(-COPIES_BYTES // (n * k * 2)))
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = None
            for (variant, fn, backend), mib in [(v, m) for m in sizes for v in variants]:
                workspace = None if mib is None else set_workspace(mib)
                previous = torch.backends.cuda.preferred_blas_library()
                torch.backends.cuda.preferred_blas_library(backend)
                try:
                    out = fn(x, weights[0])
                    if ref is None:
                        ref = out.float()
                    err = (out.float() - ref).abs().max().item()
                    us = time_calls(fn, weights, x)
                finally:
                    torch.backends.cuda.preferred_blas_library(previous)
                tflops = 2 * rows * n * k / (us * 1e-6) / 1e12
                rec = dict(
                    tool="bench_blas",
                    tag=args.tag,
                    shape=name,
                    n=n,
                    k=k,
                    rows=rows,
                    variant=variant,
                    workspace_bytes=workspace,
                    us=round(us, 2),
                    tflops=round(tflops, 1),
                    max_abs_diff_to_linear=err,
                    torch=torch.__version__,
                    device=torch.cuda.get_device_name(),
                    env={key: os.environ[key] for key in os.environ if key.startswith("CUBLAS")},
                )
                records.append(rec)
                print(
                    f"{args.tag:>10} {name:>13} rows={rows:>6} {variant:>16} ws={workspace} "
                    f"{us:9.2f} us {tflops:7.1f} TF/s  diff {err:.3g}",
                    flush=True,
                )
        del weights
        torch.cuda.empty_cache()
    if args.sustained:
        rates = sustained(args.sustained, 16384)
        tenth = max(1, len(rates) // 10)
        windows = [
            sum(rates[i : i + tenth]) / len(rates[i : i + tenth])
            for i in range(0, len(rates), tenth)
        ]
        print(
            "sustained gate|up at 16384 rows, TF/s per tenth:",
            " ".join(f"{r:.0f}" for r in windows),
        )
        records.append(
            dict(
                tool="bench_blas",
                tag=args.tag,
                sustained_seconds=args.sustained,
                tflops_windows=[round(r, 1) for r in windows],
            )
        )
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
