"""W4-job: a corpus from Parquet to Parquet embeddings with `batchlm run` (local runner),
against the in-process `LLM.embed` rate on the same texts in the same process.

W4's texts (mixed lengths, median ≈ 26 tokens), 1,000,000 by default, in 10 Parquet
shards; the MiniLM-L6 shape (random weights with `--random-weights`), default engine
settings. One engine serves both: the job's runner is handed the engine `LLM.embed` used,
so load time is out of both figures (the job's includes reading the shards and writing
its `fixed_size_list<float32>` column). Records `W4-job` with the job's texts/s, the
in-process figure as the baseline, and the ratio.

    python benchmarks/pipeline_embed.py --dtype float16 --random-weights --out results.jsonl
    python benchmarks/pipeline_embed.py --num-texts 20000                 # CPU, smaller
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from common import Recorder, Timer, run_job_on
from w4_embed import MODEL, make_texts, random_weight_model

from batchlm.engine import LLM
from batchlm.pipelines import JobSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-texts", type=int, default=1_000_000)
    ap.add_argument("--num-shards", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64, help="the job's rows per batch")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = random_weight_model() if args.random_weights else MODEL
    texts = make_texts(args.num_texts)
    llm = LLM(model, dtype=args.dtype)
    llm.embed(texts[:2048], use_tqdm=False)  # warm-up
    with Timer() as t:
        outs = llm.embed(texts, use_tqdm=False)
    embed_s = t.seconds
    dim = outs[0].outputs.hidden_size
    del outs

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "in"
        folder.mkdir()
        per = -(-len(texts) // args.num_shards)
        for i in range(args.num_shards):
            part = texts[i * per : (i + 1) * per]
            ids = range(i * per, i * per + len(part))
            pq.write_table(pa.table({"id": ids, "text": part}), folder / f"part-{i:03d}.parquet")
        job = JobSpec.from_dict(
            {
                "input": {"path": str(folder)},
                "task": "embed",
                "model": model,
                "engine": {"dtype": args.dtype},
                "output": str(Path(tmp) / "out"),
                "batch_size": args.batch_size,
            }
        )
        job_s, _ = run_job_on(llm, job)
        written = pq.read_table(Path(tmp) / "out", columns=["id", "embedding", "error"])
        assert written.num_rows == len(texts) and written.column("error").null_count == len(texts)
        assert written.schema.field("embedding").type == pa.list_(pa.float32(), dim)
    embed_tps, job_tps = len(texts) / embed_s, len(texts) / job_s
    sched = llm.llm_engine.config.scheduler
    Recorder(args.out).record(
        workload="W4-job",
        system="batchlm",
        metric="texts_per_s",
        value=round(job_tps, 1),
        seconds=round(job_s, 3),
        baseline="LLM.embed over the same texts, same engine, same process",
        baseline_value=round(embed_tps, 1),
        baseline_seconds=round(embed_s, 3),
        ratio=round(job_tps / embed_tps, 3),
        model=MODEL if not args.random_weights else "MiniLM-L6 shape, random weights",
        dtype=args.dtype,
        num_texts=len(texts),
        num_shards=args.num_shards,
        batch_size=args.batch_size,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
    )


if __name__ == "__main__":
    main()
