"""A generation job with structured outputs: the job's constraint, each row's own from a
column of JSON cells, and rows whose constraint is malformed or does not compile, each with
its message in `error` while the other rows run; read back with pyarrow."""

from __future__ import annotations

import json
import re

import jsonschema
import pyarrow.parquet as pq

from batchlm.pipelines import cli

from .conftest import write_job, write_jsonl

DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}
ROWS = [
    (None, "yes-no"),
    ({"regex": "[0-9]{3}"}, "regex"),
    ({"json": DIGIT, "disable_any_whitespace": True}, "json"),
    ({"json": {"type": "foo"}}, 'xgrammar cannot compile: Unsupported type "foo"'),
    ("{not json", "holds a string that is not JSON"),
    ({"choice": ["red", "green"], "regx": "."}, r"unknown key\(s\) \['regx'\]"),
    ({"choice": ["red", "green"]}, "colour"),
    (None, "yes-no"),
]
"""Each row's `structured_outputs` cell (as written to the JSONL) and what it must give."""


def test_per_row_constraints_and_bad_rows(tmp_path, capsys):
    rows = [
        {
            "id": i,
            "question": f"Question {i}: is the sky blue, or pick a number?",
            "constraint": cell if cell is None or isinstance(cell, str) else json.dumps(cell),
        }
        for i, (cell, _) in enumerate(ROWS)
    ]
    data = write_jsonl(tmp_path / "data" / "rows.jsonl", rows)
    job = write_job(
        tmp_path / "job.yaml",
        {
            "input": {
                "path": str(data),
                "columns": {"prompt": "question", "structured_outputs": "constraint"},
            },
            "task": "generate",
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "engine": {"max_model_len": 128},
            "sampling_params": {"temperature": 0, "max_tokens": 16},
            "structured_outputs": {"choice": ["yes", "no"]},
            "output": str(tmp_path / "out"),
            "batch_size": 8,
        },
    )
    code = cli.main(["run", str(job), "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "rows written 8 (3 failed" in " ".join(captured.out.split())
    table = pq.read_table(tmp_path / "out")
    assert table.column("id").to_pylist() == list(range(len(ROWS)))
    assert table.column("constraint").to_pylist() == [r["constraint"] for r in rows]
    for row, (_, want) in zip(table.to_pylist(), ROWS, strict=True):
        text, error = row["generated_text"], row["error"]
        if want == "yes-no":
            assert text in ("yes", "no") and error is None
        elif want == "regex":
            assert re.fullmatch("[0-9]{3}", text) and error is None
        elif want == "json":
            jsonschema.validate(json.loads(text), DIGIT)
        elif want == "colour":
            assert text in ("red", "green") and error is None
        else:
            assert text is None and re.search(want, error), error
            assert not error.startswith("prompts[")  # the row's error names no call index
