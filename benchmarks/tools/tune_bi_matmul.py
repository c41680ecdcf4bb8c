"""Launches of the batch-invariant matmul (`gpu_kernels/matmul.py`) on the Llama-3.1-8B layers,
timed at the row counts of W3 (1), of a W1 decode step (256) and of a W1 prefill chunk
(16,384), against `F.linear` (cuBLAS), with each launch's invariance checked on the device.

`matmul` takes one launch per weight shape, whatever the number of rows; that is what makes
a row's sum the same in every batch. This sweep answers two questions for the batch-
invariant mode (W1-bi at 0.49x the default mode, W3-bi at 1.53x its time per token):

1. Which one launch per shape costs least over a W1 run (the weighted sum below) and at
   one row, and how far each is from cuBLAS.
2. Whether the launch may follow the number of rows after all: for each pair of launches,
   are the rows' bits equal, and which of `block_m`, `block_n`, `block_k`, warps,
   stages and the TMA loads (`tma`, a launch's optional sixth field) differ between
   them? Tiles under 64 rows run Triton's `mma` instruction, 64 and over its `wgmma` on
   Hopper; both chain 16-wide K steps into the float32 accumulator in order. On the H200
   every pair compared has given equal bits (2026-12-02), across `block_k` and `tma` too.

Each launch is first checked to give every row the same bits at 1, 256 and 16,384 rows
(`invariant`), and to agree with cuBLAS to bf16 rounding (`max_abs_diff`). Times are CUDA
graph replays with L2 flushed (`tune_decode_attention.graph_ms`). One JSON line per
measurement, then per shape the launch with the least W1 cost:
`prefill_us * 8 + decode_us * 255` (a W1 run: 8 prefill chunks of 16,384 rows, 255 decode
steps of 256 rows).

`--table-out` writes the launch table `matmul` reads (`gpu_kernels/configs/matmul.json`): per
shape, one launch per row count (1, 256, 16,384). Where every pair of launches compared
on the shape gave the same bits, `block_k` included, each row count takes its fastest
launch whatever its `block_k` (the entry then says `"same_bits_across_block_k": true`);
otherwise the fastest at each count among those of one `block_k`, the `block_k` whose
worse ratio to cuBLAS, over a W1 run and at one row, is least (the batch-invariant mode's
targets bound both). The chosen launches' rows are compared before the entry is written;
if their bits differed, the entry would hold the one launch with the least worse ratio
instead.

    python3 benchmarks/tools/tune_bi_matmul.py --out $OUT/bi_matmul.jsonl --table-out $OUT/matmul.json
    TRITON_INTERPRET=1 python3 benchmarks/tools/tune_bi_matmul.py --smoke   # tiny, on a CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import Recorder  # noqa: E402
from tune_decode_attention import graph_ms  # noqa: E402

from batchlm.kernels.launch import device_name, dtype_name  # noqa: E402
from batchlm.kernels.matmul import (  # noqa: E402
    MatmulLaunch,
    MatmulShape,
    choose_matmul_launch,
    matmul,
    table_entry,
)

SHAPES = {  # name: (N, K), the layers of W1 and W3 (Llama-3.1-8B) and W2 (Qwen2.5-0.5B)
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
    "qwen_qkv_proj": (1152, 896),
    "qwen_o_proj": (896, 896),
    "qwen_gate_up_proj": (9728, 896),
    "qwen_down_proj": (896, 4864),
    "qwen_lm_head": (151936, 896),
}
ROWS = {"bs1": 1, "decode": 256, "prefill": 16384}
# The LM head sees one row per sequence whose logits a step samples, never a whole chunk.
HEAD_ROWS = {"bs1": 1, "decode": 256, "prefill": 256}
W1_WEIGHTS = {"prefill": 8, "decode": 255}
# (block_m, block_n, block_k, num_warps, num_stages); the first is today's default for wide
# layers. Pairs differing only in block_m answer question 2.
CANDIDATES = [
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (16, 128, 64, 4, 4),
    (16, 64, 128, 4, 4),
    (64, 64, 128, 4, 4),
    (64, 32, 64, 4, 4),
    (64, 16, 128, 4, 4),
    (16, 32, 64, 4, 4),
    (64, 16, 64, 4, 4),
    (16, 16, 64, 4, 4),
    (64, 32, 128, 4, 4),
    (128, 128, 128, 8, 3),
    (128, 256, 128, 8, 2),
    (128, 64, 128, 4, 3),
    (64, 16, 128, 4, 6),
    (64, 32, 128, 4, 6),
    (16, 16, 128, 2, 5),
    (64, 16, 256, 4, 3),
    (16, 32, 256, 4, 3),
    (64, 64, 256, 4, 3),
    # One row: long K tiles and deep pipelines put more of the weight in flight per
    # program (usable where the bits are equal across block_k).
    (16, 16, 256, 4, 4),
    (16, 32, 256, 4, 4),
    (16, 64, 256, 4, 3),
    (64, 16, 256, 4, 4),
    (64, 32, 256, 4, 3),
    (16, 32, 128, 4, 6),
    # Tiles loaded by the TMA (a sixth field, True): the same arithmetic, no per-element
    # addresses or masks.
    (128, 128, 64, 8, 4, True),
    (128, 128, 64, 8, 3, True),
    (128, 256, 64, 8, 3, True),
    (128, 128, 128, 8, 3, True),
    (128, 64, 128, 4, 3, True),
    (64, 128, 64, 4, 4, True),
    (64, 64, 64, 4, 4, True),
    (64, 64, 128, 4, 4, True),
    (16, 32, 256, 4, 4, True),
    (16, 16, 128, 2, 5, True),
    # TMA at a decode step's 256 rows: a whole step's rows in one tile (the weight read
    # once), wider tiles (the activations re-read less), more stages and warps.
    (256, 128, 64, 8, 3, True),
    (256, 64, 64, 8, 3, True),
    (128, 256, 64, 8, 4, True),
    (64, 256, 64, 8, 3, True),
    (128, 64, 64, 4, 4, True),
    (128, 128, 64, 4, 4, True),
    (128, 128, 64, 8, 5, True),
    (64, 128, 64, 4, 3, True),
    (64, 64, 64, 4, 3, True),
    (128, 64, 128, 4, 4, True),
    (64, 128, 128, 4, 3, True),
]
SMOKE_SHAPES = {"tiny": (48, 64)}
SMOKE_ROWS = {"bs1": 1, "decode": 5, "prefill": 40}
SMOKE_CANDIDATES = [
    (16, 16, 16, 1, 1),
    (32, 16, 16, 1, 1),
    (16, 32, 16, 1, 1),
    (16, 16, 16, 1, 1, True),
]


NAMES = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "tma")


def launch_of(config: tuple) -> dict[str, int | bool]:
    return dict(zip(NAMES, (*config, False)[: len(NAMES)], strict=True))


def sweep_shape(name, n, k, rows, candidates, args, emit) -> dict:
    """Every candidate on one shape; returns `{config: {"invariant", rows name: out}}`."""
    device, dtype = args.device, args.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    most = max(rows.values())
    x = torch.randn(most, k, device=device, dtype=dtype, generator=gen)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * k**-0.5
    timed = args.device == "cuda" and not args.smoke
    cublas = {}
    if timed:
        for label, m in rows.items():
            us = graph_ms(lambda m=m: F.linear(x[:m], w), args.warmup_ms, args.rep_ms) * 1e3
            cublas[label] = us
            emit(dict(shape=name, n=n, k=k, system="cublas", rows=label, m=m, us=round(us, 2)))
        cublas["w1"] = sum(cublas[label] * c for label, c in W1_WEIGHTS.items())
    results = {}
    for config in candidates:
        launch = launch_of(config)
        record = dict(shape=name, n=n, k=k, launch=list(config))
        try:
            outs = {label: matmul(x[:m], w, **launch) for label, m in rows.items()}
            full = outs["prefill"]
            record["invariant"] = all(
                torch.equal(out, full[: out.shape[0]]) for out in outs.values()
            )
            reference = F.linear(x[: rows["decode"]], w)
            record["max_abs_diff"] = round(
                (outs["decode"].float() - reference.float()).abs().max().item(), 5
            )
            if timed:
                for label, m in rows.items():
                    us = graph_ms(
                        lambda m=m, launch=launch: matmul(x[:m], w, **launch),
                        args.warmup_ms,
                        args.rep_ms,
                    )
                    record[f"{label}_us"] = round(us * 1e3, 2)
                record["w1_us"] = round(
                    sum(record[f"{label}_us"] * c for label, c in W1_WEIGHTS.items()), 1
                )
                # The launch's worse ratio to cuBLAS: over a W1 run, or at one row.
                record["worst_ratio"] = round(
                    max(record["w1_us"] / cublas["w1"], record["bs1_us"] / cublas["bs1"]), 3
                )
        except Exception as exc:  # noqa: BLE001 - a failing launch is reported, the sweep goes on
            record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            emit(record)
            continue
        emit(record)
        results[config] = dict(record=record, out=outs["prefill"])
    # Question 2: every pair of launches; `differ` names what differs between them.
    for a, b in itertools.combinations(results, 2):
        same = torch.equal(results[a]["out"], results[b]["out"])
        pair = zip(NAMES, launch_of(a).values(), launch_of(b).values(), strict=True)
        differ = [n for n, x, y in pair if x != y]
        emit(dict(shape=name, same_bits=same, differ=differ, launches=[list(a), list(b)]))
    return results, cublas


def choose_buckets(name, rows, invariant, results, cublas, emit) -> tuple[dict, bool]:
    """One launch per row count and whether every pair of launches compared on the shape
    had the same bits, `block_k` included: if so, each count's fastest whatever its
    `block_k`, else all with the `block_k` whose worse ratio to cuBLAS (over a W1 run, or
    at one row) is least; used once their rows are checked to have the same bits. If
    they do not, the single launch with the least worse ratio, for every row count."""
    outs = [r["out"] for r in results.values()]
    across = all(torch.equal(out, outs[0]) for out in outs[1:])
    by_step: dict[int | str, dict[str, dict]] = {}
    for record in invariant:
        per_label = by_step.setdefault("any" if across else record["launch"][2], {})
        for label in rows:
            if label not in per_label or record[f"{label}_us"] < per_label[label][f"{label}_us"]:
                per_label[label] = record

    def worst(per_label: dict[str, dict]) -> float:
        w1 = sum(per_label[label][f"{label}_us"] * c for label, c in W1_WEIGHTS.items())
        return max(w1 / cublas["w1"], per_label["bs1"]["bs1_us"] / cublas["bs1"])

    step, per_label = min(by_step.items(), key=lambda item: worst(item[1]))
    chosen = {label: tuple(record["launch"]) for label, record in per_label.items()}
    outs = [results[launch]["out"] for launch in set(chosen.values())]
    same = all(torch.equal(out, outs[0]) for out in outs[1:])
    if same:
        buckets = {}
        for label in ("bs1", "decode", "prefill"):  # a later label of equal rows gives way
            buckets.setdefault(rows[label], MatmulLaunch(*chosen[label]))
        ratio = worst(per_label)
    else:
        single = min(invariant, key=lambda r: r["worst_ratio"])
        buckets = {1: MatmulLaunch(*single["launch"])}
        ratio = single["worst_ratio"]
    emit(dict(shape=name, block_k=step, same_bits_across_block_k=across, same_bits=same,
              worst_ratio=round(ratio, 3),
              buckets={m: list(launch) for m, launch in buckets.items()}))  # fmt: skip
    return buckets, across


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    ap.add_argument("--table-out", default=None, help="write the launch table here (JSON)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the interpreter)")
    ap.add_argument("--warmup-ms", type=float, default=5.0)
    ap.add_argument("--rep-ms", type=float, default=20.0)
    args = ap.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.smoke:
        print("tune_bi_matmul: needs a CUDA GPU (or --smoke for tiny shapes on CPU)")
        return 0
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes, rows, candidates = (
        (SMOKE_SHAPES, SMOKE_ROWS, SMOKE_CANDIDATES) if args.smoke else (SHAPES, ROWS, CANDIDATES)
    )
    recorder = Recorder(args.out)

    def emit(record: dict) -> None:
        recorder.record(**record)

    start = time.perf_counter()
    default = {
        name: list(choose_matmul_launch(n, k, args.dtype, table={}))
        for name, (n, k) in shapes.items()
    }
    emit(dict(dtype=str(args.dtype), default_launches=default))
    entries = []
    for name, (n, k) in shapes.items():
        shape_rows = HEAD_ROWS if name.endswith("lm_head") else rows
        results, cublas = sweep_shape(name, n, k, shape_rows, candidates, args, emit)
        timed = [r["record"] for r in results.values() if "w1_us" in r["record"]]
        invariant = [r for r in timed if r["invariant"]]
        if not invariant:
            continue
        best = min(invariant, key=lambda r: r["w1_us"])
        at_one = min(invariant, key=lambda r: r["bs1_us"])
        emit(dict(shape=name, best_w1=best["launch"], best_w1_us=best["w1_us"],
                  best_bs1=at_one["launch"], best_bs1_us=at_one["bs1_us"]))  # fmt: skip
        buckets, across = choose_buckets(name, shape_rows, invariant, results, cublas, emit)
        dtype = dtype_name(args.dtype)
        shape = MatmulShape(device_name(torch.device(args.device)), n, k, dtype, dtype)
        entries.append(table_entry(shape, buckets, same_bits_across_block_k=across))
    if args.table_out:
        Path(args.table_out).write_text(json.dumps({"entries": entries}, indent=1) + "\n")
        emit(dict(table_out=args.table_out, entries=len(entries)))
    emit(dict(wall_s=round(time.perf_counter() - start, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
