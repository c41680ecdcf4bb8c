"""W3-int4 and W1-int4 of BENCHMARKS.md on a CUDA GPU: the Llama-3.1-8B shape with GPTQ
weights (4-bit, groups of 128, symmetric, no activation order) against the same shape in
bf16, in the same run, with the protocol of shared/vllm/bench.py.

Both models are built with `load_format="dummy"` from a folder holding config.json alone
(the int4 one with a GPTQ `quantization_config`: seeded random packed weights, no
checkpoint); bf16 activations, gpu_memory_utilization 0.85, max_model_len 4096,
skip_tokenizer_init, seed 0. Each variant runs in its own process (the engines do not share
the GPU's memory), bf16 first; then the int4 records carry bf16's figure as baseline:

W1 / W1-int4: 256 requests × 512 random prompt tokens → 256 greedy tokens (ignore_eos);
    one warm-up run (seed 100), then 3 timed runs on fresh prompts (seeds 1-3), the best
    output tok/s kept. W1-int4's `ratio`: int4 over bf16 (target >= 0.9).
W3 / W3-int4: one 32-token prompt → 256 tokens, the same protocol, ms per token. W3-int4's
    `ratio`: bf16's time over int4's (target >= 2), `time_ratio` the inverse (<= 0.5);
    `weights_floor_ms`: the bytes of every weight a decode step reads (all but the
    embedding) over the H200's 4.23 TB/s.

    python benchmarks/int4.py --out results.jsonl
    python benchmarks/int4.py --variant int4            # one variant, no baseline
    python benchmarks/int4.py --variant bf16 --variant int4 --variant int4-fusions \
        --workload W3                                   # A/B of the one-token fusions
    python benchmarks/int4.py --smoke                   # a tiny model (checks the script)

The vLLM side (its Marlin / Machete kernels on the same config) is `benchmarks/vllm_int4.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Recorder, batchlm_environment

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)
"""SHAPES["llama8b"] of shared/vllm/bench.py."""
GPTQ_CONFIG = dict(
    quant_method="gptq",
    bits=4,
    group_size=128,
    desc_act=False,
    sym=True,
    checkpoint_format="gptq",
    lm_head=False,
    true_sequential=True,
    damp_percent=0.01,
)
"""What AutoGPTQ / GPTQModel write for a 4-bit, group-128, symmetric checkpoint."""
SMOKE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)  # fmt: skip
VARIANTS = {
    "bf16": {},
    "int4": {},
    # The int4 variants with the switches of gpu_kernels/w4a16_mma.py and w4a16_fused.py.
    "int4-stage-row": {"BATCHLM_W4A16_MMA_STAGE_ROW": "1"},
    "int4-fusions": {"BATCHLM_W4A16_FUSIONS": "1"},
    "int4-fusions-stage-row": {"BATCHLM_W4A16_FUSIONS": "1", "BATCHLM_W4A16_MMA_STAGE_ROW": "1"},
    "int4-unstaged": {"BATCHLM_W4A16_MMA_STAGED": "0"},
}
"""Each variant's environment, set in its own process (bf16 and int4 run by default)."""
WORKLOADS = ("W1", "W3")
NUM_TIMED = 3
HBM_BYTES_PER_S = 4.23e12


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(n)]


def gptq_config(smoke: bool) -> dict:
    """GPTQ_CONFIG, in groups of 32 for the smoke shapes (whose rows hold fewer than 128)."""
    return dict(GPTQ_CONFIG, group_size=32 if smoke else 128)


def config_folder(variant: str, smoke: bool) -> Path:
    """A folder holding the variant's config.json alone."""
    shape = {**LLAMA_8B, **(SMOKE if smoke else {})}
    if variant.startswith("int4"):
        shape["quantization_config"] = gptq_config(smoke)
    folder = Path(tempfile.mkdtemp(prefix=f"int4-bench-{variant}-"))
    (folder / "config.json").write_text(json.dumps(shape))
    return folder


