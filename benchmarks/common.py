"""Helpers shared by the benchmark scripts: prompts, timing, the JSONL record."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch


def git_commit() -> str:
    """The tree's commit; `BENCH_COMMIT` when set (a device's copy of the working tree may
    carry stale git metadata)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def graph_replay_us(fn, per_sample: int, samples: int = 5) -> float:
    """Microseconds per replay of a CUDA graph of one `fn()` call (run once eagerly first,
    on a side stream, then captured): the best of `samples` timings of `per_sample`
    back-to-back replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(samples):
        start.record()
        for _ in range(per_sample):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / per_sample)
    return best


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


_VERSIONED = ("torch", "triton", "transformers", "vllm")


def library_versions() -> dict[str, str]:
    """The installed versions of the libraries a record's speed depends on (those present):
    a ratio between two records holds only where these match or are stated."""
    import importlib.metadata

    versions = {}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def random_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded random token-id prompts with lengths uniform in [min_len, max_len]."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    # Avoid the first few ids, which are special tokens in most vocabularies.
    return [torch.randint(16, vocab, (n,), generator=gen).tolist() for n in lens]


def batchlm_environment() -> dict[str, str]:
    """The `BATCHLM_*` variables set in this process: the engine's switches."""
    return {k: v for k, v in os.environ.items() if k.startswith("BATCHLM_")}


class Timer:
    def __enter__(self) -> Timer:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start


class Recorder:
    """Prints one JSON line per measurement and appends it to a results file."""

    def __init__(self, out_path: str | None, tree: str | None = None) -> None:
        self.out_path = Path(out_path) if out_path else None
        self.command = " ".join([Path(sys.executable).name, *sys.argv])
        self.commit = git_commit()
        self.device = device_name()
        self.versions = library_versions()
        self.environment = batchlm_environment()
        """batchlm's switches set for the run (the command line does not show them)."""
        self.tree = tree
        """Which source tree of batchlm ran, when it is not this checkout's (an A/B of
        two commits, each imported from its own folder)."""

    def record(self, **fields) -> None:
        row = {**fields, "device": self.device, "versions": self.versions, "commit": self.commit,
               "command": self.command}  # fmt: skip
        if self.environment:  # a record naming its own (a variant's process) keeps it
            row.setdefault("environment", self.environment)
        if self.tree is not None:
            row["tree"] = self.tree
        line = json.dumps(row)
        print(line, flush=True)
        if self.out_path:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            with self.out_path.open("a") as f:
                f.write(line + "\n")


def run_job_on(llm, job) -> tuple[float, object]:
    """Runs `job` (a `JobSpec`) with `llm` as its engine, so that load time is out of the
    figure; returns the job's seconds and its summary."""
    from batchlm.operators.config import OperatorConfig
    from batchlm.pipelines import run_job

    build = OperatorConfig.build_llm
    OperatorConfig.build_llm = lambda self: llm  # type: ignore[method-assign]
    try:
        with Timer() as t:
            summary = run_job(job, progress=False)
    finally:
        OperatorConfig.build_llm = build  # type: ignore[method-assign]
    return t.seconds, summary


def grammar_library_version() -> str | None:
    """The installed xgrammar's version, for structured-output records: the grammar
    library, not the engine, decides much of a constrained batch's speed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        return None
