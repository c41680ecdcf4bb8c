"""Profile `LLM.embed` on the W4 texts (host-side cProfile plus a CUDA-synchronised timer).

python benchmarks/tools/profile_embed.py --num-texts 100000 --dtype float16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from w4_embed import make_texts, random_weight_model  # noqa: E402

from batchlm.engine import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-texts", type=int, default=100000)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=32768)
    args = ap.parse_args()
    texts = make_texts(args.num_texts)
    llm = LLM(
        random_weight_model(),
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=4096,
    )
    llm.embed(texts[:256], use_tqdm=False)
    llm.encode(texts[:256], use_tqdm=False, pooling_task="embed")
    from batchlm.engine.llm_pooling import _encode_batch

    backend = llm.get_tokenizer()
    for name, fn in (
        ("tokenize (Rust batch)", lambda: _encode_batch(backend, texts, 256)),
        ("embed (lists)", lambda: llm.embed(texts, use_tqdm=False)),
        ("encode (tensors)", lambda: llm.encode(texts, use_tqdm=False, pooling_task="embed")),
    ):
        for _ in range(2):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            print(f"{name}: {time.perf_counter() - t:.2f}s", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    llm.encode(texts, use_tqdm=False, pooling_task="embed")
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
