"""Profile `LLM.embed` / `LLM.encode` on the W4 texts: wall time, the parent process's own CPU
time, and a cProfile of the parent (tokenizer worker processes are not in it).

    python benchmarks/tools/profile_embed.py --num-texts 100000 --dtype float16   # GPU
    # The host's share alone (no forward), with and without tokenizer workers, on any machine:
    python benchmarks/tools/profile_embed.py --num-texts 50000 --host-only --tokenize-workers 0
    python benchmarks/tools/profile_embed.py --num-texts 50000 --host-only --tokenize-workers 2

`--host-only` runs everything `encode` does in the parent except the model: tokenization
(chunked, on the helper thread or the workers), length checks, the runner's batching and
packing of ids, and one output object per text.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from w4_embed import TEXTS, random_weight_model  # noqa: E402

from batchlm.engine import LLM  # noqa: E402
from batchlm.engine.outputs import PoolingOutput, PoolingRequestOutput  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_only(llm: LLM, texts: list[str]) -> list[PoolingRequestOutput]:
    """`encode` without the forward: what the parent does per text."""
    runner = llm.llm_engine.pooling_runner

    def pack(inputs: Any, params: Any) -> list[None]:
        for batch, lens in runner._batches(inputs):
            cu = np.zeros(len(batch) + 1, np.int64)
            np.cumsum(lens, out=cu[1:])
            inputs.gather(np.asarray(batch, np.int64), lens, cu)
        return [None] * len(inputs)

    inputs, data = llm._run_chunked(texts, None, None, pack)
    return [
        PoolingRequestOutput(llm._next_id(), PoolingOutput(d), ids)
        for d, ids in zip(data, inputs.prompt_token_ids(), strict=True)
    ]


class ChunkTimeline:
    """When each chunk of a call was tokenized (on the helper thread) and run (on the
    caller's), from wrapping the LLM's `_pooling_inputs` and the runner's task."""

    def __init__(self, llm: LLM) -> None:
        self.events: list[tuple[str, float, float, int]] = []
        self._wrap(llm, "_pooling_inputs", "tokenize", lambda out: len(out[0].lens))
        runner = llm.llm_engine.pooling_runner
        self._wrap(runner, "embed", "run", len)

    def _wrap(self, obj: Any, attr: str, kind: str, count: Callable[[Any], int]) -> None:
        fn = getattr(obj, attr)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if kind == "run":
                sync()
            self.events.append((kind, start, time.perf_counter(), count(out)))
            return out

        setattr(obj, attr, wrapped)

    def report(self, start: float, end: float) -> str:
        lines = [f"{'what':<9} {'start ms':>9} {'end ms':>9} {'ms':>8} {'inputs':>7}"]
        busy = {"tokenize": 0.0, "run": 0.0}
        for kind, t0, t1, n in sorted(
            (e for e in self.events if start <= e[1] <= end), key=lambda e: e[1]
        ):
            busy[kind] += t1 - t0
            lines.append(
                f"{kind:<9} {(t0 - start) * 1e3:9.1f} {(t1 - start) * 1e3:9.1f} "
                f"{(t1 - t0) * 1e3:8.1f} {n:7d}"
            )
        lines.append(
            f"call {(end - start) * 1e3:.1f} ms; tokenizing {busy['tokenize'] * 1e3:.1f} ms, "
            f"running {busy['run'] * 1e3:.1f} ms"
        )
        return "\n".join(lines)


def timed(name: str, fn: Callable[[], Any]) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{name}: {wall:.2f}s wall, {cpu:.2f}s CPU in the parent", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-texts", type=int, default=100000)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=32768)
    ap.add_argument(
        "--tokenize-workers", default=None, help="BATCHLM_TOKENIZE_WORKERS (default: auto)"
    )
    ap.add_argument("--host-only", action="store_true", help="skip the model's forward")
    ap.add_argument("--texts", choices=sorted(TEXTS), default="w4")
    ap.add_argument("--chunk", type=int, default=None, help="texts per tokenization chunk")
    ap.add_argument(
        "--timeline", action="store_true", help="each chunk's tokenize and run times of embed"
    )
    args = ap.parse_args()
    if args.tokenize_workers is not None:
        os.environ["BATCHLM_TOKENIZE_WORKERS"] = args.tokenize_workers
    texts = TEXTS[args.texts](args.num_texts)
    if args.chunk is not None:
        import batchlm.engine.pooling_inputs as pooling_inputs

        pooling_inputs._TOKENIZE_CHUNK = args.chunk
    llm = LLM(
        random_weight_model(),
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=4096,
    )
    from batchlm.engine.pooling_inputs import _encode_batch

    tokenizer = llm.get_tokenizer()
    if args.host_only:
        runs = [("host side of encode", lambda: host_only(llm, texts))]
    else:
        llm.embed(texts[:256], use_tqdm=False)
        llm.encode(texts[:256], use_tqdm=False, pooling_task="embed")
        packed, params = llm._pooling_inputs(texts, None, None)
        runner = llm.llm_engine.pooling_runner
        runs = [
            ("runner.embed on tokenized inputs", lambda: runner.embed(packed, params)),
            ("embed (lists)", lambda: llm.embed(texts, use_tqdm=False)),
            ("encode (tensors)", lambda: llm.encode(texts, use_tqdm=False, pooling_task="embed")),
        ]
    runs.insert(
        0, ("tokenize in process (Rust batch)", lambda: _encode_batch(tokenizer, texts, 256))
    )
    for name, fn in runs:
        for _ in range(2):
            timed(name, fn)
    if args.timeline and not args.host_only:
        timeline = ChunkTimeline(llm)
        for _ in range(2):
            start = time.perf_counter()
            llm.embed(texts, use_tqdm=False)
            print(timeline.report(start, time.perf_counter()), flush=True)
    pool = llm._tokenize_pool
    print(f"tokenizer workers: {pool.num_workers if pool is not None else 0}")
    prof = cProfile.Profile()
    prof.enable()
    runs[-1][1]()
    sync()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
