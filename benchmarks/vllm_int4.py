"""W3-int4 and W1-int4 on vLLM 0.26: the side of `benchmarks/int4.py` that vLLM runs, on the
same config.json (the Llama-3.1-8B shape with a GPTQ 4-bit, group-128, symmetric
`quantization_config`), the same prompts and protocol (shared/vllm/bench.py: a warm-up run
at seed 100, 3 timed runs at seeds 1-3, the best kept), `load_format="dummy"`, bf16,
gpu_memory_utilization 0.85, max_model_len 4096, skip_tokenizer_init, seed 0. vLLM picks
its kernel from the config (`gptq_marlin`: Marlin, or Machete on Hopper where its kernel
selection prefers it); `--quantization gptq` forces its older GPTQ kernel.

vLLM's dummy loader and GPTQ (read in its source, `model_loader/dummy_loader.py` and
`weight_utils.initialize_single_dummy_weight`): every floating-point tensor of the model
gets uniform random values in [-1e-3, 1e-3], the GPTQ `scales` included; integer tensors
(`qweight`, `qzeros`, `g_idx`) are left as `torch.empty` allocated them (zeroed on ROCm
only), and the layers' `process_weights_after_loading` then repacks them for Marlin. The
packed weights are therefore whatever the allocator's memory held: any 32-bit word is a
valid set of eight 4-bit values, and with `desc_act: false` Marlin ignores `g_idx` (and a
symmetric checkpoint's `qzeros`), so the kernels read the same bytes in the same pattern as
with real weights; the timing does not depend on the values once output lengths are fixed
(`ignore_eos`).

Run it as shared/vllm/README.md says (vLLM on PYTHONPATH, `VLLM_USE_FLASHINFER_SAMPLER=0`):

    PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python3 benchmarks/vllm_int4.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from common import library_versions
from int4 import GPTQ_CONFIG, LLAMA_8B, NUM_TIMED, ids

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def log(recorder_path: str | None, **fields) -> None:
    line = json.dumps(fields)
    print(line, flush=True)
    if recorder_path:
        with open(recorder_path, "a") as f:
            f.write(line + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--quantization", default=None, help="vLLM's quantization= (default: auto)")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="vllm-int4-"))
    config = dict(LLAMA_8B, quantization_config=GPTQ_CONFIG)
    (folder / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    llm = LLM(
        str(folder),
        load_format="dummy",
        quantization=args.quantization,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.85,
        max_model_len=4096,
        seed=0,
    )
    init_s = round(time.perf_counter() - start, 1)
    try:
        method = llm.llm_engine.model_config.quantization
    except AttributeError:
        method = args.quantization
    vocab = LLAMA_8B["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, detokenize=False)

    def timed(make) -> list[tuple[float, int]]:
        runs = []
        for seed in (100, *range(1, NUM_TIMED + 1)):
            prompts, sp = make(seed)
            if hasattr(llm, "reset_prefix_cache"):
                llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            dt = time.perf_counter() - t
            if seed != 100:
                runs.append((dt, sum(len(o.outputs[0].token_ids) for o in outs)))
        return runs

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    common = dict(system="vllm-0.26", quantization=method, model="Llama-3.1-8B shape",
                  dtype="bfloat16", load_format="dummy", init_s=init_s, device=device,
                  versions=library_versions(),
                  command=" ".join([Path(sys.executable).name, *sys.argv]))  # fmt: skip
    batch = timed(
        lambda s: ([ids(r, 512, vocab) for r in [random.Random(s)] for _ in range(256)], params)
    )
    rates = [round(n / dt, 1) for dt, n in batch]
    log(args.out, workload="W1-int4", metric="output_tok_per_s", value=max(rates), runs=rates,
        num_requests=256, prompt_len=512, output_len=256, **common)  # fmt: skip
    single = timed(lambda s: ([ids(random.Random(s), 32, vocab)], params))
    ms = [round(dt / n * 1e3, 3) for dt, n in single]
    log(args.out, workload="W3-int4", metric="ms_per_token", value=min(ms), runs=ms,
        batch_size=1, prompt_len=32, output_len=256, **common)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
