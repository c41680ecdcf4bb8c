"""A trial for W3: what folding the residual add + RMSNorm into the GEMV after it would save
in a batch-1 decode step. Times, in a CUDA graph with programmatic dependent launch, a
chain of `--layers` pairs (`fused_add_rms_norm` then the q|k|v GEMV of Llama-3.1-8B, as a
decoder layer runs them) against the same chain with one kernel per pair: each GEMV program
first normalizes the whole row itself (from L2: the row and the residual, 8 KB each), with
the norm kernel's rounding, then streams its weight rows as `gemv` does; program 0 writes
the new residual. Outputs are compared bit for bit with the two-kernel chain's.

    python3 benchmarks/tools/w3_norm_gemv.py --out $OUT/w3_norm_gemv.jsonl

The fused kernel lives here only, as a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from batchlm.kernels.gemv import choose_gemv_launch, gemv
from batchlm.kernels.pdl import launch_options, wait_for_previous_kernel
from batchlm.kernels.rms_norm import fused_add_rms_norm


@triton.jit
def _normed(x_ptr, r_ptr, g_ptr, ks, rs):
    """Columns `ks` of the norm kernel's output, from the row, the residual and the weight
    (L1 / L2 hits), rounded as `rms_norm_row` rounds them and as its output is stored."""
    dtype = x_ptr.dtype.element_ty
    h = (tl.load(x_ptr + ks).to(tl.float32) + tl.load(r_ptr + ks).to(tl.float32)).to(dtype)
    normed = (h.to(tl.float32) * rs).to(dtype).to(tl.float32)
    return (normed * tl.load(g_ptr + ks).to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _add_norm_gemv_kernel(
    x_ptr, r_ptr, g_ptr, w_ptr, y_ptr, r_out_ptr, N, K, stride_wn, eps,
    HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    w = tl.load(rows + offs_k[None, :])
    wait_for_previous_kernel(PDL)
    offs = tl.arange(0, HIDDEN)
    h = (tl.load(x_ptr + offs).to(tl.float32) + tl.load(r_ptr + offs).to(tl.float32)).to(
        x_ptr.dtype.element_ty
    )
    if tl.program_id(0) == 0:
        tl.store(r_out_ptr + offs, h)
    hf = h.to(tl.float32)
    rs = tl.rsqrt(tl.sum(hf * hf, axis=0) / HIDDEN + eps)
    acc = w.to(tl.float32) * _normed(x_ptr, r_ptr, g_ptr, offs_k, rs)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(rows + k0 + offs_k[None, :])
        acc += w.to(tl.float32) * _normed(x_ptr, r_ptr, g_ptr, k0 + offs_k, rs)[None, :]
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def add_norm_gemv(x, r, g, w, eps, block_n, block_k, num_warps, num_stages):
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(r)
    _add_norm_gemv_kernel[(n // block_n,)](
        x, r, g, w, y, r_out, n, k, w.stride(0), eps, HIDDEN=k, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **launch_options(_add_norm_gemv_kernel, x.device),
    )  # fmt: skip
    return y, r_out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("w3_norm_gemv: needs a CUDA GPU")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import graph_replay_us

    dev, dtype, n, k, eps = "cuda", torch.bfloat16, 6144, 4096, 1e-5
    gen = torch.Generator(dev).manual_seed(0)
    ws = [torch.empty(n, k, device=dev, dtype=dtype).normal_(0, 0.02, generator=gen)
          for _ in range(args.layers)]  # fmt: skip
    gs = [(1 + 0.1 * torch.randn(k, device=dev, generator=gen)).to(dtype) for _ in ws]
    x = torch.randn(1, k, device=dev, dtype=dtype, generator=gen)
    r = torch.randn(1, k, device=dev, dtype=dtype, generator=gen)
    launch = choose_gemv_launch(n, k)

    def two_kernels():
        return [gemv(*fused_add_rms_norm(x, r, g, eps)[:1], w) for g, w in zip(gs, ws, strict=True)]

    def fused(block_n, block_k, num_warps, num_stages):
        return [add_norm_gemv(x, r, g, w, eps, block_n, block_k, num_warps, num_stages)[0]
                for g, w in zip(gs, ws, strict=True)]  # fmt: skip

    def timed(fn) -> float:
        return graph_replay_us(fn, per_sample=4) / args.layers

    want = two_kernels()
    records = [
        dict(variant="norm kernel + gemv", launch=list(launch), us_per_pair=timed(two_kernels))
    ]
    for cand in {tuple(launch), (8, 512, 4, 2), (8, 256, 4, 3), (16, 512, 8, 2), (4, 512, 4, 2)}:
        got = fused(*cand)
        equal = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        records.append(dict(variant="fused", launch=list(cand), equal_bits=equal,
                            us_per_pair=timed(lambda cand=cand: fused(*cand))))  # fmt: skip
    head = dict(device=torch.cuda.get_device_name(), layers=args.layers, n=n, k=k)
    lines = [json.dumps(head)] + [
        json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
        for r in records
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
