"""The `ray` runner: the job's rows through `operators.ray_data.build_processor`.

All pending shards go into one Ray Dataset (so the engine actors are built once for the
job, not per shard), tagged with a hidden shard column; the Dataset keeps row order
(`preserve_order`), and results stream back to the job, which writes each shard as soon as
its rows are in. Ray is started in this process unless one is running or `RAY_ADDRESS`
names a cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from batchlm.operators.ray_data import build_processor

from .runner import Runner, ShardBatch, ShardInput

SHARD_COLUMN = "__batchlm_shard"


class RayRunner(Runner):
    """Engine actors of `operators/ray_data.py` over the job's shards."""

    name = "ray"
    _started_ray = False

    def run(self, shards: Iterable[ShardInput]) -> Iterator[ShardBatch]:
        import ray
        import ray.data

        tables = [_tag(s) for s in shards]  # the driver reads every pending shard up front
        if not tables:
            return
        if not ray.is_initialized():
            # Actor logs stay in Ray's session folder; errors still reach this process.
            ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
            self._started_ray = True
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False  # the job draws its own
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ds = build_processor(self.config)(ray.data.from_arrow(tables))
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            yield from _split_by_shard(batch)

    def close(self) -> None:
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False


def _tag(shard: ShardInput) -> pa.Table:
    column = pa.array([shard.index] * shard.table.num_rows, pa.int64())
    return shard.table.append_column(SHARD_COLUMN, column)


def _split_by_shard(batch: pa.Table) -> Iterator[ShardBatch]:
    """Runs of consecutive rows of one shard, without the shard column."""
    if batch.num_rows == 0:
        return
    index = batch.column(SHARD_COLUMN).combine_chunks()
    body = batch.drop_columns([SHARD_COLUMN])
    # Row positions where the shard changes, plus both ends.
    changes = pc.indices_nonzero(pc.not_equal(index[1:], index[:-1])).to_pylist()
    bounds = [0, *(i + 1 for i in changes), batch.num_rows]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        yield ShardBatch(int(index[start].as_py()), body.slice(start, end - start))
