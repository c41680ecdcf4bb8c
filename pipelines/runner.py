"""The runner interface: rows of shards in, result rows of the same shards out.

A runner only computes. Planning shards, reading them, writing results and resuming
belong to the job (`pipelines/job.py`), so every runner gets the same guarantees.

Contract: `run` yields `ShardBatch`es in the order of the input rows; all batches of a
shard come before any batch of the next shard, and together hold exactly the shard's rows,
each with the row contract's output columns (`operators/rows.py`) appended.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchlm.operators.config import OperatorConfig
from batchlm.operators.rows import ModelInfo


@dataclass(frozen=True)
class ShardInput:
    """The rows of one shard, as read from its input file."""

    index: int
    table: pa.Table


@dataclass(frozen=True)
class ShardBatch:
    """Consecutive result rows of shard `index`: its input columns plus the task's."""

    index: int
    table: pa.Table


class Runner(abc.ABC):
    """Runs an `OperatorConfig` over shards; builds its engine(s) once per job."""

    name: str = ""

    def __init__(self, config: OperatorConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info

    @abc.abstractmethod
    def run(self, shards: Iterable[ShardInput]) -> Iterator[ShardBatch]:
        """Result batches for `shards` (read lazily, in order), per the module's contract."""

    def metrics(self) -> list[Any] | None:
        """The engine's metrics (`LLM.get_metrics()`) when the runner can see them."""
        return None

    def close(self) -> None:  # noqa: B027 - most runners have nothing to release
        """Releases engines and clusters the runner started."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Runner", "ShardInput", "ShardBatch"]
