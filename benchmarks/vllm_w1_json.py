"""W1-json on vLLM (the baseline of `gpu_generate.py --workload W1-json`): W1's batch with
the same JSON schema on every request against the same batch unconstrained, on the same
random-weight Llama-3.1-8B-shaped checkpoint, synthetic tokenizer and prompts, with the
same protocol (a short warm-up of each, then one timed run of each, prefix cache reset
before every run; both detokenize).

vLLM is a baseline only, never a dependency: run this where vLLM is importable (on the H200,
`../shared/vllm/README.md` says how), in its own process.

    PYTHONPATH=/tmp/vllm-site python3 benchmarks/vllm_w1_json.py --model-dir /tmp/llama8b --out r.jsonl
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from common import Recorder, grammar_library_version
from gpu_generate import LLAMA_8B
from w1_json import RECORDS_SCHEMA, w1_json_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True, help="made here if it holds no model yet")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    folder = Path(args.model_dir)
    tokenizer, token_prompts = w1_json_inputs(folder)
    vocab = LLAMA_8B["vocab_size"]
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    start = time.perf_counter()
    llm = LLM(
        str(folder),
        tokenizer=str(tokenizer),
        dtype="bfloat16",
        gpu_memory_utilization=0.85,
        max_model_len=4096,
        seed=0,
    )
    init_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in token_prompts]
    free = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    constraint = StructuredOutputsParams(json=RECORDS_SCHEMA, disable_any_whitespace=True)
    constrained = SamplingParams(
        max_tokens=256, ignore_eos=True, temperature=0, structured_outputs=constraint
    )

    def run(params: SamplingParams, batch: list) -> tuple[float, list]:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t, outs

    t = time.perf_counter()  # the schema compiled on first use
    run(SamplingParams(max_tokens=1, temperature=0, structured_outputs=constraint), prompts[:1])
    first_s = time.perf_counter() - t
    for params in (free, constrained):
        short = params.clone()
        short.max_tokens = 4
        run(short, prompts[:64])
    free_s, _ = run(free, prompts)
    json_s, outs = run(constrained, prompts)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    free_tps, json_tps = 256 * 256 / free_s, num_tokens / json_s
    common = dict(
        workload="W1-json",
        metric="output_tok_per_s",
        model="Llama-3.1-8B shape, random weights",
        dtype="bfloat16",
        num_requests=256,
        prompt_len=512,
        output_len=256,
        tokenizer=f"synthetic byte-level BPE of {vocab} tokens (both runs detokenize)",
        init_seconds=round(init_s, 1),
        xgrammar=grammar_library_version(),
    )
    rec = Recorder(args.out)
    rec.record(
        system=f"vllm-{vllm.__version__}-unconstrained",
        value=round(free_tps, 1),
        seconds=round(free_s, 3),
        **common,
    )
    rec.record(
        system=f"vllm-{vllm.__version__}",
        value=round(json_tps, 1),
        seconds=round(json_s, 3),
        output_tokens=num_tokens,
        baseline_value=round(free_tps, 1),
        ratio=round(json_tps / free_tps, 3),
        backend="auto (vLLM's default)",
        schema="records: >= 64 objects of a bounded integer, a string <= 24 chars, enum tags",
        disable_any_whitespace=True,
        first_request_seconds=round(first_s, 3),
        **common,
    )


if __name__ == "__main__":
    main()
