"""C1: SmolLM2-135M-Instruct on the CPU, batchlm against Hugging Face `generate`.

32 prompts of 16-256 random tokens (seed 0), exactly 64 greedy output tokens each, float32,
both systems on the same dequantised weights in one process. HF runs the whole batch at
once, left-padded (its fastest batched path on CPU). The systems alternate and each one's
best of `--repeats` timed runs is kept, because timings on a shared 2-core machine are noisy.

    python benchmarks/c1_cpu_smollm2.py --out benchmarks/results/c1-cpu.jsonl
"""

from __future__ import annotations

import argparse

import torch
from common import Recorder, Timer, random_prompts

from batchlm.engine import LLM, SamplingParams

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class HFRunner:
    """Hugging Face `generate` on the whole batch, left-padded."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
        pad = 0
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with Timer() as t:
            out = self.model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=pad
            )
        return t.seconds, out[:, width:].tolist()


def run_batchlm(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list[list[int]]]:
    # An empty prefix cache each time, so that no prompt work is skipped.
    llm.llm_engine.kv_cache.reset_prefix_cache()
    with Timer() as t:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return t.seconds, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each system")
    ap.add_argument("--out", default=None, help="append JSONL here")
    args = ap.parse_args()

    llm = LLM(MODEL, dtype="float32", max_model_len=1024, seed=0)
    vocab = llm.llm_engine.runner.vocab_size
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, vocab, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    hf = HFRunner(llm.llm_engine.config.model.path)
    warm = [p[:8] for p in prompts[:2]]
    run_batchlm(llm, warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    hf.run(warm, 2)

    ours_s, hf_s = [], []
    for _ in range(args.repeats):
        seconds, ours = run_batchlm(llm, prompts, params)
        ours_s.append(seconds)
        seconds, hf_tokens = hf.run(prompts, args.output_len)
        hf_s.append(seconds)
    num_out = sum(len(o) for o in ours)
    same = sum(a == b for a, b in zip(ours, hf_tokens, strict=True))
    ours_tps, hf_tps = num_out / min(ours_s), num_out / min(hf_s)

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
    rec.record(
        system="hf-generate",
        value=round(hf_tps, 2),
        seconds=round(min(hf_s), 3),
        runs_seconds=[round(x, 2) for x in hf_s],
        **common,
    )
    rec.record(
        system="batchlm",
        value=round(ours_tps, 2),
        seconds=round(min(ours_s), 3),
        runs_seconds=[round(x, 2) for x in ours_s],
        baseline_value=round(hf_tps, 2),
        ratio=round(ours_tps / hf_tps, 3),
        greedy_sequences_equal_to_baseline=f"{same}/{len(ours)}",
        **common,
    )


if __name__ == "__main__":
    main()
