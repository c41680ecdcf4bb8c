"""The output folder: one Parquet file per shard, written atomically, and the job manifest.

Invariants that make a crashed job resumable without losing or repeating rows, in a local
folder as on a store (`output_store.py` says how each keeps them):
- a shard's file appears under its final name only complete, from a hidden temporary file
  or object that was written whole first;
- `_batchlm_manifest.json` (also written whole) records the job hash; a folder whose
  manifest names another hash is never written into, unless the caller asks to start over;
- one run at a time writes a folder: a lock (local) or a lease (stores); a run that finds
  every shard written takes neither and writes nothing.

Readers skip names starting with `_` or `.`, so `pyarrow.parquet.read_table(folder)` sees
exactly the finished shards.

Example:
    >>> out = OutputFolder("s3://bucket/results/job1", manifest)
    >>> out.prepare(overwrite=False)
    >>> out.claim()    # before the first shard is written
    >>> with out.shard_writer("part-00000-a", schema) as writer:
    ...     writer.write(table)
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchlm.engine.loader.remote import RemoteStoreError

from .lease import LeaseHeldError
from .output_store import LOCK_NAME, TMP_PREFIX, LockedError, open_output_store, write_atomic
from .shard_writer import ShardCommitter, ShardWriter

MANIFEST_NAME = "_batchlm_manifest.json"
PART_PREFIX = "part-"


class OutputConflictError(RuntimeError):
    """The output folder holds something this job must not mix with or overwrite."""


class OutputNotWritableError(OutputConflictError):
    """The output folder cannot be created, locked or written (a read-only place, a path
    through a regular file, a full disk, a store that refuses): the job cannot start there."""


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
    """A job's output folder: the manifest check, the lock or lease, and atomic shard files.

    Args:
        path: A local folder or a store URI (`s3://bucket/prefix`).
        manifest: What `job_manifest` made for this job.
    """

    def __init__(self, path: str | os.PathLike[str], manifest: dict[str, Any]) -> None:
        try:
            self.store = open_output_store(path)
        except RemoteStoreError as e:
            raise OutputNotWritableError(str(e)) from None
        self.path: Path | str = self.store.path
        """The folder: a `Path`, or the store URI."""
        self.manifest = manifest
        self._done: set[str] | None = None  # part names, while the folder is prepared
        self._is_claimed = False

    def part_path(self, name: str) -> Path | str:
        """Where shard `name`'s file is (a path, or a URI)."""
        if isinstance(self.path, Path):
            return self.path / f"{name}.parquet"
        return f"{self.path}/{name}.parquet"

    def is_done(self, name: str) -> bool:
        if self.store.is_local:
            return Path(self.part_path(name)).exists()
        if self._done is None:
            self._done = self._part_names(self._names())
        return name in self._done

    def num_rows(self, name: str) -> int:
        """The rows of shard `name`'s file (read from its footer)."""
        return self._guarded(lambda: self.store.num_rows(f"{name}.parquet"))

    def prepare(self, overwrite: bool) -> None:
        """Opens the folder (locally: creates and locks it) and checks its earlier output;
        with `overwrite`, claims it and deletes that output first.

        Raises:
            OutputConflictError: another job's output is there, files batchlm did not
                write are there, or another process writes the folder.
            OutputNotWritableError: the folder cannot be created, read or written.
        """
        self._guarded(self.store.open)
        try:
            if overwrite or self.store.is_local:  # a local folder is locked from the start
                self._take()
            if overwrite:
                self._clear()
            names = self._check()
            if self._is_claimed:
                self._settle(names)
        except BaseException:
            self.close()
            raise

    def claim(self) -> None:
        """Takes the folder for writing (a store's lease; a local folder is locked already),
        checks it again, removes temporary files of killed runs and writes the manifest."""
        if self._is_claimed:
            return
        self._take()
        self._settle(self._check())

    def _take(self) -> None:
        self._guarded(self.store.claim)
        self._is_claimed = True

    def _settle(self, names: list[str]) -> None:
        for name in names:
            if name.startswith(TMP_PREFIX):  # left by a killed run; no one else is writing
                self._guarded(lambda n=name: self.store.delete(n))
        if MANIFEST_NAME not in names:
            text = json.dumps(self.manifest, indent=2, default=str) + "\n"
            if isinstance(self.path, Path):
                self._guarded(lambda: _write_atomic(Path(self.path) / MANIFEST_NAME, text))
            else:
                self._guarded(lambda: self.store.write_text(MANIFEST_NAME, text))

    def close(self) -> None:
        """Releases the lock or lease (a lock is also released if the process dies)."""
        self.store.close()
        self._is_claimed = False

    def _guarded(self, fn: Any) -> Any:
        """`fn()`, with the store's failures as the output folder's errors."""
        try:
            return fn()
        except LockedError as e:
            raise OutputConflictError(str(e)) from None
        except LeaseHeldError as e:
            raise OutputConflictError(str(e)) from None
        except RemoteStoreError as e:
            raise OutputNotWritableError(str(e)) from None
        except OSError as e:
            raise OutputNotWritableError(self._unwritable_message(e)) from None

    def _unwritable_message(self, error: OSError) -> str:
        where = f" ({error.filename})" if error.filename else ""
        return (
            f"cannot write to output folder {str(self.path)!r}: {error.strerror or error}{where}; "
            "pass a folder this process can create and write (no part of its path may be "
            "a regular file)"
        )

    def _names(self) -> list[str]:
        return self._guarded(self.store.names)

    @staticmethod
    def _part_names(names: list[str]) -> set[str]:
        return {n.removesuffix(".parquet") for n in names if _is_part(n)}

    def _clear(self) -> None:
        for name in self._names():
            if _is_part(name) or name == MANIFEST_NAME:
                self._guarded(lambda n=name: self.store.delete(n))

    def _check(self) -> list[str]:
        """Checks the folder's content against this job; returns its file names."""
        names = self._names()
        old = self._read_manifest()
        foreign = [n for n in names if not n.startswith((".", "_")) and not _is_part(n)]
        if foreign:
            shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise OutputConflictError(
                f"output folder {str(self.path)!r} holds files batchlm did not write ({shown}); "
                "use an empty or new folder"
            )
        parts = self._part_names(names)
        if old is None and parts:
            raise OutputConflictError(
                f"output folder {str(self.path)!r} holds {len(parts)} part file(s) but no "
                f"{MANIFEST_NAME}, so their job is unknown; pass --overwrite to delete them "
                "and start over, or use another folder"
            )
        if old is not None and old.get("job_hash") != self.manifest["job_hash"]:
            raise OutputConflictError(self._conflict_message(old))
        self._done = parts
        return names

    def _read_manifest(self) -> dict[str, Any] | None:
        text = self._guarded(lambda: self.store.read_text(MANIFEST_NAME))
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            where = f"{self.store.display.rstrip('/')}/{MANIFEST_NAME}"
            raise OutputConflictError(
                f"{where!r} is not valid JSON ({e.msg}); pass --overwrite to start over"
            ) from None

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
        self.claim()
        sink, temp = self._guarded(lambda: self.store.open_temp(f"{name}.parquet"))
        return ShardWriter(sink, schema, compression, name, temp)

    def commit_shard(self, writer: ShardWriter) -> None:
        """Writes the shard's last rows and gives its whole file the final name; on any
        failure the temporary file is removed and the error raised."""
        try:
            writer.close()
            final = f"{writer.name}.parquet"
            self._guarded(lambda: self.store.publish(writer.temp_name, final, writer.num_bytes))
        except BaseException:
            self.abandon_shard(writer)
            raise
        if self._done is not None:
            self._done.add(writer.name)

    def abandon_shard(self, writer: ShardWriter) -> None:
        """Gives up the shard's temporary file (the rows it holds are written again by the
        next run)."""
        try:
            writer.close(flush=False)  # may fail too (a full disk): the file goes anyway
        finally:
            with contextlib.suppress(Exception):
                self.store.delete(writer.temp_name)


def _write_atomic(path: Path, text: str) -> None:
    """A local file (the manifest) written whole."""
    write_atomic(path, text)


def _is_part(name: str) -> bool:
    return name.startswith(PART_PREFIX) and name.endswith(".parquet")


__all__ = [
    "OutputFolder",
    "ShardCommitter",
    "ShardWriter",
    "OutputConflictError",
    "OutputNotWritableError",
    "job_manifest",
    "MANIFEST_NAME",
    "LOCK_NAME",
    "TMP_PREFIX",
]
