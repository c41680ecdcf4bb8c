"""W1-lora and W3-lora on vLLM (the baseline of `lora.py`): the same random-weight
Llama-3.1-8B checkpoint, the same 16 rank-16 adapter folders (`lora.py` makes both), the same
prompts and protocol, `enable_lora=True, max_loras=16, max_lora_rank=16, max_cpu_loras=16`;
each workload with the adapters and without them on the same engine.

vLLM is a baseline only, never a dependency: run this where vLLM is importable (on the H200,
`../shared/vllm/README.md` says how), in its own process, before `lora.py --vllm`.

    PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 \
        python3 benchmarks/vllm_lora.py --out $OUT/vllm_lora.jsonl
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from common import Recorder
from lora import (
    COMMON,
    ENGINE,
    NUM_ADAPTERS,
    RANK,
    ensure_adapters,
    ensure_model,
    round_robin,
    w1_prompts,
    w3_prompts,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/sbs-models/llama8b")
    ap.add_argument("--adapter-dir", default="/tmp/sbs-models/llama8b-loras")
    ap.add_argument("--workload", action="append", choices=["W1-lora", "W3-lora"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    workloads = args.workload or ["W1-lora", "W3-lora"]
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = ensure_model(Path(args.model_dir))
    adapters = ensure_adapters(Path(args.adapter_dir))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    requests = [LoRARequest(f"adapter-{i:02d}", i + 1, str(p)) for i, p in enumerate(adapters)]
    start = time.perf_counter()
    llm = LLM(str(folder), **COMMON, **ENGINE)
    init_s = time.perf_counter() - start
    rec = Recorder(args.out)
    system = f"vllm-{vllm.__version__}"

    def run(prompts, params, loras) -> tuple[float, int]:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    common = dict(
        model="Llama-3.1-8B shape, random weights",
        dtype="bfloat16",
        init_seconds=round(init_s, 1),
        **ENGINE,
    )
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0, detokenize=False)
    if "W1-lora" in workloads:
        warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0, detokenize=False)
        figures = {}
        for with_adapters in (False, True):
            loras = round_robin(requests, 256) if with_adapters else None
            run(w1_prompts(100)[:64], warm, loras[:64] if loras else None)
            run(w1_prompts(100), params, loras)
            runs = [run(w1_prompts(seed), params, loras) for seed in range(1, args.runs + 1)]
            figures[with_adapters] = [round(n / dt, 1) for dt, n in runs]
        for with_adapters, values in figures.items():
            rec.record(
                workload="W1-lora", system=system if with_adapters else f"{system}-no-adapters",
                metric="output_tok_per_s", value=max(values), runs=values,
                adapters=f"{NUM_ADAPTERS} random rank-{RANK}, round-robin" if with_adapters else None,
                num_requests=256, prompt_len=512, output_len=256, **common,
            )  # fmt: skip
    if "W3-lora" in workloads:
        figures = {}
        for with_adapters in (False, True):
            loras = [requests[0]] if with_adapters else None
            run(w3_prompts(100), params, loras)
            runs = [run(w3_prompts(seed), params, loras) for seed in range(1, args.runs + 1)]
            figures[with_adapters] = [round(dt / n * 1e3, 3) for dt, n in runs]
        for with_adapters, values in figures.items():
            rec.record(
                workload="W3-lora", system=system if with_adapters else f"{system}-no-adapters",
                metric="ms_per_token", value=min(values), runs=values,
                adapters=f"one random rank-{RANK}" if with_adapters else None,
                batch_size=1, prompt_len=32, output_len=256, **common,
            )  # fmt: skip


if __name__ == "__main__":
    main()
