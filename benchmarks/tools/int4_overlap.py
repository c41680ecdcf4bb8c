"""Can dequantizing int4 weights hide behind the GEMMs of a many-row step? W1-int4's decode
steps (256 rows) dequantize every projection to bf16 and multiply with cuBLAS, one after
the other. This times a chain of Llama-3.1-8B layers (q|k|v, a memory-bound stand-in for
attention, o, gate|up, down) at `--rows` rows, each variant inside a CUDA graph:

- `bf16`: cuBLAS on bf16 weights (the floor);
- `serial`: dequantize each projection, then multiply (what the engine did);
- `overlap`: the next projection dequantized on a second stream into one of two buffers
  while this one multiplies;
- `overlap-carveout-N`: the same with cuBLAS(Lt) told to leave N SMs free.

    python3 benchmarks/tools/int4_overlap.py --out $OUT/int4_overlap.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SHAPES = (("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096),
          ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336))  # fmt: skip
GROUP_SIZE = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--attention-mb",
        type=float,
        default=556.0,
        help="bytes the attention stand-in reads per layer (W1 at context 530)",
    )
    ap.add_argument("--carveout", type=int, action="append", default=None)
    ap.add_argument("--chunk-mb", type=float, action="append", default=None)
    ap.add_argument("--no-carveout", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.chunk_mb = args.chunk_mb or [8.0, 16.0, 24.0]
    if not torch.cuda.is_available():
        print("int4_overlap: needs a CUDA GPU")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import graph_replay_us

    from batchlm.kernels.w4a16 import dequantize_int4

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    seq = []  # (name, int4 dict, bf16 [K, N])
    for _ in range(args.layers):
        for name, n, k in SHAPES:
            qw = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=gen, device=dev,
                               dtype=torch.int32)  # fmt: skip
            sc = (torch.rand(k // GROUP_SIZE, n, generator=gen, device=dev) * 0.01).to(dtype)
            seq.append((name, qw, sc))
    att = torch.empty(int(args.attention_mb * 2**20) // 2, dtype=dtype, device=dev).view(-1, 4096)
    att_out = torch.empty(4096, dtype=dtype, device=dev)
    xs = {k: torch.randn(args.rows, k, device=dev, dtype=dtype) for _, _, k in SHAPES}
    outs = {n: torch.empty(args.rows, n, device=dev, dtype=dtype) for _, n, _ in SHAPES}
    biggest = max(n * k for _, n, k in SHAPES)
    ring = [torch.empty(biggest, dtype=dtype, device=dev) for _ in range(2)]
    dense_biggest = torch.empty(biggest, dtype=dtype, device=dev)

    def deq(i, out=None):
        name, qw, sc = seq[i]
        k, n = qw.shape[0] * 8, qw.shape[1]
        view = None if out is None else out[: k * n].view(k, n)
        return dequantize_int4(qw, sc, None, GROUP_SIZE, None, None, dtype, out=view)

    def mm(i, w):
        name, qw, _ = seq[i]
        k, n = qw.shape[0] * 8, qw.shape[1]
        torch.mm(xs[k], w, out=outs[n])
        if name == "qkv_proj":
            torch.sum(att, dim=0, out=att_out)

    def run_bf16():
        for i, (_, qw, _) in enumerate(seq):
            k, n = qw.shape[0] * 8, qw.shape[1]
            mm(i, dense_biggest[: k * n].view(k, n))

    def run_serial():
        for i in range(len(seq)):
            mm(i, deq(i))

    chunk_buf = torch.empty(int(max(args.chunk_mb)) << 20 >> 1, dtype=dtype, device=dev)

    def run_chunked(budget_mb):
        """Each projection dequantized a slice at a time into one buffer of `budget_mb`,
        small enough to stay in L2, each slice multiplied right after: columns for the
        wide layers, rows of K (summed) for down_proj."""
        elems = int(budget_mb * 2**20) // 2
        for name, qw, sc in seq:
            k, n = qw.shape[0] * 8, qw.shape[1]
            x, out = xs[k], outs[n]
            if n >= k:
                step = max(256, elems // k // 256 * 256)
                for n0 in range(0, n, step):
                    n1 = min(n, n0 + step)
                    view = chunk_buf[: k * (n1 - n0)].view(k, n1 - n0)
                    dequantize_int4(qw[:, n0:n1], sc[:, n0:n1], None, GROUP_SIZE, None, None,
                                    dtype, out=view)  # fmt: skip
                    torch.mm(x, view, out=out[:, n0:n1])
            else:
                step = max(GROUP_SIZE, elems // n // GROUP_SIZE * GROUP_SIZE)
                for k0 in range(0, k, step):
                    k1 = min(k, k0 + step)
                    view = chunk_buf[: (k1 - k0) * n].view(k1 - k0, n)
                    dequantize_int4(qw[k0 // 8 : k1 // 8], sc[k0 // GROUP_SIZE : k1 // GROUP_SIZE],
                                    None, GROUP_SIZE, None, None, dtype, out=view)  # fmt: skip
                    if k0 == 0:
                        torch.mm(x[:, k0:k1], view, out=out)
                    else:
                        out.addmm_(x[:, k0:k1], view)
            if name == "qkv_proj":
                torch.sum(att, dim=0, out=att_out)

    side = torch.cuda.Stream()
    ready = [torch.cuda.Event() for _ in seq]
    free = [torch.cuda.Event() for _ in seq]

    def run_overlap():
        main_s = torch.cuda.current_stream()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            deq(0, ring[0])
            ready[0].record(side)
        for i in range(len(seq)):
            main_s.wait_event(ready[i])
            if i + 1 < len(seq):
                with torch.cuda.stream(side):
                    if i >= 1:
                        side.wait_event(free[i - 1])
                    deq(i + 1, ring[(i + 1) % 2])
                    ready[i + 1].record(side)
            name, qw, _ = seq[i]
            k, n = qw.shape[0] * 8, qw.shape[1]
            mm(i, ring[i % 2][: k * n].view(k, n))
            free[i].record(main_s)

    def timed(fn) -> float:
        return graph_replay_us(fn, per_sample=3) / args.layers

    # Same bits whichever way: the overlapped chain's outputs against the serial chain's.
    checks = {}
    run_serial()
    torch.cuda.synchronize()
    want = {n: o.clone() for n, o in outs.items()}
    run_overlap()
    torch.cuda.synchronize()
    checks["overlap_equal"] = all(torch.equal(outs[n], want[n]) for n in outs)
    for mb in args.chunk_mb:
        run_chunked(mb)
        torch.cuda.synchronize()
        checks[f"chunked_{mb:g}mb_max_rel_diff"] = max(
            ((outs[n].float() - want[n].float()).norm() / want[n].float().norm()).item()
            for n in outs
        )
    records = [dict(variant="bf16", us_per_layer=timed(run_bf16)),
               dict(variant="serial", us_per_layer=timed(run_serial)),
               dict(variant="overlap", us_per_layer=timed(run_overlap))]  # fmt: skip
    for mb in args.chunk_mb:
        records.append(
            dict(variant=f"chunked-{mb:g}mb", us_per_layer=timed(lambda mb=mb: run_chunked(mb)))
        )
    if args.no_carveout:
        args.carveout = []
        libs = ()
    else:
        libs = ("cublas", "cublaslt")
    for lib in libs:
        torch.backends.cuda.preferred_blas_library(lib)
        for c in args.carveout or [0, 8, 16, 32]:
            torch._C._set_sm_carveout_experimental(c or None)
            for name, fn in (("bf16", run_bf16), ("serial", run_serial), ("overlap", run_overlap)):
                records.append(dict(variant=f"{name}-{lib}-carveout-{c}", us_per_layer=timed(fn)))
        torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("cublas")
    head = dict(device=torch.cuda.get_device_name(), rows=args.rows, layers=args.layers,
                attention_mb=args.attention_mb, torch=torch.__version__, **checks)  # fmt: skip
    lines = [json.dumps(head)] + [json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                              for k, v in r.items()}) for r in records]  # fmt: skip
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
