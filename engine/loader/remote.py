"""Files on object stores and remote file systems: `s3://`, `gs://`, `abfs://`, `hdfs://`, and
any URL an fsspec implementation serves.

One place decides how a URI becomes a file system, for the engine (`LLM(model="s3://...")`)
and for the jobs of `batchlm.pipelines` (their input and output), so both accept the same
URIs and read the same credentials:

- `open_store(uri)`: pyarrow's own file system where pyarrow has one for the scheme (S3, GCS,
  Azure with the account in the URI, HDFS), else fsspec's (`memory://`, `abfs://container/...`
  with the account from the environment, ...) behind pyarrow's interface. Credentials,
  regions and endpoints come from each system's standard environment, read by its client
  (S3: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_PROFILE`,
  `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`; GCS: `GOOGLE_APPLICATION_CREDENTIALS`; Azure:
  `AZURE_STORAGE_ACCOUNT_NAME` / `_KEY` / `AZURE_STORAGE_CONNECTION_STRING` or a service
  principal; HDFS: `HADOOP_HOME`, `CLASSPATH`). Errors are `RemoteStoreError`s that quote
  the store's own message and say which settings it reads.
- `fetch_model(uri)`: a model folder (or one file, such as a `.gguf`) copied once into
  `$BATCHLM_CACHE_DIR/remote/`. Each file is fetched under a `.partial` name, its size checked
  against the store's listing, then renamed; the folder counts as complete only once every
  file is in place and the state file says so. A download cut short resumes where its
  partial files end (restarts them if the store's listing changed). A file lock makes the
  processes of one machine (Spark workers, Ray actors) download once, the others waiting.

Client libraries are imported when a URI needs them, with an error naming what to install.

Example:
    >>> store = open_store("s3://bucket/models/tiny")
    >>> fetch_model("s3://bucket/models/tiny").path
    PosixPath('/home/me/.cache/batchlm/remote/tiny-3f2a9c0d1e4b5a6c')
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import envs
from ..errors import ModelNotFoundError

__all__ = [
    "DownloadReport",
    "RemoteStoreError",
    "StorePath",
    "download_model",
    "fetch_model",
    "is_remote",
    "list_files",
    "open_store",
    "store_error",
    "uri_scheme",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PYARROW_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs")
"""Schemes pyarrow serves with file systems of its own; others go to fsspec."""
STATE_NAME = ".batchlm-download.json"
"""In a downloaded folder: its URI, the store's listing it was made from, and whether it is
complete."""
PARTIAL_SUFFIX = ".partial"
CHUNK_BYTES = 8 << 20
"""Bytes read from the store per request while downloading."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
CONFIG_ONLY_MAX_WEIGHT_BYTES = 16 << 20
"""`config_only` copies skip weight files at least this big (small ones, such as a
sentence-transformers `Dense` module, stay)."""


class RemoteStoreError(OSError):
    """A store cannot be reached, or refuses (missing credentials, no such bucket, no
    permission); the message names the URI, quotes the store and says what it reads."""


def uri_scheme(text: str) -> str | None:
    """The scheme of `text` (`s3` of `s3://bucket/key`), lower-cased; None for a plain path."""
    match = _SCHEME.match(text.strip())
    return match.group(1).lower() if match else None


def is_remote(text: str | os.PathLike[str]) -> bool:
    """Whether `text` is a URI of a store other than the local disk (`file://` is local)."""
    scheme = uri_scheme(os.fspath(text))
    return scheme is not None and scheme != "file"


@dataclass(frozen=True)
class StorePath:
    """A location on a file system: pyarrow's interface, whatever serves the scheme."""

    filesystem: Any
    """A `pyarrow.fs.FileSystem` (fsspec ones wrapped in `pyarrow.fs.PyFileSystem`)."""
    path: str
    """The location inside `filesystem` (`bucket/key` for object stores)."""
    uri: str
    """The URI as the user wrote it, without a trailing slash: for messages and manifests."""

    @property
    def scheme(self) -> str:
        return uri_scheme(self.uri) or "file"

    def child(self, name: str) -> StorePath:
        """The location `name` (a relative, `/`-separated path) below this one."""
        return StorePath(
            self.filesystem, f"{self.path.rstrip('/')}/{name}", f"{self.uri.rstrip('/')}/{name}"
        )

    def info(self) -> Any:
        """The store's `FileInfo` of this location (type `NotFound` when absent)."""
        try:
            return self.filesystem.get_file_info(self.path)
        except Exception as e:  # noqa: BLE001 - every client raises its own kinds
            raise store_error(self.uri, e, "reading") from None


