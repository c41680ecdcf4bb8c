"""W1-job: W1's prompts through `batchlm run` on the local runner, against `LLM.generate`
over the same rows in the same process.

2,048 rows (W1's 256 prompts of 512 random tokens, eight times, each copy from its own
seed) in Parquet, each with its own `max_tokens` drawn from [32, 512] (seed 0) in a per-row
`sampling_params` column, greedy, `ignore_eos`. One engine serves both: the job's runner is
handed the engine `LLM.generate` used, so engine load time is out of both figures (the
job's time includes reading the Parquet shards and writing its output). Records
`W1-job` with the job's output tok/s, the in-process figure as the baseline, and the ratio.

    python benchmarks/pipeline_generate.py --out results.jsonl            # H200, Llama-8B shape
    python benchmarks/pipeline_generate.py --cpu                         # SmolLM2, smaller
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from common import Recorder, Timer, run_job_on

from batchlm.engine import LLM, SamplingParams
from batchlm.pipelines import JobSpec

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def make_rows(num_rows: int, prompt_len: int, vocab: int, max_tokens: tuple[int, int]):
    rng = random.Random(0)
    prompts = [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(num_rows)]
    lengths = [rng.randint(*max_tokens) for _ in range(num_rows)]
    return prompts, lengths


def write_shards(folder: Path, prompts, lengths, num_shards: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(prompts) // num_shards)
    for i in range(num_shards):
        rows = range(i * per, min((i + 1) * per, len(prompts)))
        table = pa.table(
            {
                "id": list(rows),
                "prompt": [prompts[r] for r in rows],
                "sampling_params": [json.dumps({"max_tokens": lengths[r]}) for r in rows],
            }
        )
        pq.write_table(table, folder / f"part-{i:03d}.parquet")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="SmolLM2 on this machine, smaller run")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=64, help="the job's rows per batch")
    ap.add_argument("--model-dir", default=None, help="GPU: keep the random checkpoint here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rec = Recorder(args.out)
    if args.cpu:
        model, vocab, prompt_len = SMOLLM2, 49152, 64
        num_rows, max_tokens = args.rows or 64, (4, 32)
        engine = dict(max_model_len=256, max_num_seqs=32)
        name = "SmolLM2-135M-Instruct"
    else:
        import torch
        from gpu_generate import LLAMA_8B, build_random_model

        folder = Path(args.model_dir or tempfile.mkdtemp(prefix="bench-llama8b-"))
        build_random_model(LLAMA_8B, folder)
        torch.cuda.empty_cache()
        model, vocab, prompt_len = str(folder), LLAMA_8B["vocab_size"], 512
        num_rows, max_tokens = args.rows or 2048, (32, 512)
        engine = dict(dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=0.85)
        name = "Llama-3.1-8B shape, random weights"
    prompts, lengths = make_rows(num_rows, prompt_len, vocab, max_tokens)
    llm = LLM(model, **engine)
    base = dict(temperature=0, ignore_eos=True)

    def generate() -> tuple[float, int]:
        llm.reset_prefix_cache()
        params = [SamplingParams(max_tokens=n, **base) for n in lengths]
        with Timer() as t:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return t.seconds, sum(len(o.outputs[0].token_ids) for o in outs)

    # Warm-up (kernels compiled, allocator grown), then the in-process figure.
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:64]],
        SamplingParams(max_tokens=4, **base),
        use_tqdm=False,
    )
    gen_s, gen_tokens = generate()

    with tempfile.TemporaryDirectory() as tmp:
        write_shards(Path(tmp) / "in", prompts, lengths, num_shards=8)
        job = JobSpec.from_dict(
            {
                "input": {"path": str(Path(tmp) / "in")},
                "task": "generate",
                "model": model,
                "engine": engine,
                "sampling_params": {"temperature": 0, "ignore_eos": True},
                "output": str(Path(tmp) / "out"),
                "batch_size": args.batch_size,
            }
        )
        llm.reset_prefix_cache()
        job_s, summary = run_job_on(llm, job)
        written = pq.read_table(Path(tmp) / "out")
        job_tokens = sum(written.column("num_output_tokens").to_pylist())
        assert written.num_rows == num_rows and written.column("error").null_count == num_rows
        assert job_tokens == gen_tokens == sum(lengths), (job_tokens, gen_tokens)
    gen_tps, job_tps = gen_tokens / gen_s, job_tokens / job_s
    rec.record(
        workload="W1-job",
        system="batchlm",
        metric="output_tok_per_s",
        value=round(job_tps, 1),
        seconds=round(job_s, 3),
        baseline="LLM.generate over the same rows, same engine, same process",
        baseline_value=round(gen_tps, 1),
        baseline_seconds=round(gen_s, 3),
        ratio=round(job_tps / gen_tps, 3),
        model=name,
        num_rows=num_rows,
        prompt_len=prompt_len,
        max_tokens_range=list(max_tokens),
        output_tokens=job_tokens,
        batch_size=args.batch_size,
        rows_written=summary.rows_written,
    )


if __name__ == "__main__":
    main()
