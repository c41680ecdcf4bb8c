"""The wgmma W4A16 form's tiles (`gpu_kernels/w4a16_wgmma.py`) at the Llama-3.1-8B layer shapes
and 64-2,048 rows, against what `w4a16` ran before the form (the launch table's tiles, or
dequantize + cuBLAS: `BATCHLM_W4A16_WGMMA=0` for that call) and bf16 cuBLAS, on an sm_90
GPU. Weights, timing and checks as `bench_w4a16.py` (graphs of back-to-back calls over
512 MiB of weight copies, best of 5; every tile checked against `w4a16_ref` first).

    python3 benchmarks/tools/sweep_w4a16_wgmma.py --out $OUT/w4a16_wgmma_sweep.jsonl

One JSON line per (shape, rows): `workload` "W4A16-wgmma-sweep", `value` the fastest
tile's microseconds (`best`), each tile's as `us` keyed `block_n/block_rows/block_k/stages`,
`table_us` the path before the form, `bf16_us` cuBLAS on the bf16 weight.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_w4a16 as bw  # noqa: E402
from common import Recorder  # noqa: E402

from batchlm.kernels.w4a16 import w4a16  # noqa: E402
from batchlm.kernels.w4a16_wgmma import WgmmaLaunch, launch_w4a16_wgmma  # noqa: E402

TILES = [WgmmaLaunch(*t) for t in [(64, 64, 64, 4), (64, 128, 64, 4), (64, 64, 128, 4),
         (64, 128, 128, 3), (128, 128, 64, 4), (128, 64, 64, 4), (64, 256, 64, 3)]]  # fmt: skip
ROWS = (64, 128, 256, 512, 2048)


def _table(x: torch.Tensor, weight: dict) -> torch.Tensor:
    return w4a16(x, **weight)


def main() -> int:
    out, rows_list = bw.sweep_args(__doc__, ROWS)
    rec = Recorder(str(out))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k, rows, weights, dense, x, y, want in bw.layer_cases(rows_list, gen):
        tiles = {}
        for tile in TILES:

            def run(w, x=x, y=y, tile=tile):
                launch_w4a16_wgmma(x, w["qweight"], w["scales"], None, y,
                                   group_size=w["group_size"], launch=tile)  # fmt: skip

            run(weights[0])
            error = bw.relative_error(y, want)
            if error > 1e-2:
                print(f"{name} rows={rows} {tile}: relative error {error}", file=sys.stderr)
                return 1
            tiles["/".join(map(str, tile))] = round(bw.time_calls(run, weights), 2)
        os.environ["BATCHLM_W4A16_WGMMA"] = "0"
        table = bw.time_calls(partial(_table, x), weights)
        del os.environ["BATCHLM_W4A16_WGMMA"]
        best = min(tiles, key=tiles.get)
        rec.record(
            workload="W4A16-wgmma-sweep", system="batchlm-w4a16-wgmma", metric="us",
            value=tiles[best], best=best, us=tiles, table_us=round(table, 2),
            bf16_us=round(bw.time_calls(partial(F.linear, x), dense), 2),
            shape=name, n=n, k=k, rows=rows, group_size=bw.GROUP_SIZE, dtype="bfloat16",
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
