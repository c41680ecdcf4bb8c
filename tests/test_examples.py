"""Every script in examples/ runs as the README says (`python3 examples/NAME.py`) on the
bundled models, exits 0 and prints what it promises: one result per prompt, non-empty text,
the declared columns and the error cell of the bad row."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 600


def texts(pattern: str, stdout: str) -> list[str]:
    """The Python literals that `pattern`'s group matches, one per matching line."""
    return [ast.literal_eval(m) for m in re.findall(pattern, stdout, flags=re.MULTILINE)]


def check_basic(stdout: str) -> None:
    assert texts(r"^Prompt: +(.+)$", stdout) == [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    generated = texts(r"^Generated: +(.+)$", stdout)
    assert len(generated) == 4 and all(t.strip() for t in generated)


def check_generate(stdout: str) -> None:
    heads = re.findall(r"^--- (.+) \((\w+), (\d+) tokens\)$", stdout, flags=re.MULTILINE)
    assert [ast.literal_eval(p) for p, _, _ in heads][:1] == ["The capital of France is"]
    assert len(heads) == 4 and all(int(n) >= 1 for _, _, n in heads)
    assert all(reason in ("stop", "length") for _, reason, _ in heads)


def check_chat(stdout: str) -> None:
    generated = texts(r"^Generated: +(.+)$", stdout)
    assert len(generated) == 1 + 3 + 1  # one conversation, a batch of three, a custom template
    assert all(t.strip() for t in generated)


def check_queue_api(stdout: str) -> None:
    queued = texts(r"^queued request ids: (.+)$", stdout)
    done = re.findall(r"^\[(\S+)\] (.+) -> (.+)$", stdout, flags=re.MULTILINE)
    assert len(queued) == 1 and [i for i, _, _ in done] == queued[0]  # queue order
    assert len(done) == 4 and all(ast.literal_eval(t).strip() for _, _, t in done)


def check_sampling_params(stdout: str) -> None:
    sections = re.findall(r"^=== (.+)$", stdout, flags=re.MULTILINE)
    assert [s.split(" ")[0] for s in sections] == [
        "greedy",
        "temperature=0.8,",
        "stop",
        "n=3",
        "penalties",
        "logprobs=3",
    ]
    completions = re.findall(r"^  \[(\d)\] \((\w+), stop_reason=", stdout, flags=re.MULTILINE)
    assert [i for i, _ in completions] == ["0", "0", "0", "0", "1", "2", "0"]
    assert len(re.findall(r"^  .+ \(-?\d+\.\d+\)  top: ", stdout, flags=re.MULTILINE)) == 5


def check_beam_search(stdout: str) -> None:
    assert texts(r"^=== (.+)$", stdout) == ["The capital of France is", "def is_prime(n):"]
    scores = re.findall(r"^--- beam (\d) \(cumulative logprob (-?[\d.]+), ", stdout, re.M)
    assert [int(rank) for rank, _ in scores] == [0, 1, 2, 3] * 2
    for prompt in (scores[:4], scores[4:]):  # best first
        assert [float(s) for _, s in prompt] == sorted((float(s) for _, s in prompt), reverse=True)


def check_lora_generate(stdout: str) -> None:
    rows = re.findall(r"^\[(base|red|blue)\] (.+) -> (.+)$", stdout, flags=re.MULTILINE)
    assert [name for name, _, _ in rows] == ["base", "red", "blue"] * 2
    texts = [ast.literal_eval(t) for _, _, t in rows]
    assert all(t.strip() for t in texts)
    for i in (1, 2):  # each adapter changes what the base model writes for some prompt
        assert texts[i] != texts[0] or texts[3 + i] != texts[3], rows


def check_generate_rows(stdout: str) -> None:
    """ray_generate / spark_generate: 24 prompts and a null one, in and out."""
    assert re.search(r"^25 rows → ", stdout, flags=re.MULTILINE)
    rows = re.findall(r"^ *(\d+) (.+) → (.+) error=(.+)$", stdout, flags=re.MULTILINE)
    assert [int(i) for i, _, _, _ in rows] == [0, 1, 2, 3, 24]
    assert all(ast.literal_eval(t).strip() and e == "None" for _, _, t, e in rows[:4])
    assert rows[4][1:3] == ("None", "None") and "null" in rows[4][3]


def check_ray_embed(stdout: str) -> None:
    assert re.search(r"^65 rows → .+; embedding: fixed_size_list<.+>\[384\]$", stdout, re.M)
    cosines = [float(c) for c in re.findall(r" cos=(-?\d\.\d+)$", stdout, flags=re.MULTILINE)]
    assert len(cosines) == 3 and all(-1 <= c <= 1 for c in cosines)
    assert re.search(r"^errors: \[\(64, .*null", stdout, flags=re.MULTILINE)


def check_spark_embed(stdout: str) -> None:
    assert re.search(r"^dimension: 384$", stdout, flags=re.MULTILINE)
    assert re.search(r"^200 rows, 200 without error → ", stdout, flags=re.MULTILINE)
    first = re.findall(r"→ \[(.+), \.\.\.\]$", stdout, flags=re.MULTILINE)
    assert len(first) == 1 and len(first[0].split(", ")) == 4


def check_lm_eval_backend(stdout: str) -> None:
    (acc,) = re.findall(r"^acc: (\d\.\d+)  acc_norm: (\d\.\d+)$", stdout, flags=re.MULTILINE)
    assert all(0 <= float(a) <= 1 for a in acc)
    picks = re.findall(r"^'.+\?' -> '(.+)' \(answer '(.+)'\) \[(.+)\]$", stdout, re.M)
    assert len(picks) == 6 and all(len(lps.split(", ")) == 4 for _, _, lps in picks)
    right = sum(picked == answer for picked, answer, _ in picks)
    assert float(acc[0]) == pytest.approx(right / 6, abs=1e-3)


def check_image_chat(stdout: str) -> None:
    names = texts(r"^Image: +(.+)$", stdout)
    assert names == ["blue_square.png", "green_triangle.png", "red_circle.png", "yellow_bar.png"]
    generated = texts(r"^Generated: +(.+)$", stdout)
    assert len(generated) == 4 and all(t.strip() for t in generated)
    prompt = texts(r"^Chat prompt: +(.+)$", stdout)
    assert prompt == ["USER: <image>\nCompare it with <image>\nASSISTANT:"]
    assert texts(r"^Chat reply: +(.+)$", stdout)[0].strip()


CLUSTERS = ("ray", "pyspark")
"""The front ends whose examples start a local cluster and take `--output`."""
CHECKS: dict[str, tuple[str | None, Callable[[str], None]]] = {
    # name: (the package a front end needs, or None; what its output must show)
    "basic": (None, check_basic),
    "generate": (None, check_generate),
    "chat": (None, check_chat),
    "queue_api": (None, check_queue_api),
    "sampling_params": (None, check_sampling_params),
    "beam_search": (None, check_beam_search),
    "lora_generate": ("peft", check_lora_generate),
    "image_chat": (None, check_image_chat),
    "ray_generate": ("ray", check_generate_rows),
    "ray_embed": ("ray", check_ray_embed),
    "spark_generate": ("pyspark", check_generate_rows),
    "spark_embed": ("pyspark", check_spark_embed),
    "lm_eval_backend": ("lm_eval", check_lm_eval_backend),
}


def missing(name: str) -> str | None:
    """Why an example cannot run here, or None."""
    package = CHECKS[name][0]
    if package and importlib.util.find_spec(package) is None:
        return f"needs {package}"
    if package == "pyspark" and not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        return "needs java"
    return None


def _cluster(name: str) -> str | None:
    """The local cluster an example starts (`ray`, `pyspark`), or None."""
    package = CHECKS[name][0]
    return package if package in CLUSTERS else None


def run_example(name: str, folder: Path) -> subprocess.CompletedProcess:
    args = [sys.executable, str(EXAMPLES / f"{name}.py")]
    if _cluster(name):
        args += ["--output", str(folder / "out")]
    # Two examples run side by side: one thread each, so that they do not spin against each
    # other on a small machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(
        args, cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.fixture(scope="session")
def example_runs(request, smollm2_dir, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """Starts every selected example in one of two lanes that run side by side: the Ray ones
    in the first, the Spark ones in the second (never two local clusters of a kind at once),
    then the others in turn. `smollm2_dir` converts the GGUF once, before any of them."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_example"
        and missing(item.callspec.params["name"]) is None
    ]
    lanes = [ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)]
    runs: dict[str, Future] = {}
    others = 0
    for cluster in (*CLUSTERS, None):
        for name in (n for n in selected if _cluster(n) == cluster):
            if cluster is None:
                lane, others = lanes[others % 2], others + 1
            else:
                lane = lanes[cluster == "pyspark"]
            runs[name] = lane.submit(run_example, name, tmp_path_factory.mktemp(name))
    yield runs
    for lane in lanes:
        lane.shutdown(cancel_futures=True)


def test_every_example_is_checked():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(CHECKS)


@pytest.mark.parametrize("name", list(CHECKS))
def test_example(name, example_runs):
    if reason := missing(name):
        pytest.skip(reason)
    result = example_runs[name].result()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    CHECKS[name][1](result.stdout)
