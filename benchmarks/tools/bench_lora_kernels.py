"""The LoRA kernels on the Llama-3.1-8B projections, bf16, 16 rank-16 adapter slots: each
projection's base matmul alone against the matmul followed by its LoRA launches (one fused
kernel at <= 4 rows; shrink + expand above, rows round-robin over the 16 adapters), as the
layer runs them, in microseconds per call. At <= 4 rows `down_proj`'s input is made by the
SiLU-and-mul from a `[rows, 2 * 14336]` gate|up output, which does the adapter's shrink on
the way (`gpu_kernels/lora_act_shrink.py`): its base is that activation and the matmul, its LoRA
launches the activation with the shrink and the fused kernel adding up the partials.

Each measurement replays a CUDA graph of back-to-back calls cycling over enough copies of
the base weight and of the adapter slots (>= 512 MiB) that none is served from L2, as in a
decode step where the other layers' weights pass through in between; the LoRA kernels'
programmatic dependent launch overlaps them with the matmul as in the engine. The LoRA
output is checked against the kernels' PyTorch references. The `per_step` record sums a
decoder layer's four projections times 32 layers.

    python3 benchmarks/tools/bench_lora_kernels.py --out $OUT/lora_kernels.jsonl
    python3 benchmarks/tools/bench_lora_kernels.py --rows 1 --rows 256 --rows 2048
    python3 benchmarks/tools/bench_lora_kernels.py --sweep --out $OUT/lora_sweep.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

from batchlm.engine.lora.batch import SMALL_TILE_ROWS, LoRABuffers
from batchlm.engine.lora.layers import (
    ACT_SHRINK_BLOCK,
    ACT_SHRINK_WARPS,
    EXPAND_BLOCK_N,
    EXPAND_BLOCK_N_LARGE_TILES,
    EXPAND_WARPS,
    EXPAND_WARPS_LARGE_TILES,
    FUSED_BLOCK_K,
    FUSED_BLOCK_N,
    FUSED_WARPS,
    SHRINK_BLOCK_K,
    SHRINK_WARPS,
)
from batchlm.engine.models.layers.linear import linear
from batchlm.kernels.activation import silu_and_mul
from batchlm.kernels.launch import num_sms
from batchlm.kernels.lora_act_shrink import silu_and_mul_lora_shrink
from batchlm.kernels.lora_expand import column_blocks, lora_expand
from batchlm.kernels.lora_fused import lora_fused, lora_fused_ref
from batchlm.kernels.lora_shrink import choose_split_k, lora_shrink

PROJECTIONS = {  # name: (in, slice widths)
    "qkv_proj": (4096, [4096, 1024, 1024]),
    "o_proj": (4096, [4096]),
    "gate_up_proj": (4096, [14336, 14336]),
    "down_proj": (14336, [4096]),
}
NUM_SLOTS, RANK, NUM_LAYERS = 16, 16, 32
COPIES_BYTES = 512 << 20
CALLS = 16


def graph_us(fn, num_copies: int) -> float:
    """Microseconds per call of `fn(i)` over a graph of CALLS calls, i cycling copies."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i % num_copies)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i % num_copies)
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


LAUNCH_DEFAULTS = dict(
    fused_block_n=FUSED_BLOCK_N,
    fused_block_k=FUSED_BLOCK_K,
    fused_warps=FUSED_WARPS,
    shrink_block_k=SHRINK_BLOCK_K,
    shrink_warps=SHRINK_WARPS,
    split_scale=1,
    expand_block_n=EXPAND_BLOCK_N,
    expand_warps=EXPAND_WARPS,
    act_block=ACT_SHRINK_BLOCK,
    act_warps=ACT_SHRINK_WARPS,
)
"""The engine's launches (`engine/lora/layers.py`); `--sweep` varies them one group at a
time. `split_scale` multiplies the split over K that `choose_split_k` picks."""


def launch_defaults(tile_rows: int) -> dict:
    """The engine's launches for tiles of `tile_rows` rows (prefill steps' are larger)."""
    if tile_rows <= SMALL_TILE_ROWS:
        return dict(LAUNCH_DEFAULTS)
    return dict(
        LAUNCH_DEFAULTS,
        expand_block_n=EXPAND_BLOCK_N_LARGE_TILES,
        expand_warps=EXPAND_WARPS_LARGE_TILES,
    )


