"""Host time of one decode step's bookkeeping, without a model: the scheduler and the
runner's input layout for a batch of running requests (W1 / W2-sized by default).

With async scheduling the device runs step N while the host schedules and lays out step
N+1; when that takes longer than the device's step (small models: W2), the host sets the
pace. This measures the host's share on this machine's CPU:

- `schedule`: `Scheduler.schedule` with one step in flight (tokens read on the device),
- `update`: `Scheduler.update_from_output` of the step before,
- `prepare`: `ModelRunner.prepare_inputs`, block tables gathered from the scheduler's
  table rows, and (`prepare, walking ids`) built from the requests' id lists instead.

Each figure is the fastest of several repeats of many steps (the median is printed too):
timings on a shared machine are noisy.

    python3 benchmarks/tools/host_step.py [--requests 256] [--context 768]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from types import SimpleNamespace

from batchlm.engine.config import SchedulerConfig
from batchlm.engine.core.kv_cache import KVCacheManager
from batchlm.engine.core.request import Request
from batchlm.engine.core.scheduler import Scheduler
from batchlm.engine.sampling_params import SamplingParams
from batchlm.engine.worker.model_runner import ModelRunner


class _LayoutOnly:
    """The runner fields `ModelRunner.prepare_inputs` reads, without a model."""

    spec = None
    images = None  # a text model
    lora = None
    num_tokens_from_device = 0
    _fill_sources = ModelRunner._fill_sources

    def __init__(self, block_size: int, request_ids: list[str]) -> None:
        self.block_size = block_size
        # The step in flight sampled every request (its row in the samples).
        self._last_samples = SimpleNamespace(rows={rid: i for i, rid in enumerate(request_ids)})


def best_and_median(samples: list[float]) -> str:
    ordered = sorted(samples)
    return f"{ordered[0] * 1e6:8.0f} us (median {ordered[len(ordered) // 2] * 1e6:.0f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=768, help="prompt tokens per request")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40, help="steps per repeat")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    rng = random.Random(0)
    blocks = args.requests * (args.context // args.block_size + 64)
    kv = KVCacheManager(blocks, args.block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=1 << 22, max_num_seqs=args.requests)
    sched = Scheduler(config, kv, args.context + 4096)
    params = SamplingParams(max_tokens=4096, ignore_eos=True, temperature=0.6)
    for i in range(args.requests):
        prompt = [rng.randrange(30000) for _ in range(args.context)]
        sched.add_request(Request(str(i), prompt, params, (2,), i))
    runner = _LayoutOnly(args.block_size, [str(i) for i in range(args.requests)])
    times: dict[str, list[float]] = {
        "schedule": [], "update": [], "prepare": [], "prepare, walking ids": []
    }  # fmt: skip
    inflight = sched.schedule()
    for repeat in range(args.repeats + 1):
        totals = dict.fromkeys(times, 0.0)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = sched.schedule(ahead=True)
            t1 = time.perf_counter()
            ModelRunner.prepare_inputs(runner, out.scheduled, out.block_table)
            t2 = time.perf_counter()
            ModelRunner.prepare_inputs(runner, out.scheduled)
            t3 = time.perf_counter()
            sampled = {s.request_id: 7 for s in inflight.scheduled if s.needs_sample}
            sched.update_from_output(inflight, sampled)
            t4 = time.perf_counter()
            inflight = out
            totals["schedule"] += t1 - t0
            totals["prepare"] += t2 - t1
            totals["prepare, walking ids"] += t3 - t2
            totals["update"] += t4 - t3
        if repeat:  # the first repeat warms up
            for name, total in totals.items():
                times[name].append(total / args.steps)
    print(
        f"{args.requests} running requests, contexts from {args.context} tokens, blocks of "
        f"{args.block_size}; host time per decode step:"
    )
    for name, samples in times.items():
        print(f"  {name:22s} {best_and_median(samples)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
