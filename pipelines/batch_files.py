"""The files of `batchlm run-batch`: input lines read as a stream, output lines written
whole.

Both take local paths or store URIs (`engine/loader/remote.py`). Input is read in blocks and
split into lines (compressed files by their extension: `.gz`, `.bz2`, `.zst`); output lines
go to a temporary file (or store object) that becomes the output only once every line is in:
a renamed file, or the store's copy of a complete object (`output_store.py`).

Example:
    >>> with OutputLines("s3://bucket/out.jsonl") as out:
    ...     for number, text in read_lines("s3://bucket/in.jsonl"):
    ...         out.write({"line": number})
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchlm.engine.loader.remote import is_remote, open_store

from .output_store import open_output_store

READ_BYTES = 1 << 20
"""Bytes read (and written) at a time."""
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""Compact JSON, as vLLM writes its lines (one encoder: `json.dumps` with options builds one
per call)."""


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """`(line number, line)` of every non-blank line of a local file or a store's file."""
    if is_remote(path):
        store = open_store(path)
        source = store.filesystem.open_input_stream(store.path)
    else:
        import pyarrow as pa

        source = pa.input_stream(path)  # decompresses by extension (.gz, .bz2, .zst)
    with source:
        rest = b""
        line_no = 0
        while True:
            block = source.read(READ_BYTES)
            if not block:
                break
            pieces = (rest + block).split(b"\n")
            rest = pieces.pop()
            for piece in pieces:
                line_no += 1
                if piece.strip():
                    yield line_no, piece
        if rest.strip():
            yield line_no + 1, rest


class OutputLines:
    """The output lines, written to a temporary file (or store object) that becomes the
    output only when every line is in."""

    def __init__(self, path: str) -> None:
        self.path = path
        text = path.rstrip("/")
        parent, _, self.name = text.rpartition("/")
        if not is_remote(text):
            parent = str(Path(text).expanduser().absolute().parent)
            self.name = Path(text).name
            Path(parent).mkdir(parents=True, exist_ok=True)
        self.store = open_output_store(parent)
        sink, self.temp = self.store.open_temp(self.name)
        self._file: Any = open(sink, "wb") if self.store.is_local else sink  # noqa: SIM115
        self._buffer: list[bytes] = []
        self._buffered = 0
        self.num_bytes = 0

    def write(self, line: dict[str, Any]) -> None:
        data = _ENCODER.encode(line).encode() + b"\n"
        self._buffer.append(data)
        self._buffered += len(data)
        if self._buffered >= READ_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._buffer:
            data = b"".join(self._buffer)
            self._file.write(data)
            self.num_bytes += len(data)
        self._buffer, self._buffered = [], 0

    def __enter__(self) -> OutputLines:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            with contextlib.suppress(Exception):
                self.store.delete(self.temp)
            return
        self._flush()
        self._file.close()
        self.store.publish(self.temp, self.name, self.num_bytes)


__all__ = ["OutputLines", "read_lines"]