def run_variant(variant: str, smoke: bool, workloads: tuple[str, ...] = WORKLOADS) -> dict:
    """W1's and W3's figures (those of `workloads`) for one variant (its own engine)."""
    import torch

    from batchlm.engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        str(config_folder(variant, smoke)),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.85,
        max_model_len=4096,
        seed=0,
    )
    init_s = round(time.perf_counter() - start, 1)
    model = llm.llm_engine.runner.model
    vocab = LLAMA_8B["vocab_size"] if not smoke else SMOKE["vocab_size"]
    embedding = model.model.embed_tokens.weight
    read_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_bytes -= embedding.numel() * embedding.element_size()

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

    num_requests = 4 if smoke else 256
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, detokenize=False)
    batch = single = []
    if "W1" in workloads:
        batch = timed(
            lambda s: (
                [ids(r, 512, vocab) for r in [random.Random(s)] for _ in range(num_requests)],
                params,
            )
        )
    if "W3" in workloads:
        single = timed(lambda s: ([ids(random.Random(s), 32, vocab)], params))
    result = dict(
        variant=variant,
        environment=batchlm_environment(),
        num_requests=num_requests,
        init_s=init_s,
        w1_runs=[round(n / dt, 1) for dt, n in batch],
        w3_runs=[round(dt / n * 1e3, 3) for dt, n in single],
        weights_read_gib=round(read_bytes / 2**30, 2),
        weights_floor_ms=round(read_bytes / HBM_BYTES_PER_S * 1e3, 3),
        num_kv_blocks=llm.llm_engine.num_kv_blocks,
        memory_allocated_gib=(
            round(torch.cuda.memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None
        ),
    )
    llm.shutdown()
    return result


def record(recorder: Recorder, results: dict[str, dict], smoke: bool) -> None:
    common = dict(model="Llama-3.1-8B shape" + (" (smoke)" if smoke else ""), dtype="bfloat16",
                  load_format="dummy")  # fmt: skip
    bf16 = results.get("bf16")
    label = f"gptq 4-bit g{gptq_config(smoke)['group_size']} sym"
    for variant, r in results.items():
        suffix = "" if variant == "bf16" else "-int4"
        system = "batchlm" if variant == "bf16" else f"batchlm-{variant}"
        extra = dict(quantization=label if variant != "bf16" else None,
                     init_s=r["init_s"], weights_read_gib=r["weights_read_gib"],
                     weights_floor_ms=r["weights_floor_ms"], num_kv_blocks=r["num_kv_blocks"],
                     memory_allocated_gib=r["memory_allocated_gib"], **common)  # fmt: skip
        if r["environment"]:
            extra["environment"] = r["environment"]
        for workload, key, metric, best, fields in (
            ("W1", "w1_runs", "output_tok_per_s", max,
             dict(num_requests=r["num_requests"], prompt_len=512, output_len=256)),
            ("W3", "w3_runs", "ms_per_token", min,
             dict(batch_size=1, prompt_len=32, output_len=256)),
        ):  # fmt: skip
            if not r[key]:
                continue
            value = best(r[key])
            base = {}
            if bf16 is not None and bf16[key] and r is not bf16:
                b = best(bf16[key])
                speed = value / b if best is max else b / value  # int4's speed over bf16's
                base = dict(baseline="bf16, same run", baseline_value=b, ratio=round(speed, 3))
                if best is min:  # and the times' ratio, the inverse
                    base["time_ratio"] = round(value / b, 3)
            recorder.record(workload=workload + suffix, system=system, metric=metric,
                            value=value, runs=r[key], **fields, **base, **extra)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", choices=list(VARIANTS),
                    help="repeat for several (default: bf16 then int4, each in its own process)")  # fmt: skip
    ap.add_argument("--workload", action="append", choices=WORKLOADS,
                    help="repeat for several (default: both)")  # fmt: skip
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (checks the script)")
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    workloads = tuple(args.workload or WORKLOADS)
    if args.result:  # a child: one variant, its figures to a file
        result = run_variant(args.variant[0], args.smoke, workloads)
        Path(args.result).write_text(json.dumps(result))
        return 0
    results = {}
    for variant in args.variant or ("bf16", "int4"):
        out = Path(tempfile.mkdtemp()) / f"{variant}.json"
        cmd = [sys.executable, __file__, "--variant", variant, "--result", str(out)]
        cmd += [f"--workload={w}" for w in workloads] + (["--smoke"] if args.smoke else [])
        env = {**os.environ, **VARIANTS[variant]}
        if subprocess.run(cmd, env=env).returncode:
            return 1
        results[variant] = json.loads(out.read_text())
    record(Recorder(args.out), results, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
