"""Input files → shards: discovery, schemas (read without the data), planning and reading.

A shard is one input file, or, for a Parquet file with more rows than `rows_per_shard`, a
range of its row groups. Shards are ordered by path and named after their position and
source, so the same input always gives the same shard names and output file names.

Input may be local or on a store (`s3://bucket/prefix/`, a folder or a glob there, listed
on the store through `engine/loader/remote.py`); a store's files are read as streams, and
whatever the store says when it cannot be read (no credentials, no bucket) is a
`JobSpecError`, raised before any model loads.

Example:
    >>> files = find_input_files(InputSpec("conf/data/prompts"))
    >>> shards = plan_shards(files, rows_per_shard=None)
    >>> table = read_shard(shards[0])
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from batchlm.engine.loader.remote import (
    RemoteStoreError,
    StorePath,
    is_remote,
    list_files,
    open_store,
)

from .spec import InputSpec, JobSpecError

EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
}


@dataclass(frozen=True)
class InputFile:
    """One input file and what identifies its content (size and modification time)."""

    path: str
    """A local path, or the file's URI on a store."""
    format: str
    size: int
    mtime_ns: int
    store: StorePath | None = field(default=None, compare=False, repr=False)
    """Where a store's file is read from (None: a local file)."""


@dataclass(frozen=True)
class Shard:
    """A unit of work with its own output file; written completely or not at all."""

    index: int
    """Position in the job (shards are ordered by path, then row group)."""
    name: str
    """The output file's stem, e.g. `part-00003-reviews`; unique and stable."""
    file: InputFile
    row_groups: tuple[int, int] | None = None
    """Parquet: the half-open range of row groups; None: the whole file."""
    num_rows: int | None = None
    """Rows, known before reading (Parquet metadata, JSONL lines); None for CSV. Only for
    progress: the rows actually read are what the job counts."""


def find_input_files(spec: InputSpec) -> list[InputFile]:
    """The job's input files, sorted; raises `JobSpecError` when there are none."""
    if is_remote(spec.path):
        try:
            return _store_input_files(spec)
        except RemoteStoreError as e:
            raise JobSpecError(f"input.path: {e}") from None
    pattern = spec.path
    path = Path(pattern).expanduser()
    if path.is_file():
        paths = [path]
    elif path.is_dir():
        paths = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and not _hidden(p.relative_to(path))
            and (_format_of(p) == spec.format if spec.format != "auto" else _format_of(p))
        )
        if not paths:
            raise JobSpecError(
                f"input.path: folder {pattern!r} holds no "
                f"{'input' if spec.format == 'auto' else spec.format} files "
                f"({', '.join(sorted(EXTENSIONS))})"
            )
    elif glob.has_magic(pattern):
        paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
        paths = [p for p in paths if p.is_file()]
        if not paths:
            raise JobSpecError(f"input.path: the glob {pattern!r} matches no files")
    else:
        raise JobSpecError(
            f"input.path: {pattern!r} does not exist (relative paths start from the current "
            f"directory, {os.getcwd()})"
        )
    files = []
    for p in paths:
        fmt = spec.format if spec.format != "auto" else _format_of(p)
        if fmt is None:
            raise JobSpecError(
                f"input.path: cannot tell the format of {str(p)!r} from its extension; "
                "set input.format to parquet, jsonl or csv"
            )
        stat = p.stat()
        files.append(InputFile(str(p), fmt, stat.st_size, stat.st_mtime_ns))
    return files


def _store_input_files(spec: InputSpec) -> list[InputFile]:
    """The input files of a store URI: one file, a folder's files (recursively), or a glob's
    matches (`*` within a name, `**` across folders), listed on the store."""
    uri = spec.path
    head, _, rest = uri.partition("://")
    if glob.has_magic(rest):
        parts = rest.split("/")
        static = next(i for i, part in enumerate(parts) if glob.has_magic(part))
        root = open_store(f"{head}://{'/'.join(parts[:static])}")
        tail = "/".join(parts[static:])
        from fsspec.utils import glob_translate

        pattern = re.compile(glob_translate(f"{root.path.rstrip('/')}/{tail}"))
        infos = [i for i in list_files(root) if pattern.match(i.path)]
        found = [(root, i) for i in infos]
        if not found:
            raise JobSpecError(f"input.path: the glob {uri!r} matches no files")
    else:
        store = open_store(uri)
        info = store.info()
        import pyarrow.fs as pafs

        if info.type == pafs.FileType.File:
            found = [(store, info)]
        elif info.type == pafs.FileType.Directory:
            prefix = store.path.rstrip("/") + "/"
            found = [
                (store, i)
                for i in list_files(store)
                if not _hidden(Path(i.path[len(prefix) :]))
                and (
                    _format_of(Path(i.path)) == spec.format
                    if spec.format != "auto"
                    else _format_of(Path(i.path))
                )
            ]
            if not found:
                raise JobSpecError(
                    f"input.path: folder {uri!r} holds no "
                    f"{'input' if spec.format == 'auto' else spec.format} files "
                    f"({', '.join(sorted(EXTENSIONS))})"
                )
        else:
            raise JobSpecError(f"input.path: {uri!r} does not exist on the store")
    files = []
    for store, info in found:
        relative = info.path[len(store.path.rstrip("/")) + 1 :] if info.path != store.path else ""
        where = store.child(relative) if relative else store
        fmt = spec.format if spec.format != "auto" else _format_of(Path(info.path))
        if fmt is None:
            raise JobSpecError(
                f"input.path: cannot tell the format of {where.uri!r} from its extension; "
                "set input.format to parquet, jsonl or csv"
            )
        mtime = int(info.mtime_ns) if info.mtime_ns is not None else 0
        files.append(InputFile(where.uri, fmt, int(info.size), mtime, where))
    return files


