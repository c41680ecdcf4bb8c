"""Where a decode step's time goes: the CUDA kernels of W3 and a W1-like batch, under
`torch.profiler`, against the step's wall time.

A random-weight Llama-3.1-8B-shaped checkpoint (safetensors written directly, bf16) is
loaded into one `LLM` (max_num_seqs 256, CUDA graphs unless --enforce-eager). Each workload
is driven step by step through `llm.llm_engine`; once every request is past its prompt,
each step is a pure decode step. Over those steps it prints:

- the wall time per decode step (without the profiler, then with it),
- the GPU busy time per decode step (the union of every kernel's and copy's interval),
  so host overhead = wall - GPU busy,
- the top 25 CUDA kernels by total time: calls, calls per step, per-call and per-step µs,
- with --host-profile, rank 0's Python functions over as many more steps (cProfile, its
  overhead included): where the host's share of a step goes, and how long it waits for
  the device.

W3: batch 1, 32-token prompt, 64 output tokens, greedy (run inside CUDA graphs).
W1-prefill: W1's prompts with one output token each: the prefill phase alone (steps of
    max_num_batched_tokens prompt tokens), wall against GPU busy, its top kernels.
W1-run: the whole of W1 (256 x 512-token prompts, 256 greedy tokens each) step by step under
    the profiler: wall against GPU busy over the run, the device's idle gaps (how many, how
    long, the largest with the activities either side, grouped by those), the Triton
    kernel variants compiled and the garbage collector's passes inside the run, and the
    host's time per step call by phase (steps with prompt tokens, then pure decode).
W2 (with --model qwen05b): 256 prompts of 100-1,024 tokens as W2's, sampled at temperature
    0.6, every request decoding: its steps at their largest batch.
W1: 256 x 512-token prompts, greedy, with output long enough for 2 + 2 x --w1-steps decode
    steps with all 256 running after the last prefill chunk (chunked prefill interleaves the
    first requests' decodes with the later prompts, so those steps come late).

    python3 benchmarks/tools/profile_decode.py --out $OUT/profile.txt
    python3 benchmarks/tools/profile_decode.py --model qwen3moe  # W6's shape, dummy weights
    python3 benchmarks/tools/profile_decode.py --model llama8b-int4 --workload W3  # W3-int4
    python3 benchmarks/tools/profile_decode.py --smoke  # tiny shapes, CPU activities only
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_generate import LLAMA_8B, LLAMA_8B_RANK_SHARE, QWEN_05B, SMOKE, prompts_of  # noqa: E402
from int4 import gptq_config  # noqa: E402
from moe_w6 import QWEN3_30B_A3B  # noqa: E402
from moe_w6 import SMOKE as MOE_SMOKE  # noqa: E402
from timeline import RunLog, busy_us, device_events, idle_gaps  # noqa: E402

from batchlm.engine import LLM, SamplingParams  # noqa: E402
from batchlm.engine.gc_freeze import gc_heap_frozen  # noqa: E402

TOP_KERNELS = 25
MODEL_NAMES = {
    "llama8b": "Llama-3.1-8B",
    "llama8b-int4": "Llama-3.1-8B GPTQ (4-bit, symmetric, groups of 128; 32 with --smoke)",
    "qwen3moe": "Qwen3-30B-A3B",
    "qwen05b": "Qwen2.5-0.5B",
}


def write_random_llama(shape: dict, folder: Path, dtype: torch.dtype, device: str) -> Path:
    """config.json and seeded random safetensors in the names batchlm's loader reads (HF
    Llama's), generated on `device`, one file per few layers. Seconds for the 8B shape."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = dict(shape, torch_dtype=str(dtype).removeprefix("torch."))
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    q_size = shape["num_attention_heads"] * head_dim
    kv_size = shape["num_key_value_heads"] * head_dim
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int) -> torch.Tensor:  # std 0.02, as HF initialises
        return torch.empty(size, device=device, dtype=dtype).normal_(0, 0.02, generator=gen).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    save_file(
        {
            "model.embed_tokens.weight": randn(shape["vocab_size"], hidden),
            "model.norm.weight": ones(hidden),
            "lm_head.weight": randn(shape["vocab_size"], hidden),
        },
        str(folder / "model-embed.safetensors"),
        metadata={"format": "pt"},
    )
    layers_per_file = 4
    for first in range(0, shape["num_hidden_layers"], layers_per_file):
        tensors = {}
        for i in range(first, min(first + layers_per_file, shape["num_hidden_layers"])):
            p = f"model.layers.{i}."
            tensors.update(
                {
                    p + "input_layernorm.weight": ones(hidden),
                    p + "post_attention_layernorm.weight": ones(hidden),
                    p + "self_attn.q_proj.weight": randn(q_size, hidden),
                    p + "self_attn.k_proj.weight": randn(kv_size, hidden),
                    p + "self_attn.v_proj.weight": randn(kv_size, hidden),
                    p + "self_attn.o_proj.weight": randn(hidden, q_size),
                    p + "mlp.gate_proj.weight": randn(inter, hidden),
                    p + "mlp.up_proj.weight": randn(inter, hidden),
                    p + "mlp.down_proj.weight": randn(hidden, inter),
                }
            )
        save_file(
            tensors,
            str(folder / f"model-layers-{first:03d}.safetensors"),
            metadata={"format": "pt"},
        )
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def is_decode_only(engine, num_requests: int) -> bool:
    """Whether the next steps run one new token for each of the `num_requests` requests:
    all running, every prompt computed (a step launched ahead may still be in flight)."""
    scheduler = engine.scheduler
    return (
        not scheduler.waiting
        and len(scheduler.running) == num_requests
        and all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
    )


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(engine, num_steps: int) -> float:
    """Seconds per step over `num_steps` engine steps."""
    synchronize()
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    synchronize()
    return (time.perf_counter() - start) / num_steps


