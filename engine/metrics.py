"""Prometheus metrics of one engine, and the snapshot types `LLM.get_metrics()` returns.

Each engine owns a `CollectorRegistry`, so several engines in one process never share a
counter. Names are vLLM's with a `batchlm:` prefix. Counters and gauges that the scheduler
and KV cache manager already keep (running / waiting requests, cache usage, prefix-cache
queries and hits, preemptions) are read when the registry is collected, so they cost nothing
per step; the rest is accumulated in plain Python numbers and numpy bucket counts (one
vectorised update per step instead of one `observe` per token).

As in vLLM, a counter's name has no `_total` suffix (`batchlm:prompt_tokens`); the
Prometheus text exposition adds it (`batchlm:prompt_tokens_total`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

from .core.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

PREFIX = "batchlm:"

# Histogram upper bounds (seconds), spanning interactive to long offline runs.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3),
    *(0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
E2E_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
FINISH_REASONS = ("stop", "length", "abort")
LOG_INTERVAL_S = 10.0
"""Seconds between two statistics lines in the log."""
_IDLE = SchedulerStats(0, 0, 0.0, 0, 0, 0)


# ---- snapshot types (what get_metrics returns) --------------------------------------------


@dataclass
class Metric:
    """One metric (one label combination) at the time of the snapshot."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]
    """Cumulative count per upper bound (Prometheus `le` string), ending with `+Inf`."""


@dataclass
class Vector(Metric):
    values: list[int]
    """A counter per position (e.g. accepted draft tokens at each speculative position)."""


# ---- accumulation -------------------------------------------------------------------------


class _BucketCounts:
    """A histogram's per-bucket counts and sum, updated a batch of values at a time."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # last: above every bound
        self.sum = 0.0

    def observe(self, values: Sequence[float]) -> None:
        if not len(values):
            return
        arr = np.asarray(values, dtype=np.float64)
        # Prometheus buckets hold values <= their bound: the first bound >= value.
        index = np.searchsorted(self.bounds, arr, side="left")
        self.counts += np.bincount(index, minlength=len(self.counts))
        self.sum += float(arr.sum())

    def cumulative(self) -> list[tuple[str, float]]:
        cum = np.cumsum(self.counts).tolist()
        les = [floatToGoString(b) for b in self.bounds.tolist()] + ["+Inf"]
        return list(zip(les, cum, strict=True))


def token_buckets(max_model_len: int) -> list[float]:
    """1-2-5 steps up to `max_model_len` (token-count histograms)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10


