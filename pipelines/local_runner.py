"""The `local` runner: one engine in this process, rows streamed through it.

Batches of `batch_size` rows enter the engine as it has room (`operators/row_stream.py`):
generation keeps twice the engine's `max_num_seqs` rows in flight, across batches and
shards, so the engine is never drained between batches; results come out in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from batchlm.operators.row_stream import stream_tables

from .runner import Runner, ShardBatch, ShardInput


class LocalRunner(Runner):
    """Builds the engine when the first shard arrives and streams every batch through it."""

    name = "local"
    _llm: Any = None

    def run(self, shards: Iterable[ShardInput]) -> Iterator[ShardBatch]:
        shards = iter(shards)
        first = next(shards, None)
        if first is None:  # every shard was written before: no engine
            return
        if self._llm is None:
            self._llm = self.config.build_llm()
        rows_in_flight = 2 * self._llm.llm_engine.config.scheduler.max_num_seqs
        batches = self._batches(itertools.chain([first], shards))
        for index, out in stream_tables(
            self._llm, self.config.spec, batches, self.info, rows_in_flight=rows_in_flight
        ):
            yield ShardBatch(index, out)  # type: ignore[arg-type]

    def _batches(self, shards: Iterable[ShardInput]) -> Iterator[tuple[int, pa.Table]]:
        size = self.config.batch_size
        for shard in shards:
            for start in range(0, shard.table.num_rows, size):
                yield shard.index, shard.table.slice(start, size)

    def metrics(self) -> list[Any] | None:
        get_metrics = getattr(self._llm, "get_metrics", None)
        return get_metrics() if get_metrics is not None else None

    def close(self) -> None:
        self._llm = None