def _random_access(file: InputFile) -> Any:
    """What pyarrow reads a Parquet file from: its path, or a store's seekable file."""
    if file.store is None:
        return file.path
    return file.store.filesystem.open_input_file(file.store.path)


def _stream(file: InputFile) -> Any:
    """What pyarrow reads a CSV / JSONL file from: its path, or a store's stream."""
    if file.store is None:
        return file.path
    return file.store.filesystem.open_input_stream(file.store.path)


def read_schema(file: InputFile) -> pa.Schema:
    """The file's schema, from its footer (Parquet) or its first block (JSONL, CSV)."""
    try:
        if file.format == "parquet":
            return pq.read_schema(_random_access(file))
        if file.format == "csv":
            with pa_csv.open_csv(_stream(file)) as reader:
                return reader.schema
        with pa_json.open_json(_stream(file)) as reader:
            return reader.schema
    except (pa.ArrowInvalid, OSError) as e:
        raise JobSpecError(f"input: cannot read {file.path!r} as {file.format}: {e}") from None


def plan_shards(files: list[InputFile], rows_per_shard: int | None) -> list[Shard]:
    """Shards in a stable order, one per file or per range of Parquet row groups."""
    shards: list[Shard] = []
    stems = [_safe_stem(f.path) for f in files]
    for file, stem in zip(files, stems, strict=True):
        ranges: list[tuple[tuple[int, int] | None, int | None]] = [(None, None)]
        if file.format == "jsonl" and file.store is None:  # a store's file is read once
            ranges = [(None, _count_lines(file.path))]
        if file.format == "parquet":
            meta = pq.ParquetFile(_random_access(file)).metadata
            ranges = [(None, meta.num_rows)]
            if rows_per_shard and meta.num_rows > rows_per_shard:
                ranges = [(r, n) for r, n in _row_group_ranges(meta, rows_per_shard)]
        for row_groups, num_rows in ranges:
            suffix = "" if row_groups is None else f"-rg{row_groups[0]:05d}"
            name = f"part-{len(shards):05d}-{stem}{suffix}"
            shards.append(Shard(len(shards), name, file, row_groups, num_rows))
    return shards


def _row_group_ranges(
    meta: pq.FileMetaData, rows_per_shard: int
) -> list[tuple[tuple[int, int], int]]:
    """Consecutive row groups gathered until each range holds at least `rows_per_shard`."""
    out = []
    start, rows = 0, 0
    for i in range(meta.num_row_groups):
        rows += meta.row_group(i).num_rows
        if rows >= rows_per_shard or i == meta.num_row_groups - 1:
            out.append(((start, i + 1), rows))
            start, rows = i + 1, 0
    return out


def read_shard(shard: Shard) -> pa.Table:
    """The shard's rows (all columns)."""
    file = shard.file
    if file.format == "parquet":
        pf = pq.ParquetFile(_random_access(file))
        if shard.row_groups is None:
            return pf.read()
        return pf.read_row_groups(list(range(*shard.row_groups)))
    if file.format == "csv":
        return pa_csv.read_csv(_stream(file))
    return pa_json.read_json(_stream(file))


def input_fingerprint(spec: InputSpec, files: list[InputFile]) -> str:
    """What identifies the job's input: the files (path, size, mtime) and how they shard."""
    data = {
        "files": [
            {
                "path": f.path if f.store is not None else str(Path(f.path).resolve()),
                "format": f.format,
                "size": f.size,
                "mtime_ns": f.mtime_ns,
            }
            for f in files
        ],
        "rows_per_shard": spec.rows_per_shard,
    }
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _count_lines(path: str) -> int:
    """Non-blank lines of a JSONL file: its row count, for the progress bar only."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _format_of(path: Path) -> str | None:
    return EXTENSIONS.get(path.suffix.lower())


def _hidden(relative: Path) -> bool:
    return any(part.startswith((".", "_")) for part in relative.parts)


def _safe_stem(path: str) -> str:
    stem = Path(path).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem)[:48] or "input"


__all__ = [
    "InputFile",
    "Shard",
    "find_input_files",
    "read_schema",
    "plan_shards",
    "read_shard",
    "input_fingerprint",
]