@dataclass
class FinishedRequestStats:
    """What a finished request adds to the request histograms."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


class EngineMetrics:
    """The metrics of one engine, registered in its own `CollectorRegistry`.

    Args:
        model_name: Value of the `model_name` label on every metric.
        max_model_len: Largest token count (bounds of the token histograms).
        scheduler_snapshot: Returns the scheduler's counts, or None when the engine has no
            scheduler (pooling models).
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        scheduler_snapshot: Callable[[], SchedulerStats | None],
    ) -> None:
        self.labels = {"model_name": model_name}
        self._scheduler_snapshot = scheduler_snapshot
        self._lock = threading.Lock()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = dict.fromkeys(FINISH_REASONS, 0)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.ttft = _BucketCounts(TTFT_BUCKETS)
        self.itl = _BucketCounts(ITL_BUCKETS)
        self.e2e = _BucketCounts(E2E_BUCKETS)
        self.prompt_lens = _BucketCounts(token_buckets(max_model_len))
        self.generation_lens = _BucketCounts(token_buckets(max_model_len))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._http_server: Any = None
        self.http_port: int | None = None
        """Port of the HTTP exposition, once started."""
        self._last_log = (time.monotonic(), 0, 0)

    # ---- recording --------------------------------------------------------------------

    def record_step(
        self,
        first_token_latencies: Sequence[float],
        inter_token_latencies: Sequence[float],
        num_prompt_tokens: int,
        num_generation_tokens: int,
    ) -> None:
        """One engine step: the prompts that produced their first token (their latencies and
        token count) and every new token's gap to its request's previous token."""
        with self._lock:
            self.num_prompt_tokens += num_prompt_tokens
            self.num_generation_tokens += num_generation_tokens
            self.ttft.observe(first_token_latencies)
            self.itl.observe(inter_token_latencies)

    def record_finished(self, finished: Sequence[FinishedRequestStats]) -> None:
        if not finished:
            return
        with self._lock:
            for f in finished:
                self.num_finished[f.finish_reason] = self.num_finished.get(f.finish_reason, 0) + 1
            self.e2e.observe([f.e2e_latency for f in finished])
            self.prompt_lens.observe([f.num_prompt_tokens for f in finished])
            self.generation_lens.observe([f.num_generation_tokens for f in finished])

    def record_pooling(self, prompt_lens: Sequence[int], elapsed: float) -> None:
        """A pooling call (embed / classify / score / encode): every input is a request that
        finished ('stop') after `elapsed` seconds, the duration of the call."""
        with self._lock:
            self.num_prompt_tokens += int(sum(prompt_lens))
            self.num_finished["stop"] += len(prompt_lens)
            self.e2e.observe([elapsed] * len(prompt_lens))
            self.prompt_lens.observe(prompt_lens)

    def record_spec_decode(
        self,
        num_drafts: int,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        accepted_per_position: Sequence[int] | None = None,
    ) -> None:
        """Speculative decoding of one step: drafts proposed, draft tokens among them, tokens
        accepted, and optionally how many were accepted at each draft position."""
        with self._lock:
            self.num_drafts += num_drafts
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted_tokens
            if accepted_per_position is not None:
                grow = len(accepted_per_position) - len(self.accepted_per_position)
                if grow > 0:
                    self.accepted_per_position.extend([0] * grow)
                for i, n in enumerate(accepted_per_position):
                    self.accepted_per_position[i] += int(n)

    # ---- collection -------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        """Prometheus collector protocol: every metric family, current values."""
        with self._lock:  # built whole under the lock: a slow reader never blocks the engine
            families = list(self._families())
        return iter(families)

    def _families(self) -> Iterator[Any]:
        keys = list(self.labels)
        values = list(self.labels.values())
        sched = self._scheduler_snapshot() or _IDLE

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=keys)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=keys)
            c.add_metric(values, value)
            return c

        def histogram(name: str, doc: str, h: _BucketCounts) -> HistogramMetricFamily:
            f = HistogramMetricFamily(PREFIX + name, doc, labels=keys)
            f.add_metric(values, h.cumulative(), h.sum)
            return f

        yield gauge("num_requests_running", "Requests in the running batch.", sched.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to run.", sched.num_waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0 to 1).",
            sched.kv_cache_usage,
        )
        yield counter("prompt_tokens", "Prompt tokens processed.", self.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", self.num_generation_tokens)
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            labels=[*keys, "finished_reason"],
        )
        for reason, n in self.num_finished.items():
            success.add_metric([*values, reason], n)
        yield success
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            sched.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            sched.prefix_cache_hits,
        )
        yield counter(
            "num_preemptions", "Requests preempted for KV cache room.", sched.num_preemptions
        )
        yield histogram("time_to_first_token_seconds", "Arrival to first token.", self.ttft)
        yield histogram("inter_token_latency_seconds", "Gap between consecutive tokens.", self.itl)
        yield histogram("e2e_request_latency_seconds", "Arrival to finish.", self.e2e)
        yield histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", self.prompt_lens
        )
        yield histogram(
            "request_generation_tokens",
            "Generated tokens of finished requests.",
            self.generation_lens,
        )
        yield counter("spec_decode_num_drafts", "Speculative drafts proposed.", self.num_drafts)
        yield counter(
            "spec_decode_num_draft_tokens",
            "Speculative draft tokens proposed.",
            self.num_draft_tokens,
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative draft tokens accepted.",
            self.num_accepted_tokens,
        )
        if self.accepted_per_position:
            per_pos = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Speculative draft tokens accepted, by draft position.",
                labels=[*keys, "position"],
            )
            for pos, n in enumerate(self.accepted_per_position):
                per_pos.add_metric([*values, str(pos)], n)
            yield per_pos

    def snapshot(self) -> list[Metric]:
        """Every metric as `Counter` / `Gauge` / `Histogram` / `Vector` values."""
        return snapshot_registry(self.registry)

    # ---- outputs ----------------------------------------------------------------------

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve the registry in Prometheus text format at `http://addr:port/metrics`.

        Port 0 lets the system pick a free port; the port used is returned (and kept in
        `http_port`).
        """
        from prometheus_client import start_http_server

        try:
            server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:  # most often: the port is taken (by another engine?)
            raise OSError(
                e.errno,
                f"metrics_port={port} cannot be served on {addr}: {e.strerror}; pass another "
                "port, or metrics_port=0 for any free one",
            ) from e
        self._http_server = server
        self.http_port = int(server.server_address[1])
        logger.info("Prometheus metrics served on port %d", self.http_port)
        return self.http_port

    def shutdown(self) -> None:
        """Stop the HTTP exposition, if any (idempotent)."""
        server, self._http_server = self._http_server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def log_if_due(self) -> None:
        """Log throughput and cache use every `LOG_INTERVAL_S` seconds."""
        now = time.monotonic()
        last, last_prompt, last_gen = self._last_log
        if now - last < LOG_INTERVAL_S:
            return
        sched = self._scheduler_snapshot() or _IDLE
        elapsed = now - last
        hit_rate = sched.prefix_cache_hits / max(sched.prefix_cache_queries, 1)
        logger.info(
            "prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, "
            "running %d, waiting %d, KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
            (self.num_prompt_tokens - last_prompt) / elapsed,
            (self.num_generation_tokens - last_gen) / elapsed,
            sched.num_running,
            sched.num_waiting,
            100 * sched.kv_cache_usage,
            100 * hit_rate,
        )
        self._last_log = (now, self.num_prompt_tokens, self.num_generation_tokens)


def snapshot_registry(registry: CollectorRegistry, prefix: str = PREFIX) -> list[Metric]:
    """The registry's metrics whose name starts with `prefix`, as snapshot dataclasses.

    Counters with a `position` label become one `Vector` per other-label combination.
    """
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        if family.type == "gauge":
            out.extend(Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples)
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name.endswith("_total")]
            if totals and all("position" in s.labels for s in totals):
                out.extend(_vectors(family.name, totals))
            else:
                out.extend(Counter(family.name, dict(s.labels), int(s.value)) for s in totals)
        elif family.type == "histogram":
            out.extend(_histograms(family))
    return out


def _vectors(name: str, samples: list[Any]) -> list[Vector]:
    groups: dict[tuple, dict[int, int]] = {}
    for s in samples:
        labels = {k: v for k, v in s.labels.items() if k != "position"}
        key = tuple(sorted(labels.items()))
        groups.setdefault(key, {})[int(s.labels["position"])] = int(s.value)
    out = []
    for key, by_pos in groups.items():
        values = [by_pos.get(i, 0) for i in range(max(by_pos) + 1)]
        out.append(Vector(name, dict(key), values))
    return out


def _histograms(family: Any) -> list[Histogram]:
    groups: dict[tuple, dict[str, Any]] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        entry = groups.setdefault(
            tuple(sorted(labels.items())), {"labels": labels, "buckets": {}, "count": 0, "sum": 0}
        )
        if s.name.endswith("_bucket"):
            entry["buckets"][s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            entry["count"] = int(s.value)
        elif s.name.endswith("_sum"):
            entry["sum"] = float(s.value)
    return [
        Histogram(family.name, e["labels"], e["count"], e["sum"], e["buckets"])
        for e in groups.values()
    ]
