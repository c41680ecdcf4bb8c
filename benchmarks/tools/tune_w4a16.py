"""Sweep the launches of the W4A16 GEMM on a CUDA GPU and write the launch table `w4a16`
reads (`gpu_kernels/configs/w4a16.json`, see `gpu_kernels/w4a16_launch.py`).

Shapes: the Llama-3.1-8B layers on one rank (q|k|v 6144 x 4096, o 4096 x 4096, gate|up
28672 x 4096, down 4096 x 14336; `--tp 2` for one rank's share at tensor_parallel_size=2),
groups of 128, bf16 activations (`--dtype float16` for fp16), for row buckets 1, 2, 4, ...,
16384. For each (shape, bucket), candidate launches from a pool by row range (shared
across shapes, so each compiles once; from 2 rows on, `tl.dot` tiles with the activations
or the weight first), and the dequantize + cuBLAS path, are each checked
against `w4a16_ref` (relative error < 1e-2) and timed as `bench_w4a16.py` times them
(a CUDA graph of back-to-back calls over enough weight copies that none sits in L2); bf16
cuBLAS on the same shape is timed beside them for the log. The fastest wins the bucket:
where that is dequantize + cuBLAS, the table says `"cublas"` (the log shows by how much).

Output: one JSON line per measurement on stdout (and `--log`), then the table written to
`--out`: the table already there (an earlier run's; else the repository's) with this
device's buckets for the swept shapes replaced bucket by bucket, so runs over different
`--m` or `--shape` subsets add up. Copy it to `gpu_kernels/configs/w4a16.json` to keep it.

    python3 benchmarks/tools/tune_w4a16.py --out $OUT/w4a16.json --log $OUT/tune_w4a16.jsonl
    python3 benchmarks/tools/tune_w4a16.py --m 16 --m 64 --m 256 --out $OUT/w4a16.json
    python3 benchmarks/tools/tune_w4a16.py --m 16 --m 64 --m 256 --out $OUT/w4a16.json --dry-run

The sweep stops starting new candidates after `--max-seconds` (the best so far stays;
buckets not reached are left out and keep the table's or the defaults). `--dry-run` (no
GPU needed) checks every candidate launch and prints, per bucket, how many there are and,
per shape, which of the table's buckets the run would replace and which it keeps.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from functools import partial
from typing import TYPE_CHECKING

import torch
from bench_w4a16 import (
    GROUP_SIZE,
    copies,
    int4_bytes,
    random_dense,
    random_int4,
    relative_error,
    shapes_for,
    time_calls,
)

if TYPE_CHECKING:
    from batchlm.kernels.w4a16_launch import W4a16Launch

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TOLERANCE = 1e-2

# (block_m, block_n, block_k, split_k, num_warps, num_stages). One row: the matrix-vector
# kernel against narrow tl.dot tiles, split over K until the programs fill the SMs (bound
# by reading the weights). Up to 64 rows: 16- to 64-row tiles, split. More: wide tiles,
# deep pipelines, the tensor cores' rate (and dequantize + cuBLAS, added to every pool).
#
# The matrix-vector kernel (w4a16_gemv.py) holds block_n * block_k / (256 * num_warps)
# words a thread: 16 or 32 stay in registers, 64 spill. Each thread takes about one word
# row of a step and many columns, so wider steps share each activation among more
# weights; num_stages 1 loads a step's weights when the step starts, 2 (or more) one step
# ahead.
_ONE_ROW = [
    *[(1, 128, 128, s, 4, 2) for s in (1, 2, 4, 8, 16)],
    *[(1, 256, 128, s, 4, 2) for s in (1, 2, 4, 8, 16)],
    *[(1, 128, 256, s, 4, 2) for s in (1, 2, 4, 8, 16)],
    *[(1, 256, 128, s, 8, 2) for s in (2, 4, 8, 16)],
    *[(1, 512, 128, s, 8, 2) for s in (1, 2, 4, 8)],
    *[(1, 256, 256, s, 8, 2) for s in (1, 2, 4, 8)],
    *[(1, 128, 512, s, 8, 2) for s in (1, 2, 4, 8)],
    *[(1, 64, 1024, s, 8, 2) for s in (1, 2, 4)],
    *[(1, 64, 128, s, 4, 2) for s in (4, 8, 16)],
    *[(1, 128, 128, s, 4, 1) for s in (2, 4, 8)],
    *[(1, 256, 128, s, 8, 1) for s in (2, 4, 8)],
    *[(16, 64, 128, s, 4, 3) for s in (1, 2, 4, 8)],
]
_FEW_ROWS = [
    *[(16, n, 128, s, 4, 3) for n in (32, 64, 128) for s in (1, 2, 4, 8)],
    *[(16, 64, 64, s, 4, 4) for s in (2, 4, 8)],
    (16, 128, 128, 1, 8, 3),
    (16, 128, 128, 2, 8, 3),
    *[(1, 64, 128, s, 4, 3) for s in (2, 4)],
]
_MEDIUM_ROWS = [
    *[(bm, 64, 128, s, 4, 3) for bm in (16, 32, 64) for s in (1, 2, 4)],
    *[(bm, 128, 64, s, 4, 4) for bm in (32, 64) for s in (1, 2)],
    (64, 128, 128, 1, 8, 3),
    (64, 64, 64, 2, 4, 4),
]
_MANY_ROWS = [
    (64, 128, 64, 1, 4, 4),
    (128, 128, 64, 1, 8, 3),
    (128, 128, 64, 1, 8, 4),
    (128, 256, 64, 1, 8, 3),
    (256, 128, 64, 1, 8, 3),
    (128, 64, 64, 1, 4, 4),
    (128, 128, 64, 2, 8, 3),
    (256, 128, 64, 2, 8, 3),
    (64, 256, 64, 1, 8, 3),
    (128, 128, 128, 1, 8, 3),
]
_LARGE_ROWS = [
    (128, 128, 64, 1, 8, 3),
    (128, 128, 64, 1, 8, 4),
    (128, 256, 64, 1, 8, 3),
    (256, 128, 64, 1, 8, 3),
    (256, 128, 64, 1, 8, 4),
    (128, 128, 128, 1, 8, 3),
    (128, 64, 64, 1, 4, 4),
]

# The weight-first form (`swap_ab`): the outputs are wgmma's M (64 per warpgroup, so 8
# warps only from 128 outputs on) and the rows its N, so a tile's rows are the call's rows
# rounded up to 16 and no more. Up to 64 rows a call is bound by reading the weights: the
# split over K grows with the outputs per program until the programs fill the SMs; from 256
# rows on, wide tiles without a split, as in the activation-first pools. Launches whose
# registers spill in the sm_90 code are left out.
_SWAP_FEW_ROWS = [
    *[(16, 64, 128, s, 4, 3) for s in (1, 2, 4, 8)],
    *[(16, 64, 64, s, 4, 4) for s in (2, 4, 8)],
    *[(16, 128, 128, s, 4, 3) for s in (1, 2, 4, 8)],
    *[(16, 128, 128, s, 4, 4) for s in (2, 4)],
    *[(16, 128, 64, s, 4, 4) for s in (1, 2, 4, 8)],
    *[(16, 128, 32, s, 4, 4) for s in (2, 4)],
    *[(16, 128, 128, s, 8, 3) for s in (1, 2, 4)],
    *[(16, 256, 128, s, 8, 3) for s in (1, 2, 4)],
    *[(16, 256, 64, s, 8, 4) for s in (1, 2, 4)],
]
_SWAP_MEDIUM_ROWS = [
    *[(32, 64, 128, s, 4, 3) for s in (2, 4)],
    *[(32, 128, 128, s, 4, 3) for s in (1, 2, 4)],
    *[(32, 128, 64, s, 4, 4) for s in (1, 2, 4)],
    *[(32, 256, 64, s, 8, 3) for s in (1, 2)],
    *[(64, 64, 128, s, 4, 3) for s in (1, 2, 4)],
    *[(64, 128, 128, s, 4, 3) for s in (1, 2)],
    *[(64, 128, 64, s, 4, 4) for s in (1, 2)],
    *[(64, 128, 128, s, 8, 3) for s in (1, 2, 4)],
    *[(64, 256, 64, s, 8, 3) for s in (1, 2)],
    *[(64, 256, 128, s, 8, 3) for s in (1, 2)],
]
_SWAP_MANY_ROWS = [
    *[(64, 64, 128, s, 4, 3) for s in (1, 2)],
    (64, 128, 64, 1, 4, 3),
    (64, 128, 64, 1, 4, 4),
    (64, 128, 64, 2, 4, 4),
    (64, 128, 128, 1, 4, 3),
    (64, 128, 128, 2, 8, 3),
    (64, 256, 64, 1, 8, 3),
    (64, 256, 64, 1, 8, 4),
    (64, 256, 128, 1, 8, 3),
    (128, 64, 64, 1, 4, 4),
    (128, 128, 64, 1, 8, 3),
    (128, 128, 64, 1, 8, 4),
    (128, 128, 64, 2, 8, 3),
    (128, 128, 128, 1, 8, 3),
    (128, 256, 64, 1, 8, 3),
]
_SWAP_LARGE_ROWS = [
    (128, 128, 64, 1, 8, 4),
    (128, 256, 64, 1, 8, 3),
    (128, 128, 128, 1, 8, 3),
    (64, 256, 64, 1, 8, 3),
]


def candidates(rows: int) -> list[W4a16Launch]:
    """The launches swept for a bucket of `rows` (the cuBLAS path comes on top)."""
    from batchlm.kernels.w4a16_launch import W4a16Launch

    if rows == 1:
        pools = (_ONE_ROW, [])
    elif rows <= 16:
        pools = (_FEW_ROWS, _SWAP_FEW_ROWS)
    elif rows <= 64:
        pools = (_MEDIUM_ROWS, _SWAP_MEDIUM_ROWS)
    elif rows <= 512:
        pools = (_MANY_ROWS, _SWAP_MANY_ROWS)
    else:
        pools = (_LARGE_ROWS, _SWAP_LARGE_ROWS)
    activations_first, weight_first = pools
    return [W4a16Launch(*c) for c in activations_first] + [
        W4a16Launch(*c, swap_ab=True) for c in weight_first
    ]


def sweep(name, num_n, num_k, rows, weights, args, emit, deadline, locks):
    """The fastest launch of a (shape, rows) bucket, or None when the deadline came first."""
    from batchlm.kernels.w4a16 import w4a16, w4a16_ref
    from batchlm.kernels.w4a16_launch import CUBLAS, CUBLAS_LAUNCH, launch_value

    dtype = getattr(torch, args.dtype)
    x = torch.randn(rows, num_k, device="cuda", dtype=dtype)
    ref = w4a16_ref(x, **weights[0])
    tag = dict(shape=name, n=num_n, k=num_k, m=rows, dtype=args.dtype)
    calls = 24 if rows <= 256 else 8
    timed = []
    for launch in [*candidates(rows), CUBLAS_LAUNCH]:
        if time.perf_counter() > deadline:
            emit(dict(tag, stopped="deadline"))
            break
        is_cublas = launch.backend == CUBLAS
        options = dict(backend=CUBLAS) if is_cublas else launch._asdict()
        record = dict(tag, launch=launch_value(launch))
        try:
            error = relative_error(w4a16(x, **weights[0], locks=locks, **options), ref)
            record["rel_error"] = round(error, 5)
            if not error < TOLERANCE:
                record["error"] = "output differs from the reference"
                emit(record)
                continue
            us = time_calls(
                lambda w, o=options: w4a16(x, **w, locks=locks, **o),
                weights,
                calls=8 if is_cublas else calls,
            )
        except Exception as exc:  # noqa: BLE001 - a failing launch is reported, the sweep goes on
            record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            emit(record)
            continue
        record["us"] = round(us, 2)
        record["weight_GBps"] = round(int4_bytes(weights[0]) / us / 1e3, 1)
        emit(record)
        timed.append((us, launch))
    if not timed:
        return None
    best_us, best = min(timed, key=lambda t: t[0])
    triton_us = min((us for us, launch in timed if launch.backend != CUBLAS), default=None)
    bf16 = copies(partial(random_dense, num_n, num_k, dtype), num_n * num_k * 2)
    bf16_us = time_calls(lambda w: torch.nn.functional.linear(x, w), bf16, calls=calls)
    del bf16
    emit(
        dict(
            tag,
            best=launch_value(best),
            best_us=round(best_us, 2),
            best_triton_us=round(triton_us, 2) if triton_us else None,
            bf16_cublas_us=round(bf16_us, 2),
            speedup_vs_bf16=round(bf16_us / best_us, 3),
        )
    )
    return best


def write_table(path: str, new: dict) -> None:
    """`new` (shape → {bucket: launch}) merged, bucket by bucket, into the table already at
    `path` (an earlier run's), else into the repository's."""
    from pathlib import Path

    from batchlm.kernels.w4a16_launch import DEFAULT_TABLE_PATH, load_w4a16_table, table_entry

    base = path if Path(path).exists() else DEFAULT_TABLE_PATH
    table = {shape: dict(buckets) for shape, buckets in load_w4a16_table(base).items()}
    for shape, buckets in new.items():
        table.setdefault(shape, {}).update(buckets)
    entries = [table_entry(shape, buckets) for shape, buckets in table.items()]
    text = json.dumps({"entries": entries}, indent=1)
    text = re.sub(
        r"\[([^\[\]{}]*)\]", lambda m: f"[{', '.join(v.strip() for v in m[1].split(','))}]", text
    )
    with open(path, "w") as f:
        f.write(text + "\n")


def dry_run(args: argparse.Namespace) -> int:
    """Check every candidate of the buckets asked for, and print the sweep's plan: per bucket
    the launches it would time, per shape the table's buckets it would replace and keep."""
    from pathlib import Path

    from batchlm.kernels.w4a16_launch import DEFAULT_TABLE_PATH, check_launch, load_w4a16_table

    buckets = args.m or ROW_BUCKETS
    for rows in buckets:
        launches = [check_launch(launch) for launch in candidates(rows)]
        weight_first = sum(launch.swap_ab for launch in launches)
        print(json.dumps(dict(m=rows, launches=len(launches) + 1, weight_first=weight_first)))
    base = Path(args.out) if Path(args.out).exists() else DEFAULT_TABLE_PATH
    table = load_w4a16_table(base)
    for name, (num_n, num_k) in shapes_for(args.tp).items():
        if args.shape and name not in args.shape:
            continue
        key = (num_n, num_k, GROUP_SIZE, args.dtype)
        entries = {s.device_name: b for s, b in table.items() if tuple(s[1:]) == key} or {"": []}
        for device, entry in entries.items():
            have = [m for m, _ in entry]
            plan = dict(shape=name, n=num_n, k=num_k, table=str(base), device=device,
                        replaces=[m for m in have if m in buckets],
                        keeps=[m for m in have if m not in buckets],
                        adds=[m for m in buckets if m not in have])  # fmt: skip
            print(json.dumps(plan))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="where to write the launch table (JSON)")
    ap.add_argument("--log", default=None, help="also write the JSON lines to this file")
    ap.add_argument("--shape", action="append", help="layer names (default: all four)")
    ap.add_argument("--m", type=int, action="append", help=f"row buckets (default {ROW_BUCKETS})")
    ap.add_argument("--tp", type=int, default=1, help="one rank's shapes at this TP size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--max-seconds", type=float, default=540.0)
    ap.add_argument("--dry-run", action="store_true", help="check and print the plan; no GPU")
    args = ap.parse_args()
    if args.dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print("tune_w4a16: needs a CUDA GPU; nothing to do on this machine")
        return 0
    import triton

    from batchlm.kernels.launch import device_name
    from batchlm.kernels.w4a16 import new_split_k_locks
    from batchlm.kernels.w4a16_launch import W4a16Shape

    start = time.perf_counter()
    deadline = start + args.max_seconds
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 - closed below

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if log:
            log.write(line + "\n")

    device = torch.device("cuda", torch.cuda.current_device())
    emit(dict(device=device_name(device), triton=triton.__version__, torch=torch.__version__))
    locks = new_split_k_locks(device)
    gen = torch.Generator("cuda").manual_seed(0)
    dtype = getattr(torch, args.dtype)
    new: dict = {}
    for name, (num_n, num_k) in shapes_for(args.tp).items():
        if args.shape and name not in args.shape:
            continue
        sample = random_int4(num_n, num_k, dtype, gen)
        weights = copies(partial(random_int4, num_n, num_k, dtype, gen), int4_bytes(sample))
        shape = W4a16Shape(device_name(device), num_n, num_k, GROUP_SIZE, args.dtype)
        for rows in args.m or ROW_BUCKETS:
            best = sweep(name, num_n, num_k, rows, weights, args, emit, deadline, locks)
            if best is not None:
                new.setdefault(shape, {})[rows] = best
        del weights
        torch.cuda.empty_cache()
    write_table(args.out, new)
    emit(dict(out=args.out, shapes=len(new), wall_s=round(time.perf_counter() - start, 1)))
    if log:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