def open_store(uri: str) -> StorePath:
    """The file system serving `uri` and the location inside it.

    Raises:
        RemoteStoreError: no installed library serves the scheme (the message says what to
            install), or the store's client cannot be set up (e.g. HDFS without Java).
    """
    text = uri.strip().rstrip("/") if uri.strip() not in ("", "/") else uri.strip()
    scheme = uri_scheme(text)
    if scheme is None:
        raise ValueError(f"{uri!r} is not a URI (scheme://...)")
    import pyarrow.fs as pafs

    pyarrow_error: Exception | None = None
    try:
        filesystem, path = pafs.FileSystem.from_uri(text)
        return StorePath(filesystem, path, text)
    except Exception as e:  # noqa: BLE001 - ArrowInvalid: not a pyarrow scheme; OSError: setup
        pyarrow_error = e
    if scheme in PYARROW_SCHEMES and not _is_invalid_uri(pyarrow_error):
        raise store_error(text, pyarrow_error, "opening") from None
    try:
        import fsspec.core
    except ImportError:
        raise RemoteStoreError(
            f"{text}: pyarrow does not serve {scheme}:// ({pyarrow_error}); install fsspec and "
            f"its implementation for {scheme}:// (pip install fsspec)"
        ) from None
    try:
        fs, path = fsspec.core.url_to_fs(text)
    except ImportError as e:  # fsspec knows the scheme; its implementation is missing
        raise RemoteStoreError(f"{text}: {e} (pip install the package it names)") from None
    except ValueError as e:  # unknown protocol
        raise RemoteStoreError(
            f"{text}: no file system serves {scheme}:// (pyarrow: {pyarrow_error}; fsspec: {e}); "
            "use s3://, gs://, abfs://, hdfs:// or another scheme an installed fsspec "
            "implementation registers"
        ) from None
    except Exception as e:  # noqa: BLE001 - the implementation's own setup errors
        raise store_error(text, e, "opening") from None
    return StorePath(pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path, text)


def _is_invalid_uri(error: Exception | None) -> bool:
    """pyarrow could not parse the URI for its own file system (e.g. `abfs://container/path`
    without the account, which fsspec's adlfs takes from the environment)."""
    import pyarrow as pa

    return isinstance(error, pa.ArrowInvalid)


_SETTINGS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE "
    "and the shared credentials files, or an instance role; AWS_DEFAULT_REGION for the region "
    "and AWS_ENDPOINT_URL for an S3-compatible store",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS (a service-account key file) or the machine's default "
    "service account",
    "abfs": "the account in the URI (abfs://container@account.dfs.core.windows.net/path) or "
    "AZURE_STORAGE_ACCOUNT_NAME, with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_CONNECTION_STRING "
    "or a service principal (AZURE_TENANT_ID, AZURE_CLIENT_ID, AZURE_CLIENT_SECRET)",
    "hdfs": "JAVA_HOME, HADOOP_HOME and CLASSPATH (`hadoop classpath --glob`), and "
    "ARROW_LIBHDFS_DIR where libhdfs is not under HADOOP_HOME",
}
_SETTINGS.update(s3a=_SETTINGS["s3"], gcs=_SETTINGS["gs"], abfss=_SETTINGS["abfs"])
_SETTINGS.update(az=_SETTINGS["abfs"], viewfs=_SETTINGS["hdfs"])


def store_error(uri: str, error: BaseException, doing: str) -> RemoteStoreError:
    """`error` from a store's client as a `RemoteStoreError`: the URI, what was being done,
    the store's own message, and the settings its client reads."""
    message = str(error).strip().rstrip(".") or type(error).__name__
    scheme = uri_scheme(uri) or "file"
    settings = _SETTINGS.get(scheme)
    hint = f"; {scheme}:// reads {settings}" if settings else ""
    return RemoteStoreError(f"{uri}: {doing} failed: {message}{hint}")


