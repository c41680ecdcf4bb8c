"""W6 of BENCHMARKS.md with bf16 and with fp8 weights (`quantization="fp8"`: the experts
and the dense projections), on a CUDA GPU, with the protocol of shared/vllm/bench.py.

The Qwen3-30B-A3B shape (48 layers, hidden 2048, 128 experts of width 768, 8 active) is
built with `load_format="dummy"` from a folder holding its config.json alone (61 GB in
bf16: too large to save); bf16, gpu_memory_utilization 0.85, max_model_len 4096,
skip_tokenizer_init. Each variant runs in its own process (the engines do not share the
GPU's memory):

W6 / W6-fp8: 256 requests × 512 random prompt tokens → 256 greedy tokens (ignore_eos);
    one warm-up run (seed 100), then 3 timed runs on fresh prompts (seeds 1-3), the best
    output tok/s kept.
W6-bs1 / W6-fp8-bs1: one 32-token prompt → 256 tokens, the same protocol, ms per token.

    python benchmarks/moe_w6.py --out results.jsonl
    python benchmarks/moe_w6.py --variant fp8
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Recorder

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=8192,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)
"""SHAPES["qwen3moe"] of shared/vllm/bench.py."""
SMOKE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
             num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512)  # fmt: skip
"""`--smoke`: a tiny model of the same family, to check the script on any machine."""
VARIANTS = {"bf16": None, "fp8": "fp8"}
NUM_TIMED = 3


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(n)]


def run_variant(variant: str, out: str | None, smoke: bool) -> None:
    import torch

    from batchlm.engine import LLM, SamplingParams

    recorder = Recorder(out)
    shape = {**QWEN3_30B_A3B, **(SMOKE if smoke else {})}
    folder = Path(tempfile.mkdtemp(prefix="w6-config-"))
    (folder / "config.json").write_text(json.dumps(shape))
    start = time.perf_counter()
    llm = LLM(
        str(folder),
        load_format="dummy",
        quantization=VARIANTS[variant],
        dtype="bfloat16",
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.85,
        max_model_len=4096,
        seed=0,
    )
    init_s = round(time.perf_counter() - start, 1)
    weights_gib = (
        round(torch.cuda.memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None
    )
    vocab = shape["vocab_size"]
    num_requests = 4 if smoke else 256
    suffix = "" if variant == "bf16" else f"-{variant}"

    def timed(make) -> list[tuple[float, int]]:
        """Seed 100 warms up; seeds 1..NUM_TIMED are timed."""
        runs = []
        for seed in (100, *range(1, NUM_TIMED + 1)):
            prompts, params = make(seed)
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            dt = time.perf_counter() - t
            if seed != 100:
                runs.append((dt, sum(len(o.outputs[0].token_ids) for o in outs)))
        return runs

    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, detokenize=False)
    batch = timed(
        lambda s: (
            [ids(r, 512, vocab) for r in [random.Random(s)] for _ in range(num_requests)],
            params,
        )
    )
    rates = [round(n / dt, 1) for dt, n in batch]
    common = dict(system="batchlm", quantization=VARIANTS[variant], init_s=init_s,
                  memory_allocated_gib=weights_gib, num_kv_blocks=llm.llm_engine.num_kv_blocks)  # fmt: skip
    recorder.record(workload=f"W6{suffix}", metric="output_tok_per_s", value=max(rates),
                    runs=rates, **common)  # fmt: skip
    single = timed(lambda s: ([ids(random.Random(s), 32, vocab)], params))
    ms = [round(dt / n * 1e3, 3) for dt, n in single]
    recorder.record(workload=f"W6{suffix}-bs1", metric="ms_per_token", value=min(ms), runs=ms,
                    **common)  # fmt: skip
    llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", choices=list(VARIANTS),
                    help="repeat for several (default: bf16 then fp8, each in its own process)")  # fmt: skip
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (checks the script)")
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    variants = args.variant or list(VARIANTS)
    if args.in_process or len(variants) == 1:
        for variant in variants:
            run_variant(variant, args.out, args.smoke)
        return 0
    for variant in variants:
        cmd = [sys.executable, __file__, "--variant", variant, "--in-process"]
        cmd += ["--out", args.out] if args.out else []
        cmd += ["--smoke"] if args.smoke else []
        if subprocess.run(cmd).returncode:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
