"""The `local` runner: one engine in this process, `process_table` per batch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from batchlm.operators.rows import process_table

from .runner import Runner, ShardBatch, ShardInput


class LocalRunner(Runner):
    """Builds the engine on first use and runs every batch through it, in order."""

    name = "local"
    _llm: Any = None

    def run(self, shards: Iterable[ShardInput]) -> Iterator[ShardBatch]:
        batch_size = self.config.batch_size
        for shard in shards:
            if self._llm is None:
                self._llm = self.config.build_llm()
            for start in range(0, shard.table.num_rows, batch_size):
                batch = shard.table.slice(start, batch_size)
                out = process_table(self._llm, self.config.spec, batch, self.info)
                yield ShardBatch(shard.index, out)

    def metrics(self) -> list[Any] | None:
        get_metrics = getattr(self._llm, "get_metrics", None)
        return get_metrics() if get_metrics is not None else None

    def close(self) -> None:
        self._llm = None
