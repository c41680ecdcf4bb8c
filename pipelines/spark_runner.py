"""The `spark` runner: each shard through `operators.spark_udf.map_in_arrow`.

One Spark job per shard; the engine is cached in each Python worker (Spark reuses them),
so it loads once per worker, not per shard. Rows are numbered before Spark and put back in
that order after it, whatever the partitioning. The active SparkSession is used, or one is
started here (`local[*]` unless `spark-submit` says otherwise) and stopped at the end.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
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
    _sigint: Any = None
    """The SIGINT handler found before starting a session (None: not started, or not from
    the main thread, or not a handler Python can put back)."""

    def run(self, shards: Iterable[ShardInput]) -> Iterator[ShardBatch]:
        for shard in shards:
            spark = self._spark()
            table = shard.table
            numbered = table.append_column(ROW_COLUMN, pa.array(range(table.num_rows), pa.int64()))
            df = _to_spark(spark, numbered)
            parts = min(
                self.config.max_concurrency, math.ceil(table.num_rows / self.config.batch_size)
            )
            # One partition per engine replica; coalescing to one moves no data.
            df = df.repartition(parts) if parts > 1 else df.coalesce(1)
            out = _to_arrow(map_in_arrow(df, self.config))
            out = out.sort_by(ROW_COLUMN).drop_columns([ROW_COLUMN])
            yield ShardBatch(shard.index, out)

    def _spark(self) -> Any:
        if self._session is None:
            from pyspark.sql import SparkSession

            session = SparkSession.getActiveSession()
            if session is None:
                # Python workers must run this interpreter (where batchlm is installed).
                os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
                if threading.current_thread() is threading.main_thread():
                    self._sigint = signal.getsignal(signal.SIGINT)
                session = (
                    SparkSession.builder.appName("batchlm")
                    .config("spark.ui.showConsoleProgress", "false")
                    .config("spark.sql.execution.arrow.pyspark.enabled", "true")
                    .getOrCreate()
                )
                session.sparkContext.setLogLevel("ERROR")
                self._started_session = True
            self._session = session
        return self._session

    def close(self) -> None:
        if self._started_session and self._session is not None:
            self._session.stop()
            # SparkContext installs a SIGINT handler of its own in the process that starts
            # it and leaves it after `stop()`: the one found before is put back.
            if self._sigint is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, self._sigint)
        self._session = None
        self._started_session = False
        self._sigint = None


def _is_pyspark4() -> bool:
    import pyspark

    return int(pyspark.__version__.split(".")[0]) >= 4


def _to_spark(spark: Any, table: pa.Table) -> Any:
    """An Arrow table as a DataFrame: directly from PySpark 4.0; before, through pandas with
    the table's own schema (so that nested and list columns keep their types)."""
    if _is_pyspark4():
        return spark.createDataFrame(table)
    from pyspark.sql.pandas.types import from_arrow_schema

    spark.conf.set("spark.sql.execution.arrow.pyspark.enabled", "true")
    return spark.createDataFrame(table.to_pandas(), schema=from_arrow_schema(table.schema))


def _to_arrow(df: Any) -> pa.Table:
    """A DataFrame's rows as one Arrow table: `toArrow()` from PySpark 4.0; before, the
    record batches that `toPandas()` itself collects (PySpark 3.5's `_collect_as_arrow`)."""
    if _is_pyspark4():
        return df.toArrow()
    from pyspark.sql.pandas.types import to_arrow_schema

    batches = df._collect_as_arrow()
    return pa.Table.from_batches(batches, schema=to_arrow_schema(df.schema))
