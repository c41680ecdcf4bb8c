"""What a job shows while it runs (a progress bar on stderr) and when it ends (a summary)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from batchlm.operators.rows import ERROR_COLUMN

# Engine counters worth a line in the summary, when the runner can read them.
_SUMMARY_METRICS = {
    "batchlm:prompt_tokens": "prompt tokens (engine)",
    "batchlm:generation_tokens": "generated tokens (engine)",
    "batchlm:num_preemptions": "preemptions",
    "batchlm:prefix_cache_hits": "prefix-cache hit tokens",
}


class Progress:
    """Counts rows, failed rows and tokens of result batches; draws a bar on `stream`."""

    def __init__(self, total_rows: int | None, stream: IO[str], enabled: bool = True) -> None:
        self.rows = 0
        self.failed = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.cached_prompt_tokens: int | None = None
        """Prompt tokens the prefix cache served, where the task reports them."""
        self.start = time.perf_counter()
        self._bar = tqdm(
            total=total_rows,
            unit="row",
            file=stream,
            disable=not enabled,
            dynamic_ncols=True,
            mininterval=0.5,
        )

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def add_total(self, num_rows: int) -> None:
        """Grows the bar's total when a shard's size is only known once it is read."""
        self._bar.total = (self._bar.total or 0) + num_rows
        self._bar.refresh()

    def update(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        if ERROR_COLUMN in table.column_names:
            self.failed += table.num_rows - table.column(ERROR_COLUMN).null_count
        if "num_output_tokens" in table.column_names:
            self.output_tokens += _sum(table.column("num_output_tokens"))
        if "num_input_tokens" in table.column_names:
            self.prompt_tokens += _sum(table.column("num_input_tokens"))
        if "num_cached_tokens" in table.column_names:
            cached = _sum(table.column("num_cached_tokens"))
            self.cached_prompt_tokens = (self.cached_prompt_tokens or 0) + cached
        postfix = []
        if self.output_tokens:
            postfix.append(f"{self.output_tokens / max(self.seconds, 1e-9):.1f} tok/s")
        if self.failed:
            postfix.append(f"{self.failed} failed")
        self._bar.set_postfix_str(", ".join(postfix), refresh=False)
        self._bar.update(table.num_rows)

    def close(self) -> None:
        self._bar.close()


def _sum(column: pa.ChunkedArray) -> int:
    value = pc.sum(column).as_py()
    return int(value or 0)


@dataclass(frozen=True)
class JobSummary:
    """What a finished (or resumed) job did."""

    output_path: str
    num_shards: int
    num_shards_written: int
    num_shards_skipped: int
    rows_written: int
    rows_failed: int
    rows_in_output: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    engine_metrics: dict[str, float] | None = None
    cached_prompt_tokens: int | None = None
    """Of `prompt_tokens`, those the prefix cache served (the rest were computed); None where
    the task does not report them (only `loglikelihood` does)."""

    @property
    def computed_prompt_tokens(self) -> int | None:
        """Prompt tokens the engine computed; None where the task does not report them."""
        if self.cached_prompt_tokens is None:
            return None
        return self.prompt_tokens - self.cached_prompt_tokens

    def format(self) -> str:
        """The end-of-job report: one `label  value` line each."""
        rows: list[tuple[str, str]] = [
            ("output", self.output_path),
            (
                "shards",
                f"{self.num_shards_written} written, {self.num_shards_skipped} skipped "
                f"(already written), {self.num_shards} in the job",
            ),
            ("rows written", f"{self.rows_written} ({self.rows_failed} failed: non-null `error`)"),
            ("rows in output", str(self.rows_in_output)),
        ]
        if self.rows_written:
            rate = f"{self.rows_written / self.seconds:.1f} rows/s over {self.seconds:.1f} s"
            if self.output_tokens:
                rate += f", {self.output_tokens / self.seconds:.1f} generated tok/s"
            rows.append(("throughput", rate))
        if self.computed_prompt_tokens is not None:
            ratio = self.computed_prompt_tokens / max(self.prompt_tokens, 1)
            rows.append(
                (
                    "prompt tokens",
                    f"{self.prompt_tokens} given, {self.computed_prompt_tokens} computed "
                    f"({ratio:.1%}; {self.cached_prompt_tokens} from the prefix cache)",
                )
            )
        for name, label in _SUMMARY_METRICS.items():
            if self.engine_metrics and name in self.engine_metrics:
                rows.append((label, f"{self.engine_metrics[name]:.0f}"))
        read = f"t = pq.read_table({self.output_path!r})"
        rows.append(
            (
                "look at it",
                f'python3 -c "import pyarrow.parquet as pq; {read}; print(t.to_pandas())"',
            )
        )
        if self.rows_failed:
            rows.append(
                (
                    "failed rows",
                    'python3 -c "import pyarrow.parquet as pq, pyarrow.compute as pc; '
                    f"{read}; print(t.filter(pc.is_valid(t['error'])).to_pandas())\"",
                )
            )
        width = max(len(label) for label, _ in rows) + 2
        return "\n".join(f"{label:<{width}}{value}" for label, value in rows)


def metric_values(metrics: list[Any] | None) -> dict[str, float] | None:
    """Counter and gauge values by name, from `LLM.get_metrics()`."""
    if not metrics:
        return None
    return {
        m.name: float(m.value)
        for m in metrics
        if isinstance(getattr(m, "value", None), (int, float))
    }


__all__ = ["Progress", "JobSummary", "metric_values"]