def kernel_table(
    events, num_steps: int, is_cuda: bool, what_steps: str = "decode steps"
) -> tuple[list[str], float]:
    """The top kernels by total time as text lines, and the busy time per step (µs)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        # CPU ops nest: their self time; kernels do not.
        us = e.time_range.elapsed_us() if is_cuda else e.self_cpu_time_total
        totals[e.name][0] += 1
        totals[e.name][1] += us
    busy = busy_us(events)
    all_us = sum(us for _, us in totals.values()) or 1.0
    what = "CUDA kernels / copies" if is_cuda else "CPU ops (self time)"
    lines = [
        f"top {TOP_KERNELS} {what} by total time over {num_steps} {what_steps}",
        f"{'calls':>7} {'/step':>6} {'total ms':>9} {'us/call':>9} {'us/step':>9} {'%':>5}  name",
    ]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    for name, (calls, us) in ranked[:TOP_KERNELS]:
        lines.append(
            f"{calls:7d} {calls / num_steps:6.1f} {us / 1e3:9.3f} {us / calls:9.2f} "
            f"{us / num_steps:9.1f} {100 * us / all_us:5.1f}  {name[:110]}"
        )
    rest = sum(us for _, (_, us) in ranked[TOP_KERNELS:])
    if rest:
        lines.append(f"{'':>7} {'':>6} {rest / 1e3:9.3f} {'':>9} {rest / num_steps:9.1f} "
                     f"{100 * rest / all_us:5.1f}  ({len(ranked) - TOP_KERNELS} others)")  # fmt: skip
    return lines, busy / num_steps


def busy_lines(wall_us: float, busy_us: float, is_cuda: bool, step: str) -> list[str]:
    """The busy time per step and the host overhead (wall - busy), as report lines."""
    label = f"{'GPU' if is_cuda else 'CPU'} busy per {step}:"
    return [
        f"{label:<32} {busy_us / 1e3:9.3f} ms",
        f"{'host overhead (wall - busy):':<32} {(wall_us - busy_us) / 1e3:9.3f} ms "
        f"({100 * (wall_us - busy_us) / wall_us:.1f}% of the step)",
    ]


def host_profile_lines(engine, num_steps: int) -> list[str]:
    """`num_steps` engine steps under cProfile: rank 0's functions by own time and by
    cumulative time, per step."""
    prof = cProfile.Profile()
    prof.enable()
    per_step = timed_steps(engine, num_steps)
    prof.disable()
    lines = [f"host profile (cProfile) over {num_steps} steps: {per_step * 1e3:.3f} ms per "
             "step with its overhead; seconds are totals over the steps"]  # fmt: skip
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
        body = text.getvalue()
        lines += [f"-- by {key}", *body[body.find("ncalls") :].rstrip().splitlines()]
    return lines


def profile_workload(
    llm: LLM,
    name: str,
    prompts,
    max_tokens: int,
    steps: int,
    warmup: int,
    host_profile: bool = False,
    temperature: float = 0.0,
):
    """Prefill, then `warmup` decode steps, `steps` timed ones, `steps` profiled ones and
    (with `host_profile`) `steps` under cProfile; returns the report's lines."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, params)
    prefill_steps = 0
    synchronize()
    start = time.perf_counter()
    while not is_decode_only(engine, len(prompts)):
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"{name}: the requests finished before a pure decode step")
        engine.step()
        prefill_steps += 1
    synchronize()
    prefill_s = time.perf_counter() - start
    timed_steps(engine, warmup)
    wall = timed_steps(engine, steps)
    is_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if is_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        wall_profiled = timed_steps(engine, steps)
    host = host_profile_lines(engine, steps) if host_profile else []
    if not is_decode_only(engine, len(prompts)):
        raise RuntimeError(f"{name}: a request finished inside the measured window")
    contexts = [r.num_tokens for r in engine.scheduler.running]
    while engine.has_unfinished_requests():
        engine.step()
    table, busy = kernel_table(device_events(prof), steps, is_cuda)
    wall_us = wall * 1e6
    return [
        f"== {name}: {len(prompts)} sequences, contexts {min(contexts)}..{max(contexts)} at "
        f"the end; prefill phase {prefill_steps} steps in {prefill_s:.2f} s; "
        f"{warmup} warm-up + {steps} timed + {steps} profiled decode steps",
        f"wall per decode step:            {wall_us / 1e3:9.3f} ms "
        f"(under the profiler {wall_profiled * 1e3:.3f} ms)",
        *busy_lines(wall_us, busy, is_cuda, "decode step"),
        *table,
        *host,
        "",
    ]


