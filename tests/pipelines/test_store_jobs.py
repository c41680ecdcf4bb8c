"""Jobs whose input and output live on an S3-compatible store: the same rows as the job on
local files on every runner, resumed after a kill with every row written once, a finished
job rewriting nothing, a changed job refused, concurrent runs kept apart by the lease, and
unreachable stores refused with exit code 2 before any model loads."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from batchlm.operators.config import OperatorConfig
from batchlm.operators.fault_injection import FaultPlan
from batchlm.pipelines import JobSpec, cli, run_job
from batchlm.pipelines.lease import LEASE_NAME
from batchlm.pipelines.output import MANIFEST_NAME

from .conftest import run_cli, write_job, write_jsonl

PROMPTS = [
    "The lighthouse keeper climbed",
    "Every morning the baker",
    "",  # refused by the engine: this row gets an error, the others run
    "A glacier moves",
    "Octopuses can",
    "The train left the station and",
    "Compost heaps",
]
PARTS = ["part-00000-a.parquet", "part-00001-b.parquet", "part-00002-c.parquet"]


def _inputs(folder: Path) -> Path:
    """Three shards of three formats: Parquet, CSV and JSONL."""
    rows = [{"id": i, "line": p} for i, p in enumerate(PROMPTS)]
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:3]), folder / "a.parquet")
    pa_csv.write_csv(pa.Table.from_pylist(rows[3:5]), folder / "b.csv")
    write_jsonl(folder / "c.jsonl", rows[5:])
    return folder


def _job(model: Path | str, source: str, output: str) -> dict:
    return {
        "input": {"path": source, "columns": {"prompt": "line"}},
        "task": "generate",
        "model": str(model),
        "engine": {"max_model_len": 64},
        "sampling_params": {"temperature": 0, "max_tokens": 6},
        "output": output,
        "batch_size": 2,
    }


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_model_factory) -> tuple[Path, Path, pa.Table]:
    """The job on local files: (input folder, model, its output)."""
    root = tmp_path_factory.mktemp("store-jobs")
    model = tiny_model_factory("llama")
    source = _inputs(root / "in")
    job = JobSpec.from_dict(_job(model, str(source), str(root / "out")))
    assert run_job(job, progress=False).num_shards_written == 3
    return source, model, pq.read_table(root / "out")


def _read(s3, prefix: str) -> pa.Table:
    return pq.read_table(f"{s3.bucket}/{prefix}", filesystem=s3.fs)


def test_store_to_store_equals_the_local_job(s3, local_run):
    # The Ray and Spark runners' store-to-store runs are in test_runners.py.
    source, model, expected = local_run
    s3.upload(source, "in")
    remote_model = s3.upload(model, "models/tiny-llama")  # the model from the store too
    job = JobSpec.from_dict(_job(remote_model, s3.uri("in/"), s3.uri("out")))
    summary = run_job(job, progress=False)
    assert summary.num_shards_written == 3 and summary.rows_in_output == len(PROMPTS)
    assert sorted(k for k in s3.keys("out")) == sorted(
        [f"out/{p}" for p in PARTS] + [f"out/{MANIFEST_NAME}"]
    ), "only whole shards and the manifest: no temporary objects, no lease left"
    out = _read(s3, "out")
    assert out.schema == expected.schema
    assert out.to_pylist() == expected.to_pylist()


def test_kill_mid_shard_then_resume_writes_every_row_once(tmp_path, s3, local_run, capsys):
    source, model, expected = local_run
    s3.upload(source, "in")
    job = write_job(tmp_path / "job.yaml", _job(model, s3.uri("in"), s3.uri("out")))
    # Killed while shard 1's rows are being written: shard 0 is in place, shard 1 is not.
    killed = run_cli("run", str(job), "-q", env={**s3.env, **FaultPlan(exit_after_batches=3).env()})
    assert killed.returncode == 3, killed.stderr
    keys = s3.keys("out")
    assert f"out/{PARTS[0]}" in keys and f"out/{PARTS[1]}" not in keys
    assert not [k for k in keys if k.startswith("out/part-") and k != f"out/{PARTS[0]}"]
    first = keys[f"out/{PARTS[0]}"]

    code = cli.main(["run", str(job), "-q"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "2 of 3 shard(s) to run" in err
    after = s3.keys("out")
    assert after[f"out/{PARTS[0]}"] == first, "the finished shard was written again"
    assert sorted(after) == sorted([f"out/{p}" for p in PARTS] + [f"out/{MANIFEST_NAME}"])
    out = _read(s3, "out")
    assert sorted(out.column("id").to_pylist()) == list(range(len(PROMPTS)))
    assert out.sort_by("id").to_pylist() == expected.to_pylist()

    code = cli.main(["run", str(job), "-q"])  # finished: nothing is written, not even a lease
    assert code == 0
    assert "0 of 3 shard(s) to run" in capsys.readouterr().err
    assert s3.keys("out") == after


def test_changed_job_refuses_to_mix_then_overwrite_starts_over(
    tmp_path, s3, local_run, capsys, monkeypatch
):
    source, model, _ = local_run
    s3.upload(source, "in")
    job = write_job(tmp_path / "job.yaml", _job(model, s3.uri("in"), s3.uri("out")))
    assert cli.main(["run", str(job), "-q"]) == 0
    before = s3.keys("out")
    capsys.readouterr()
    build_llm = OperatorConfig.build_llm
    _refuse_models(monkeypatch)
    code = cli.main(["run", str(job), "-q", "--set", "sampling_params.max_tokens=3"])
    err = capsys.readouterr().err
    assert code == 2 and "holds results of a different job" in err, err
    assert s3.keys("out") == before

    monkeypatch.setattr(OperatorConfig, "build_llm", build_llm)  # starting over loads it
    args = ["-q", "--set", "sampling_params.max_tokens=3", "--overwrite"]
    assert cli.main(["run", str(job), *args]) == 0, capsys.readouterr().err
    after = s3.keys("out")
    assert set(after) == set(before) and all(after[k] != before[k] for k in after)
    assert set(_read(s3, "out").column("num_output_tokens").to_pylist()) <= {None, 3}


def _refuse_models(monkeypatch) -> None:
    def refuse(self):
        raise AssertionError("a model was loaded for a job that cannot run")

    monkeypatch.setattr(OperatorConfig, "build_llm", refuse)


def test_another_run_holding_the_lease_is_refused(tmp_path, s3, local_run, capsys, monkeypatch):
    source, model, _ = local_run
    s3.upload(source, "in")
    job = write_job(tmp_path / "job.yaml", _job(model, s3.uri("in"), s3.uri("out")))
    lease = {"owner": "x", "host": "elsewhere", "pid": 1, "started": time.time()}
    s3.put(f"out/{LEASE_NAME}", json.dumps({**lease, "renewed": time.time()}).encode())
    _refuse_models(monkeypatch)
    code = cli.main(["run", str(job), "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "another batchlm run is writing to" in err and "host elsewhere, process 1" in err
    assert set(s3.keys("out")) == {f"out/{LEASE_NAME}"}, "the refused run wrote nothing"


def test_lease_of_a_killed_run_is_taken_over(tmp_path, s3, local_run, capsys):
    source, model, expected = local_run
    s3.upload(source, "in")
    job = write_job(tmp_path / "job.yaml", _job(model, s3.uri("in"), s3.uri("out")))
    # A process of this host that is gone (pid 2**22 + 1 is above Linux's pid limit).
    dead = {"owner": "x", "host": socket.gethostname(), "pid": 2**22 + 1, "started": time.time()}
    s3.put(f"out/{LEASE_NAME}", json.dumps({**dead, "renewed": time.time()}).encode())
    assert cli.main(["run", str(job), "-q"]) == 0, capsys.readouterr().err
    assert _read(s3, "out").sort_by("id").to_pylist() == expected.to_pylist()
    assert f"out/{LEASE_NAME}" not in s3.keys("out")


def test_glob_on_the_store(s3, local_run, tmp_path):
    source, model, expected = local_run
    s3.upload(source, "in")
    s3.put("in/notes.txt", b"not an input")
    job = JobSpec.from_dict(_job(model, s3.uri("in/*.[cj]s*"), s3.uri("out")))
    summary = run_job(job, progress=False)
    assert summary.num_shards == 2  # b.csv and c.jsonl
    out = _read(s3, "out")
    assert out.column("id").to_pylist() == [3, 4, 5, 6]


def _run_refused(tmp_path: Path, capsys, job: dict) -> str:
    path = write_job(tmp_path / "job.yaml", job)
    code = cli.main(["run", str(path), "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def test_missing_credentials_and_buckets_exit_2_before_any_model(
    tmp_path, s3, local_run, capsys, monkeypatch
):
    source, model, _ = local_run
    s3.upload(source, "in")
    _refuse_models(monkeypatch)
    before = s3.keys()

    err = _run_refused(tmp_path, capsys, _job(model, s3.uri("in"), "s3://no-such-bucket/out"))
    assert "output.path" in err and "the bucket 'no-such-bucket' does not exist" in err

    err = _run_refused(tmp_path, capsys, _job(model, "s3://no-such-bucket/in", s3.uri("out")))
    assert "input.path" in err and "does not exist" in err

    err = _run_refused(
        tmp_path,
        capsys,
        _job(model, s3.uri("in"), s3.uri("out")) | {"model": s3.uri("models/none")},
    )
    assert "has no file or non-empty folder there" in err

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-the-key")
    err = _run_refused(tmp_path, capsys, _job(model, s3.uri("in"), s3.uri("out")))
    assert "input.path" in err and "ACCESS_DENIED" in err  # a HEAD's 403 has no body

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    err = _run_refused(tmp_path, capsys, _job(model, s3.uri("in"), s3.uri("out")))
    assert "input.path" in err and "ACCESS_DENIED" in err and "AWS_ACCESS_KEY_ID" in err
    err = _run_refused(tmp_path, capsys, _job(model, str(source), s3.uri("out")))
    assert "output.path" in err and "ACCESS_DENIED" in err

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env["AWS_SECRET_ACCESS_KEY"])
    assert s3.keys() == before, "a refused job wrote to the store"


def test_unreachable_store_exits_2(tmp_path, capsys, monkeypatch, local_run):
    source, model, _ = local_run
    _refuse_models(monkeypatch)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    err = _run_refused(tmp_path, capsys, _job(model, "s3://bucket/in", str(tmp_path / "out")))
    assert "input.path: s3://bucket/in" in err
    assert not (tmp_path / "out").exists()
