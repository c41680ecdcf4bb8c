"""Model folders on an object store: fetched once into the cache, sizes checked, resumed after
an interruption, never used half-written, and loaded as the local folder they copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import ModelNotFoundError
from batchlm.engine.loader import resolve_model
from batchlm.engine.loader.remote import (
    PARTIAL_SUFFIX,
    STATE_NAME,
    RemoteStoreError,
    fetch_model,
    is_remote,
    open_store,
)

from .conftest import REPO

PROMPTS = ["The lighthouse keeper climbed", "Octopuses can", "Every morning the baker"]


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }


def test_uris_and_paths():
    assert is_remote("s3://bucket/key") and is_remote("gs://b/k") and is_remote("hdfs://nn/x")
    assert is_remote("memory://folder") and is_remote("abfs://container/path")
    assert not is_remote("/data/models/tiny") and not is_remote("relative/path")
    assert not is_remote("file:///data/x") and not is_remote("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_unknown_scheme_names_what_to_install():
    with pytest.raises(RemoteStoreError, match="no file system serves nosuchfs://"):
        open_store("nosuchfs://bucket/key")


def test_store_folder_loads_with_the_local_tokens(s3, tiny_model_factory):
    local = tiny_model_factory("llama")
    uri = s3.upload(local, "models/tiny-llama")
    params = SamplingParams(temperature=0, max_tokens=8)
    reference = LLM(str(local), max_model_len=64).generate(PROMPTS, params, use_tqdm=False)

    llm = LLM(uri + "/", max_model_len=64)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in reference]
    llm.shutdown()

    report = fetch_model(uri)  # the copy is there: nothing is fetched again
    assert report.bytes_fetched == 0 and report.num_fetched == 0
    assert _files(report.path) == _files(local)
    assert resolve_model(uri) == report.path


def test_interrupted_download_resumes_where_it_stopped(s3, tiny_model_factory):
    local = tiny_model_factory("llama")
    uri = s3.upload(local, "models/resume")
    first = fetch_model(uri, progress=False)
    total = sum(len(b) for b in _files(local).values())
    assert first.bytes_fetched == total and first.num_resumed == 0

    # As a download killed in the middle of the weights leaves it: the state not complete,
    # the weights a partial file of their first bytes.
    folder = first.path
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    (folder / f"model.safetensors{PARTIAL_SUFFIX}").write_bytes(data[: len(data) // 3])
    state = json.loads((folder / STATE_NAME).read_text())
    (folder / STATE_NAME).write_text(json.dumps({**state, "complete": False}))

    resumed = fetch_model(uri, progress=False)
    assert resumed.num_resumed == 1 and resumed.num_fetched == 1
    assert resumed.bytes_fetched == len(data) - len(data) // 3
    assert _files(folder) == _files(local)
    assert not list(folder.rglob(f"*{PARTIAL_SUFFIX}"))


def test_changed_store_file_restarts_its_partial_download(s3, tiny_model_factory):
    local = tiny_model_factory("llama")
    uri = s3.upload(local, "models/changed")
    folder = fetch_model(uri, progress=False).path
    config = folder / "config.json"
    config.rename(folder / f"config.json{PARTIAL_SUFFIX}")
    state = json.loads((folder / STATE_NAME).read_text())
    (folder / STATE_NAME).write_text(json.dumps({**state, "complete": False}))
    # The store's config.json changes meanwhile: its partial file is not continued.
    new_config = json.loads((local / "config.json").read_text())
    new_config["eos_token_id"] = 0
    body = json.dumps(new_config, indent=2).encode()
    s3.put("models/changed/config.json", body)

    report = fetch_model(uri, progress=False)
    assert report.num_resumed == 0 and report.num_fetched == 1
    assert report.bytes_fetched == len(body)
    assert (folder / "config.json").read_bytes() == body


def test_processes_of_one_machine_download_once(s3, tiny_model_factory):
    uri = s3.upload(tiny_model_factory("llama"), "models/shared")
    code = (
        "import json, sys; from batchlm.engine.loader.remote import fetch_model; "
        "r = fetch_model(sys.argv[1], progress=False); print(json.dumps(r.bytes_fetched))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, uri], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    fetched = sorted(int(p.communicate(timeout=120)[0]) for p in procs)
    assert all(p.returncode == 0 for p in procs)
    total = sum(len(b) for b in _files(tiny_model_factory("llama")).values())
    assert fetched == [0, total]


def test_missing_model_and_missing_credentials(s3, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="has no file or non-empty folder there"):
        LLM(s3.uri("models/none"))
    s3.put("models/file.txt", b"not a model")
    with pytest.raises(ModelNotFoundError, match="is a file but not a .gguf file"):
        resolve_model(s3.uri("models/file.txt"))
    with pytest.raises(ModelNotFoundError, match="revision='main' applies only"):
        resolve_model(s3.uri("models/file.txt"), revision="main")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteStoreError, match="ACCESS_DENIED.*AWS_ACCESS_KEY_ID"):
        LLM(s3.uri("models/none"))