SWEEP = {
    "fused": dict(
        fused_block_n=[64, 128, 256],
        fused_block_k=[128, 256, 512, 1024],
        fused_warps=[4, 8],
    ),
    "shrink": dict(shrink_block_k=[32, 64, 128], shrink_warps=[4, 8], split_scale=[0.5, 1, 2]),
    "expand": dict(expand_block_n=[64, 128, 256, 512], expand_warps=[4, 8]),
    "act": dict(act_block=[128, 256, 512, 1024, 2048], act_warps=[2, 4, 8]),
}


class Projection:
    """One projection's weights (copies), adapter slots and a step's rows, on the GPU."""

    def __init__(self, name: str, rows: int) -> None:
        dtype, dev = torch.bfloat16, torch.device("cuda")
        k, slices = PROJECTIONS[name]
        n = sum(slices)
        self.name, self.rows, self.k, self.num_slices = name, rows, k, len(slices)
        self.starts = [0, *np.cumsum(slices).tolist()]
        layer_bytes = (n * k + NUM_SLOTS * (len(slices) * RANK * k + n * RANK)) * 2
        self.copies = max(2, min(8, COPIES_BYTES // layer_bytes))
        gen = torch.Generator(device=dev).manual_seed(0)
        self.weights = [
            torch.randn(n, k, device=dev, dtype=dtype, generator=gen) / k**0.5
            for _ in range(self.copies)
        ]
        self.lora_a = [
            torch.randn(NUM_SLOTS, len(slices), RANK, k, device=dev, generator=gen).to(dtype)
            / k**0.5
            for _ in range(self.copies)
        ]
        self.lora_b = [
            torch.randn(NUM_SLOTS, n, RANK, device=dev, generator=gen).to(dtype) * 0.01
            for _ in range(self.copies)
        ]
        buffers = LoRABuffers(max(rows, 16), NUM_SLOTS, dev)
        self.batch = buffers.stage((np.arange(rows) % NUM_SLOTS).astype(np.int32))
        self.folded = name == "down_proj" and self.batch.fused
        """The activation makes `x` (and does the shrink)."""
        if self.folded:
            self.gate_up = torch.randn(rows, 2 * k, device=dev, dtype=dtype, generator=gen)
            self.x = silu_and_mul(self.gate_up)
        else:
            self.x = torch.randn(rows, k, device=dev, dtype=dtype, generator=gen)
        self.outs = [torch.empty(rows, n, device=dev, dtype=dtype) for _ in range(2)]
        self.base_us = graph_us(self.base, self.copies)

    def base(self, i):
        x = silu_and_mul(self.gate_up) if self.folded else self.x
        self.outs[i % 2] = linear(x, self.weights[i])
        return self.outs[i % 2]

    def split_k(self, launch: dict) -> int:
        chosen = choose_split_k(
            self.batch.tiles.shape[0],
            self.num_slices,
            self.k,
            launch["shrink_block_k"],
            num_sms(self.x.device),
        )
        return max(1, min(64, int(chosen * launch["split_scale"])))

    def with_lora(self, launch: dict):
        dev, batch = self.x.device, self.batch
        fused = batch.fused
        fused_blocks = column_blocks(self.starts, launch["fused_block_n"], dev)
        expand_blocks = column_blocks(self.starts, launch["expand_block_n"], dev)
        split_k = self.split_k(launch)

        def run(i):
            if not self.folded:
                out, partials = self.base(i), None
            else:
                x, partials = silu_and_mul_lora_shrink(
                    self.gate_up, self.lora_a[i], batch.token_slots,
                    block=launch["act_block"], num_warps=launch["act_warps"],
                )  # fmt: skip
                out = self.outs[i % 2] = linear(x, self.weights[i])
            if fused:
                lora_fused(self.x, self.lora_a[i], self.lora_b[i], out, batch.token_slots,
                           fused_blocks, block_n=launch["fused_block_n"],
                           block_k=launch["fused_block_k"], num_warps=launch["fused_warps"],
                           partials=partials)  # fmt: skip
            else:
                shrunk = lora_shrink(self.x, self.lora_a[i], batch.token_ids, batch.tiles,
                                     tile_rows=batch.tile_rows, split_k=split_k,
                                     block_k=launch["shrink_block_k"],
                                     num_warps=launch["shrink_warps"])  # fmt: skip
                lora_expand(shrunk, self.lora_b[i], out, batch.token_ids, batch.tiles,
                            expand_blocks, tile_rows=batch.tile_rows,
                            block_n=launch["expand_block_n"],
                            num_warps=launch["expand_warps"])  # fmt: skip
            return out

        return run

    def lora_us(self, launch: dict) -> float:
        """Microseconds the adapters add to the matmul, the output checked first."""
        run = self.with_lora(launch)
        expected = lora_fused_ref(
            self.x,
            self.lora_a[0],
            self.lora_b[0],
            linear(self.x, self.weights[0]),
            self.batch.token_slots,
            self.starts,
        )
        torch.testing.assert_close(run(0).float(), expected.float(), atol=3e-2, rtol=3e-2)
        return graph_us(run, self.copies) - self.base_us


def bench(name: str, rows: int, rec) -> dict:
    proj = Projection(name, rows)
    launch = launch_defaults(proj.batch.tile_rows)
    lora_us = proj.lora_us(launch)
    fused = proj.batch.fused
    split_k = proj.split_k(launch)
    record = dict(
        workload="lora-kernels",
        projection=name,
        rows=rows,
        path=("activation shrink + fused" if proj.folded else "fused")
        if fused
        else f"shrink+expand (tile_rows {proj.batch.tile_rows}, split_k {split_k})",
        launches=1 if fused else 2,
        base_us=round(proj.base_us, 2),
        base_plus_lora_us=round(proj.base_us + lora_us, 2),
        lora_us=round(lora_us, 2),
        ratio=round((proj.base_us + lora_us) / proj.base_us, 3),
        slots=NUM_SLOTS,
        rank=RANK,
        weight_copies=proj.copies,
        launch=launch,
    )
    rec(record)
    return record


def sweep(name: str, rows: int, rec, only: list[str] | None = None) -> None:
    """Each group of launch fields over its values (the others at the engine's), one
    record per launch, the best of each group last; `only`: those groups alone."""
    proj = Projection(name, rows)
    groups = ["fused"] if proj.batch.fused else ["shrink", "expand"]
    if proj.folded:
        groups.append("act")
    groups = [g for g in groups if not only or g in only]
    launch = launch_defaults(proj.batch.tile_rows)
    for group in groups:
        fields = SWEEP[group]
        results = []
        for values in itertools.product(*fields.values()):
            trial = {**launch, **dict(zip(fields, values, strict=True))}
            try:
                us = proj.lora_us(trial)
            except Exception as e:  # a launch the device cannot run (resources): skipped
                print(f"{name} rows={rows} {trial}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            results.append((us, trial))
            rec(dict(workload="lora-sweep", projection=name, rows=rows, group=group,
                     lora_us=round(us, 2), launch={f: trial[f] for f in fields}))  # fmt: skip
        best_us, launch = min(results, key=lambda r: r[0])
        rec(dict(workload="lora-sweep-best", projection=name, rows=rows, group=group,
                 lora_us=round(best_us, 2), base_us=round(proj.base_us, 2),
                 launch={f: launch[f] for f in fields}))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, action="append", help="default: 1 and 256")
    ap.add_argument("--projection", action="append", choices=list(PROJECTIONS))
    ap.add_argument("--sweep", action="store_true", help="time each launch in SWEEP instead")
    ap.add_argument("--group", action="append", choices=list(SWEEP), help="sweep these alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_lora_kernels: needs a CUDA GPU")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import Recorder

    recorder = Recorder(args.out)
    if args.sweep:
        for rows in args.rows or [1, 256]:
            for name in args.projection or PROJECTIONS:
                sweep(name, rows, lambda r: recorder.record(**r), args.group)
        print(json.dumps({"done": True}))
        return 0
    for rows in args.rows or [1, 256]:
        found = [
            bench(name, rows, lambda r: recorder.record(**r))
            for name in args.projection or PROJECTIONS
        ]
        if len(found) == len(PROJECTIONS):
            base = sum(r["base_us"] for r in found) * NUM_LAYERS
            added = sum(r["lora_us"] for r in found) * NUM_LAYERS
            recorder.record(
                workload="lora-kernels",
                projection="per_step (4 projections x 32 layers)",
                rows=rows,
                launches=sum(r["launches"] for r in found) * NUM_LAYERS,
                base_ms=round(base / 1e3, 3),
                lora_ms=round(added / 1e3, 3),
                ratio=round((base + added) / base, 3),
            )
    print(json.dumps({"done": True}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