def list_files(store: StorePath) -> list[Any]:
    """Every file below `store` (recursively), as the store's `FileInfo`s sorted by path."""
    import pyarrow.fs as pafs

    try:
        infos = store.filesystem.get_file_info(pafs.FileSelector(store.path, recursive=True))
    except Exception as e:  # noqa: BLE001
        raise store_error(store.uri, e, "listing") from None
    return sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path)


# ---- model folders ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DownloadReport:
    """What `fetch_model` did."""

    path: Path
    """The local folder (or, for a URI naming one file, that file)."""
    num_files: int
    """Files the copy holds."""
    num_fetched: int
    """Files (or their remaining parts) read from the store this time."""
    bytes_fetched: int
    """Bytes read from the store this time (0: the copy was already complete)."""
    num_resumed: int
    """Files continued from a partial file an interrupted download left."""


def download_model(uri: str, *, config_only: bool = False, progress: bool = True) -> Path:
    """`fetch_model(uri, ...).path`: the local copy of a model folder or file on a store."""
    return fetch_model(uri, config_only=config_only, progress=progress).path


def fetch_model(
    uri: str,
    *,
    config_only: bool = False,
    progress: bool = True,
    names: Collection[str] | None = None,
) -> DownloadReport:
    """Copies the folder (or single file) at `uri` into `$BATCHLM_CACHE_DIR/remote/`, once.

    A later call lists the store again and fetches nothing when the copy matches the listing
    (paths, sizes, modification times); files that changed on the store are fetched again.
    Names starting with `.` (tool caches such as `.cache/huggingface`) are skipped.

    Args:
        uri: `s3://bucket/models/name`, or any URI `open_store` serves.
        config_only: skip the weight files (`*.safetensors`, `*.bin`, ... of 16 MiB and
            more): enough to read the model's config and tokenizer without its weights.
        progress: a progress bar of bytes on stderr while fetching.
        names: fetch only the files of the folder with these names (paths relative to
            it), such as a LoRA adapter's config and weights out of a training run's folder.

    Raises:
        ModelNotFoundError: nothing is stored at `uri` (none of `names`, when given).
        RemoteStoreError: the store cannot be reached or refuses, or a file's size differs
            from the listing after its download (it changed meanwhile: run again).
    """
    store = open_store(uri)
    info = store.info()
    import pyarrow.fs as pafs

    if info.type == pafs.FileType.File:
        entries = {_base_name(store.path): info}
    elif info.type == pafs.FileType.Directory:
        prefix = store.path.rstrip("/") + "/"
        entries = {
            i.path[len(prefix) :]: i
            for i in list_files(store)
            if not any(part.startswith(".") for part in i.path[len(prefix) :].split("/"))
        }
    else:
        entries = {}
    if config_only and info.type == pafs.FileType.Directory:
        entries = {
            name: i
            for name, i in entries.items()
            if not (name.endswith(WEIGHT_SUFFIXES) and i.size >= CONFIG_ONLY_MAX_WEIGHT_BYTES)
        }
    if names is not None and info.type == pafs.FileType.Directory:
        entries = {name: i for name, i in entries.items() if name in names}
    if not entries:
        raise ModelNotFoundError(
            f"model={uri!r}: the store has no file or non-empty folder there; pass the URI of "
            "a model folder (config.json, *.safetensors, tokenizer files) or of a .gguf file"
        )
    listing = {name: [int(i.size), _mtime_ns(i)] for name, i in sorted(entries.items())}
    target = _cache_folder(store.uri, config_only, names)
    with _locked(target):
        report = _sync(store, entries, listing, target, progress)
    if info.type == pafs.FileType.File:
        report = DownloadReport(
            target / _base_name(store.path),
            report.num_files,
            report.num_fetched,
            report.bytes_fetched,
            report.num_resumed,
        )
    return report


def _base_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _mtime_ns(info: Any) -> int:
    mtime = info.mtime_ns
    return int(mtime) if mtime is not None else 0


