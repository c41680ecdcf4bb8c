"""Nothing lost, nothing twice: a job killed after its first shard resumes without
rewriting it; a finished job rewrites nothing; a changed job refuses to mix its output."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from batchlm.operators.fault_injection import FaultPlan
from batchlm.pipelines import cli
from batchlm.pipelines.output import MANIFEST_NAME

from .conftest import run_cli


def run_here(capsys, *args: str) -> tuple[int, str, str]:
    """The command in this process (same code path, no interpreter start-up)."""
    code = cli.main(["run", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def file_states(folder: Path) -> dict[str, tuple[int, int]]:
    """name → (inode, mtime_ns) of every visible file."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
        if not p.name.startswith(".")
    }


def test_kill_then_resume_then_nothing_to_do(embed_job: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    killed = run_cli("run", str(embed_job), env=FaultPlan(exit_after_shards=1).env())
    assert killed.returncode == 3, killed.stderr
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    assert parts == ["part-00000-a.parquet"]
    first = file_states(out)

    resumed = run_cli("run", str(embed_job))
    assert resumed.returncode == 0, resumed.stderr
    assert "2 of 3 shard(s) to run" in resumed.stderr
    assert "1 skipped" in resumed.stdout
    after = file_states(out)
    assert after["part-00000-a.parquet"] == first["part-00000-a.parquet"], "shard 0 rewritten"
    assert after[MANIFEST_NAME] == first[MANIFEST_NAME]
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]

    table = pq.read_table(out)
    ids = sorted(table.column("id").to_pylist())
    assert ids == list(range(12)), "every row exactly once"
    assert table.column("error").null_count == 12
    assert table.schema.field("embedding").type.list_size == 384

    code, stdout, stderr = run_here(capsys, str(embed_job))
    assert code == 0, stderr
    assert "0 of 3 shard(s) to run" in stderr
    assert "0 written, 3 skipped" in stdout and "rows in output 12" in " ".join(stdout.split())
    assert file_states(out) == after, "a finished job rewrote files"


def test_changed_job_refuses_then_overwrite_starts_over(embed_job: Path, tmp_path: Path, capsys):
    out = tmp_path / "out"
    code, _, stderr = run_here(capsys, str(embed_job), "-q")
    assert code == 0, stderr
    before = file_states(out)
    old_hash = json.loads((out / MANIFEST_NAME).read_text())["job_hash"]

    code, _, stderr = run_here(capsys, str(embed_job), "--set", "pooling_params.normalize=false")
    assert code == 2, stderr
    assert "holds results of a different job" in stderr
    assert old_hash in stderr and "config fingerprint" in stderr and "--overwrite" in stderr
    assert file_states(out) == before, "a refused job touched the output"

    args = ("-q", "--set", "pooling_params.normalize=false", "--overwrite")
    code, stdout, stderr = run_here(capsys, str(embed_job), *args)
    assert code == 0, stderr
    assert "3 written, 0 skipped" in stdout
    now = file_states(out)
    assert set(now) == set(before)
    # A rewritten file may reuse its predecessor's freed inode: compare (inode, mtime).
    assert all(now[name] != before[name] for name in now), "files were not rewritten"
    new_hash = json.loads((out / MANIFEST_NAME).read_text())["job_hash"]
    assert new_hash != old_hash
    assert pq.read_table(out).num_rows == 12


def test_changed_input_refuses(embed_job: Path, tmp_path: Path, capsys):
    code, _, stderr = run_here(capsys, str(embed_job), "-q")
    assert code == 0, stderr
    with open(tmp_path / "data" / "c.jsonl", "a") as f:
        f.write('{"id": 99, "text": "A late addition."}\n')
    code, _, stderr = run_here(capsys, str(embed_job), "-q")
    assert code == 2
    assert "the input files changed (input fingerprint" in stderr
