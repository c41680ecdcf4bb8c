"""The GEMV of a weight just read into L2 against one that reads it from memory: per layer
of 32 weight copies (more than L2 holds), in a CUDA graph, at launches of 132 / 264 / 528
programs for the read. `gemv_after_prefetch_us` = (read + GEMV) - read alone.

    python3 benchmarks/tools/l2_prefetch_gemv.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import graph_replay_us  # noqa: E402

from batchlm.kernels.gemv import gemv  # noqa: E402
from batchlm.kernels.l2_prefetch import prefetch_l2  # noqa: E402

LAYERS = 32


def _times(ws, x, sink, programs):
    """µs per layer: the GEMVs alone, the reads alone, each read followed by its GEMV."""

    def product():
        for w in ws:
            gemv(x, w)

    def read():
        for w in ws:
            prefetch_l2(w, sink=sink, programs=programs)

    def read_then_product():
        for w in ws:
            prefetch_l2(w, sink=sink, programs=programs)
            gemv(x, w)

    return [graph_replay_us(f, 20) / LAYERS for f in (product, read, read_then_product)]


def main() -> int:
    if not torch.cuda.is_available():
        print("l2_prefetch_gemv: needs a CUDA GPU")
        return 0
    torch.manual_seed(0)
    for n, k, name in [(4096, 4096, "o"), (6144, 4096, "qkv")]:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        sink = torch.empty(1024, dtype=torch.int32, device="cuda")
        for programs in (132, 264, 528):
            tg, tp, tpg = _times(ws, x, sink, programs)
            print(json.dumps(dict(
                shape=name, programs=programs, gemv_us=round(tg, 2), prefetch_us=round(tp, 2),
                prefetch_then_gemv_us=round(tpg, 2), gemv_after_prefetch_us=round(tpg - tp, 2),
                prefetch_TBps=round(n * k * 2 / tp / 1e6, 2),
            )), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
