"""W7 on vLLM (the baseline of `w7.py`): the same Qwen2.5-VL-7B-shaped folder without weights
(`load_format="dummy"`), the same images, prompts and protocol, in its own process.

vLLM is a baseline only, never a dependency: run this where vLLM is importable (on the H200,
`../shared/vllm/README.md` says how), before `w7.py --vllm`.

    PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 \
        python3 benchmarks/vllm_w7.py --out $OUT/vllm_w7.jsonl
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from common import Recorder
from w7 import (
    COMMON,
    NUM_REQUESTS,
    OUTPUT_LEN,
    ensure_folder,
    library_versions,
    prompt_text,
    timed_run,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/sbs-models/qwen25vl7b")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = ensure_folder(Path(args.model_dir))
    text = prompt_text(folder)
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(folder), **COMMON)
    init_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)

    timed_run(llm, params, text, 1000, 32)  # warm-up
    runs = [timed_run(llm, params, text, seed, NUM_REQUESTS) for seed in range(1, args.runs + 1)]
    rec = Recorder(args.out)
    tok_s = [round(n / dt, 1) for dt, n, _ in runs]
    req_s = [round(NUM_REQUESTS / dt, 3) for dt, _, _ in runs]
    rec.record(
        workload="W7", system=f"vllm-{vllm.__version__}", metric="output_tok_per_s",
        value=max(tok_s), runs=tok_s, requests_per_s=max(req_s), requests_per_s_runs=req_s,
        num_requests=NUM_REQUESTS, prompt_len=runs[0][2], output_len=OUTPUT_LEN,
        model="Qwen2.5-VL-7B shape, random weights (dummy)", dtype=COMMON["dtype"],
        init_seconds=round(init_s, 1), **library_versions(),
    )  # fmt: skip


if __name__ == "__main__":
    main()