def _cache_folder(uri: str, config_only: bool, names: Collection[str] | None = None) -> Path:
    """`$BATCHLM_CACHE_DIR/remote/<last name>-<hash of the URI>` (`-config` for config-only)."""
    what = "config" if config_only else "all"
    if names is not None:
        what += "|" + ",".join(sorted(names))
    key = hashlib.sha256(f"{uri}|{what}".encode()).hexdigest()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", _base_name(uri.split("://", 1)[-1]))[:48] or "model"
    suffix = "-config" if config_only else ""
    return envs.cache_dir() / "remote" / f"{name}-{key[:16]}{suffix}"


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Holds an exclusive lock on `target`'s download (released when the process dies)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent / f"{target.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"batchlm: waiting for another process downloading into {target}",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_state(target: Path) -> dict[str, Any]:
    try:
        state = json.loads((target / STATE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(target: Path, state: dict[str, Any]) -> None:
    tmp = target / f"{STATE_NAME}.tmp"
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, target / STATE_NAME)


def _sync(
    store: StorePath,
    entries: dict[str, Any],
    listing: dict[str, list[int]],
    target: Path,
    progress: bool,
) -> DownloadReport:
    """Brings `target` to `listing`; every file is written whole before it gets its name."""
    state = _read_state(target)
    previous = state.get("files") if isinstance(state.get("files"), dict) else {}
    if state.get("complete") and previous == listing and _all_present(target, listing):
        return DownloadReport(target, len(listing), 0, 0, 0)
    target.mkdir(parents=True, exist_ok=True)
    # The listing goes down first: partial files are continued only under the same listing.
    _write_state(target, {"uri": store.uri, "files": listing, "complete": False})
    _remove_unlisted(target, listing)
    todo: list[tuple[str, int]] = []  # (name, offset to start from)
    num_resumed = 0
    for name, (size, _mtime) in listing.items():
        final = target / name
        partial = target / f"{name}{PARTIAL_SUFFIX}"
        unchanged = previous.get(name) == listing[name]
        if unchanged and final.is_file() and final.stat().st_size == size:
            continue
        final.unlink(missing_ok=True)
        offset = partial.stat().st_size if unchanged and partial.is_file() else 0
        if offset > size:
            offset = 0
        if offset:
            num_resumed += 1
        else:
            partial.unlink(missing_ok=True)
        todo.append((name, offset))
    total = sum(listing[name][0] - offset for name, offset in todo)
    bar = _progress_bar(total, store.uri, enabled=progress and total > 0)
    fetched = 0
    try:
        for name, offset in todo:
            fetched += _fetch_file(store, entries[name], target, name, offset, bar)
    finally:
        bar.close()
    _write_state(target, {"uri": store.uri, "files": listing, "complete": True})
    return DownloadReport(target, len(listing), len(todo), fetched, num_resumed)


def _all_present(target: Path, listing: dict[str, list[int]]) -> bool:
    return all(
        (target / name).is_file() and (target / name).stat().st_size == size
        for name, (size, _) in listing.items()
    )


def _remove_unlisted(target: Path, listing: dict[str, list[int]]) -> None:
    """Files of an older listing that the store no longer has (partial ones kept for now)."""
    keep = {STATE_NAME, *listing, *(f"{n}{PARTIAL_SUFFIX}" for n in listing)}
    for path in sorted(target.rglob("*"), reverse=True):
        rel = path.relative_to(target).as_posix()
        if path.is_file() and rel not in keep:
            path.unlink()


def _fetch_file(store: StorePath, info: Any, target: Path, name: str, offset: int, bar: Any) -> int:
    """Copies one file from `offset` on into its partial file, checks its size, renames it."""
    final = target / name
    partial = target / f"{name}{PARTIAL_SUFFIX}"
    partial.parent.mkdir(parents=True, exist_ok=True)
    source_uri = f"{store.uri.rstrip('/')}/{name}" if info.path != store.path else store.uri
    fetched = 0
    try:
        with store.filesystem.open_input_file(info.path) as source, open(partial, "ab") as out:
            if offset:
                source.seek(offset)
            while True:
                chunk = source.read(CHUNK_BYTES)
                if not chunk:
                    break
                out.write(chunk)
                fetched += len(chunk)
                bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
    except Exception as e:  # noqa: BLE001 - every client raises its own kinds
        raise store_error(source_uri, e, "downloading") from None
    size = partial.stat().st_size
    if size != info.size:
        partial.unlink(missing_ok=True)
        raise RemoteStoreError(
            f"{source_uri}: downloaded {size} bytes, but the store lists {info.size}; the file "
            "changed during the download: run again to fetch it anew"
        )
    os.replace(partial, final)
    return fetched


def _progress_bar(total: int, uri: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"downloading {uri}",
        disable=not enabled,
        file=sys.stderr,
    )
