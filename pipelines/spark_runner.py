"""The `spark` runner: each shard through `operators.spark_udf.map_in_arrow`.

One Spark job per shard; the engine is cached in each Python worker (Spark reuses them),
so it loads once per worker, not per shard. Rows are numbered before Spark and put back in
that order after it, whatever the partitioning. The active SparkSession is used, or one is
started here (`local[*]` unless `spark-submit` says otherwise) and stopped at the end.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from batchlm.operators.spark_udf import map_in_arrow

from .runner import Runner, ShardBatch, ShardInput

ROW_COLUMN = "__batchlm_row"


class SparkRunner(Runner):
    """`map_in_arrow` of `operators/spark_udf.py` over each shard, in `concurrency` partitions."""

    name = "spark"
    _session: Any = None
    _started_session = False

    def run(self, shards: Iterable[ShardInput]) -> Iterator[ShardBatch]:
        for shard in shards:
            spark = self._spark()
            table = shard.table
            numbered = table.append_column(ROW_COLUMN, pa.array(range(table.num_rows), pa.int64()))
            df = spark.createDataFrame(numbered)
            parts = min(self.config.concurrency, math.ceil(table.num_rows / self.config.batch_size))
            # One partition per engine replica; coalescing to one moves no data.
            df = df.repartition(parts) if parts > 1 else df.coalesce(1)
            out = map_in_arrow(df, self.config).toArrow()
            out = out.sort_by(ROW_COLUMN).drop_columns([ROW_COLUMN])
            yield ShardBatch(shard.index, out)

    def _spark(self) -> Any:
        if self._session is None:
            from pyspark.sql import SparkSession

            session = SparkSession.getActiveSession()
            if session is None:
                # Python workers must run this interpreter (where batchlm is installed).
                os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
                session = (
                    SparkSession.builder.appName("batchlm")
                    .config("spark.ui.showConsoleProgress", "false")
                    .getOrCreate()
                )
                session.sparkContext.setLogLevel("ERROR")
                self._started_session = True
            self._session = session
        return self._session

    def close(self) -> None:
        if self._started_session and self._session is not None:
            self._session.stop()
        self._session = None
        self._started_session = False
