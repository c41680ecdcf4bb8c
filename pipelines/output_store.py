"""Where a job's output folder lives: a local folder, or a prefix of a store (`s3://...`).

Both stores give the output folder (`output.py`) the same few operations, each keeping a
file invisible under its final name until it is whole:

- `LocalStore`: a shard is written to a hidden temporary file in the folder, flushed to
  disk, then renamed (atomic on POSIX), and the folder's entry flushed; `flock` on a lock
  file keeps other processes out.
- `RemoteStore`: a shard is uploaded to a hidden temporary object, then copied by the store
  itself to its final key (`FileSystem.move`: S3's CopyObject, GCS's rewrite, a rename on
  HDFS), and its size checked there. The final key is only ever written by that one copy of
  a complete object: an upload cut short (a killed process, a failed stream, whose client may
  still complete it) leaves at most a hidden temporary object, removed by the next run. A
  lease object (`lease.py`) keeps concurrent runs apart, as stores have no file lock.

Example:
    >>> store = open_output_store("s3://bucket/results/job1")
    >>> store.open()
"""

from __future__ import annotations

import fcntl
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchlm.engine.loader.remote import RemoteStoreError, is_remote, open_store, store_error

from .lease import Lease

LOCK_NAME = ".batchlm.lock"
TMP_PREFIX = ".tmp-"
BUCKET_SCHEMES = ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "az")
"""Stores whose first path component is a bucket (or container) that must exist."""


def open_output_store(path: str | os.PathLike[str]) -> LocalStore | RemoteStore:
    """The store of an output folder: a local path or a URI."""
    text = os.fspath(path)
    return RemoteStore(text) if is_remote(text) else LocalStore(Path(text))


class LocalStore:
    """A local output folder."""

    is_local = True

    def __init__(self, path: Path) -> None:
        self.path = path
        self.display = str(path)
        self._lock_fd: int | None = None

    def open(self) -> None:
        """Creates the folder and takes its lock (other processes are refused)."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockedError(
                f"another batchlm process is writing to {self.display!r}; wait for it or "
                "use another output path"
            ) from None
        self._lock_fd = fd

    def claim(self) -> None:
        """Nothing more: `open` took the lock."""

    def check_claim(self) -> None:
        """The lock cannot be lost while the process lives."""

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def names(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir())

    def read_text(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        write_atomic(self.path / name, text)

    def delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def open_temp(self, name: str) -> tuple[Any, str]:
        """A sink for `name`'s content under a hidden temporary name, and that name."""
        temp = f"{TMP_PREFIX}{name}.{os.getpid()}"
        return self.path / temp, temp

    def publish(self, temp: str, name: str, num_bytes: int | None) -> None:
        """Gives the whole temporary file its final name, flushed to disk."""
        _fsync(self.path / temp)
        os.replace(self.path / temp, self.path / name)
        _fsync(self.path)

    def num_rows(self, name: str) -> int:
        return pq.read_metadata(self.path / name).num_rows


class LockedError(RuntimeError):
    """Another process writes the folder."""


class RemoteStore:
    """An output folder on a store: a prefix of keys."""

    is_local = False

    def __init__(self, uri: str) -> None:
        self.location = open_store(uri)
        self.path = self.location.uri
        self.display = self.location.uri
        self.lease = Lease(self)

    def open(self) -> None:
        """Checks that the store answers and the bucket exists; writes nothing."""
        loc = self.location
        if loc.scheme in BUCKET_SCHEMES:
            bucket = loc.path.split("/", 1)[0]
            info = _call(loc.uri, "reading", loc.filesystem.get_file_info, bucket)
            if info.type == pafs.FileType.NotFound:
                raise RemoteStoreError(
                    f"{loc.uri}: the bucket {bucket!r} does not exist; create it first "
                    "(batchlm never creates buckets) or fix the output path"
                )
        self.names()

    def claim(self) -> None:
        """Takes the lease (another run writing here is refused)."""
        self.lease.acquire()

    def check_claim(self) -> None:
        self.lease.check()

    def close(self) -> None:
        self.lease.release()

    def names(self) -> list[str]:
        """The files directly in the folder."""
        loc = self.location
        selector = pafs.FileSelector(loc.path, allow_not_found=True)
        infos = _call(loc.uri, "listing", loc.filesystem.get_file_info, selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def read_text(self, name: str) -> str | None:
        loc = self.location.child(name)
        info = _call(loc.uri, "reading", loc.filesystem.get_file_info, loc.path)
        if info.type == pafs.FileType.NotFound:
            return None
        with _call(loc.uri, "reading", loc.filesystem.open_input_stream, loc.path) as f:
            return f.read().decode()

    def write_text(self, name: str, text: str) -> None:
        """One upload of the whole text (an object appears only once complete)."""
        loc = self.location.child(name)
        data = text.encode()
        with _call(loc.uri, "writing", loc.filesystem.open_output_stream, loc.path) as out:
            out.write(data)

    def delete(self, name: str) -> None:
        loc = self.location.child(name)
        try:
            loc.filesystem.delete_file(loc.path)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise store_error(loc.uri, e, "deleting") from None

    def open_temp(self, name: str) -> tuple[Any, str]:
        """An upload stream of a hidden temporary object for `name`, and its name (unique
        across hosts and processes)."""
        temp = f"{TMP_PREFIX}{name}.{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        loc = self.location.child(temp)
        return _call(loc.uri, "writing", loc.filesystem.open_output_stream, loc.path), temp

    def publish(self, temp: str, name: str, num_bytes: int | None) -> None:
        """Copies the complete temporary object to its final key (the store's own copy),
        checks the size there and deletes the temporary object."""
        self.lease.check()
        source, target = self.location.child(temp), self.location.child(name)
        fs = self.location.filesystem
        try:
            fs.move(source.path, target.path)
        except NotImplementedError:  # Azure without a hierarchical namespace
            _call(target.uri, "copying", fs.copy_file, source.path, target.path)
            self.delete(temp)
        except Exception as e:  # noqa: BLE001
            raise store_error(target.uri, e, "publishing") from None
        info = _call(target.uri, "reading", fs.get_file_info, target.path)
        if num_bytes is not None and info.size != num_bytes:
            self.delete(name)
            raise RemoteStoreError(
                f"{target.uri}: the store holds {info.size} bytes after the copy, but "
                f"{num_bytes} were written; the shard was removed and runs again next time"
            )

    def num_rows(self, name: str) -> int:
        loc = self.location.child(name)
        with _call(loc.uri, "reading", loc.filesystem.open_input_file, loc.path) as f:
            return pq.read_metadata(f).num_rows


def _call(uri: str, doing: str, fn: Any, *args: Any) -> Any:
    """`fn(*args)`, a store's errors raised as `RemoteStoreError`s naming `uri`."""
    try:
        return fn(*args)
    except RemoteStoreError:
        raise
    except Exception as e:  # noqa: BLE001 - each client raises its own kinds
        raise store_error(uri, e, doing) from None


def write_atomic(path: Path, text: str) -> None:
    """Writes a local file whole: a temporary file, flushed, renamed, the folder flushed."""
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
    "LocalStore",
    "LockedError",
    "RemoteStore",
    "open_output_store",
    "write_atomic",
    "TMP_PREFIX",
]
