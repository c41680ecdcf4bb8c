"""Helpers for job tests: input files, job files, and the `batchlm` command in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_job(path: Path, job: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def sentences(start: int, count: int) -> list[dict[str, Any]]:
    """Rows `{id, text}` with distinct short sentences."""
    words = ["river", "lantern", "orchard", "copper", "meadow", "harbor", "violet", "granite"]
    return [
        {"id": i, "text": f"The {words[i % 8]} number {i} sits near the {words[(i * 3) % 8]}."}
        for i in range(start, start + count)
    ]


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    """`python3 -m batchlm.pipelines ARGS` in a subprocess; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "batchlm.pipelines", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd or REPO,
        timeout=300,
    )


@pytest.fixture
def embed_job(tmp_path: Path) -> Path:
    """An embed job over three JSONL shards (5, 4 and 3 rows) with MiniLM."""
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", sentences(0, 5))
    write_jsonl(data / "b.jsonl", sentences(5, 4))
    write_jsonl(data / "c.jsonl", sentences(9, 3))
    job = {
        "input": {"path": str(data)},
        "task": "embed",
        "model": MINILM,
        "output": {"path": str(tmp_path / "out")},
        "batch_size": 4,
    }
    return write_job(tmp_path / "job.yaml", job)


# ---- an S3-compatible store -------------------------------------------------------------------

S3_ACCESS_KEY = "batchlm-test-key"
S3_SECRET_KEY = "batchlm-test-secret"


class S3Store:
    """A fresh bucket on the test server, and the environment a job needs to reach it."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        import pyarrow.fs as pafs

        self.endpoint = endpoint
        self.bucket = bucket
        self.env = {
            "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            # Nothing of this machine's own AWS set-up may answer for the test's.
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/batchlm-credentials",
            "AWS_CONFIG_FILE": "/nonexistent/batchlm-config",
        }
        self.fs = pafs.S3FileSystem(
            access_key=S3_ACCESS_KEY,
            secret_key=S3_SECRET_KEY,
            region="us-east-1",
            endpoint_override=endpoint,
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )
        self.fs.create_dir(bucket)

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def put(self, key: str, data: bytes) -> None:
        with self.fs.open_output_stream(f"{self.bucket}/{key}") as out:
            out.write(data)

    def read(self, key: str) -> bytes:
        with self.fs.open_input_stream(f"{self.bucket}/{key}") as f:
            return f.read()

    def upload(self, local: Path, prefix: str) -> str:
        """Copies a local file or folder to `prefix`; returns its URI."""
        import pyarrow.fs as pafs

        pafs.copy_files(
            str(local),
            f"{self.bucket}/{prefix}",
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=self.fs,
        )
        return self.uri(prefix)

    def keys(self, prefix: str = "") -> dict[str, tuple[int, int]]:
        """key → (size, modification time in ns) of every object under `prefix`."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(f"{self.bucket}/{prefix}".rstrip("/"), recursive=True)
        selector.allow_not_found = True
        return {
            i.path.split("/", 1)[1]: (i.size, i.mtime_ns)
            for i in self.fs.get_file_info(selector)
            if i.type == pafs.FileType.File
        }


@pytest.fixture(scope="session")
def s3_endpoint() -> Any:
    """`http://127.0.0.1:<port>` of an S3-compatible server (moto's, in its own process, that
    refuses unsigned requests and unknown keys as S3 does)."""
    pytest.importorskip("moto.moto_server.werkzeug_app")
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.pipelines.s3_server", S3_ACCESS_KEY],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline() if server.stdout else ""
        if not line.startswith("port "):
            pytest.fail(f"the S3 test server did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        server.terminate()
        server.wait(timeout=30)


_BUCKETS = iter(range(1_000_000))


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch) -> S3Store:
    """A new bucket, with this process's environment pointing at the server (credentials,
    region, endpoint), as a job's would."""
    store = S3Store(s3_endpoint, f"batchlm-test-{os.getpid()}-{next(_BUCKETS)}")
    for key, value in store.env.items():
        monkeypatch.setenv(key, value)
    return store


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """A seeded random 1-layer BERT (hidden 16) with MiniLM's tokenizer: an embedding
    model that makes 100,000 short texts a matter of seconds."""
    import shutil

    import torch
    import transformers

    from batchlm.engine.loader import resolve_model

    minilm = resolve_model(MINILM)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=128,
    )
    torch.manual_seed(1234)
    out = tmp_path_factory.mktemp("tiny-bert") / "bert"
    transformers.BertModel(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm / name).exists():
            shutil.copy(minilm / name, out / name)
    return out
