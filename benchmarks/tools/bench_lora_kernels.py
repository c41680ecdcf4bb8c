"""The LoRA kernels on the Llama-3.1-8B projections, bf16, 16 rank-16 adapter slots: each
projection's base matmul alone against the matmul followed by its LoRA launches (one fused
kernel at <= 4 rows; shrink + expand above, rows round-robin over the 16 adapters), as the
layer runs them, in microseconds per call.

Each measurement replays a CUDA graph of back-to-back calls cycling over enough copies of
the base weight and of the adapter slots (>= 512 MiB) that none is served from L2, as in a
decode step where the other layers' weights pass through in between; the LoRA kernels'
programmatic dependent launch overlaps them with the matmul as in the engine. The LoRA
output is checked against the kernels' PyTorch references. The `per_step` record sums a
decoder layer's four projections times 32 layers.

    python3 benchmarks/tools/bench_lora_kernels.py --out $OUT/lora_kernels.jsonl
    python3 benchmarks/tools/bench_lora_kernels.py --rows 1 --rows 256 --rows 2048
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from batchlm.engine.lora.batch import LoRABuffers
from batchlm.engine.lora.layers import (
    EXPAND_BLOCK_N,
    FUSED_BLOCK_K,
    FUSED_BLOCK_N,
    SHRINK_BLOCK_K,
)
from batchlm.engine.models.layers.linear import linear
from batchlm.kernels.launch import num_sms
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


def bench(name: str, rows: int, rec) -> dict:
    dtype, dev = torch.bfloat16, torch.device("cuda")
    k, slices = PROJECTIONS[name]
    n = sum(slices)
    starts = [0, *np.cumsum(slices).tolist()]
    layer_bytes = (n * k + NUM_SLOTS * (len(slices) * RANK * k + n * RANK)) * 2
    copies = max(2, min(8, COPIES_BYTES // layer_bytes))
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [
        torch.randn(n, k, device=dev, dtype=dtype, generator=gen) / k**0.5 for _ in range(copies)
    ]
    lora_a = [
        torch.randn(NUM_SLOTS, len(slices), RANK, k, device=dev, generator=gen).to(dtype) / k**0.5
        for _ in range(copies)
    ]
    lora_b = [
        torch.randn(NUM_SLOTS, n, RANK, device=dev, generator=gen).to(dtype) * 0.01
        for _ in range(copies)
    ]
    x = torch.randn(rows, k, device=dev, dtype=dtype, generator=gen)
    buffers = LoRABuffers(max(rows, 16), NUM_SLOTS, dev)
    slots = (np.arange(rows) % NUM_SLOTS).astype(np.int32)
    batch = buffers.stage(slots)
    fused_blocks = column_blocks(starts, FUSED_BLOCK_N, dev)
    expand_blocks = column_blocks(starts, EXPAND_BLOCK_N, dev)
    split_k = choose_split_k(batch.tiles.shape[0], len(slices), k, SHRINK_BLOCK_K, num_sms(dev))
    outs = [torch.empty(rows, n, device=dev, dtype=dtype) for _ in range(2)]

    def base(i):
        outs[i % 2] = linear(x, weights[i])
        return outs[i % 2]

    def with_lora(i):
        out = base(i)
        if batch.fused:
            lora_fused(x, lora_a[i], lora_b[i], out, batch.token_slots, fused_blocks,
                       block_n=FUSED_BLOCK_N, block_k=FUSED_BLOCK_K)  # fmt: skip
        else:
            shrunk = lora_shrink(x, lora_a[i], batch.token_ids, batch.tiles,
                                 tile_rows=batch.tile_rows, split_k=split_k, block_k=SHRINK_BLOCK_K)  # fmt: skip
            lora_expand(shrunk, lora_b[i], out, batch.token_ids, batch.tiles, expand_blocks,
                        tile_rows=batch.tile_rows, block_n=EXPAND_BLOCK_N)  # fmt: skip
        return out

    expected = lora_fused_ref(
        x, lora_a[0], lora_b[0], linear(x, weights[0]), batch.token_slots, starts
    )
    torch.testing.assert_close(with_lora(0).float(), expected.float(), atol=3e-2, rtol=3e-2)
    base_us = graph_us(base, copies)
    lora_us = graph_us(with_lora, copies)
    record = dict(
        workload="lora-kernels",
        projection=name,
        rows=rows,
        path="fused"
        if batch.fused
        else f"shrink+expand (tile_rows {batch.tile_rows}, split_k {split_k})",
        launches=1 if batch.fused else 2,
        base_us=round(base_us, 2),
        base_plus_lora_us=round(lora_us, 2),
        lora_us=round(lora_us - base_us, 2),
        ratio=round(lora_us / base_us, 3),
        slots=NUM_SLOTS,
        rank=RANK,
        weight_copies=copies,
    )
    rec(record)
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, action="append", help="default: 1 and 256")
    ap.add_argument("--projection", action="append", choices=list(PROJECTIONS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_lora_kernels: needs a CUDA GPU")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import Recorder

    recorder = Recorder(args.out)
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
