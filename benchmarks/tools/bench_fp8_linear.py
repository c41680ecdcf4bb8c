"""Time the fp8 linear layer against bfloat16 on the W1 (Llama-3.1-8B) projection shapes.

Per case (rows M, in K, out N), in milliseconds (median):

- `bf16`: `F.linear(x, w)` with bfloat16 `x` and `w`;
- `fp8`: the engine's fp8 path on CUDA: `gpu_kernels/quant_fp8.py` quantises `x` per token,
  then `torch._scaled_mm` (row-wise scales, bfloat16 out);
- `fp8_torch_quant`: the same matmul after the PyTorch quantisation
  (`quant.quantize_fp8_per_token`, the path before the kernel);
- `quant_kernel`, `quant_torch`, `scaled_mm`: the three parts alone.

One JSON line per case. `bit_equal` says whether the kernel's fp8 values and scales equal
the PyTorch ones on that case's input.

    python benchmarks/tools/bench_fp8_linear.py                 # CUDA, capability >= 8.9
    python benchmarks/tools/bench_fp8_linear.py --cuda-graph    # timed as graph replays
    python benchmarks/tools/bench_fp8_linear.py --smoke         # tiny shapes, CPU works too

With `--smoke` on a machine without CUDA, the kernel runs in Triton's interpreter and the
times mean nothing; it checks that the script and the paths run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before batchlm.kernels is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import device_name, git_commit  # noqa: E402

from batchlm.engine.models.layers import quant  # noqa: E402
from batchlm.kernels.quant_fp8 import quantize_fp8_per_token  # noqa: E402

ROWS = (1, 256, 8192)  # one sequence decoding; W1's 256 decoding at once; a long prefill
SHAPES = {  # name → (in K, out N), Llama-3.1-8B
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}
SMOKE_ROWS = (1, 5)
SMOKE_SHAPES = {"qkv": (64, 96), "down": (224, 64)}


def _timer(device: torch.device, cuda_graph: bool) -> Callable[[Callable[[], object]], float]:
    """A function that returns the median milliseconds of one call of `fn`."""
    if device.type == "cuda":
        import triton.testing

        if cuda_graph:
            return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_time


def bench_case(
    name: str, m: int, k: int, n: int, device: torch.device, timer: Callable
) -> dict[str, object]:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(torch.bfloat16)
    wq = quant.quantize_per_row(w, quant.FP8_DTYPE)
    w_t = wq.values.t()  # [K, N] column-major, as the layer passes it
    w_scale = wq.scale[None, :]  # [1, N]

    def scaled_mm(xq) -> torch.Tensor:
        return torch._scaled_mm(
            xq.values, w_t, scale_a=xq.scale[:, None], scale_b=w_scale, out_dtype=torch.bfloat16
        )

    def quant_kernel():
        return quantize_fp8_per_token(x, min_amax=quant._MIN_SCALE)

    def quant_torch():
        return quant.quantize_fp8_per_token(x)

    got, want = quant_kernel(), quant_torch()
    bit_equal = torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8)) and (
        torch.equal(got.scale, want.scale)
    )
    times = {
        "bf16": timer(lambda: torch.nn.functional.linear(x, w)),
        "fp8": timer(lambda: scaled_mm(quant_kernel())),
        "fp8_torch_quant": timer(lambda: scaled_mm(quant_torch())),
        "quant_kernel": timer(quant_kernel),
        "quant_torch": timer(quant_torch),
        "scaled_mm": timer(lambda: scaled_mm(want)),
    }
    return {
        "case": name,
        "m": m,
        "k": k,
        "n": n,
        **{f"{key}_ms": round(ms, 5) for key, ms in times.items()},
        "speedup_fp8_vs_bf16": round(times["bf16"] / times["fp8"], 3),
        "speedup_fp8_vs_torch_quant": round(times["fp8_torch_quant"] / times["fp8"], 3),
        "bf16_tflops": round(2 * m * k * n / times["bf16"] / 1e9, 2),
        "fp8_tflops": round(2 * m * k * n / times["fp8"] / 1e9, 2),
        "bit_equal": bit_equal,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU too)")
    ap.add_argument("--cuda-graph", action="store_true", help="time CUDA graph replays")
    ap.add_argument("--rows", type=int, nargs="*", help=f"M values (default {ROWS})")
    ap.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), help="default: all")
    args = ap.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda")
        if not quant.supports_fp8_matmul(device):
            sys.exit(f"fp8 matmuls need CUDA capability >= 8.9; {device_name()} has less")
    elif args.smoke:
        device = torch.device("cpu")
    else:
        sys.exit("no CUDA device: this benchmark times GPU matmuls (use --smoke to check it runs)")
    if args.cuda_graph and device.type != "cuda":
        sys.exit("--cuda-graph needs CUDA")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = {name: SHAPES[name] for name in args.shapes}
    rows = args.rows or (SMOKE_ROWS if args.smoke else ROWS)
    timer = _timer(device, args.cuda_graph)
    meta = {"device": device_name(), "commit": git_commit(), "torch": torch.__version__}
    meta["timing"] = "cuda_graph" if args.cuda_graph else device.type
    for name, (k, n) in shapes.items():
        for m in rows:
            record = bench_case(name, m, k, n, device, timer)
            print(json.dumps({**record, **meta}), flush=True)


if __name__ == "__main__":
    main()
