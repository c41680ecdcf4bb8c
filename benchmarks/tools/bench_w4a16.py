"""The W4A16 kernel table: microseconds, weight-read GB/s and TFLOP/s per layer of the
Llama-3.1-8B shape at 1, 16, 64, 256 and 2,048 rows, for the int4 GEMM (`gpu_kernels/w4a16.py`,
the launch its table chooses), against bf16 cuBLAS (`F.linear` on the bf16 weight) and
against dequantize + cuBLAS, on a CUDA GPU. Weights as W3-int4's: GPTQ-like, groups of
128, symmetric, bf16 activations and scales.

Each measurement replays a CUDA graph of back-to-back calls that cycle through enough copies
of the weights (>= 512 MiB) that none is served from L2, as in a step where the other
layers' weights pass through in between; the best of 5 replays of 4 graphs is kept. Every
output is checked against `w4a16_ref` first (relative error < 1e-2).

    python3 benchmarks/tools/bench_w4a16.py --out $OUT/w4a16_kernels.jsonl
    python3 benchmarks/tools/bench_w4a16.py --rows 1 --shape down_proj --launch 1,64,128,8,4,3
    python3 benchmarks/tools/bench_w4a16.py --rows 16 --launch 16,128,128,4,4,3,swap_ab
    python3 benchmarks/tools/bench_w4a16.py --table $OUT/w4a16.json --out $OUT/w4a16_kernels.jsonl
    python3 benchmarks/tools/bench_w4a16.py --tinygemm --out $OUT/w4a16_tinygemm.jsonl

The launches are the repository's table's (`gpu_kernels/configs/w4a16.json`), another table's
(`--table`, a tuner's output before it is copied there) or the one `--launch` names. `--tp
2`: one rank's shapes at tensor_parallel_size=2. One JSON line per (shape, rows):
`workload` "W4A16-kernel", `value` the int4 microseconds, `baseline_value` bf16 cuBLAS's,
`ratio` bf16 time over int4 time (above 1: int4 faster), `launch` the launch that ran as
the table writes it, or `"mma"` / `["wgmma", block_n, block_rows, block_k, stages]` where
`w4a16` took one of the register-operand forms. With `--tinygemm`, PyTorch's own int4 kernel too
(`aten::_weight_int4pack_mm`, on the same shapes with its own packing, checked against its
dequantized weight first): `tinygemm_us`.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K) on one rank
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
ROW_PARALLEL = ("o_proj", "down_proj")
ROWS = (1, 16, 64, 256, 2048)
GROUP_SIZE = 128
COPIES_BYTES = 512 << 20
HBM_BYTES_PER_S = 4.23e12  # the H200's measured device copy rate (BENCHMARKS.md)


def shapes_for(tp: int) -> dict[str, tuple[int, int]]:
    """One rank's layer shapes: column-parallel layers split N, row-parallel ones K."""
    return {
        name: (n, k // tp) if name in ROW_PARALLEL else (n // tp, k)
        for name, (n, k) in SHAPES.items()
    }


def random_int4(num_n: int, num_k: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """A random int4 weight in the kernel's layout (symmetric, no activation order)."""
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (num_k // 8, num_n), generator=gen, device="cuda", dtype=torch.int32
    )
    scales = torch.rand(num_k // GROUP_SIZE, num_n, generator=gen, device="cuda")
    scales = ((0.5 + scales) / (4.6 * num_k**0.5)).to(dtype)
    return dict(qweight=qweight, scales=scales, zeros=None, group_size=GROUP_SIZE)


def random_dense(num_n: int, num_k: int, dtype: torch.dtype) -> torch.Tensor:
    """A random weight in the activation dtype (the bf16 cuBLAS baseline's)."""
    return (torch.randn(num_n, num_k, device="cuda") / num_k**0.5).to(dtype)


def random_tinygemm(
    num_n: int, num_k: int, dtype: torch.dtype, gen: torch.Generator, keep_q: bool = True
) -> dict:
    """A random int4 weight in PyTorch's tinygemm layout (`_convert_weight_to_int4pack`, 8
    inner K tiles), with its `[groups, N, 2]` scales and zeros, and the nibbles it packs
    (`q`, `[N, K]`, with `keep_q`)."""
    q = torch.randint(0, 16, (num_n, num_k), generator=gen, device="cuda", dtype=torch.uint8)
    packed = torch._convert_weight_to_int4pack(q[:, ::2] << 4 | q[:, 1::2], 8)
    scales = torch.rand(num_k // GROUP_SIZE, num_n, generator=gen, device="cuda")
    scales = (0.5 + scales) / (4.6 * num_k**0.5)  # symmetric: zeros 0
    scales_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1).to(dtype)
    weight = dict(packed=packed, scales_zeros=scales_zeros)
    return dict(weight, q=q) if keep_q else weight


def tinygemm(x: torch.Tensor, weight: dict) -> torch.Tensor:
    return torch._weight_int4pack_mm(x, weight["packed"], GROUP_SIZE, weight["scales_zeros"])


def tinygemm_dense(weight: dict) -> torch.Tensor:
    """tinygemm's weight `[K, N]` as float32 of the activation dtype's values, dequantized
    as it defines it: (q - 8) * scale + zero."""
    scale, zero = weight["scales_zeros"].float().repeat_interleave(GROUP_SIZE, 0).unbind(-1)
    dense = (weight["q"].T.float() - 8) * scale + zero
    return dense.to(weight["scales_zeros"].dtype).float()


def int4_bytes(weight: dict) -> int:
    return sum(t.numel() * t.element_size() for t in weight.values() if torch.is_tensor(t))


def copies(make, nbytes: int) -> list:
    """Enough copies of `make()` (each `nbytes`) to fill `COPIES_BYTES` (at least 2)."""
    return [make() for _ in range(max(2, -(-COPIES_BYTES // nbytes)))]


def time_calls(fn, inputs: list, calls: int = 24, replays: int = 5) -> float:
    """Microseconds per call of `fn(item)`, from a graph of `calls` calls cycling over
    `inputs` (each compiled and run outside the graph first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for item in inputs[:2]:
            fn(item)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(inputs[i % len(inputs)])
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (4 * calls))
    del graph
    return best


def sweep_args(doc: str, rows: tuple[int, ...]) -> tuple[Path, list[int]]:
    """A sweep's command line: `--out` (required) and `--rows` (default `rows`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(map(str, rows)))
    args = parser.parse_args()
    return args.out, [int(r) for r in args.rows.split(",")]


def layer_cases(rows: list[int], gen: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """For each 8B layer shape and row count: `(name, n, k, m, weights, dense, x, y, want)`,
    the int4 weight's copies (for `time_calls`), the bf16 weight's copies (for cuBLAS),
    random activations, an output buffer and `w4a16_ref`'s output on the first copy."""
    from batchlm.kernels.w4a16 import w4a16_ref

    for name, (n, k) in SHAPES.items():
        weights = copies(partial(random_int4, n, k, dtype, gen), n * k // 2)
        dense = copies(partial(random_dense, n, k, dtype), n * k * 2)
        for m in rows:
            x = torch.randn(m, k, device="cuda").to(dtype)
            y = torch.empty(m, n, device="cuda", dtype=dtype)
            yield name, n, k, m, weights, dense, x, y, w4a16_ref(x, **weights[0])
        del weights, dense
        torch.cuda.empty_cache()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--shape", action="append", choices=list(SHAPES), help="default: all")
    ap.add_argument("--rows", type=int, action="append", help=f"default: {ROWS}")
    ap.add_argument("--tp", type=int, default=1, help="one rank's shapes at this TP size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument(
        "--launch", default=None,
        help="block_m,block_n,block_k,split_k,num_warps,num_stages[,swap_ab] (or cublas) "
        "instead of the table's",
    )  # fmt: skip
    ap.add_argument("--table", default=None, help="launch table (default: the repository's)")
    ap.add_argument(
        "--tinygemm", action="store_true", help="also time PyTorch's int4 kernel (tinygemm)"
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import Recorder

    from batchlm.kernels.launch import cdiv, device_name, dtype_name, num_sms
    from batchlm.kernels.w4a16 import (
        fit_launch,
        new_split_k_locks,
        register_form_launch,
        w4a16,
        w4a16_ref,
    )
    from batchlm.kernels.w4a16_launch import (
        CUBLAS,
        SWAP_AB,
        W4a16Launch,
        W4a16Shape,
        choose_w4a16_launch,
        launch_value,
        load_w4a16_table,
    )

    overrides: dict = {}
    if args.launch == CUBLAS:
        overrides = dict(backend=CUBLAS)
    elif args.launch:
        values = args.launch.split(",")
        overrides = dict(swap_ab=values[6:] == [SWAP_AB])
        if len(values) not in (6, 7) or (values[6:] and not overrides["swap_ab"]):
            ap.error(f"--launch {args.launch}: six integers, then optionally {SWAP_AB}")
        fields = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
        overrides.update(zip(fields, map(int, values[:6]), strict=True))
    table = load_w4a16_table(args.table) if args.table else None
    if not torch.cuda.is_available():
        print("bench_w4a16: needs a CUDA GPU; nothing to do on this machine")
        return 0
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    rec = Recorder(args.out)
    locks = new_split_k_locks(device)
    gen = torch.Generator("cuda").manual_seed(0)
    for name, (num_n, num_k) in shapes_for(args.tp).items():
        if args.shape and name not in args.shape:
            continue
        sample = random_int4(num_n, num_k, dtype, gen)
        int4_weights = copies(partial(random_int4, num_n, num_k, dtype, gen), int4_bytes(sample))
        bf16_weights = copies(partial(random_dense, num_n, num_k, dtype), num_n * num_k * 2)
        tiny_weights = []
        if args.tinygemm:
            tiny_sample = random_tinygemm(num_n, num_k, dtype, gen)
            tiny_dense = tinygemm_dense(tiny_sample)
            tiny_weights = copies(
                partial(random_tinygemm, num_n, num_k, dtype, gen, keep_q=False),
                int4_bytes(tiny_sample) - tiny_sample["q"].nbytes,
            )
        for rows in args.rows or ROWS:
            x = torch.randn(rows, num_k, device="cuda", dtype=dtype)
            shape = W4a16Shape(device_name(device), num_n, num_k, GROUP_SIZE, dtype_name(dtype))
            launch = choose_w4a16_launch(rows, shape, num_sms(device), table, **overrides)
            row_tiles = rows if launch.block_m == 1 else cdiv(rows, max(launch.block_m, 1))
            tiles = row_tiles * cdiv(num_n, max(launch.block_n, 1))
            launch = fit_launch(launch, num_k, GROUP_SIZE, False, tiles)
            ran = launch_value(launch)
            form = None  # `w4a16` takes the register-operand forms by itself
            if not overrides:
                form = register_form_launch(rows, num_n, num_k, GROUP_SIZE, dtype, device)
            if isinstance(form, W4a16Launch):
                ran = "mma"
            elif form is not None:
                ran = ["wgmma", *form]
            ref = w4a16_ref(x, **int4_weights[0])
            got = w4a16(x, **int4_weights[0], locks=locks, table=table, **overrides)
            error = relative_error(got, ref)
            errors = {
                "int4": error,
                "dequantize + cuBLAS": relative_error(
                    w4a16(x, **int4_weights[0], backend=CUBLAS), ref
                ),
            }
            if args.tinygemm:
                errors["tinygemm"] = relative_error(
                    tinygemm(x, tiny_sample), (x.float() @ tiny_dense).to(dtype)
                )
            if max(errors.values()) > 1e-2:
                raise AssertionError(f"{name} rows={rows}: relative errors {errors}")
            int4_us = time_calls(
                lambda w, x=x: w4a16(x, **w, locks=locks, table=table, **overrides), int4_weights
            )
            dequant_us = time_calls(
                lambda w, x=x: w4a16(x, **w, backend=CUBLAS), int4_weights, calls=8
            )
            bf16_us = time_calls(lambda w, x=x: F.linear(x, w), bf16_weights)
            extra = {}
            if args.tinygemm:
                extra = dict(
                    tinygemm_us=round(time_calls(lambda w, x=x: tinygemm(x, w), tiny_weights), 2),
                    tinygemm_rel_error=round(errors["tinygemm"], 5),
                )
            int4_read = int4_bytes(int4_weights[0])
            flops = 2 * rows * num_n * num_k
            rec.record(
                workload="W4A16-kernel",
                system="batchlm-w4a16",
                metric="us",
                value=round(int4_us, 2),
                baseline="bf16 cuBLAS (F.linear)",
                baseline_value=round(bf16_us, 2),
                ratio=round(bf16_us / int4_us, 3),
                dequant_cublas_us=round(dequant_us, 2),
                shape=name,
                n=num_n,
                k=num_k,
                rows=rows,
                tp=args.tp,
                group_size=GROUP_SIZE,
                dtype=args.dtype,
                launch=ran,
                table=args.table or "repository",
                int4_weight_GBps=round(int4_read / int4_us / 1e3, 1),
                bf16_weight_GBps=round(num_n * num_k * 2 / bf16_us / 1e3, 1),
                int4_floor_us=round(int4_read / HBM_BYTES_PER_S * 1e6, 2),
                int4_TFLOPs=round(flops / int4_us / 1e6, 1),
                bf16_TFLOPs=round(flops / bf16_us / 1e6, 1),
                rel_error=round(error, 5),
                **extra,
            )
        del int4_weights, bf16_weights, tiny_weights
        tiny_sample = tiny_dense = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
