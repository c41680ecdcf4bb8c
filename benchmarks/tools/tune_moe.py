"""Sweep the launches of `fused_moe`'s two grouped GEMMs on a CUDA GPU and write the launch
table `fused_moe` reads (`gpu_kernels/configs/fused_moe.json`, see `gpu_kernels/moe_launch.py`).

Shape: W6's experts (Qwen3-30B-A3B: 128 experts of width 768 over hidden 2048, top 8,
bf16 activations), with bf16 weights and with fp8 weights (per-channel scales), for
num_tokens M in 1, 2, 4, ..., 8192. Routing from random router logits (`route`, top 8,
renormalised), so M = 1 reads 8 experts and M = 8192 all of them.

For each M, up to 10 candidate launches (a pool by M range, shared across M so each
compiles once) are checked end to end against the current launch's output, then the
gate|up GEMM and the down GEMM are each captured in a CUDA graph and timed with
`triton.testing.do_bench` (L2 flushed before every replay: the weights come from HBM, as
each layer's do in a model). The grouping is made once per block_m and timed too. The
winner per M takes the block_m with the least grouping + gate|up + down time and, for it,
each GEMM's fastest launch. The winner and the current launch are then timed as a whole
`fused_moe` call.

Output: one JSON line per measurement on stdout (and `--log`), then the table: the
repository's entries for other devices / shapes kept, this device's W6 entries replaced,
written to `--out`. Copy it to `gpu_kernels/configs/fused_moe.json` to keep it.

    python3 benchmarks/tools/tune_moe.py --out $OUT/fused_moe.json --log $OUT/tune_moe.jsonl

The whole sweep stops starting new candidates after `--max-seconds` (the best so far
stays; buckets not reached are left out of the table and keep the defaults).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch
from tune_decode_attention import graph_ms

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DTYPE = torch.bfloat16
TOLERANCE = 2e-2  # max |difference| from the current launch's output (bf16 outputs of ~1)

# (block_m, block_n, block_k, num_warps, num_stages). Decode sizes are bound by reading the
# weights (narrow N tiles for more programs, long K tiles for more bytes in flight); prefill
# sizes by the tensor cores (wide tiles, more warps).
_SMALL = [
    (16, 32, 128, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 32, 128, 2, 3),
    (16, 32, 256, 4, 3),
    (16, 64, 256, 4, 3),
    (16, 128, 128, 4, 3),
    (16, 128, 64, 4, 3),
    (16, 64, 64, 4, 3),
]
_MEDIUM = [
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 3),
    (16, 128, 64, 4, 3),
    (32, 64, 128, 4, 4),
    (32, 128, 64, 4, 4),
    (32, 128, 128, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 128, 64, 8, 3),
    # W6's decode steps (2,048 slots, about 16 per expert): the down GEMM read its weights
    # at 3.2 TB/s against gate|up's 3.9; narrower N and longer K tiles put more bytes in
    # flight per program.
    (16, 32, 256, 4, 3),
    (16, 64, 256, 4, 3),
    (32, 64, 256, 4, 3),
    (32, 32, 128, 4, 4),
]
_LARGE = [
    (32, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 2),
    (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
]


def candidates(num_tokens: int) -> list[tuple[int, ...]]:
    if num_tokens <= 64:
        return _SMALL
    return _MEDIUM if num_tokens <= 512 else _LARGE


class Layer:
    """One MoE layer's weights (bf16 or fp8) and its inputs for each M."""

    def __init__(self, weight_dtype: str, w13: torch.Tensor, w2: torch.Tensor, inter: int):
        self.weight_dtype = weight_dtype
        self.inter = inter
        self.scales: dict[str, torch.Tensor] = {}
        if weight_dtype == "float8_e4m3fn":
            from batchlm.engine.models.layers.moe import quantize_experts_fp8

            (w13, s13), (w2, s2) = quantize_experts_fp8(w13), quantize_experts_fp8(w2)
            self.scales = dict(w13_scale=s13, w2_scale=s2)
        self.w13, self.w2 = w13, w2

    def inputs(self, num_tokens: int, seed: int):
        from batchlm.kernels.moe_routing import route

        gen = torch.Generator("cuda").manual_seed(seed + num_tokens)
        hidden = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).to(DTYPE)
        logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda", generator=gen)
        weights, ids = route(logits, TOP_K, renormalize=True)
        return hidden, weights, ids

    def fused(self, hidden, weights, ids, launch=None):
        from batchlm.kernels.fused_moe import fused_moe

        return fused_moe(hidden, self.w13, self.w2, weights, ids, launch=launch, **self.scales)


