"""A trial of the W4A16 tile form at many rows (W1-int4's 256-row decode steps): the weight
operand built from a load and elementwise operations only (each element loads its own word
and shifts out its nibble, no reshape), the form in which Triton may keep a computed
`tl.dot` operand in registers as wgmma's A operand instead of passing it through shared
memory. Sweeps its launches on the Llama-3.1-8B layers and prints, per layer, the best
against bf16 cuBLAS and dequantize + cuBLAS, and what the compiler made of the first
launch (shared-memory allocations in the TTGIR, the wgmma instruction).

    python3 benchmarks/tools/w4a16_load_elementwise.py 256 $OUT/kernel.ttgir

The kernel lives here only: it was slower than `w4a16.py`'s (docs/performance.md).
"""

import json
import sys

import torch
import triton
import triton.language as tl

from batchlm.kernels.w4a16 import _tile_of_program, dequantize_int4, w4a16_ref


@triton.jit
def k_rega(
    x_ptr, qw_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_qk, stride_sg, stride_ym,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BF16_MATH: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_of_program(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    sh = (ks % 8) * 4
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        wptrs = qw_ptr + ((k0 + ks)[None, :] // 8).to(tl.int64) * stride_qk + offs_n[:, None]
        words = tl.load(wptrs)
        scale = tl.load(s_ptr + (k0 // GROUP_SIZE) * stride_sg + offs_n)[:, None]
        q = (((words >> sh[None, :]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        if BF16_MATH:
            w = (q - 8388616.0).to(tl.bfloat16) * scale
        else:
            w = ((q - 8388616.0) * scale.to(tl.float32)).to(tl.bfloat16)
        xs = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k0 + ks)[:, None],
                     mask=(offs_m < M)[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(w, xs, acc)
    out = tl.trans(acc)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], out.to(tl.bfloat16),
             mask=(offs_m < M)[:, None])  # fmt: skip


def run(x, qw, sc, bm, bn, bk, warps, stages, bf16_math):
    m, k = x.shape
    n = qw.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    c = k_rega[grid](x, qw, sc, y, m, n, k, x.stride(0), qw.stride(0), sc.stride(0), y.stride(0),
                     GROUP_SIZE=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                     BF16_MATH=bf16_math, num_warps=warps, num_stages=stages)  # fmt: skip
    return y, c


def main():
    dev = "cuda"
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    gen = torch.Generator(dev).manual_seed(0)
    shapes = (
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
    )
    configs = [(bm, bn, bk, w, s, b) for bm in (64, 128, 256) for bn in (64, 128) for bk in (32, 64)
               for w in (4, 8) for s in (2, 3) for b in (False,)]  # fmt: skip
    reported = False
    for name, n, k in shapes:
        qw = torch.randint(
            -(2**31), 2**31 - 1, (k // 8, n), generator=gen, device=dev, dtype=torch.int32
        )
        sc = (torch.rand(k // 128, n, generator=gen, device=dev) * 0.01).to(torch.bfloat16)
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        ref = w4a16_ref(x, qw, sc, None, group_size=128)
        wd = dequantize_int4(qw, sc, None, 128, None, None, torch.bfloat16)
        cub = triton.testing.do_bench(lambda x=x, wd=wd: torch.mm(x, wd), rep=50) * 1e3
        deq = triton.testing.do_bench(
            lambda x=x, qw=qw, sc=sc: torch.mm(x, dequantize_int4(qw, sc, None, 128, None, None, torch.bfloat16)),
            rep=50) * 1e3  # fmt: skip
        best = None
        for cfg in configs:
            try:
                y, c = run(x, qw, sc, *cfg)
            except Exception as e:  # out of resources
                print(name, cfg, "fail", type(e).__name__, str(e)[:80])
                continue
            err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            if err > 1e-2:
                print(name, cfg, "bad", err)
                continue
            us = (
                triton.testing.do_bench(
                    lambda cfg=cfg, x=x, qw=qw, sc=sc: run(x, qw, sc, *cfg), rep=50
                )
                * 1e3
            )
            if best is None or us < best[0]:
                best = (us, cfg, err)
            if not reported:
                reported = True
                ttgir = c.asm["ttgir"]
                ptx = c.asm["ptx"]
                print("local_alloc in ttgir:", ttgir.count("local_alloc"),
                      "wgmma lines:", sum("wgmma.mma_async" in line for line in ptx.splitlines()))  # fmt: skip
                for line in ptx.splitlines():
                    if "wgmma.mma_async" in line:
                        print("  ", line.strip()[:160])
                        break
                with open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/rega.ttgir", "w") as f:
                    f.write(ttgir)
        print(json.dumps(dict(shape=name, rows=rows, cublas_bf16_us=round(cub, 2),
                              dequant_cublas_us=round(deq, 2), rega_us=round(best[0], 2),
                              rega_cfg=best[1], ratio_to_cublas=round(cub / best[0], 3),
                              err=best[2])), flush=True)  # fmt: skip


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("w4a16_load_elementwise: needs a CUDA GPU")
        sys.exit(0)
    main()
