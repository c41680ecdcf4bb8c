"""Generate with Ray Data: Parquet of questions in, Parquet with completions out.

Runs on a local Ray (CPU is fine) with the bundled SmolLM2-135M-Instruct. The engine actor
loads the model once; the batches it is given share its engine, so it stays full.

python examples/ray_generate.py [--input questions.parquet] [--output out/ray_generate]
"""

import argparse
import os
import tempfile

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls from Ray

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from batchlm.operators.ray_data import ProcessorConfig, build_processor

parser = argparse.ArgumentParser()
parser.add_argument("--input", help="Parquet with `id` and `question` columns (default: a demo)")
parser.add_argument("--output", default="out/ray_generate")
args = parser.parse_args()

if args.input is None:
    openings = ["The capital of France is", "Three facts about the Moon:", "def fib(n):"]
    questions = [f"{openings[i % 3]} ({i})" for i in range(24)] + [None]  # a null row
    args.input = os.path.join(tempfile.mkdtemp(), "questions.parquet")
    pq.write_table(pa.table({"id": list(range(len(questions))), "question": questions}), args.input)

ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
ray.data.DataContext.get_current().enable_progress_bars = False

config = ProcessorConfig.create(
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "generate",
    engine_kwargs={"max_model_len": 256},
    sampling_params={"temperature": 0, "max_tokens": 16},
    batch_size=8,
)
processor = build_processor(
    config,
    preprocess=lambda row: {**row, "prompt": row["question"]},
    postprocess=lambda row: {
        "id": row["id"],
        "question": row["question"],
        "answer": row["generated_text"],
        "error": row["error"],
    },
)
processor(ray.data.read_parquet(args.input)).write_parquet(args.output)

result = pq.read_table(args.output).sort_by("id")
print(f"{result.num_rows} rows → {args.output}")
for row in result.slice(0, 4).to_pylist() + result.slice(result.num_rows - 1).to_pylist():
    print(f"{row['id']:>3} {row['question']!r} → {row['answer']!r} error={row['error']!r}")
ray.shutdown()
