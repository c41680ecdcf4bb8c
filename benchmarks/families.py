"""W1's batch on the shapes of other decoder families, beside Llama-3.1-8B in the same run.

Gemma-2-9B (soft-capped attention and logits, GeGLU, pre- and post-norms) and Phi-3-mini
(fused q|k|v and gate|up checkpoints), random weights in bf16: 256 requests × 512 prompt
tokens → 256 greedy tokens each, as W1. Each record gives output tok/s and the decode step
against its bandwidth floor (`decode_step_over_floor`); a family within 10 % of Llama's
floor ratio runs as close to the hardware as Llama does.

    python benchmarks/families.py --out results.jsonl
    python benchmarks/families.py --smoke            # tiny shapes, any device
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import gpu_generate  # noqa: E402  (DEVICE / DTYPE are set by --smoke)
import torch
from common import Recorder
from gpu_generate import (
    LLAMA_8B,
    SMOKE,
    build_random_model,
    compiles_in_last_run,
    count_triton_compiles,
    decode_breakdown,
    make_llm,
    prompts_of,
    release,
    run_batchlm,
    step_budget,
)

from batchlm.engine import SamplingParams

GEMMA2_9B = dict(
    architectures=["Gemma2ForCausalLM"],
    model_type="gemma2",
    hidden_size=3584,
    intermediate_size=14336,
    num_hidden_layers=42,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    vocab_size=256000,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
)
PHI3_MINI = dict(
    architectures=["Phi3ForCausalLM"],
    model_type="phi3",
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32064,
    max_position_embeddings=4096,
    original_max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=32000,
)
SHAPES = {
    "W1": ("Llama-3.1-8B", LLAMA_8B),
    "W1-gemma2": ("Gemma-2-9B", GEMMA2_9B),
    "W1-phi3": ("Phi-3-mini", PHI3_MINI),
}


def run_shape(args, rec: Recorder, workload: str, name: str, shape: dict) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{workload}-"))
    try:
        prompts = prompts_of([512] * 256, shape["vocab_size"], 0)
        build_random_model(shape, folder)
        release()
        llm = make_llm(folder, args, max_num_seqs=256)
        params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
        run_batchlm(llm, prompts[:64], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
        secs, _ = run_batchlm(llm, prompts, params)
        record = dict(
            workload=workload,
            system="batchlm",
            metric="output_tok_per_s",
            value=round(256 * 256 / secs, 1),
            seconds=round(secs, 3),
            model=f"{name} shape, random weights",
            dtype="bfloat16",
            num_requests=256,
            prompt_len=512,
            output_len=256,
            triton_compiles_in_run=compiles_in_last_run(),
            **step_budget(llm),
            **decode_breakdown(llm, prompts, params, shape),
        )
        del llm
        release()
        return record
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", action="append", choices=list(SHAPES))
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on this machine's device")
    args = ap.parse_args()
    if args.smoke:
        gpu_generate.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        gpu_generate.DTYPE = torch.float32
        for _, shape in SHAPES.values():
            shape.update(SMOKE)
            shape.pop("head_dim", None)
    rec = Recorder(args.out)
    count_triton_compiles()
    records = {}
    for workload in args.workload or list(SHAPES):
        start = time.perf_counter()
        name, shape = SHAPES[workload]
        records[workload] = run_shape(args, rec, workload, name, shape)
        print(json.dumps({"workload": workload, "wall_s": round(time.perf_counter() - start, 1)}))
    llama = records.get("W1")
    for workload, record in records.items():
        if llama is not None and workload != "W1":
            # Oriented so that higher is better: Llama's step-over-floor over the family's.
            record["baseline_value"] = llama["decode_step_over_floor"]
            record["ratio"] = round(
                llama["decode_step_over_floor"] / record["decode_step_over_floor"], 3
            )
            record["baseline"] = "Llama-3.1-8B shape's decode_step_over_floor, same run"
        rec.record(**record)


if __name__ == "__main__":
    main()
