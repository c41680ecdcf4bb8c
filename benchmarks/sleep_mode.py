"""sleep-mode: what `LLM.sleep` gives back to the device, and what waking costs against
building the LLM afresh, on a CUDA GPU.

Llama-3.1-8B shape (gpu_generate.py's), bf16, random weights: with `--load-format dummy`
(the default) built from its config.json alone, waking from level 2 drawing the same
seeded weights again; with `--load-format auto` saved as a checkpoint first (16 GB on
disk), level 2 reading it back. gpu_memory_utilization 0.85, skip_tokenizer_init,
enable_sleep_mode. 64 prompts of 256 random tokens → 32 greedy tokens (ignore_eos) before
each sleep and after each wake.

Records (one JSON line each, `--out FILE` appends):
- `device_bytes_in_use` (total - free, `torch.cuda.mem_get_info`) at `phase` before_sleep,
  asleep and awake, per `level` (1 and 2); `baseline_value` is before_sleep, `ratio` the
  phase's share of it (lower is better while asleep). `freed_bytes`, the engine's
  `weight_bytes` and `kv_cache_bytes` ride along.
- `sleep_seconds` and `wake_seconds` per level; for wake, `baseline_value` is the seconds
  `LLM(...)` takes to build the same engine afresh (weights, KV cache profiling, CUDA graph
  capture) in the same process once the first is shut down, `ratio` = afresh / wake.
- every record of a level carries `outputs_equal`: the greedy tokens after waking equal
  those before the sleep.

    python benchmarks/sleep_mode.py --out results.jsonl                  # an H200
    python benchmarks/sleep_mode.py --load-format auto --out results.jsonl
    python benchmarks/sleep_mode.py --tensor-parallel-size 2             # two GPUs
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from common import Recorder

from batchlm.engine import LLM, SamplingParams

WORKLOAD = "sleep-mode"
NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 256, 32


def used_bytes() -> int:
    """Device memory in use by live tensors, graphs and contexts: the caching allocator's
    free blocks are handed back first, so that before and after compare what is held."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def make_llm(folder: Path, args) -> tuple[LLM, float]:
    start = time.perf_counter()
    llm = LLM(
        str(folder),
        load_format=args.load_format,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.85,
        max_model_len=4096,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_sleep_mode=True,
    )
    torch.cuda.synchronize()
    return llm, time.perf_counter() - start


def run(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def prepare(folder: Path, args) -> None:
    from gpu_generate import LLAMA_8B, build_random_model

    if args.load_format == "dummy":
        config = {k: v for k, v in LLAMA_8B.items()}
        config["torch_dtype"] = "bfloat16"
        (folder / "config.json").write_text(json.dumps(config))
    else:
        build_random_model(LLAMA_8B, folder)
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the JSON lines to this file")
    parser.add_argument("--load-format", choices=("dummy", "auto"), default="dummy")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--folder", help="where the model goes (default: a temporary folder)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sleep-mode measures device memory: run it on a CUDA GPU")
    rec = Recorder(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        prepare(folder, args)
        import random

        rng = random.Random(0)
        prompts = [
            {"prompt_token_ids": [rng.randrange(16, 128000) for _ in range(PROMPT_LEN)]}
            for _ in range(NUM_PROMPTS)
        ]
        llm, _ = make_llm(folder, args)
        runner = llm.llm_engine.runner
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        common = dict(
            workload=WORKLOAD,
            system="batchlm",
            load_format=args.load_format,
            tensor_parallel_size=args.tensor_parallel_size,
            weight_bytes=weight_bytes,
            kv_cache_bytes=kv_bytes,
        )
        want = run(llm, prompts)
        timings = {}
        for level in (1, 2):
            before = used_bytes()
            start = time.perf_counter()
            llm.sleep(level=level)
            sleep_s = time.perf_counter() - start
            asleep = used_bytes()
            start = time.perf_counter()
            llm.wake_up()
            torch.cuda.synchronize()
            wake_s = time.perf_counter() - start
            awake = used_bytes()
            equal = run(llm, prompts) == want
            for phase, value in (("before_sleep", before), ("asleep", asleep), ("awake", awake)):
                rec.record(
                    **common,
                    metric="device_bytes_in_use",
                    phase=phase,
                    level=level,
                    value=value,
                    baseline_value=before,
                    ratio=round(value / before, 4),
                    freed_bytes=before - asleep,
                    outputs_equal=equal,
                )
            timings[level] = (sleep_s, wake_s, equal)
        llm.shutdown()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
        fresh, fresh_s = make_llm(folder, args)
        fresh.shutdown()
        for level, (sleep_s, wake_s, equal) in timings.items():
            rec.record(
                **common,
                metric="sleep_seconds",
                level=level,
                value=round(sleep_s, 3),
                outputs_equal=equal,
            )
            rec.record(
                **common,
                metric="wake_seconds",
                level=level,
                value=round(wake_s, 3),
                baseline_value=round(fresh_s, 3),
                ratio=round(fresh_s / wake_s, 2),
                outputs_equal=equal,
            )


if __name__ == "__main__":
    main()