def sweep_m(layer: Layer, num_tokens: int, args, emit, deadline: float) -> dict | None:
    """The best launches for M = `num_tokens`, or None when the deadline came first."""
    from batchlm.kernels.fused_moe import ExpertGrouping, moe_down, moe_gate_up
    from batchlm.kernels.moe_launch import MoeLaunch, MoeLaunches
    from batchlm.kernels.moe_routing import align_tokens

    hidden, weights, ids = layer.inputs(num_tokens, args.seed)
    reference = layer.fused(hidden, weights, ids)
    tag = dict(weight_dtype=layer.weight_dtype, inter=layer.inter, m=num_tokens)
    groupings: dict[int, tuple[ExpertGrouping, float]] = {}
    timed = []
    for config in candidates(num_tokens):
        if time.perf_counter() > deadline:
            emit(dict(tag, stopped="deadline"))
            break
        launch = MoeLaunch(*config)
        record = dict(tag, launch=list(config))
        try:
            out = layer.fused(hidden, weights, ids, launch=MoeLaunches(launch, launch))
            diff = (out.float() - reference.float()).abs().max().item()
            record["max_abs_diff"] = round(diff, 5)
            if not diff < TOLERANCE:
                record["error"] = "output differs from the current launch's"
                emit(record)
                continue
            if launch.block_m not in groupings:

                def group(bm=launch.block_m):
                    return align_tokens(ids, NUM_EXPERTS, bm)

                slots, experts, _ = group()
                grouping = ExpertGrouping(slots, experts, num_tokens * TOP_K, TOP_K)
                groupings[launch.block_m] = (grouping, graph_ms(group, args.warmup_ms, args.rep_ms))
            grouping, _ = groupings[launch.block_m]
            act = moe_gate_up(hidden, layer.w13, layer.scales.get("w13_scale"), grouping, launch)

            def gate_up(launch=launch, grouping=grouping):
                moe_gate_up(hidden, layer.w13, layer.scales.get("w13_scale"), grouping, launch)

            def down(launch=launch, grouping=grouping, act=act):
                moe_down(act, layer.w2, layer.scales.get("w2_scale"), grouping, launch)

            record["gate_up_us"] = round(graph_ms(gate_up, args.warmup_ms, args.rep_ms) * 1e3, 2)
            record["down_us"] = round(graph_ms(down, args.warmup_ms, args.rep_ms) * 1e3, 2)
        except Exception as exc:  # noqa: BLE001 - a failing launch is reported, the sweep goes on
            record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            emit(record)
            continue
        emit(record)
        timed.append((launch, record))
    if not timed:
        return None
    best = None
    for block_m, (_, group_ms) in groupings.items():
        mine = [(launch, r) for launch, r in timed if launch.block_m == block_m]
        if not mine:
            continue
        gu = min(mine, key=lambda x: x[1]["gate_up_us"])
        dn = min(mine, key=lambda x: x[1]["down_us"])
        total = group_ms * 1e3 + gu[1]["gate_up_us"] + dn[1]["down_us"]
        if best is None or total < best[0]:
            best = (total, MoeLaunches(gu[0], dn[0]))
    assert best is not None
    chosen = best[1]
    tuned_us = graph_ms(
        lambda: layer.fused(hidden, weights, ids, chosen), args.warmup_ms, args.rep_ms
    )
    current_us = graph_ms(lambda: layer.fused(hidden, weights, ids), args.warmup_ms, args.rep_ms)
    summary = dict(
        tag,
        best_gate_up=list(chosen.gate_up),
        best_down=list(chosen.down),
        tuned_us=round(tuned_us * 1e3, 2),
        current_us=round(current_us * 1e3, 2),
        speedup=round(current_us / tuned_us, 3),
    )
    emit(summary)
    return dict(launches=chosen, summary=summary)


