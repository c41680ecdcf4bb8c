"""Pipeline faults: a job killed at any point and resumed writes every row exactly once;
readers never see a partial file; an unwritable output or a full disk fails clearly and
leaves nothing that claims work not done."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchlm.operators.fault_injection import FaultPlan
from batchlm.pipelines import cli
from batchlm.pipelines import output as output_module
from batchlm.pipelines.output import MANIFEST_NAME, TMP_PREFIX

from ..pipelines.conftest import REPO

NUM_SHARDS, ROWS_PER_SHARD, BATCH_SIZE = 3, 4, 2


def _rows(shard: int) -> list[dict]:
    words = ["copper", "violet", "granite", "harbor"]
    return [
        {"id": shard * ROWS_PER_SHARD + i, "prompt": f"Shard {shard} row {i}: the {words[i]} gate"}
        for i in range(ROWS_PER_SHARD)
    ]


def _write_job(folder: Path, model: str, output: Path) -> Path:
    data = folder / "data"
    data.mkdir(parents=True)
    for shard in range(NUM_SHARDS):
        lines = "".join(json.dumps(r) + "\n" for r in _rows(shard))
        (data / f"s{shard}.jsonl").write_text(lines)
    job = {
        "input": str(data),
        "task": "generate",
        "model": model,
        "engine": {"max_model_len": 64},
        "sampling_params": {"temperature": 0, "max_tokens": 3},
        "output": str(output),
        "batch_size": BATCH_SIZE,
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> pa.Table:
    """The output of the same job run once without faults, sorted by id."""
    folder = tmp_path_factory.mktemp("reference")
    job = _write_job(folder, model_dir, folder / "out")
    assert cli.main(["run", str(job), "-q"]) == 0
    table = pq.read_table(folder / "out").sort_by("id")
    assert table.num_rows == NUM_SHARDS * ROWS_PER_SHARD
    return table


def _visible(folder: Path) -> list[Path]:
    """What a reader of the folder sees: names starting with "." or "_" are skipped."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith((".", "_")))


def _parts(folder: Path) -> list[str]:
    return [p.name for p in _visible(folder)]


def _check_readable(folder: Path) -> None:
    """Every visible file is a whole Parquet file with whole shards; the manifest is JSON."""
    for path in _visible(folder):
        table = pq.read_table(path)
        assert table.num_rows == ROWS_PER_SHARD, f"{path.name} has {table.num_rows} rows"
    manifest = folder / MANIFEST_NAME
    if manifest.exists():
        json.loads(manifest.read_text())


