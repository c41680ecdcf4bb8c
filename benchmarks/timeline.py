"""What a profiled run did over time, shared by the benchmark scripts: the device's
activities merged into busy spans and the idle gaps between them (from a torch.profiler
trace), and what happened on the host meanwhile (`RunLog`: Triton compiles and garbage
collections, by engine step; `StepLog`: each step's host time and what it scheduled;
`StackSampler`: where a thread's Python code was, sampled)."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

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
        self.slow_passes: list[dict] = []
        """Collections of 10 ms or more: step, generation, ms, objects freed; for full
        passes also the objects they went over, their commonest types and the frozen."""
        self._gc_start = 0.0
        self._gen2: tuple = (0, [], 0)

    def _on_compile(self, *, repr, **_) -> bool:
        self.compiles.append((self.step, repr))
        return False  # compile as usual

    def _on_gc(self, phase: str, info: dict) -> None:
        import gc

        if phase == "start":
            # What a full pass goes over (counted before its clock starts): the objects
            # in the oldest generation and their commonest types.
            if info["generation"] == 2:
                objects = gc.get_objects(generation=2)
                types = Counter(type(o).__name__ for o in objects).most_common(5)
                self._gen2 = (len(objects), types, gc.get_freeze_count())
                del objects
            self._gc_start = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._gc_start) * 1e3
            self.collections.append((self.step, info["generation"], ms))
            if ms >= 10:
                detail = {"step": self.step, "generation": info["generation"],
                          "ms": round(ms, 1), "collected": info["collected"]}  # fmt: skip
                if info["generation"] == 2:
                    detail["objects"], detail["commonest"], detail["frozen"] = self._gen2
                self.slow_passes.append(detail)

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


_MODULE_CALL = str(Path("nn", "modules", "module.py"))


class StackSampler:
    """Where one thread's Python code is, sampled every `interval` seconds from a
    background thread: (perf_counter time, its innermost `depth` frames as
    `file:line function`). The sampler runs whenever the sampled thread lets go of the GIL
    (torch ops, waits on the device, every switch interval), so a host stall of tens of
    milliseconds gets many samples."""

    def __init__(self, thread_id: int | None = None, interval: float = 0.002, depth: int = 5):
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.interval, self.depth = interval, depth
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            stack = []
            while frame is not None and len(stack) < self.depth:
                code = frame.f_code
                if not code.co_filename.endswith(_MODULE_CALL):  # nn.Module's call wrappers
                    stack.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            self.samples.append((time.perf_counter(), tuple(stack)))

    def __enter__(self) -> StackSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def during(self, start: float, end: float, top: int = 3) -> list[tuple[int, str]]:
        """The `top` most sampled stacks between two perf_counter times, with their
        counts, innermost frame first."""
        counts = Counter(stack for t, stack in self.samples if start <= t < end)
        return [(n, " < ".join(stack)) for stack, n in counts.most_common(top)]


class StepLog:
    """Each engine step of the calls made inside it, timed on the host: (number, start,
    end in perf_counter seconds, requests it finished, tokens and requests it scheduled).
    With async scheduling a step's time is mostly the wait for the step launched before
    it; the time between steps is the caller's loop. `run_log` (a `RunLog`) is told each
    step's number."""

    def __init__(self, engine, run_log: RunLog | None = None) -> None:
        self.engine, self.run_log = engine, run_log
        self.steps: list[tuple[int, float, float, int, int, int]] = []

    def __enter__(self) -> StepLog:
        engine = self.engine
        step, schedule = engine.step, engine._schedule
        scheduled = [0, 0]

        def logged_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            scheduled[:] = [out.num_scheduled_tokens, len(out.scheduled)]
            return out

        def logged_step():
            n = len(self.steps)
            if self.run_log is not None:
                self.run_log.step = n
            scheduled[:] = [0, 0]
            t = time.perf_counter()
            out = step()
            self.steps.append((n, t, time.perf_counter(), len(out), *scheduled))
            return out

        engine.step, engine._schedule = logged_step, logged_schedule
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step, self.engine._schedule

    def between(self) -> list[tuple[int, float, float, int, int, int]]:
        """The intervals between consecutive steps, as steps of nothing (numbered by the
        step after them)."""
        return [(b[0], a[2], b[1], 0, 0, 0) for a, b in itertools.pairwise(self.steps)]

    def summary(self) -> dict:
        """Steps, their host time (all, decode-only, with prefill), the time between them."""

        def stats(ms: list[float]) -> dict:
            if not ms:
                return {"n": 0}
            ms = sorted(ms)
            return {
                "n": len(ms), "total_ms": round(sum(ms), 1), "median_ms": round(ms[len(ms) // 2], 3),
                "p90_ms": round(ms[int(len(ms) * 0.9)], 3), "max_ms": round(ms[-1], 1),
            }  # fmt: skip

        dur = [((e - s) * 1e3, tok > seqs) for _, s, e, _, tok, seqs in self.steps]
        return {
            "steps": stats([d for d, _ in dur]),
            "decode_only": stats([d for d, prefill in dur if not prefill]),
            "with_prefill": stats([d for d, prefill in dur if prefill]),
            "between_steps": stats([(e - s) * 1e3 for _, s, e, *_ in self.between()]),
        }


def python_speed_ms(iterations: int = 1_000_000) -> float:
    """A control for host-bound runs: ms for a fixed loop of plain Python on this thread.
    A run that is slower with this unchanged was not slowed by the host's CPU speed."""
    t, x = time.perf_counter(), 0
    for i in range(iterations):
        x += i & 7
    return round((time.perf_counter() - t) * 1e3, 2)
