"""A job that cannot run stops with a message naming the problem and exit code 2, before
any model weights load."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchlm.operators.config import OperatorConfig
from batchlm.pipelines import cli

from .conftest import MINILM, run_cli, sentences, write_job, write_jsonl


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    def refuse(self):
        raise AssertionError("a model was loaded for a job that cannot run")

    monkeypatch.setattr(OperatorConfig, "build_llm", refuse)


@pytest.fixture
def base(tmp_path: Path) -> dict:
    write_jsonl(tmp_path / "in.jsonl", sentences(0, 3))
    return {
        "input": {"path": str(tmp_path / "in.jsonl")},
        "task": "embed",
        "model": MINILM,
        "output": {"path": str(tmp_path / "out")},
    }


def run(tmp_path: Path, capsys, job: dict | str, *extra: str) -> str:
    path = tmp_path / "job.yaml"
    if isinstance(job, str):
        path.write_text(job)
    else:
        write_job(path, job)
    code = cli.main(["run", str(path), "--quiet", *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "batchlm: error:" in err
    assert not (tmp_path / "out").exists(), "nothing may be written for a job that cannot run"
    return err


def test_yaml_syntax_error(tmp_path, capsys):
    err = run(tmp_path, capsys, "input: [conf/data\ntask: embed\n")
    assert "is not valid YAML" in err and "line 2" in err


def test_job_file_missing(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_empty_job_file(tmp_path, capsys):
    assert "is empty" in run(tmp_path, capsys, "")


def test_unknown_top_level_key(tmp_path, capsys, base):
    base["batchsize"] = 8
    err = run(tmp_path, capsys, base)
    assert "unknown key(s) in the job: 'batchsize' (did you mean 'batch_size'?)" in err
    assert "valid keys: batch_size, chat_template" in err


@pytest.mark.parametrize(
    ("section", "key", "where"),
    [
        ("input", "colums", "input"),
        ("output", "compresion", "output"),
        ("engine", "max_model_length", "engine"),
    ],
)
def test_unknown_nested_key(tmp_path, capsys, base, section, key, where):
    base.setdefault(section, {})[key] = 1
    err = run(tmp_path, capsys, base)
    assert f"unknown key(s) in {where}: {key!r}" in err and "valid keys:" in err


def test_unknown_params_key(tmp_path, capsys, base):
    base["pooling_params"] = {"normalise": True}
    err = run(tmp_path, capsys, base)
    assert "pooling_params has unknown key(s) 'normalise' (did you mean 'normalize'?)" in err


def test_unknown_column_role(tmp_path, capsys, base):
    base["input"]["columns"] = {"txt": "text"}
    err = run(tmp_path, capsys, base)
    assert "unknown key(s) in input.columns: 'txt' (did you mean 'text'?)" in err


def test_missing_required_key(tmp_path, capsys, base):
    del base["model"]
    assert "model is required" in run(tmp_path, capsys, base)


def test_missing_input(tmp_path, capsys, base):
    base["input"]["path"] = str(tmp_path / "absent.jsonl")
    err = run(tmp_path, capsys, base)
    assert "absent.jsonl" in err and "does not exist" in err


def test_glob_matching_nothing(tmp_path, capsys, base):
    base["input"]["path"] = str(tmp_path / "*.parquet")
    assert "matches no files" in run(tmp_path, capsys, base)


def test_wrong_column_from_the_schema(tmp_path, capsys, base):
    # Parquet: the schema comes from the footer; the rows are never read.
    pq.write_table(pa.table({"id": [1, 2], "body": ["a", "b"]}), tmp_path / "in.parquet")
    base["input"] = {"path": str(tmp_path / "in.parquet")}
    err = run(tmp_path, capsys, base)
    assert "task 'embed' reads column 'text' (input.columns.text)" in err
    assert "['id', 'body']" in err and "set input.columns.text" in err


def test_mapped_column_absent(tmp_path, capsys, base):
    base["input"]["columns"] = {"text": "sentence"}
    err = run(tmp_path, capsys, base)
    assert "reads column 'sentence' (input.columns.text)" in err


def test_output_column_would_overwrite_input(tmp_path, capsys, base):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "a", "error": "x"}])
    assert "would be overwritten" in run(tmp_path, capsys, base)


def test_bad_task(tmp_path, capsys, base):
    base["task"] = "summarize"
    err = run(tmp_path, capsys, base)
    assert "task: 'summarize' is unknown; use one of generate, chat, embed, score, classify" in err


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("batch_size", "ten", "batch_size: expected an integer, got 'ten' (a string)"),
        ("batch_size", 0, "batch_size=0 must be an integer >= 1"),
        ("concurrency", 1.5, "concurrency: expected an integer or a list of 2 integers, got 1.5"),
        ("runner", "dask", "runner: 'dask' is unknown; use one of local, ray, spark"),
        ("input", 3, "input: expected a mapping of keys, got an integer"),
        ("engine", ["dtype"], "engine: expected a mapping, got ['dtype'] (a list)"),
    ],
)
def test_bad_value(tmp_path, capsys, base, key, value, message):
    base[key] = value
    assert message in run(tmp_path, capsys, base)


def test_bad_params_value(tmp_path, capsys, base):
    base["task"] = "generate"
    base["input"]["columns"] = {"prompt": "text"}
    base["sampling_params"] = {"max_tokens": 0}
    assert "sampling_params: max_tokens=0" in run(tmp_path, capsys, base)


def test_params_of_the_other_kind(tmp_path, capsys, base):
    base["sampling_params"] = {"max_tokens": 4}
    assert "sampling_params apply to generate / chat" in run(tmp_path, capsys, base)


def test_unknown_model(tmp_path, capsys, base):
    base["model"] = "nobody/no-such-model"
    err = run(tmp_path, capsys, base)
    assert "nobody/no-such-model" in err


def test_bad_set_override(tmp_path, capsys, base):
    assert "expected KEY.PATH=VALUE" in run(tmp_path, capsys, base, "--set", "batch_size")
    err = run(tmp_path, capsys, base, "--set", "input.colums.text=x")
    assert "unknown key(s) in input: 'colums'" in err


def test_set_override_reaches_validation(tmp_path, capsys, base):
    err = run(tmp_path, capsys, base, "--set", "pooling_params.dimensions=two")
    assert "dimensions" in err


def test_cli_process_exit_code_and_help(tmp_path, base):
    base["task"] = "translate"
    job = write_job(tmp_path / "bad.yaml", base)
    out = run_cli("run", str(job))
    assert out.returncode == 2, out.stderr
    assert "batchlm: error:" in out.stderr and "'translate' is unknown" in out.stderr
    help_out = run_cli("--help")
    assert help_out.returncode == 0 and "batchlm run conf/generate_demo.yaml" in help_out.stdout
    run_help = run_cli("run", "--help")
    assert run_help.returncode == 0
    for words in ("--overwrite", "--set", "--runner", "resume", "exit codes"):
        assert words in run_help.stdout
