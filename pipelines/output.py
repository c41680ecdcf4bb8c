"""The output folder: one Parquet file per shard, written atomically, and the job manifest.

Invariants that make a crashed job resumable without losing or repeating rows:
- a shard's file appears under its final name only complete: it is written to a hidden
  temporary name in the same folder, flushed to disk, then renamed (atomic on POSIX);
- `_batchlm_manifest.json` (also written by rename) records the job hash; a folder whose
  manifest names another hash is never written into, unless the caller asks to start over;
- an exclusive lock on the folder keeps two processes from writing the same job at once.

Readers skip names starting with `_` or `.`, so `pyarrow.parquet.read_table(folder)` sees
exactly the finished shards.

Example:
    >>> out = OutputFolder("out/job", manifest)
    >>> out.prepare(overwrite=False)
    >>> with out.shard_writer("part-00000-a", schema) as writer:
    ...     writer.write(table)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST_NAME = "_batchlm_manifest.json"
LOCK_NAME = ".batchlm.lock"
PART_PREFIX = "part-"
TMP_PREFIX = ".tmp-"


class OutputConflictError(RuntimeError):
    """The output folder holds something this job must not mix with or overwrite."""


class OutputNotWritableError(OutputConflictError):
    """The output folder cannot be created, locked or written (a read-only place, a path
    through a regular file, a full disk): the job cannot start there."""


def job_manifest(
    config: dict[str, Any],
    config_fingerprint: str,
    input_fingerprint: str,
    inputs: dict[str, Any],
    shard_names: list[str],
) -> dict[str, Any]:
    """The manifest's content; `job_hash` joins the config and input fingerprints."""
    return {
        "format": "batchlm-job/1",
        "job_hash": f"{config_fingerprint}-{input_fingerprint}",
        "config_fingerprint": config_fingerprint,
        "input_fingerprint": input_fingerprint,
        "config": config,
        "input": inputs,
        "shards": shard_names,
    }


