"""The host's share of a W2 run: W2's requests (256 prompts and output lengths uniform in
[100, 1024], seed 0, temperature 0.6) through a real engine whose model layers are stubbed
out (zeros for hidden states, no attention), on this machine's CPU. What remains is the
host's work of every step (scheduling, the step's layout, sampling, the tokens' bookkeeping)
plus the CPU's own sampling ops, which on a GPU are kernels.

W2 is bound by the host on an H200 (docs/performance.md, "W2 within one process"), so this
run's time, less its sampling ops, tracks W2's pace; an A/B of host-side changes can be
made here, on a quiet machine, before the GPU's run confirms it.

    python3 benchmarks/tools/host_run.py [--runs 3] [--requests 256] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_generate import QWEN_05B, SMOKE  # noqa: E402

from batchlm.engine import LLM, SamplingParams  # noqa: E402


def stubbed_llm(folder: Path) -> LLM:
    """An engine on W2's config at the smoke sizes whose layers do nothing."""
    config = dict(QWEN_05B, **SMOKE, torch_dtype="float32")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), dtype="float32", load_format="dummy", max_num_seqs=256,
              skip_tokenizer_init=True, seed=0, async_scheduling=True)  # fmt: skip
    runner = llm.llm_engine.runner
    hidden = runner.model.config.hidden_size

    def no_layers(input_ids, positions, kv_caches, metadata, **kwargs):
        return torch.zeros(len(input_ids), hidden)

    runner.model.forward = no_layers
    runner.backend.prepare = lambda metadata: None
    return llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="one more run under cProfile")
    args = ap.parse_args()
    llm = stubbed_llm(Path(tempfile.mkdtemp(prefix="host-run-")))
    rng = random.Random(0)
    lens_in = [rng.randint(100, 1024) for _ in range(args.requests)]
    lens_out = [rng.randint(100, 1024) for _ in range(args.requests)]
    prompts = [{"prompt_token_ids": [rng.randrange(16, 500) for _ in range(n)]} for n in lens_in]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.6) for n in lens_out]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.6),
                 use_tqdm=False)  # fmt: skip
    seconds = []
    for _ in range(args.runs):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.requests} requests, {tokens} output tokens; host-only run (s): "
          + " / ".join(f"{s:.3f}" for s in seconds) + f"; best {tokens / min(seconds):,.0f} tok/s")  # fmt: skip
    if args.profile:
        llm.reset_prefix_cache()
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
