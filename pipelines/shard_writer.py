"""One shard's Parquet file being written, and the thread that commits finished shards.

`ShardWriter` gathers result batches into row groups and encodes each on a thread of its own
while the engine computes the next rows; `ShardCommitter` publishes whole shards (the
output folder's `commit_shard`) in the background, in order, one at a time. Where the bytes
go (a local temporary file, or a temporary object of a store) is the output folder's
business: a writer takes an open sink.

Example:
    >>> writer = ShardWriter(sink, schema, "zstd", "part-00000-a")
    >>> writer.write(table)
    >>> writer.close()
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq


class ShardPublisher(Protocol):
    """What commits or gives up a written shard (the output folder)."""

    def commit_shard(self, writer: ShardWriter) -> None: ...

    def abandon_shard(self, writer: ShardWriter) -> None: ...


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

    def __init__(self, out: ShardPublisher, on_commit: Callable[[], None]) -> None:
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

    def __init__(
        self,
        sink: Any,
        schema: pa.Schema,
        compression: str,
        name: str = "",
        temp_name: str = "",
    ) -> None:
        self.sink = sink
        """Where the bytes go: a local path, or a writable pyarrow stream (closed here)."""
        self.path = sink if isinstance(sink, (str, os.PathLike)) else None
        """The local file being written (None for a stream)."""
        self.name = name
        """The shard's name (its final file is `<name>.parquet`)."""
        self.temp_name = temp_name
        """The temporary file's name in the output folder, until the shard is committed."""
        self.schema = schema
        self.num_rows = 0
        self.num_bytes: int | None = None
        """The file's size once `close()` returned."""
        codec = None if compression == "none" else compression
        floats = float_columns(schema)
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            sink,
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
        and closes the file (and the stream it was written to)."""
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
            try:
                writer.close()
            finally:
                self._close_sink()

    def _close_sink(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.num_bytes = os.path.getsize(self.path)
            return
        self.num_bytes = self.sink.tell()
        self.sink.close()


__all__ = ["ShardCommitter", "ShardWriter", "float_columns", "ROW_GROUP_BYTES", "ROW_GROUP_ROWS"]