class OutputFolder:
    """A job's output folder: the manifest check, the lock, and atomic shard files."""

    def __init__(self, path: str | os.PathLike[str], manifest: dict[str, Any]) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self._lock_fd: int | None = None

    def part_path(self, name: str) -> Path:
        return self.path / f"{name}.parquet"

    def is_done(self, name: str) -> bool:
        return self.part_path(name).exists()

    def prepare(self, overwrite: bool) -> None:
        """Creates and locks the folder; checks (or, with `overwrite`, clears) earlier output.

        Raises:
            OutputConflictError: another job's output is there, files batchlm did not
                write are there, or another process holds the lock.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock()
        except OSError as e:
            raise OutputNotWritableError(self._unwritable_message(e)) from None
        try:
            self._check_and_clear(overwrite)
        except OSError as e:
            self.close()
            raise OutputNotWritableError(self._unwritable_message(e)) from None
        except BaseException:
            self.close()
            raise

    def _unwritable_message(self, error: OSError) -> str:
        where = f" ({error.filename})" if error.filename else ""
        return (
            f"cannot write to output folder {str(self.path)!r}: {error.strerror or error}{where}; "
            "pass a folder this process can create and write (no part of its path may be "
            "a regular file)"
        )

    def _check_and_clear(self, overwrite: bool) -> None:
        manifest_path = self.path / MANIFEST_NAME
        old = _read_manifest(manifest_path)
        foreign = sorted(
            p.name
            for p in self.path.iterdir()
            if not p.name.startswith((".", "_")) and not _is_part(p.name)
        )
        if foreign:
            shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise OutputConflictError(
                f"output folder {str(self.path)!r} holds files batchlm did not write ({shown}); "
                "use an empty or new folder"
            )
        parts = [p for p in self.path.iterdir() if _is_part(p.name)]
        if overwrite:
            for p in parts:
                p.unlink()
            manifest_path.unlink(missing_ok=True)
            old, parts = None, []
        if old is None and parts:
            raise OutputConflictError(
                f"output folder {str(self.path)!r} holds {len(parts)} part file(s) but no "
                f"{MANIFEST_NAME}, so their job is unknown; pass --overwrite to delete them "
                "and start over, or use another folder"
            )
        if old is not None and old.get("job_hash") != self.manifest["job_hash"]:
            raise OutputConflictError(self._conflict_message(old))
        for p in self.path.iterdir():
            if p.name.startswith(TMP_PREFIX):
                p.unlink()  # left by a killed run; the lock says no one else is writing
        if old is None:
            _write_atomic(manifest_path, json.dumps(self.manifest, indent=2, default=str) + "\n")

    def _conflict_message(self, old: dict[str, Any]) -> str:
        new = self.manifest
        changed = []
        if old.get("config_fingerprint") != new["config_fingerprint"]:
            changed.append(
                "the model, task, params or engine options changed (config fingerprint "
                f"{old.get('config_fingerprint')} -> {new['config_fingerprint']})"
            )
        if old.get("input_fingerprint") != new["input_fingerprint"]:
            changed.append(
                "the input files changed (input fingerprint "
                f"{old.get('input_fingerprint')} -> {new['input_fingerprint']})"
            )
        return (
            f"output folder {str(self.path)!r} holds results of a different job: job hash "
            f"{old.get('job_hash')} there, {new['job_hash']} now; {' and '.join(changed)}. "
            "Use another output path, or pass --overwrite to delete the old results and "
            "start over"
        )

    def _lock(self) -> None:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputConflictError(
                f"another batchlm process is writing to {str(self.path)!r}; wait for it or "
                "use another output path"
            ) from None
        self._lock_fd = fd

    def close(self) -> None:
        """Releases the lock (also released if the process dies)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextlib.contextmanager
    def shard_writer(
        self, name: str, schema: pa.Schema, compression: str = "zstd"
    ) -> Iterator[ShardWriter]:
        """Writes one shard's file; it appears under its final name only if the block
        finishes without an exception."""
        writer = self.open_shard(name, schema, compression)
        try:
            yield writer
        except BaseException:
            self.abandon_shard(writer)
            raise
        self.commit_shard(writer)

    def open_shard(self, name: str, schema: pa.Schema, compression: str = "zstd") -> ShardWriter:
        """A writer of shard `name`'s temporary file; `commit_shard` or `abandon_shard` ends
        it."""
        tmp = self.path / f"{TMP_PREFIX}{name}.parquet.{os.getpid()}"
        return ShardWriter(tmp, schema, compression, name)

    def commit_shard(self, writer: ShardWriter) -> None:
        """Writes the shard's last rows and renames its file to its final name, flushed to
        disk; on any failure the temporary file is removed and the error raised."""
        try:
            writer.close()
            _fsync(writer.path)
            os.replace(writer.path, self.part_path(writer.name))
            _fsync(self.path)
        except BaseException:
            self.abandon_shard(writer)
            raise

    def abandon_shard(self, writer: ShardWriter) -> None:
        """Gives up the shard's temporary file (the rows it holds are written again by the
        next run)."""
        try:
            writer.close(flush=False)  # may fail too (a full disk): the file goes anyway
        finally:
            writer.path.unlink(missing_ok=True)


