"""The mma.sync W4A16 form's launches (`gpu_kernels/w4a16_mma.py`) at the Llama-3.1-8B layer
shapes and 1-8 rows, by outputs per program and split of K, against the launch
`mma_launch` chooses and bf16 cuBLAS. Weights, timing and
checks as `bench_w4a16.py` (graphs of back-to-back calls over 512 MiB of weight copies,
best of 5; every launch checked against `w4a16_ref` first), PDL as the engine launches.

    python3 benchmarks/tools/sweep_w4a16_mma.py --out $OUT/w4a16_mma_sweep.jsonl

One JSON line per (shape, rows): `workload` "W4A16-mma-sweep", `value` the fastest
launch's microseconds (`best`), each launch's as `us` keyed
`block_n/split_k`, `chosen` and `chosen_us` the launch `mma_launch`
chose, `bf16_us` cuBLAS on the bf16 weight.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_w4a16 as bw  # noqa: E402
from common import Recorder  # noqa: E402

from batchlm.kernels.pdl import launch_options  # noqa: E402
from batchlm.kernels.w4a16 import _split_k_parts, _w4a16_kernel, new_split_k_locks  # noqa: E402
from batchlm.kernels.w4a16_launch import MMA, W4a16Launch  # noqa: E402
from batchlm.kernels.w4a16_mma import launch_w4a16_mma, mma_launch  # noqa: E402

BLOCK_N = (128, 64)
SPLITS = (1, 2, 4, 8, 16)
ROWS = (1, 2, 3, 4, 6, 8)


def _run(launch: W4a16Launch, x, y, locks, pdl: bool, w: dict) -> None:
    parts = _split_k_parts(launch.split_k, locks, y)
    launch_w4a16_mma(x, w["qweight"], w["scales"], None, None, y, parts, locks,
                     group_size=w["group_size"], launch=launch, pdl=pdl)  # fmt: skip


def main() -> int:
    out, rows_list = bw.sweep_args(__doc__, ROWS)
    rec = Recorder(str(out))
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    device = torch.device("cuda")
    pdl = launch_options(_w4a16_kernel, device)["PDL"]
    locks = new_split_k_locks(device)
    for name, n, k, rows, weights, dense, x, y, want in bw.layer_cases(rows_list, gen):
        chosen = mma_launch(rows, n, k, bw.GROUP_SIZE, bf16, device)
        launches = {chosen}
        for block_n in BLOCK_N:
            for split in SPLITS:
                if (k // 128) % split == 0:
                    launches.add(W4a16Launch(8, block_n, 128, split, 4, 1, MMA))
        us = {}
        for launch in sorted(launches):
            run = partial(_run, launch, x, y, locks, pdl)
            y.zero_()
            run(weights[0])
            error = bw.relative_error(y, want)
            if error > 1e-2 or int(locks.abs().sum()):
                print(f"{name} rows={rows} {launch}: relative error {error}", file=sys.stderr)
                return 1
            key = f"{launch.block_n}/{launch.split_k}"
            us[key] = round(bw.time_calls(run, weights), 2)
        best = min(us, key=us.get)
        chosen_key = f"{chosen.block_n}/{chosen.split_k}"
        print(f"{name} rows={rows}: best {best} {us[best]} us, chosen {chosen_key} "
              f"{us[chosen_key]} us", flush=True)  # fmt: skip
        rec.record(
            workload="W4A16-mma-sweep", system="batchlm-w4a16-mma", metric="us",
            value=us[best], best=best, us=us, chosen=chosen_key, chosen_us=us[chosen_key],
            bf16_us=round(bw.time_calls(partial(F.linear, x), dense), 2), pdl=pdl,
            shape=name, n=n, k=k, rows=rows, group_size=bw.GROUP_SIZE, dtype="bfloat16",
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
