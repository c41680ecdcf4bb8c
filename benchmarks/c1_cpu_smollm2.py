"""C1: SmolLM2-135M-Instruct on the CPU, batchlm against Hugging Face `generate`.

32 prompts of 16-256 random tokens (seed 0), exactly 64 greedy output tokens each, float32,
both systems on the same dequantised weights in one process. HF runs the whole batch at
once, left-padded (its fastest batched path on CPU).

    python benchmarks/c1_cpu_smollm2.py --out benchmarks/results/c1-cpu.jsonl
"""

from __future__ import annotations

import argparse

import torch
from common import Recorder, Timer, random_prompts

from batchlm.engine import LLM, SamplingParams

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def run_hf(model_dir: str, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    pad = 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(
            ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False
        )
        with Timer() as t:
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=pad
            )
    return t.seconds, out[:, width:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None, help="append JSONL here")
    args = ap.parse_args()

    llm = LLM(MODEL, dtype="float32", max_model_len=1024, seed=0)
    vocab = llm.llm_engine.runner.vocab_size
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, vocab, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:8]} for p in prompts[:2]], params, use_tqdm=False)
    # Warm run done; measure with an empty prefix cache so no prompt work is skipped.
    llm.llm_engine.kv_cache.reset_prefix_cache()
    with Timer() as t:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    num_out = sum(len(o) for o in ours)

    hf_seconds, hf_tokens = run_hf(llm.llm_engine.config.model.path, prompts, args.output_len)
    same = sum(a == b for a, b in zip(ours, hf_tokens, strict=True))
    ours_tps, hf_tps = num_out / t.seconds, num_out / hf_seconds
    rec = Recorder(args.out)
    common = dict(
        workload="C1",
        metric="output_tok_per_s",
        model=MODEL,
        dtype="float32",
        num_prompts=args.num_prompts,
        prompt_len=[args.min_len, args.max_len],
        output_len=args.output_len,
        threads=torch.get_num_threads(),
    )
    rec.record(system="hf-generate", value=round(hf_tps, 2), seconds=round(hf_seconds, 3), **common)
    rec.record(
        system="batchlm",
        value=round(ours_tps, 2),
        seconds=round(t.seconds, 3),
        baseline_value=round(hf_tps, 2),
        ratio=round(ours_tps / hf_tps, 3),
        greedy_sequences_equal_to_baseline=f"{same}/{len(ours)}",
        **common,
    )


if __name__ == "__main__":
    main()