def profile_prefill(llm: LLM, name: str, prompts) -> list[str]:
    """The prompts with one output token each, run twice: timed, then profiled (the
    prefix cache emptied before each)."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    is_cuda = torch.cuda.is_available()

    def run(tag: str) -> tuple[int, float]:
        llm.reset_prefix_cache()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{name}-{tag}-{i}", prompt, params)
        steps = 0
        synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        synchronize()
        return steps, time.perf_counter() - start

    num_steps, wall = run("timed")
    activities = [ProfilerActivity.CUDA] if is_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        _, wall_profiled = run("profiled")
    table, busy = kernel_table(device_events(prof), num_steps, is_cuda, "prefill steps")
    num_tokens = sum(len(p) for p in prompts)
    wall_us = wall * 1e6 / num_steps
    return [
        f"== {name}: {len(prompts)} prompts, {num_tokens} tokens, one output token each; "
        f"{num_steps} steps in {wall:.3f} s ({num_tokens / wall:,.0f} prompt tokens/s; "
        f"under the profiler {wall_profiled:.3f} s)",
        f"wall per step:                   {wall_us / 1e3:9.3f} ms",
        *busy_lines(wall_us, busy, is_cuda, "step"),
        *table,
        "",
    ]


def profile_run(llm: LLM, name: str, prompts, max_tokens: int) -> list[str]:
    """The whole batch, step by step, under the profiler: wall and GPU busy over the run,
    idle gaps, and the host's time per step call (prompt steps, then pure decode)."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    is_cuda = torch.cuda.is_available()
    llm.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, params)
    host_ms: dict[str, list[float]] = {"prompt": [], "decode": []}
    activities = [ProfilerActivity.CUDA] if is_cuda else [ProfilerActivity.CPU]
    # As in LLM.generate: the objects made before the run stay out of full collections.
    with profile(activities=activities) as prof, gc_heap_frozen(), RunLog() as log:
        synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            phase = "decode" if is_decode_only(engine, len(prompts)) else "prompt"
            log.step += 1
            t = time.perf_counter()
            engine.step()
            host_ms[phase].append((time.perf_counter() - t) * 1e3)
        synchronize()
        wall = time.perf_counter() - start
    events = device_events(prof)
    busy = busy_us(events) / 1e6
    named_gaps = sorted(idle_gaps(events), reverse=True)
    gaps = [g for g, _, _ in named_gaps]
    tokens = len(prompts) * max_tokens
    lines = [
        f"== {name}: {len(prompts)} prompts, {max_tokens} output tokens each; "
        f"{sum(len(v) for v in host_ms.values())} steps in {wall:.3f} s under the profiler "
        f"({tokens / wall:,.0f} output tok/s)",
        f"{'GPU' if is_cuda else 'CPU'} busy {busy:.3f} s; idle {wall - busy:.3f} s of the wall time "
        f"({100 * (wall - busy) / wall:.1f}%)",
        f"idle gaps between device activities: {len(gaps)}, {sum(gaps) / 1e3:.1f} ms in all",
    ]
    for low, high in [(0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf"))]:
        inside = [g for g in gaps if low <= g < high]
        lines.append(f"  {low:>5}..{high:<5} us: {len(inside):7d} gaps, "
                     f"{sum(inside) / 1e3:9.1f} ms")  # fmt: skip
    lines.append("  largest (us), with the activities either side:")
    lines += [
        f"  {g:8.0f}  {before[:50]}  ->  {after[:50]}" for g, before, after in named_gaps[:12]
    ]
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for g, before, after in named_gaps:
        if g >= 100:
            pairs[before[:50], after[:50]].append(g)
    lines.append("  gaps of 100 us or more by the activities either side:")
    for (before, after), values in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:10]:
        lines.append(f"  {len(values):5d} gaps, {sum(values) / 1e3:7.1f} ms: {before} -> {after}")
    lines += log.lines()
    for phase, values in host_ms.items():
        if values:
            ordered = sorted(values)
            lines.append(
                f"host time per step call, {phase} steps ({len(values)}): median "
                f"{ordered[len(ordered) // 2]:.2f} ms, p90 {ordered[int(len(ordered) * 0.9)]:.2f}"
                f", max {ordered[-1]:.2f}, total {sum(values) / 1e3:.3f} s"
            )
    return [*lines, ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the tables to this text file")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on this machine's device")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--batch-invariant", action="store_true", help="LLM(batch_invariant=True)")
    ap.add_argument(
        "--workload", action="append", choices=["W3", "W1", "W1-prefill", "W1-run", "W2"]
    )
    ap.add_argument("--w3-steps", type=int, default=28, help="timed (and profiled) W3 steps")
    ap.add_argument("--w1-steps", type=int, default=8, help="timed (and profiled) W1 steps")
    ap.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks (rank 0's kernels profiled)"
    )
    ap.add_argument(
        "--host-profile", action="store_true", help="also cProfile rank 0 over the steps"
    )
    ap.add_argument("--model-dir", default=None, help="reuse / keep the random checkpoint here")
    ap.add_argument(
        "--model",
        choices=sorted(MODEL_NAMES),
        default="llama8b",
        help="qwen3moe: W6's Qwen3-30B-A3B shape; qwen05b: W2's Qwen2.5-0.5B shape; "
        "llama8b-int4: W3-int4's GPTQ config (all load_format='dummy': no checkpoint written)",
    )
    ap.add_argument(
        "--rank-share",
        action="store_true",
        help="one rank's share of the model at tensor_parallel_size=2, as a model of its own",
    )
    args = ap.parse_args()
    is_cuda = torch.cuda.is_available()
    if not is_cuda and not args.smoke:
        print("profile_decode: needs a CUDA GPU (or --smoke for tiny shapes on CPU)")
        return 0
    moe = args.model == "qwen3moe"
    dummy = args.model != "llama8b"
    if moe:
        shape = dict(QWEN3_30B_A3B, **(MOE_SMOKE if args.smoke else {}))
    elif args.model == "qwen05b":
        shape = dict(QWEN_05B, **(SMOKE if args.smoke else {}))
    else:
        shape = LLAMA_8B_RANK_SHARE if args.rank_share else LLAMA_8B
        if args.model == "llama8b-int4":
            shape = dict(shape, quantization_config=gptq_config(args.smoke))
        if args.smoke:
            shape = {**shape, **SMOKE, "bos_token_id": 1, "eos_token_id": 2, "head_dim": None}
    dtype = torch.bfloat16 if is_cuda else torch.float32
    lines = [
        f"device: {torch.cuda.get_device_name() if is_cuda else 'cpu'}; model: "
        f"{'smoke ' if args.smoke else ''}{MODEL_NAMES[args.model]} shape"
        f"{' (one rank share at tensor_parallel_size=2)' if args.rank_share else ''}, "
        f"random weights, {dtype}, "
        f"tensor_parallel_size={args.tensor_parallel_size}"
        f"{', batch_invariant=True' if args.batch_invariant else ''}",
    ]
    print(lines[0], flush=True)
    folder = Path(args.model_dir or tempfile.mkdtemp(prefix="profile-decode-"))
    start = time.perf_counter()
    if dummy:  # random weights drawn by the engine (load_format="dummy")
        folder.mkdir(parents=True, exist_ok=True)
        config = dict(shape, torch_dtype=str(dtype).removeprefix("torch."))
        (folder / "config.json").write_text(json.dumps(config))
    elif not (folder / "config.json").exists():
        write_random_llama(shape, folder, dtype, "cuda" if is_cuda else "cpu")
        if is_cuda:
            torch.cuda.empty_cache()  # the engine sizes its KV cache from free memory
    lines.append(f"checkpoint written in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    llm = LLM(
        str(folder),
        dtype=str(dtype).removeprefix("torch."),
        skip_tokenizer_init=True,
        load_format="dummy" if dummy else "auto",
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        gpu_memory_utilization=0.85,
        max_num_seqs=256,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    lines.append(f"engine built in {time.perf_counter() - start:.1f} s")
    print("\n".join(lines[1:]), flush=True)
    vocab = shape["vocab_size"]
    # One short run first: compiles the kernels outside every measured window.
    llm.generate([{"prompt_token_ids": p} for p in prompts_of([32, 40], vocab, 9)],
                 SamplingParams(max_tokens=8, ignore_eos=True, temperature=0),
                 use_tqdm=False)  # fmt: skip
    for workload in args.workload or ["W3", "W1"]:
        if workload == "W3":
            steps, warmup = args.w3_steps, 3
            max_tokens = max(64, 2 + warmup + 3 * steps)
            report = profile_workload(
                llm, "W3", prompts_of([32], vocab, 0), max_tokens, steps, warmup,
                args.host_profile,
            )  # fmt: skip
        elif workload == "W2":
            # W2's batch at its start: 256 prompts of 100-1,024 tokens (seed 0), sampled at
            # temperature 0.6, every request decoding.
            steps, warmup = args.w1_steps, 2
            rng = random.Random(0)
            lens = [rng.randint(100, 1024) for _ in range(256)]
            report = profile_workload(
                llm, "W2", prompts_of(lens, vocab, 0), 64 + warmup + 3 * steps, steps, warmup,
                args.host_profile, temperature=0.6,
            )  # fmt: skip
        elif workload == "W1-prefill":
            report = profile_prefill(llm, workload, prompts_of([512] * 256, vocab, 0))
        elif workload == "W1-run":
            # As gpu_generate's W1: a warm-up with its sampling and full prefill steps.
            llm.generate([{"prompt_token_ids": p} for p in prompts_of([512] * 32, vocab, 5)],
                         SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
                         use_tqdm=False)  # fmt: skip
            report = profile_run(llm, workload, prompts_of([512] * 256, vocab, 0), 256)
        else:
            steps, warmup = args.w1_steps, 2
            budget = llm.llm_engine.config.scheduler.max_num_batched_tokens
            prefill_steps = -(-256 * 512 // budget) + 4  # a few to spare
            report = profile_workload(
                llm,
                "W1",
                prompts_of([512] * 256, vocab, 0),
                prefill_steps + 1 + warmup + 3 * steps,
                steps,
                warmup,
                args.host_profile,
            )
        print("\n".join(report), flush=True)
        lines += report
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    if not args.model_dir:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
