"""Embed with Ray Data: Parquet of texts in, Parquet with `fixed_size_list<float32>[384]`
embeddings out.

Runs on a local Ray (CPU is fine) with the bundled all-MiniLM-L6-v2; the engine actor loads
the model once, and the output column types are the declared ones, never inferred.

python examples/ray_embed.py [--input texts.parquet] [--output out/ray_embed]
"""

import argparse
import os
import tempfile

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls from Ray

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from batchlm.operators.ray_data import ProcessorConfig, build_processor

parser = argparse.ArgumentParser()
parser.add_argument("--input", help="Parquet with `id` and `text` columns (default: a demo)")
parser.add_argument("--output", default="out/ray_embed")
args = parser.parse_args()

if args.input is None:
    words = ["river", "lantern", "orchard", "copper", "meadow", "harbor"]
    texts = [f"The {words[i % 6]} is number {i}." for i in range(64)] + [None]  # a null row
    args.input = os.path.join(tempfile.mkdtemp(), "texts.parquet")
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), args.input)

ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
ray.data.DataContext.get_current().enable_progress_bars = False

config = ProcessorConfig.create("sentence-transformers/all-MiniLM-L6-v2", "embed", batch_size=16)
processor = build_processor(config)
processor(ray.data.read_parquet(args.input)).write_parquet(args.output)

result = pq.read_table(args.output).sort_by("id")
print(f"{result.num_rows} rows → {args.output}; embedding: {result.schema.field('embedding').type}")
ok = result.filter(result["error"].is_null())
vectors = np.asarray(ok["embedding"].combine_chunks().flatten()).reshape(ok.num_rows, -1)
sims = vectors @ vectors[0]  # the vectors are normalised: dot product = cosine
print(f"nearest to {ok['text'][0].as_py()!r}:")
for i in np.argsort(-sims)[1:4]:
    print(f"  {ok['text'][int(i)].as_py()!r} cos={sims[i]:.3f}")
print("errors:", [(r["id"], r["error"]) for r in result.to_pylist() if r["error"]])
ray.shutdown()
