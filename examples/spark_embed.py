"""Embed a Parquet corpus with Spark's mapInArrow: every input column plus `embedding`.

Runs on a local Spark (CPU is fine) with the bundled all-MiniLM-L6-v2. The output schema is
declared up front; the embedding is `array<float>` and its dimension sits in the column's
metadata.

python examples/spark_embed.py [--input texts.parquet] [--output out/spark_embed]
"""

import argparse
import os
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from batchlm.operators.config import OperatorConfig
from batchlm.operators.spark_udf import FIXED_SIZE_KEY, map_in_arrow

parser = argparse.ArgumentParser()
parser.add_argument("--input", help="Parquet with a `text` column (default: a demo)")
parser.add_argument("--output", default="out/spark_embed")
args = parser.parse_args()

if args.input is None:
    topics = ["cooking pasta", "the solar system", "training a puppy", "tax returns"]
    texts = [f"A short note about {topics[i % 4]}, number {i}." for i in range(200)]
    args.input = os.path.join(tempfile.mkdtemp(), "texts.parquet")
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), args.input)

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers use this interpreter
spark = (
    SparkSession.builder.master("local[2]")
    .config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false")
    .config("spark.sql.execution.arrow.maxRecordsPerBatch", "64")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")

config = OperatorConfig.create(
    "sentence-transformers/all-MiniLM-L6-v2", "embed", pooling_params={"normalize": True}
)
out = map_in_arrow(spark.read.parquet(args.input), config)
print("dimension:", out.schema["embedding"].metadata[FIXED_SIZE_KEY])
out.write.mode("overwrite").parquet(args.output)

result = pq.read_table(args.output).sort_by("id")
print(f"{result.num_rows} rows, {result.column('error').null_count} without error → {args.output}")
first = result.slice(0, 1).to_pylist()[0]
print(f"{first['text']!r} → [{', '.join(f'{x:.4f}' for x in first['embedding'][:4])}, ...]")
spark.stop()
