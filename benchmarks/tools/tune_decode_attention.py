"""Sweep `decode_attention`'s launch configuration on a CUDA GPU, for the two decode shapes
that matter (Llama-3.1-8B attention: 32 query heads, 8 kv heads, head_dim 128, bf16, cache
blocks of 16 tokens, a shuffled block table):

W1: 256 sequences, contexts uniform in [512, 768], splits from the host's max_seq_len.
W3: 1 sequence, context 288, `split_each_seq=True` with max_seq_len 4096 and 2048 (as in a
    CUDA graph captured for max_model_len).

Each configuration is captured in a CUDA graph (one `decode_attention` call: the decode
kernel and, with splits, the merge) and timed with `triton.testing.do_bench` (L2 flushed
before every replay, median). Its output is checked against the default configuration's
(max abs diff < 2e-2); configurations that fail to compile or launch are reported, not
timed. Phase 1 sweeps block_n x num_warps x num_splits at the default num_stages; phase 2
sweeps num_stages x align_tiles_to_blocks for the two best of phase 1.

Output: one JSON line per configuration (`us`, achieved `gb_per_s` over the bytes of K and V
actually read plus the query and the output), then one line with the best per shape.

    python3 benchmarks/tools/tune_decode_attention.py --out $OUT/tune.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
TOLERANCE = 2e-2
BLOCK_NS = (16, 32, 64, 128)
NUM_WARPS = (2, 4, 8)
NUM_STAGES = (1, 2, 3, 4)
W1_SPLITS = (1, 2)
W3_SPLITS = (4, 8, 16, 32, 64)
CONFIG_KEYS = ("block_n", "num_warps", "num_stages", "num_splits", "align_tiles_to_blocks")


class LastLaunch:
    """Keeps the compiled decode kernel of the latest launch, for its registers, spills and
    shared memory (the launcher does not return it)."""

    def __init__(self) -> None:
        from batchlm.kernels import decode_attention as module

        self.kernel = None
        jit = module._decode_kernel
        run = jit.run

        def recording_run(*args, **kwargs):
            self.kernel = run(*args, **kwargs)
            return self.kernel

        jit.run = recording_run

    def stats(self) -> dict:
        try:
            kernel = self.kernel
            kernel._init_handles()
            return dict(regs=kernel.n_regs, spills=kernel.n_spills, shared=kernel.metadata.shared)
        except Exception:  # noqa: BLE001 - diagnostics only; Triton internals may move
            return {}


def build_inputs(seq_lens: list[int], seed: int, layout: str = "NHD") -> tuple[torch.Tensor, ...]:
    """query `[num_seqs, 32, 128]`, key / value caches `[num_blocks, 16, 8, 128]` (twice the
    blocks the sequences use, so theirs are scattered), block tables (shuffled ids), lens.

    `layout` is the caches' memory order: NHD, each block token-major (a token's heads
    together); HND, head-major (a head's tokens of the block together), seen through the
    same `[num_blocks, block_size, kv_heads, head_dim]` strided view."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = 2 * sum(blocks_per_seq)
    ids = torch.randperm(num_blocks, generator=gen, device=DEVICE)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = ids[used : used + nb].cpu()
        used += nb
    if layout == "HND":
        shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    else:
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    value_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    if layout == "HND":
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    query = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return query.to(DTYPE), key_cache, value_cache, block_tables.to(DEVICE), lens


def bytes_moved(seq_lens: list[int]) -> int:
    """K and V of every context token, plus the query and the output."""
    kv = sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize * 2
    return kv + 2 * len(seq_lens) * NUM_HEADS * HEAD_DIM * DTYPE.itemsize


class Shape:
    def __init__(self, name: str, seq_lens: list[int], max_seq_len: int, split_each_seq: bool,
                 splits: tuple[int, ...], seed: int, layout: str) -> None:  # fmt: skip
        self.name, self.seq_lens, self.splits = name, seq_lens, splits
        self.max_seq_len, self.split_each_seq = max_seq_len, split_each_seq
        self.inputs = build_inputs(seq_lens, seed, layout)
        self.out = torch.empty_like(self.inputs[0])
        self.bytes = bytes_moved(seq_lens)

    def rates(self, ms: float) -> dict:
        return dict(gb_per_s=round(self.bytes / (ms * 1e-3) / 1e9, 1))

    def call(self, config: dict) -> None:
        from batchlm.kernels.decode_attention import decode_attention

        decode_attention(
            *self.inputs,
            HEAD_DIM**-0.5,
            self.max_seq_len,
            out=self.out,
            split_each_seq=self.split_each_seq,
            **config,
        )


def jsonl_emitter(sink):
    """`emit(record)`: prints one JSON line and appends it to `sink` (an open file, or None)
    as it goes, so an interrupted sweep keeps what it measured."""

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    return emit


def graph_ms(call, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds of `call()` replayed from a CUDA graph (`do_bench`, L2 flushed
    before each replay). `call` has run once already (compiled)."""
    from triton.testing import do_bench

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # allocations of the launcher settle before capture
        with torch.cuda.graph(graph, stream=stream):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    return do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def measure(shape, config: dict, reference: torch.Tensor | None, args) -> dict:
    """One configuration: compile, check, capture, time. Returns its JSON record (`shape`
    has `name`, `call(config)`, `out` and `rates(ms)`; `args` the timing options and, for
    register counts, `last_launch`)."""
    record = dict(shape=shape.name, **config)
    try:
        shape.call(config)  # compiles
        torch.cuda.synchronize()
        if getattr(args, "last_launch", None) is not None:
            record.update(args.last_launch.stats())
        out = shape.out.clone()
        ms = graph_ms(lambda: shape.call(config), args.warmup_ms, args.rep_ms)
    except Exception as exc:  # noqa: BLE001 - a failing config is reported, the sweep goes on
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        return record
    diff = 0.0 if reference is None else (out.float() - reference.float()).abs().max().item()
    record.update(
        us=round(ms * 1e3, 2),
        **shape.rates(ms),
        max_abs_diff=round(diff, 5),
        ok=bool(diff < TOLERANCE and torch.isfinite(out).all().item()),
    )
    if reference is None:
        record["output"] = out
    return record


def sweep(shape: Shape, args, emit) -> dict:
    """Phase 1 and 2 over one shape; returns its best record (and the default's)."""
    from batchlm.kernels.decode_attention import choose_launch, decode_attention_ref

    query, key_cache, value_cache, block_tables, lens = shape.inputs
    default = measure(shape, {}, None, args)
    if "error" in default:
        emit(default)
        return dict(shape=shape.name, error=default["error"])
    reference = default.pop("output")
    exact = decode_attention_ref(query, key_cache, value_cache, block_tables, lens, HEAD_DIM**-0.5)
    resolved = choose_launch(
        DTYPE, HEAD_DIM, len(shape.seq_lens), NUM_KV_HEADS, BLOCK_SIZE, shape.max_seq_len,
        torch.device(DEVICE), split_each_seq=shape.split_each_seq,
    )._asdict()  # fmt: skip
    default.update(
        default=True,
        resolved=resolved,
        ref_max_abs_diff=round((reference.float() - exact.float()).abs().max().item(), 5),
    )
    emit(default)
    timed = []
    for block_n, num_warps, num_splits in itertools.product(BLOCK_NS, NUM_WARPS, shape.splits):
        config = dict(block_n=block_n, num_warps=num_warps, num_splits=num_splits)
        record = measure(shape, config, reference, args)
        emit(record)
        if record.get("ok"):
            timed.append(record)
    firsts = sorted(timed, key=lambda r: r["us"])[: args.top]
    for first in firsts:
        base = {k: first[k] for k in ("block_n", "num_warps", "num_splits")}
        for num_stages, align in itertools.product(NUM_STAGES, (False, True)):
            if num_stages == resolved["num_stages"] and not align:
                continue  # measured in phase 1
            config = dict(base, num_stages=num_stages, align_tiles_to_blocks=align)
            record = measure(shape, config, reference, args)
            emit(record)
            if record.get("ok"):
                timed.append(record)
    best = min(timed, key=lambda r: r["us"]) if timed else default
    # The minimum over many noisy timings flatters: time the winner and the default again.
    best_config = {k: best[k] for k in CONFIG_KEYS if k in best}
    best_again = measure(shape, best_config, reference, args)
    default_again = measure(shape, {}, reference, args)
    return dict(
        shape=shape.name,
        best=best_config,
        best_us=best_again.get("us"),
        best_gb_per_s=best_again.get("gb_per_s"),
        default=resolved,
        default_us=default_again.get("us"),
        default_gb_per_s=default_again.get("gb_per_s"),
        speedup=round(default_again["us"] / best_again["us"], 3)
        if "us" in best_again and "us" in default_again
        else None,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    ap.add_argument("--shape", action="append", choices=["W1", "W3-4096", "W3-2048"])
    ap.add_argument("--warmup-ms", type=float, default=10.0)
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument("--top", type=int, default=2, help="phase-1 configs that get phase 2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cache-layout", action="append", choices=["NHD", "HND"],
        help="memory order of the caches' blocks (repeat to sweep both; default NHD)",
    )  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tune_decode_attention: needs a CUDA GPU; nothing to do on this machine")
        return 0
    import triton

    sink = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below
    emit = jsonl_emitter(sink)

    start = time.perf_counter()
    args.last_launch = LastLaunch()
    emit(
        dict(
            device=torch.cuda.get_device_name(),
            sms=torch.cuda.get_device_properties(0).multi_processor_count,
            triton=triton.__version__,
            torch=torch.__version__,
        )
    )
    gen = torch.Generator().manual_seed(args.seed)
    w1_lens = torch.randint(512, 769, (256,), generator=gen).tolist()
    shapes = {
        "W1": (w1_lens, max(w1_lens), False, W1_SPLITS),
        "W3-4096": ([288], 4096, True, W3_SPLITS),
        "W3-2048": ([288], 2048, True, W3_SPLITS),
    }
    layouts = args.cache_layout or ["NHD"]
    best = {}
    for name, layout in itertools.product(args.shape or list(shapes), layouts):
        label = name if layouts == ["NHD"] else f"{name}/{layout}"
        shape = Shape(label, *shapes[name], args.seed, layout)
        best[label] = sweep(shape, args, emit)
        del shape
        torch.cuda.empty_cache()
    emit(dict(best=best, wall_s=round(time.perf_counter() - start, 1)))
    if sink:
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