class ShardCommitter:
    """Commits whole shards (`OutputFolder.commit_shard`) on a thread of its own, one at a
    time and in order, so that the last row group's compression, the flushes and the
    rename of one shard overlap the next shard's rows. `on_commit` runs on the caller's
    thread once a shard's file is in place; a failed commit raises from the next call.

    Example:
        >>> with ShardCommitter(out, on_commit) as committer:
        ...     committer.submit(writer)   # returns at once
        ...     committer.wait()           # the last shard is in place (or its error)
    """

    def __init__(self, out: OutputFolder, on_commit: Callable[[], None]) -> None:
        self._out = out
        self._on_commit = on_commit
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="batchlm-commit")
        self._in_flight: Future[None] | None = None

    def submit(self, writer: ShardWriter) -> None:
        """Commits `writer`'s shard in the background, after the shard before it."""
        try:
            self.wait()
        except BaseException:
            self._out.abandon_shard(writer)  # its rows are written again by the next run
            raise
        self._in_flight = self._thread.submit(self._out.commit_shard, writer)

    def wait(self) -> None:
        """Returns once the shard in flight, if any, is committed; raises its error."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()
            self._on_commit()

    def close(self) -> None:
        """Lets a commit in flight finish (a whole shard is kept even when the job fails
        after it); its error is dropped here, so call `wait` first on success."""
        self._thread.shutdown(wait=True)
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and in_flight.exception() is None:
            self._on_commit()

    def __enter__(self) -> ShardCommitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ROW_GROUP_BYTES = 64 << 20
"""Batches are gathered into row groups of about this many bytes (or `ROW_GROUP_ROWS`) before
they are written: one small row group per batch makes slow writes and slow readers."""

ROW_GROUP_ROWS = 1 << 20


def float_columns(schema: pa.Schema) -> set[str]:
    """The columns of floats, or of lists of floats (embeddings, probabilities, scores).

    They are written PLAIN, not dictionary-encoded: their values rarely repeat, so a
    dictionary is built only to be dropped. (`BYTE_STREAM_SPLIT` would compress 384-wide
    float32 embeddings 2.3x faster with zstd and 8 % smaller, but Spark's vectorized
    Parquet reader, cuDF and others do not read it.)
    """
    found = set()
    for field in schema:
        kind = field.type
        if pa.types.is_floating(kind) or (
            (pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind))
            and pa.types.is_floating(kind.value_type)
        ):
            found.add(field.name)
    return found


class ShardWriter:
    """Appends batches to one shard's temporary Parquet file, in the declared schema.

    Batches are gathered into row groups, and each row group is encoded and compressed on
    a thread of its own (Arrow releases the GIL there) while the engine computes the next
    rows; at most one row group is being written at a time. `num_rows` counts the rows
    handed in; all of them are in the file once `close()` returns.
    """

    def __init__(self, path: Path, schema: pa.Schema, compression: str, name: str = "") -> None:
        self.path = path
        """The file being written."""
        self.name = name
        """The shard's name (its final file is `<name>.parquet`)."""
        self.schema = schema
        self.num_rows = 0
        codec = None if compression == "none" else compression
        floats = float_columns(schema)
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            path,
            schema,
            compression=codec,
            use_dictionary=[f.name for f in schema if f.name not in floats],
        )
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._pending_bytes = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="batchlm-parquet")
        self._in_flight: Future[None] | None = None

    def write(self, table: pa.Table) -> None:
        if table.schema != self.schema:
            table = table.select(self.schema.names).cast(self.schema)
        assert self._writer is not None, "the shard is already closed"
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self._pending_bytes += table.nbytes
        self.num_rows += table.num_rows
        if self._pending_rows >= ROW_GROUP_ROWS or self._pending_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Hands the gathered batches to the writing thread as one row group (after the
        row group before it is written: a failed write raises here)."""
        self._wait()
        if self._pending and self._writer is not None:
            merged = pa.concat_tables(self._pending)
            writer = self._writer
            self._in_flight = self._thread.submit(
                writer.write_table, merged, row_group_size=merged.num_rows
            )
        self._pending, self._pending_rows, self._pending_bytes = [], 0, 0

    def _wait(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def close(self, flush: bool = True) -> None:
        """Writes the rows still gathered (unless `flush=False`: the file is being given up)
        and closes the file."""
        writer = self._writer
        if writer is None:
            return
        try:
            if flush:
                self._flush()
                self._wait()
            else:  # the row group in flight is given up with the file; its error too
                with contextlib.suppress(Exception):
                    self._wait()
        finally:
            self._writer = None
            self._pending = []
            self._thread.shutdown(wait=True)
            writer.close()


def _is_part(name: str) -> bool:
    return name.startswith(PART_PREFIX) and name.endswith(".parquet")


def _read_manifest(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise OutputConflictError(
            f"{str(path)!r} is not valid JSON ({e.msg}); pass --overwrite to start over"
        ) from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    """Flushes a file, or a folder's entries (so that a rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "OutputFolder",
    "ShardCommitter",
    "ShardWriter",
    "OutputConflictError",
    "OutputNotWritableError",
    "job_manifest",
    "MANIFEST_NAME",
]