def _killed_run(job: Path, folder: Path, plan: FaultPlan) -> None:
    """The job in a subprocess that `plan` ends abruptly; the folder is read all along."""
    env = {**os.environ, **plan.env()}
    cmd = [sys.executable, "-m", "batchlm.pipelines", "run", str(job), "-q"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    num_reads = 0
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the job did not end"
        try:
            _check_readable(folder)
        except FileNotFoundError:  # renamed away (a temporary file) between list and read
            continue
        num_reads += 1
        time.sleep(0.02)
    _, stderr = proc.communicate()
    assert proc.returncode == 3, stderr  # the hook's exit, not a failure
    _check_readable(folder)
    assert num_reads > 0


def _states(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in _visible(folder)}


def _assert_complete(folder: Path, reference: pa.Table) -> None:
    table = pq.read_table(folder).sort_by("id")
    assert table.column("id").to_pylist() == list(range(NUM_SHARDS * ROWS_PER_SHARD)), (
        "every row exactly once"
    )
    assert table.equals(reference.select(table.column_names)), "resumed output differs"
    assert not [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_killed_before_mid_and_between_shards_then_resumed(tmp_path, capsys, model_dir, reference):
    out = tmp_path / "out"
    job = _write_job(tmp_path, model_dir, out)
    names = [f"part-0000{i}-s{i}.parquet" for i in range(NUM_SHARDS)]

    # 1. Killed as the first batch arrives: no shard written.
    _killed_run(job, out, FaultPlan(exit_after_batches=0))
    assert _parts(out) == []
    assert (out / MANIFEST_NAME).exists()

    # 2. Resumed, killed mid-shard 1: no shard but 0 can be there. Shard 0's commit runs in
    # the background while shard 1's rows arrive, so the kill may have come before it.
    _killed_run(job, out, FaultPlan(exit_after_batches=3))
    assert _parts(out) in (names[:1], [])
    assert [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX + "part-00001")]
    kept = _states(out)

    # 3. Resumed, killed right after its first commit: one more shard, the others untouched.
    _killed_run(job, out, FaultPlan(exit_after_shards=1))
    assert _parts(out) == names[: len(kept) + 1]
    assert {k: v for k, v in _states(out).items() if k in kept} == kept, "a shard was rewritten"
    kept = _states(out)

    # 4. Resumed to the end: only the shards not yet there run.
    assert cli.main(["run", str(job), "-q"]) == 0
    captured = capsys.readouterr()
    left = NUM_SHARDS - len(kept)
    assert f"{left} of 3 shard(s) to run" in captured.err
    assert f"{left} written, {len(kept)} skipped" in captured.out
    assert {k: v for k, v in _states(out).items() if k in kept} == kept
    _assert_complete(out, reference)


# ---- an output that cannot be written ---------------------------------------------------------


def _chmod_blocks_writes(folder: Path) -> bool:
    probe = folder / "probe"
    try:
        probe.write_text("x")
    except PermissionError:
        return True
    probe.unlink()
    return False  # root, or a filesystem that ignores the mode


@pytest.mark.parametrize("where", ["read-only-folder", "path-through-a-file"])
def test_unwritable_output_is_a_clear_error_and_writes_nothing(where, tmp_path, capsys, model_dir):
    if where == "read-only-folder":
        out = tmp_path / "locked"
        out.mkdir()
        out.chmod(0o555)
        if not _chmod_blocks_writes(out):
            out.chmod(0o755)
            pytest.skip("running as root: a read-only mode does not block writes")
        expected = "Permission denied"
    else:
        (tmp_path / "report.txt").write_text("a file, not a folder")
        out = tmp_path / "report.txt" / "out"
        expected = "Not a directory"
    job = _write_job(tmp_path, model_dir, out)
    try:
        code = cli.main(["run", str(job), "-q"])
    finally:
        if out.is_dir():
            out.chmod(0o755)
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"cannot write to output folder {str(out)!r}" in err and expected in err, err
    assert "Traceback" not in err
    assert not (out / MANIFEST_NAME).exists()
    assert _parts(out) == []


# ---- a full disk ------------------------------------------------------------------------------


class FullDisk:
    """Makes the output's writes fail with ENOSPC from the `after`-th batch on, and the
    closes of the shards that saw it (or, with `close_of`, the commit of that shard alone,
    which runs in the background)."""

    def __init__(self, monkeypatch, after: int | None, close_of: str | None = None) -> None:
        self.after, self.num_writes = after, 0
        self.hit: set[int] = set()
        real_write = output_module.ShardWriter.write
        real_close = output_module.ShardWriter.close
        disk = self

        def write(writer, table):
            disk.num_writes += 1
            if disk.is_full:
                disk.hit.add(id(writer))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_write(writer, table)

        def close(writer, flush=True):
            real_close(writer, flush)  # the file handle is released either way
            if id(writer) in disk.hit or (flush and writer.name == close_of):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(output_module.ShardWriter, "write", write)
        monkeypatch.setattr(output_module.ShardWriter, "close", close)

    @property
    def is_full(self) -> bool:
        return self.after is not None and self.num_writes > self.after


def test_full_disk_mid_job_fails_clearly_and_resumes(
    monkeypatch, tmp_path, capsys, model_dir, reference
):
    out = tmp_path / "out"
    job = _write_job(tmp_path, model_dir, out)
    FullDisk(monkeypatch, after=3)  # shard 0 fits, shard 1 does not
    code = cli.main(["run", str(job), "-q"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "No space left on device" in captured.err
    assert "rows written" not in captured.out, "a summary for a failed job"
    assert _parts(out) == ["part-00000-s0.parquet"]
    _check_readable(out)
    assert not [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    monkeypatch.undo()

    assert cli.main(["run", str(job), "-q"]) == 0
    captured = capsys.readouterr()
    assert "2 of 3 shard(s) to run" in captured.err
    assert json.loads((out / MANIFEST_NAME).read_text()) == manifest
    _assert_complete(out, reference)


def test_failed_background_commit_fails_the_job_and_resumes(
    monkeypatch, tmp_path, capsys, model_dir, reference
):
    """A shard's last row group and rename run while the next shard's rows arrive; when
    that commit fails, the job fails with its error, the shards before it stay, and the
    shard after it is given up whole (no temporary file left) and written by the rerun."""
    out = tmp_path / "out"
    job = _write_job(tmp_path, model_dir, out)
    FullDisk(monkeypatch, after=None, close_of="part-00001-s1")
    code = cli.main(["run", str(job), "-q"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "No space left on device" in captured.err
    assert _parts(out) == ["part-00000-s0.parquet"]
    _check_readable(out)
    assert not [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]
    monkeypatch.undo()

    assert cli.main(["run", str(job), "-q"]) == 0
    assert "2 of 3 shard(s) to run" in capsys.readouterr().err
    _assert_complete(out, reference)


def test_full_disk_before_the_manifest_leaves_no_manifest(monkeypatch, tmp_path, capsys, model_dir):
    out = tmp_path / "out"
    job = _write_job(tmp_path, model_dir, out)

    def no_space(path, text):
        path.with_name(TMP_PREFIX + path.name).write_text(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(output_module, "_write_atomic", no_space)
    code = cli.main(["run", str(job), "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "No space left on device" in err and str(out) in err
    assert not (out / MANIFEST_NAME).exists(), "a manifest for a job that never started"
    assert _parts(out) == []
    monkeypatch.undo()
    assert cli.main(["run", str(job), "-q"]) == 0
    capsys.readouterr()
    assert len(_parts(out)) == NUM_SHARDS
    assert not [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]
