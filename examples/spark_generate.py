"""Generate with a Spark pandas UDF: Parquet of prompts in, Parquet with completions out.

Runs on a local Spark (CPU is fine) with the bundled SmolLM2-135M-Instruct; each Python
worker loads the model once and keeps it for every batch it is given.

python examples/spark_generate.py [--input prompts.parquet] [--output out/spark_generate]
"""

import argparse
import os
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from batchlm.operators.config import OperatorConfig
from batchlm.operators.spark_udf import generate_udf

parser = argparse.ArgumentParser()
parser.add_argument("--input", help="Parquet with `id` and `prompt` columns (default: a demo)")
parser.add_argument("--output", default="out/spark_generate")
args = parser.parse_args()

if args.input is None:
    openings = ["The capital of France is", "Three facts about the Moon:", "def fib(n):"]
    prompts = [f"{openings[i % 3]} ({i})" for i in range(24)] + [None]  # a null row
    args.input = os.path.join(tempfile.mkdtemp(), "prompts.parquet")
    pq.write_table(pa.table({"id": list(range(len(prompts))), "prompt": prompts}), args.input)

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers use this interpreter
spark = (
    SparkSession.builder.master("local[2]")
    .config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false")
    .config("spark.sql.execution.arrow.maxRecordsPerBatch", "16")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")

config = OperatorConfig.create(
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "generate",
    engine_kwargs={"max_model_len": 256},
    sampling_params={"temperature": 0, "max_tokens": 16},
)
df = spark.read.parquet(args.input)
out = df.withColumn("out", generate_udf(config)("prompt")).select("id", "prompt", "out.*")
out.write.mode("overwrite").parquet(args.output)

result = pq.read_table(args.output).sort_by("id")
print(f"{result.num_rows} rows → {args.output}")
for row in result.slice(0, 4).to_pylist() + result.slice(result.num_rows - 1).to_pylist():
    print(f"{row['id']:>3} {row['prompt']!r} → {row['generated_text']!r} error={row['error']!r}")
spark.stop()
