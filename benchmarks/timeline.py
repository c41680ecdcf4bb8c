"""What a profiled run did over time, shared by the benchmark scripts: the device's
activities merged into busy spans and the idle gaps between them (from a torch.profiler
trace), and what happened on the host meanwhile (`RunLog`: Triton compiles and garbage
collections, by engine step)."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

from torch.autograd import DeviceType


def device_events(prof) -> list:
    """The profiled device activities (kernels, copies, sets); on CPU, the CPU ops."""
    events = list(prof.events())
    cuda = [e for e in events if e.device_type == DeviceType.CUDA]
    return cuda or [e for e in events if e.device_type == DeviceType.CPU]


def merged_spans(events) -> list[tuple[float, float, str, str]]:
    """The events' time ranges (µs) merged where they overlap or nest, in order: (start,
    end, the name of the event that starts the span, of the one that ends it)."""
    merged: list[list] = []
    for e in sorted(events, key=lambda e: e.time_range.start):
        start, end = e.time_range.start, e.time_range.end
        if merged and start <= merged[-1][1]:
            if end >= merged[-1][1]:
                merged[-1][1], merged[-1][3] = end, e.name
        else:
            merged.append([start, end, e.name, e.name])
    return [tuple(span) for span in merged]


def busy_us(events) -> float:
    """Microseconds covered by at least one event (overlaps and nesting counted once)."""
    return sum(end - start for start, end, _, _ in merged_spans(events))


def idle_gaps(events) -> list[tuple[float, str, str]]:
    """The device's idle intervals between the first and the last activity: (µs, the
    activity that ended last before it, the one that ends it)."""
    spans = merged_spans(events)
    return [(nxt[0] - prev[1], prev[3], nxt[2]) for prev, nxt in itertools.pairwise(spans)]


class RunLog:
    """What happened on the host during a profiled run, by step: Triton kernel variants
    compiled (a cache miss: compiled, or loaded from Triton's disk cache) and the garbage
    collector's passes, with their durations."""

    def __init__(self) -> None:
        self.step = -1
        self.compiles: list[tuple[int, str]] = []
        self.collections: list[tuple[int, int, float]] = []
        self._gc_start = 0.0

    def _on_compile(self, *, repr, **_) -> bool:
        self.compiles.append((self.step, repr))
        return False  # compile as usual

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._gc_start) * 1e3
            self.collections.append((self.step, info["generation"], ms))

    def __enter__(self) -> RunLog:
        import gc

        import triton

        self._previous_hook = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = self._on_compile
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        import triton

        triton.knobs.runtime.jit_cache_hook = self._previous_hook
        gc.callbacks.remove(self._on_gc)

    def lines(self) -> list[str]:
        lines = [f"Triton kernel variants compiled inside the run: {len(self.compiles)}"]
        lines += [f"  step {step}: {what[:160]}" for step, what in self.compiles[:20]]
        by_gen: dict[int, list[float]] = defaultdict(list)
        for _, gen, ms in self.collections:
            by_gen[gen].append(ms)
        for gen, values in sorted(by_gen.items()):
            lines.append(
                f"garbage collections of generation {gen}: {len(values)}, {sum(values):.1f} ms "
                f"in all, longest {max(values):.2f} ms"
            )
        slow = [(step, gen, ms) for step, gen, ms in self.collections if ms >= 0.5]
        lines += [f"  step {step}: generation {gen}, {ms:.2f} ms" for step, gen, ms in slow[:20]]
        return lines
