"""Sweep `prefill_attention`'s launch configuration on a CUDA GPU over the prefill shapes of
the benchmarks (bf16, cache blocks of 16 tokens, shuffled block tables):

W1: Llama-3.1-8B attention (32 heads, 8 kv heads, head_dim 128); one prefill step of W1,
    16 fresh prompts of 512 tokens.
W5: the same model; 64 sequences of 64 new tokens after a cached 1,088-token context (a
    prefix-cache hit), and 7 fresh 1,088-token prompts (prefix caching off).
W2: Qwen2.5-0.5B attention (14 heads, 2 kv heads, head_dim 64); 12 fresh prompts of 100 to
    1,024 tokens.

Every configuration (block_m x block_n x num_warps x num_stages) is captured in a CUDA graph
and timed with `triton.testing.do_bench` (median, L2 flushed before each replay); its output
is checked against the default configuration's. Output: one JSON line per configuration
(`us`, `tflops` over the causal score and value products actually needed), then per shape
the best and the default, timed again.

    python3 benchmarks/tools/tune_prefill_attention.py --out $OUT/tune-prefill.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys

import torch
from tune_decode_attention import jsonl_emitter, measure

DTYPE = torch.bfloat16
DEVICE = "cuda"
BLOCK_SIZE = 16
BLOCK_MS = (64, 128)
BLOCK_NS = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)


class Shape:
    """One prefill launch: `batch` is a list of (query_len, seq_len)."""

    def __init__(self, name, batch, num_heads, num_kv_heads, head_dim, seed) -> None:
        self.name, self.batch, self.head_dim = name, batch, head_dim
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        blocks_per_seq = [-(-s // BLOCK_SIZE) for _, s in batch]
        num_blocks = 2 * sum(blocks_per_seq)
        ids = torch.randperm(num_blocks, generator=gen, device=DEVICE).cpu()
        tables = torch.zeros(len(batch), max(blocks_per_seq), dtype=torch.int32)
        used = 0
        for i, nb in enumerate(blocks_per_seq):
            tables[i, :nb] = ids[used : used + nb]
            used += nb
        cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        q_lens = [q for q, _ in batch]
        qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(q_lens).cumsum(0)
        self.inputs = (
            torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=DEVICE).to(DTYPE),
            torch.randn(cache_shape, generator=gen, device=DEVICE).to(DTYPE),
            torch.randn(cache_shape, generator=gen, device=DEVICE).to(DTYPE),
            tables.to(DEVICE),
            torch.tensor([s for _, s in batch], dtype=torch.int32, device=DEVICE),
            qsl.to(DEVICE),
        )
        self.max_query_len = max(q_lens)
        self.out = torch.empty_like(self.inputs[0])
        # Query token at position p sees p + 1 keys: QK^T and PV, 2 FLOPs per multiply-add.
        visible = sum(sum(range(s - q + 1, s + 1)) for q, s in batch)
        self.flops = 4 * visible * num_heads * head_dim

    def rates(self, ms: float) -> dict:
        return dict(tflops=round(self.flops / (ms * 1e-3) / 1e12, 1))

    def call(self, config: dict) -> None:
        from batchlm.kernels.prefill_attention import prefill_attention

        prefill_attention(
            *self.inputs, self.head_dim**-0.5, self.max_query_len, out=self.out, **config
        )


def sweep(shape: Shape, args, emit) -> dict:
    default = measure(shape, {}, None, args)
    if "error" in default:
        emit(default)
        return dict(shape=shape.name, error=default["error"])
    reference = default.pop("output")
    emit(dict(default, default=True))
    timed = []
    for block_m, block_n, warps, stages in itertools.product(
        BLOCK_MS, BLOCK_NS, NUM_WARPS, NUM_STAGES
    ):
        config = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        record = measure(shape, config, reference, args)
        emit(record)
        if record.get("ok"):
            timed.append(record)
    if not timed:
        return dict(shape=shape.name, error="no configuration ran")
    best = min(timed, key=lambda r: r["us"])
    best_config = {k: best[k] for k in ("block_m", "block_n", "num_warps", "num_stages")}
    # The minimum over many noisy timings flatters: time the winner and the default again.
    best_again = measure(shape, best_config, reference, args)
    default_again = measure(shape, {}, reference, args)
    return dict(
        shape=shape.name,
        best=best_config,
        best_us=best_again.get("us"),
        best_tflops=best_again.get("tflops"),
        default_us=default_again.get("us"),
        default_tflops=default_again.get("tflops"),
    )


def shapes(names: list[str]) -> list[Shape]:
    rng = random.Random(0)
    table = {
        "W1": lambda: Shape("W1", [(512, 512)] * 16, 32, 8, 128, 0),
        "W5-hit": lambda: Shape("W5-hit", [(64, 1088)] * 64, 32, 8, 128, 1),
        "W5-off": lambda: Shape("W5-off", [(1088, 1088)] * 7, 32, 8, 128, 2),
        "W2": lambda: Shape(
            "W2", [(n, n) for n in (rng.randint(100, 1024) for _ in range(12))], 14, 2, 64, 3
        ),
    }
    return [table[n]() for n in names]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", action="append", choices=["W1", "W5-hit", "W5-off", "W2"])
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below
    emit = jsonl_emitter(out)

    import triton

    emit(dict(device=torch.cuda.get_device_name(), triton=triton.__version__,
              command=" ".join(sys.argv)))  # fmt: skip
    for shape in shapes(args.shape or ["W1", "W5-hit", "W5-off", "W2"]):
        emit(sweep(shape, args, emit))
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
