"""Evaluate with lm-evaluation-harness on batchlm: `model="batchlm"` (needs the `eval` extra).

Writes a tiny four-choice task of its own (a JSONL file and the task's YAML) to a temporary
folder, loads it with the harness's `TaskManager(include_path=...)`, and scores it with the
bundled SmolLM2-135M-Instruct. Every request goes to the engine in one call, and the four
choices of a question share its context's KV blocks (prefix cache). Nothing is downloaded.

python examples/lm_eval_backend.py
"""

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task reads a local file only

import lm_eval
from lm_eval.tasks import TaskManager

import batchlm.operators.lm_eval  # noqa: F401  (registers model="batchlm")

QUESTIONS = [
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("What do bees make?", ["milk", "silk", "wool", "honey"], 3),
    ("Which planet do we live on?", ["Earth", "Mars", "Venus", "Jupiter"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which shape has three sides?", ["square", "circle", "triangle", "hexagon"], 2),
    ("What is the capital of Italy?", ["Madrid", "Rome", "Paris", "Berlin"], 1),
]
TASK_YAML = """\
task: demo_quiz
dataset_path: json
dataset_kwargs:
  data_files: {{test: "{data}"}}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""

folder = Path(tempfile.mkdtemp(prefix="lm-eval-demo-"))
data = folder / "quiz.jsonl"
data.write_text(
    "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS)
)
(folder / "demo_quiz.yaml").write_text(TASK_YAML.format(data=data))

results = lm_eval.simple_evaluate(
    model="batchlm",
    model_args="pretrained=HuggingFaceTB/SmolLM2-135M-Instruct,max_model_len=512",
    tasks=["demo_quiz"],
    task_manager=TaskManager(include_path=str(folder), include_defaults=False),
    log_samples=True,
)
scores = results["results"]["demo_quiz"]
print(f"acc: {scores['acc,none']:.3f}  acc_norm: {scores['acc_norm,none']:.3f}")
for sample in results["samples"]["demo_quiz"]:
    question, choices, answer = QUESTIONS[sample["doc_id"]]
    logprobs = [round(lp, 2) for lp, _ in sample["filtered_resps"]]
    picked = max(range(len(choices)), key=lambda i: logprobs[i])
    print(f"{question!r} -> {choices[picked]!r} (answer {choices[answer]!r}) {logprobs}")