def write_table(path: str, new_entries: list[dict]) -> None:
    """The repository's table with `new_entries` in place of those of the same shapes."""
    from batchlm.kernels.moe_launch import DEFAULT_TABLE_PATH

    keys = ("device", "num_experts", "hidden", "inter", "dtype", "weight_dtype")
    replaced = {tuple(e[k] for k in keys) for e in new_entries}
    kept = []
    if DEFAULT_TABLE_PATH.exists():
        current = json.loads(DEFAULT_TABLE_PATH.read_text())["entries"]
        kept = [e for e in current if tuple(e[k] for k in keys) not in replaced]
    text = json.dumps({"entries": kept + new_entries}, indent=1)
    # One line per launch: `[16, 64, 128, 4, 4]`.
    text = re.sub(
        r"\[([^\[\]{}]*)\]", lambda m: f"[{', '.join(v.strip() for v in m[1].split(','))}]", text
    )
    with open(path, "w") as f:
        f.write(text + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="where to write the launch table (JSON)")
    ap.add_argument("--log", default=None, help="also write the JSON lines to this file")
    ap.add_argument(
        "--weight-dtype", action="append", choices=["bfloat16", "float8_e4m3fn"],
        help="repeat for both (default: both)",
    )  # fmt: skip
    ap.add_argument(
        "--inter", type=int, action="append",
        help="expert width on one rank (default 768; 384 for two ranks)",
    )  # fmt: skip
    ap.add_argument("--m", type=int, action="append", help="token counts (default 1 .. 8192)")
    ap.add_argument("--warmup-ms", type=float, default=5.0)
    ap.add_argument("--rep-ms", type=float, default=20.0)
    ap.add_argument("--max-seconds", type=float, default=165.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tune_moe: needs a CUDA GPU; nothing to do on this machine")
        return 0
    import triton

    from batchlm.kernels.launch import dtype_name
    from batchlm.kernels.moe_launch import MoeShape, device_name, table_entry

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
    gen = torch.Generator("cuda").manual_seed(args.seed)
    entries = []
    for inter in args.inter or [INTER]:
        w13 = torch.randn(NUM_EXPERTS, 2 * inter, HIDDEN, device="cuda", generator=gen)
        w2 = torch.randn(NUM_EXPERTS, HIDDEN, inter, device="cuda", generator=gen)
        w13, w2 = (w13 / HIDDEN**0.5).to(DTYPE), (w2 / inter**0.5).to(DTYPE)
        for weight_dtype in args.weight_dtype or ["bfloat16", "float8_e4m3fn"]:
            layer = Layer(weight_dtype, w13, w2, inter)
            buckets = {}
            for m in args.m or TOKEN_COUNTS:
                result = sweep_m(layer, m, args, emit, deadline)
                if result is not None:
                    buckets[m] = result["launches"]
            if buckets:
                shape = MoeShape(
                    device_name(device), NUM_EXPERTS, HIDDEN, inter, dtype_name(DTYPE), weight_dtype
                )
                entries.append(table_entry(shape, buckets))
            del layer
            torch.cuda.empty_cache()
        del w13, w2
    write_table(args.out, entries)
    emit(dict(out=args.out, entries=len(entries), wall_s=round(time.perf_counter() - start, 1)))
    if log:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
