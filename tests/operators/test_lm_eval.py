"""The lm-evaluation-harness backend against the harness's own `hf` backend on the same
SmolLM2 weights: the same acc / acc_norm / exact_match on a tiny local multiple-choice task
and a generate-until task (with and without the chat template), per-request loglikelihoods
within 1e-3, rolling loglikelihoods over several windows, and the command line.

The tasks live in `lm_eval_tasks/` (YAML that `TaskManager(include_path=...)` loads, JSONL
read with Hugging Face datasets' `json` builder); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import batchlm.operators.lm_eval as backend  # noqa: E402

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
MC, GEN = "batchlm_tiny_mc", "batchlm_tiny_gen"
MAX_MODEL_LEN = 256
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    # The harness's own tasks (thousands of YAML files to index) are not needed here.
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


@pytest.fixture(scope="module")
def batchlm_lm(smollm2_dir):
    """Built as `simple_evaluate(model="batchlm", model_args=...)` builds it."""
    args = f"pretrained={smollm2_dir},dtype=float32,max_model_len={MAX_MODEL_LEN}"
    return get_model("batchlm").create_from_arg_string(args, {"batch_size": 1, "device": "cuda"})


@pytest.fixture(scope="module")
def hf_lm(smollm2_dir):
    # max_length: the same rolling windows as the engine's (its input plus the token it
    # scores fill max_model_len).
    args = f"pretrained={smollm2_dir},dtype=float32,max_length={MAX_MODEL_LEN - 1}"
    return get_model("hf").create_from_arg_string(args, {"batch_size": 16, "device": "cpu"})


def _evaluate(lm, task_manager, tasks, **kwargs) -> dict:
    return lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=task_manager, log_samples=True, **kwargs
    )


@pytest.fixture(scope="module")
def runs(batchlm_lm, hf_lm, task_manager) -> dict[str, dict]:
    return {
        name: _evaluate(lm, task_manager, [MC, GEN])
        for name, lm in (("batchlm", batchlm_lm), ("hf", hf_lm))
    }


def _metrics(results: dict, task: str) -> dict[str, float]:
    return {
        k: v
        for k, v in results["results"][task].items()
        if k.split(",")[0] in ("acc", "acc_norm", "exact_match")
    }


def test_the_backend_is_registered():
    assert get_model("batchlm") is backend.BatchlmLM
    assert get_model("hf").__name__ == "HFLM"  # the harness's own backends are still there


def test_multiple_choice_equals_hf(runs):
    ours, theirs = runs["batchlm"], runs["hf"]
    assert _metrics(ours, MC) == _metrics(theirs, MC)
    assert set(_metrics(ours, MC)) == {"acc,none", "acc_norm,none"}
    samples = zip(ours["samples"][MC], theirs["samples"][MC], strict=True)
    num_requests = 0
    for a, b in samples:
        assert a["doc_id"] == b["doc_id"]
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(
            a["filtered_resps"], b["filtered_resps"], strict=True
        ):
            assert abs(lp_a - lp_b) <= LOGPROB_ATOL, (a["doc_id"], lp_a, lp_b)
            assert greedy_a == greedy_b
            num_requests += 1
    assert num_requests == 80


def test_generate_until_equals_hf(runs):
    ours, theirs = runs["batchlm"], runs["hf"]
    assert _metrics(ours, GEN) == _metrics(theirs, GEN)
    assert [s["resps"] for s in ours["samples"][GEN]] == [
        s["resps"] for s in theirs["samples"][GEN]
    ]
    assert 0 < ours["results"][GEN]["exact_match,strip"] < 1  # neither all right nor all wrong


def test_chat_template_equals_hf(batchlm_lm, hf_lm, task_manager):
    history = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 3 + 4?"},
    ]
    for add_generation_prompt in (True, False):
        assert batchlm_lm.apply_chat_template(history, add_generation_prompt) == (
            hf_lm.apply_chat_template(history, add_generation_prompt)
        )
    assert batchlm_lm.tokenizer_name == hf_lm.tokenizer_name
    assert batchlm_lm.chat_template(True) == hf_lm.chat_template(True)
    ours, theirs = (
        _evaluate(lm, task_manager, [GEN], apply_chat_template=True) for lm in (batchlm_lm, hf_lm)
    )
    assert _metrics(ours, GEN) == _metrics(theirs, GEN)
    assert [s["resps"] for s in ours["samples"][GEN]] == [
        s["resps"] for s in theirs["samples"][GEN]
    ]
    assert "<|im_start|>user" in str(ours["samples"][GEN][0]["arguments"])  # the template ran


def test_rolling_loglikelihood_equals_hf_over_several_windows(batchlm_lm, hf_lm):
    lines = [json.loads(line)["question"] for line in (TASKS_DIR / "tiny_mc.jsonl").open()]
    texts = [" ".join(lines * 4), "A short text to score."]
    assert len(batchlm_lm.tok_encode(texts[0])) > 2 * MAX_MODEL_LEN  # three windows
    requests = [Instance("loglikelihood_rolling", doc={}, arguments=(t,), idx=0) for t in texts]
    ours = batchlm_lm.loglikelihood_rolling(requests, disable_tqdm=True)
    theirs = hf_lm.loglikelihood_rolling(requests, disable_tqdm=True)
    assert ours == pytest.approx(theirs, abs=LOGPROB_ATOL)


def test_command_line(tiny_model_factory, tmp_path, capsys, monkeypatch):
    """`python -m batchlm.operators.lm_eval` with the harness's arguments (in this process;
    a tiny random model: only the plumbing is under test here)."""
    import lm_eval.tasks

    class LocalTasks(TaskManager):  # the local tasks only, as in `task_manager`
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)
    backend.main(
        [
            "--model_args",
            f"pretrained={tiny_model_factory('llama')},max_model_len=128",
            "--tasks",
            MC,
            "--include_path",
            str(TASKS_DIR),
            "--limit",
            "4",
            "--output_path",
            str(tmp_path / "results"),
        ]
    )
    (results,) = (tmp_path / "results").rglob("results_*.json")
    report = json.loads(results.read_text())
    assert report["config"]["model"] == "batchlm"
    assert report["results"][MC]["sample_len"] == 4 and "acc,none" in report["results"][MC]
    assert "batchlm" in capsys.readouterr().out
