"""How fast the int4 words of the Llama-3.1-8B layers can be read at all, in the tiles the
one-row W4A16 form reads them (`gpu_kernels/w4a16_mma.py`: a program owns 128 outputs and
a split of K, and reads `[16 word rows, 128 outputs]` a step from the `[K // 8, N]` layout),
and in a tile-major copy of the same words (each program's share contiguous), on a CUDA GPU.

A Triton kernel XORs the words it loads (nothing else) and stores one word per program;
Triton pipelines its loads over `num_stages` buffers. Timing as `bench_w4a16.py` (graphs
of back-to-back calls over 512 MiB of weight copies, best of 5).

    python3 benchmarks/tools/int4_read_floor.py --out $OUT/int4_read_floor.jsonl

One JSON line per (shape, layout, split): `workload` "W4A16-read-floor", `value` the best
microseconds over the stages tried (`us` per stage count), `tb_per_s` the words' bytes
over that time.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_w4a16 as bw  # noqa: E402
from common import Recorder  # noqa: E402

BLOCK_N = 128
BLOCK_K8 = 16  # 128 features a step
SPLITS = {"qkv_proj": (4, 8, 16), "o_proj": (8, 16), "gate_up_proj": (1, 2, 4),
          "down_proj": (8, 16)}  # fmt: skip
STAGES = (1, 2, 3, 4, 6)


@triton.jit
def _read_kernel(
    w_ptr, out_ptr, k8_len, stride_row, stride_col_block, stride_split,
    BLOCK_K8: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_K8)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    base = w_ptr + pid_n.to(tl.int64) * stride_col_block + pid_k.to(tl.int64) * stride_split
    ptrs = base + rows * stride_row + cols
    acc = tl.zeros([BLOCK_K8, BLOCK_N], tl.int32)
    for _ in tl.range(0, k8_len // BLOCK_K8):
        acc ^= tl.load(ptrs)
        ptrs += BLOCK_K8 * stride_row
    total = tl.reduce(tl.reshape(acc, [BLOCK_K8 * BLOCK_N]), 0, _xor)
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, total)


@triton.jit
def _xor(a, b):
    return a ^ b


def _read(layout: str, split: int, stages: int, out: torch.Tensor, words: torch.Tensor) -> None:
    if layout == "kn":  # [K8, N]: a program's rows are N words apart
        k8, n = words.shape
        strides = (n, BLOCK_N, (k8 // split) * n)
    else:  # [N / 128, K8, 128]: a program's share contiguous
        blocks, k8, _ = words.shape
        n = blocks * BLOCK_N
        strides = (BLOCK_N, k8 * BLOCK_N, (k8 // split) * BLOCK_N)
    _read_kernel[(n // BLOCK_N, split)](
        words, out, k8 // split, *strides, BLOCK_K8=BLOCK_K8, BLOCK_N=BLOCK_N,
        num_warps=4, num_stages=stages,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rec = Recorder(str(args.out))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in bw.SHAPES.items():
        k8 = k // 8
        kn = bw.copies(
            lambda n=n, k8=k8: torch.randint(
                -(2**31), 2**31 - 1, (k8, n), generator=gen, device="cuda", dtype=torch.int32
            ),
            n * k // 2,
        )
        tiled = [w.view(k8, n // BLOCK_N, BLOCK_N).transpose(0, 1).contiguous() for w in kn]
        want = None
        for layout, copies in (("kn", kn), ("tiled", tiled)):
            for split in SPLITS[name]:
                out = torch.empty(split * (n // BLOCK_N), dtype=torch.int32, device="cuda")
                us = {}
                for stages in STAGES:
                    run = partial(_read, layout, split, stages, out)
                    run(copies[0])
                    got = _xor_all(out)
                    want = _xor_all(kn[0]) if want is None else want
                    if got != want:
                        print(f"{name} {layout} split={split}: wrong XOR", file=sys.stderr)
                        return 1
                    us[stages] = round(bw.time_calls(run, copies), 2)
                best = min(us.values())
                print(f"{name} {layout} split={split}: {best} us", flush=True)
                rec.record(
                    workload="W4A16-read-floor", system="triton-read", metric="us", value=best,
                    us=us, tb_per_s=round(n * k / 2 / best / 1e6, 3), layout=layout,
                    split_k=split, shape=name, n=n, k=k, block_n=BLOCK_N,
                    block_k=8 * BLOCK_K8,
                )  # fmt: skip
        del kn, tiled
        torch.cuda.empty_cache()
    return 0


def _xor_all(t: torch.Tensor) -> int:
    """The XOR of all words of `t` (on the device)."""
    t = t.flatten()
    while t.numel() > 1:
        if t.numel() % 2:
            t = torch.cat([t, t.new_zeros(1)])
        t = t[0::2] ^ t[1::2]
    return int(t.item())


if __name__ == "__main__":
    sys.exit(main())
