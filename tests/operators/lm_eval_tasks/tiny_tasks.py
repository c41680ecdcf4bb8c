"""The datasets of the tiny lm-eval tasks: JSONL files next to this one, read with Hugging
Face datasets' `json` builder (local files only; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / f"{name}.jsonl")})


def load_mc(**kwargs):
    """20 four-choice questions: `question`, `choices`, `answer` (the right choice's index)."""
    return _load("tiny_mc")


def load_gen(**kwargs):
    """10 short questions with one-word answers: `question`, `answer`."""
    return _load("tiny_gen")
