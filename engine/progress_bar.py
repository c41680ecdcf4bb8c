"""The progress bar of `LLM` calls: `use_tqdm` is a bool or, as in vLLM, a factory that
makes the bar (say `functools.partial(tqdm, leave=False)`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm


def progress_bar(use_tqdm: bool | Callable[..., Any], total: int, desc: str, unit: str) -> Any:
    """A tqdm bar of `total` steps (hidden when `use_tqdm` is False), or the factory's."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, unit=unit)
    return tqdm(total=total, desc=desc, unit=unit, disable=not use_tqdm)
