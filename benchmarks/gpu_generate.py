"""W1, W2, W3 and W5 of BENCHMARKS.md on a CUDA GPU: batchlm against its baseline, one run.

Random-weight models of real shapes (seeded; throughput does not depend on weight values
once output lengths are fixed with `ignore_eos`), random token-id prompts (seed 0). The
baseline runs first on the same weights, is freed, then batchlm loads them from the same
folder. Each line of output is one JSON record (see benchmarks/common.py).

    python benchmarks/gpu_generate.py --workload W1 --out results.jsonl
    python benchmarks/gpu_generate.py --workload W3 --workload W5
    python benchmarks/gpu_generate.py --workload W1 --workload W2 --workload W3 \
        --batch-invariant --no-baseline --out bi.jsonl

W1: Llama-3.1-8B shape, 256 requests × 512 prompt tokens, 256 output tokens, greedy;
    HF `generate` at batch 128.
W2: Qwen2.5-0.5B shape, 256 requests, prompt and output lengths uniform in [100, 1024],
    temperature 0.6; HF continuous batching (`generate_batch`) when `--baseline-w2`.
W3: Llama-3.1-8B shape, batch 1, 32-token prompt, 256 output tokens; HF `generate`.
W1-fp8: W1's batch in bf16 against fp8, and fp8 with an fp8 KV cache (all batchlm).
W1-json: W1's batch with a JSON schema on every request (structured outputs, xgrammar)
    against the same batch unconstrained (both batchlm; a synthetic tokenizer of the model's
    vocabulary, see synthetic_tokenizer.py).
W3-ngram: batch 1, a copy-heavy prompt (the model made to copy, see `w3_ngram`), ngram
    speculation against none (both batchlm).
W3-tp2: W3 with tensor_parallel_size=2 against 1 (both batchlm; 2 GPUs).
W1-bi, W2-bi, W3-bi (with `--batch-invariant`): W1, W2 and W3 again with
    `batch_invariant=True`, each recorded against the default mode's run just before it.
W5: Llama-3.1-8B shape, 256 requests sharing a 1,024-token prefix + 64 own tokens, 64 output
    tokens; batchlm with prefix caching on against off.

Every batchlm record carries a decode-step breakdown: the measured time per decode step
(the full run minus a prefill-only run, over the decode steps) against the floor
(weight bytes + KV bytes read per step) / HBM bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Recorder, Timer
from timeline import RunLog, StepLog, python_speed_ms

from batchlm.engine import LLM, SamplingParams

HBM_BYTES_PER_S = 4.23e12  # measured device-to-device copy rate of the H200
DEVICE = "cuda"
DTYPE = torch.bfloat16
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
# One rank's share of LLAMA_8B at tensor_parallel_size=2 as a model of its own (half the
# query and KV heads, of the MLP and of the vocabulary): on one GPU, the per-rank work of
# W3-tp2 without any communication.
LLAMA_8B_RANK_SHARE = dict(
    LLAMA_8B,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=14336 // 2,
    vocab_size=128256 // 2,
    bos_token_id=1,
    eos_token_id=2,
)
QWEN_05B = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)


def build_random_model(shape: dict, folder: Path):
    """A seeded random-weight HF model on the GPU (bf16), saved to `folder` for batchlm."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE, device_map=DEVICE)
    else:
        config = AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "architectures"})
        config.architectures = shape["architectures"]
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
        model.save_pretrained(folder, max_shard_size="20GB")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(n)] for n in lengths]


def hf_generate(model, prompts: list[list[int]], max_new: int, batch_size: int) -> float:
    """Seconds for HF `generate` over `prompts` in batches (left-padded, greedy)."""
    total = 0.0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=DEVICE)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=DEVICE)
        with torch.inference_mode(), Timer() as t:
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
            )
        total += t.seconds
    return total


def release() -> None:
    """Returns the memory of models and engines the caller has just dropped (`del`)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_COMPILES = {"total": 0, "last_run": 0}


def count_triton_compiles() -> None:
    """From now on, count Triton's kernel compilations (JIT cache misses: compiled, or
    loaded from its disk cache), so that each timed run can say how many fell inside it."""
    import triton

    previous = triton.knobs.runtime.jit_cache_hook

    def hook(**kwargs):
        _COMPILES["total"] += 1
        return previous(**kwargs) if previous else False

    triton.knobs.runtime.jit_cache_hook = hook


def compiles_in_last_run() -> int:
    """Triton compilations inside the last `run_batchlm` (0 after a proper warm-up)."""
    return _COMPILES["last_run"]


def run_batchlm(llm: LLM, prompts, params) -> tuple[float, list]:
    llm.reset_prefix_cache()
    before = _COMPILES["total"]
    with Timer() as t:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _COMPILES["last_run"] = _COMPILES["total"] - before
    return t.seconds, outs


def weight_bytes(llm: LLM) -> int:
    model = llm.llm_engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_breakdown(llm: LLM, prompts, params: SamplingParams, shape: dict) -> dict:
    """Time per decode step against the bandwidth floor, for a fixed-length batch."""
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=params.temperature)
    prefill_s, _ = run_batchlm(llm, prompts, one)
    full_s, outs = run_batchlm(llm, prompts, params)
    steps = max(len(o.outputs[0].token_ids) for o in outs) - 1
    per_step = (full_s - prefill_s) / max(steps, 1)
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    kv_bytes_per_token = (
        2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2
    )
    mean_ctx = sum(len(p) for p in prompts) / len(prompts) + (steps + 1) / 2
    floor = (weight_bytes(llm) + len(prompts) * mean_ctx * kv_bytes_per_token) / HBM_BYTES_PER_S
    return dict(
        prefill_seconds=round(prefill_s, 3),
        decode_steps=steps,
        decode_ms_per_step=round(per_step * 1e3, 3),
        decode_floor_ms_per_step=round(floor * 1e3, 3),
        decode_step_over_floor=round(per_step / floor, 2),
    )


def make_llm(folder: Path, args, **kwargs) -> LLM:
    kwargs.setdefault("skip_tokenizer_init", True)
    return LLM(
        str(folder),
        dtype=str(DTYPE).removeprefix("torch."),
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=0.85,
        **(
            {"max_num_batched_tokens": args.max_num_batched_tokens}
            if args.max_num_batched_tokens
            else {}
        ),
        **kwargs,
    )


def step_budget(llm: LLM) -> dict:
    """The engine's per-step limits (defaults depend on the device), for the record."""
    sched = llm.llm_engine.config.scheduler
    return dict(
        max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs
    )


def batch_invariant_run(
    args,
    rec: Recorder,
    folder: Path,
    workload: str,
    default: float,
    prompts,
    params,
    warmup: SamplingParams,
    max_num_seqs: int,
    shape: dict | None = None,
) -> None:
    """`workload` again with `batch_invariant=True`, recorded as `<workload>-bi` with the
    default mode's value (`default`, same metric) as its baseline. W3's metric is a time
    per token (its ratio: the mode's time over the default's); the others' a throughput
    (the mode's over the default's)."""
    llm = make_llm(folder, args, max_num_seqs=max_num_seqs, batch_invariant=True)
    run_batchlm(llm, prompts, warmup)
    secs, outs = run_batchlm(llm, prompts, params)
    compiles = compiles_in_last_run()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    per_token = workload == "W3"
    value = secs / tokens * 1e3 if per_token else tokens / secs
    rec.record(
        workload=f"{workload}-bi",
        system="batchlm-batch-invariant",
        metric="ms_per_token" if per_token else "output_tok_per_s",
        value=round(value, 3 if per_token else 1),
        seconds=round(secs, 3),
        output_tokens=tokens,
        baseline_value=default,
        baseline="batchlm default mode, same run",
        ratio=round(value / default, 3),
        dtype=str(DTYPE).removeprefix("torch."),
        triton_compiles_in_run=compiles,
        **step_budget(llm),
        **(decode_breakdown(llm, prompts, params, shape) if shape else {}),
    )
    del llm
    release()


def w1(args, rec: Recorder, folder: Path) -> None:
    prompts = prompts_of([512] * 256, LLAMA_8B["vocab_size"], 0)
    hf = build_random_model(LLAMA_8B, folder)
    base_s = hf_generate(hf, prompts, 256, 128) if args.baseline else None
    del hf
    release()
    llm = make_llm(folder, args, max_num_seqs=256)
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    # Warm-up with the measured run's sampling and full-budget prefill steps mixed with
    # decode rows and a chunked prompt (64 prompts: two full steps at a budget of 16384),
    # so that no kernel is compiled inside the timed run. 32 prompts left one kernel variant
    # to the timed run at 16384 (9,375 tok/s on a fresh machine).
    run_batchlm(llm, prompts[:64], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    secs, _ = run_batchlm(llm, prompts, params)
    compiles = compiles_in_last_run()
    tps = 256 * 256 / secs
    base = 256 * 256 / base_s if base_s else None
    rec.record(
        workload="W1",
        system="batchlm",
        metric="output_tok_per_s",
        value=round(tps, 1),
        seconds=round(secs, 3),
        baseline_value=round(base, 1) if base else None,
        ratio=round(tps / base, 3) if base else None,
        model="Llama-3.1-8B shape, random weights",
        dtype="bfloat16",
        num_requests=256,
        prompt_len=512,
        output_len=256,
        **step_budget(llm),
        triton_compiles_in_run=compiles,
        **decode_breakdown(llm, prompts, params, LLAMA_8B),
    )
    if base:
        rec.record(
            workload="W1",
            system="hf-generate",
            metric="output_tok_per_s",
            value=round(base, 1),
            seconds=round(base_s, 3),
            batch_size=128,
        )
    del llm
    release()
    if args.batch_invariant:
        warmup = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        batch_invariant_run(
            args, rec, folder, "W1", round(tps, 1), prompts, params, warmup, 256, LLAMA_8B
        )


def w3(args, rec: Recorder, folder: Path) -> None:
    prompts = prompts_of([32], LLAMA_8B["vocab_size"], 0)
    hf = build_random_model(LLAMA_8B, folder)
    base_ms = None
    if args.baseline:
        hf_generate(hf, prompts, 8, 1)
        base_ms = hf_generate(hf, prompts, 256, 1) / 256 * 1e3
    del hf
    release()
    llm = make_llm(folder, args, max_num_seqs=16)
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    run_batchlm(llm, prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    secs, _ = run_batchlm(llm, prompts, params)
    ms = secs / 256 * 1e3
    rec.record(
        workload="W3",
        system="batchlm",
        metric="ms_per_token",
        value=round(ms, 3),
        seconds=round(secs, 3),
        triton_compiles_in_run=compiles_in_last_run(),
        baseline_value=round(base_ms, 3) if base_ms else None,
        ratio=round(base_ms / ms, 3) if base_ms else None,
        model="Llama-3.1-8B shape, random weights",
        dtype="bfloat16",
        batch_size=1,
        prompt_len=32,
        output_len=256,
        **step_budget(llm),
        **decode_breakdown(llm, prompts, params, LLAMA_8B),
    )
    if base_ms:
        rec.record(
            workload="W3", system="hf-generate", metric="ms_per_token", value=round(base_ms, 3)
        )
    del llm
    release()
    if args.batch_invariant:
        warmup = SamplingParams(max_tokens=16, ignore_eos=True)
        batch_invariant_run(
            args, rec, folder, "W3", round(ms, 3), prompts, params, warmup, 16, LLAMA_8B
        )


def w5(args, rec: Recorder, folder: Path) -> None:
    vocab = LLAMA_8B["vocab_size"]
    prefix = prompts_of([1024], vocab, 1)[0]
    prompts = [prefix + own for own in prompts_of([64] * 256, vocab, 2)]
    if not (folder / "config.json").exists():
        build_random_model(LLAMA_8B, folder)
        release()
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    results, compiles = {}, 0
    for caching in (False, True):
        llm = make_llm(folder, args, max_num_seqs=256, enable_prefix_caching=caching)
        run_batchlm(llm, prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))
        results[caching], _ = run_batchlm(llm, prompts, params)
        compiles += compiles_in_last_run()
        budget = step_budget(llm)
        del llm
        release()
    tps_on, tps_off = 256 * 64 / results[True], 256 * 64 / results[False]
    common = dict(
        workload="W5",
        metric="output_tok_per_s",
        model="Llama-3.1-8B shape, random weights",
        shared_prefix_len=1024,
        own_len=64,
        output_len=64,
        num_requests=256,
        triton_compiles_in_runs=compiles,
        **budget,
    )
    rec.record(system="batchlm-prefix-caching-off", value=round(tps_off, 1), **common)
    rec.record(
        system="batchlm",
        value=round(tps_on, 1),
        baseline_value=round(tps_off, 1),
        ratio=round(tps_on / tps_off, 3),
        **common,
    )


def w2(args, rec: Recorder, folder: Path) -> None:
    rng = random.Random(0)
    lens_in = [rng.randint(100, 1024) for _ in range(256)]
    lens_out = [rng.randint(100, 1024) for _ in range(256)]
    prompts = prompts_of(lens_in, QWEN_05B["vocab_size"], 0)
    hf = build_random_model(QWEN_05B, folder)
    base = None
    if args.baseline_w2:
        from transformers import GenerationConfig

        gen = GenerationConfig(
            max_new_tokens=max(lens_out), do_sample=True, temperature=0.6, eos_token_id=None
        )
        with Timer() as t:
            results = hf.generate_batch(inputs=prompts, generation_config=gen)
        # One max_new_tokens for the whole batch: HF's rate over the tokens it generated.
        base = sum(len(r.generated_tokens) for r in results.values()) / t.seconds
    del hf
    release()
    llm = make_llm(folder, args, max_num_seqs=256)
    # As BENCHMARKS.md gives it: temperature 0.6, no per-request seeds (the engine's seed
    # makes the run reproducible).
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.6) for n in lens_out]
    # Warm-up over every prompt (two tokens each): the timed run's prefill and mixed steps
    # then compile no kernel variant (the first 4 prompts alone left some to the timed run).
    run_batchlm(llm, prompts, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.6))
    runs = []
    for _ in range(args.runs):
        control_ms = python_speed_ms()
        with RunLog() as log, StepLog(llm.llm_engine, log) as steps:
            secs, outs = run_batchlm(llm, prompts, params)
        total = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append(
            dict(
                tok_s=round(total / secs, 1), seconds=round(secs, 3), python_speed_ms=control_ms,
                gc_ms=round(sum(ms for _, _, ms in log.collections), 1),
                slow_gc_passes=log.slow_passes,
                triton_compiles=len(log.compiles), **steps.summary(),
            )
        )  # fmt: skip
    rates = sorted(r["tok_s"] for r in runs)
    tps, compiles = rates[len(rates) // 2], sum(r["triton_compiles"] for r in runs)
    rec.record(
        workload="W2",
        system="batchlm",
        metric="output_tok_per_s",
        value=tps,
        value_is="median of the runs",
        runs=[r["tok_s"] for r in runs],
        spread=round((rates[-1] - rates[0]) / tps, 3),
        run_details=runs,
        output_tokens=total,
        baseline_value=round(base, 1) if base else None,
        ratio=round(tps / base, 3) if base else None,
        model="Qwen2.5-0.5B shape, random weights",
        dtype="bfloat16",
        num_requests=256,
        triton_compiles_in_run=compiles,
        **step_budget(llm),
    )
    del llm
    release()
    if args.batch_invariant:
        warmup = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.6)
        batch_invariant_run(args, rec, folder, "W2", round(tps, 1), prompts, params, warmup, 256)


def w1_fp8(args, rec: Recorder, folder: Path) -> None:
    """W1's batch in bf16, with fp8 weights and activations, and with those and an fp8 KV
    cache, all batchlm, same run."""
    prompts = prompts_of([512] * 256, LLAMA_8B["vocab_size"], 0)
    if not (folder / "config.json").exists():
        build_random_model(LLAMA_8B, folder)
        release()
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    variants = {
        "bf16": {},
        "fp8": dict(quantization="fp8"),
        "fp8+kv": dict(quantization="fp8", kv_cache_dtype="fp8"),
    }
    results = {}
    for name, options in variants.items():
        llm = make_llm(folder, args, max_num_seqs=256, **options)
        run_batchlm(llm, prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True))
        secs, _ = run_batchlm(llm, prompts, params)
        results[name] = 256 * 256 / secs
        del llm
        release()
    common = dict(
        workload="W1-fp8",
        metric="output_tok_per_s",
        num_requests=256,
        prompt_len=512,
        output_len=256,
        model="Llama-3.1-8B shape, random weights",
    )
    base = results["bf16"]
    rec.record(system="batchlm-bf16", value=round(base, 1), **common)
    for name, kv in (("fp8", "auto"), ("fp8+kv", "fp8")):
        rec.record(
            system="batchlm",
            quantization="fp8",
            kv_cache_dtype=kv,
            value=round(results[name], 1),
            baseline_value=round(base, 1),
            ratio=round(results[name] / base, 3),
            **common,
        )


def zero_attention_outputs(llm: LLM) -> None:
    """Zero every layer's attention output projection, in place (the graphs keep reading
    the same tensors): the model's next token is then a function of its current token."""
    for name, module in llm.llm_engine.runner.model.named_modules():
        if name.endswith("o_proj"):
            module.weight.data.zero_()


def w3_ngram(args, rec: Recorder, folder: Path) -> None:
    """Batch 1, a copy-heavy prompt, 256 output tokens; ngram prompt lookup against no
    speculation, both batchlm, same run.

    Random weights do not copy text, so the model is made to: with the attention output
    projections zeroed, each next token depends on the current token alone (the compute per
    step is unchanged: every kernel still runs). The prompt is the model's own greedy
    passage of 320 tokens followed by its first 32 tokens again, so the answer repeats the
    passage from token 32 on, as a model does when it copies from its context; the record
    carries the acceptance rate and how much of the answer the passage predicted."""
    if not (folder / "config.json").exists():
        build_random_model(LLAMA_8B, folder)
        release()
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    start = prompts_of([1], LLAMA_8B["vocab_size"], 3)[0]
    results, accepted, passage, copied = {}, None, None, None
    for spec in (False, True):
        extra = (
            dict(
                spec_method="ngram",
                spec_tokens=4,
                prompt_lookup_min=2,
                prompt_lookup_max=8,
                disable_log_stats=False,
            )
            if spec
            else {}
        )
        llm = make_llm(folder, args, max_num_seqs=16, **extra)
        zero_attention_outputs(llm)
        if passage is None:
            _, outs = run_batchlm(
                llm, [start], SamplingParams(max_tokens=319, ignore_eos=True, temperature=0)
            )
            passage = start + list(outs[0].outputs[0].token_ids)
        prompt = passage + passage[:32]
        run_batchlm(llm, [prompt], SamplingParams(max_tokens=16, ignore_eos=True))
        results[spec], outs = run_batchlm(llm, [prompt], params)
        answer = list(outs[0].outputs[0].token_ids)
        copied = sum(a == b for a, b in zip(answer, passage[32:], strict=False)) / len(answer)
        if spec:
            counts = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
            drafted = counts.get("batchlm:spec_decode_num_draft_tokens", 0)
            accepted = counts.get("batchlm:spec_decode_num_accepted_tokens", 0) / max(drafted, 1)
        del llm
        release()
    rec.record(
        workload="W3-ngram",
        system="batchlm-no-spec",
        metric="ms_per_token",
        value=round(results[False] / 256 * 1e3, 3),
    )
    rec.record(
        workload="W3-ngram",
        system="batchlm",
        metric="ms_per_token",
        value=round(results[True] / 256 * 1e3, 3),
        baseline_value=round(results[False] / 256 * 1e3, 3),
        ratio=round(results[False] / results[True], 3),
        acceptance_rate=round(accepted or 0.0, 3),
        answer_copied_from_passage=round(copied, 3),
        distinct_passage_tokens=len(set(passage)),
        spec_tokens=4,
        prompt="the model's own 320-token greedy passage, then its first 32 tokens again",
        model="Llama-3.1-8B shape, random weights, attention output projections zeroed",
        batch_size=1,
        output_len=256,
    )


def w3_tp2(args, rec: Recorder, folder: Path) -> None:
    """W3 with tensor_parallel_size=2 against 1, both batchlm, same run (2 GPUs)."""
    if torch.cuda.device_count() < 2:
        raise SystemExit("W3-tp2 needs 2 GPUs")
    prompts = prompts_of([32], LLAMA_8B["vocab_size"], 0)
    if not (folder / "config.json").exists():
        build_random_model(LLAMA_8B, folder)
        release()
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    ms = {}
    for tp in (1, 2):
        llm = make_llm(folder, args, max_num_seqs=16, tensor_parallel_size=tp)
        run_batchlm(llm, prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        secs, _ = run_batchlm(llm, prompts, params)
        ms[tp] = secs / 256 * 1e3
        llm.shutdown()
        del llm
        release()
    common = dict(
        workload="W3-tp2",
        metric="ms_per_token",
        model="Llama-3.1-8B shape, random weights",
        dtype="bfloat16",
        batch_size=1,
        prompt_len=32,
        output_len=256,
    )
    rec.record(system="batchlm-tp1", value=round(ms[1], 3), **common)
    rec.record(
        system="batchlm",
        tensor_parallel_size=2,
        value=round(ms[2], 3),
        baseline_value=round(ms[1], 3),
        time_ratio_tp2_over_tp1=round(ms[2] / ms[1], 3),
        ratio=round(ms[1] / ms[2], 3),
        **common,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--workload",
        action="append",
        choices=["W1", "W2", "W3", "W5", "W1-fp8", "W1-json", "W3-ngram", "W3-tp2"],
    )
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument("--baseline-w2", action="store_true", help="HF generate_batch (slow)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="W1, W2, W3: also run batch_invariant=True (records W1-bi, W2-bi, W3-bi)",
    )
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="engine default if unset"
    )
    ap.add_argument("--runs", type=int, default=1, help="W2: timed runs in one process")
    ap.add_argument(
        "--profile", default=None, help="W1-json: kernel tables of short runs, both ways, here"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--model-dir",
        default=None,
        help="keep the random Llama-8B-shaped checkpoint here (reused when it exists)",
    )
    ap.add_argument(
        "--tree",
        default=None,
        help="label each record with the batchlm source tree that ran (A/B of two commits)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on this machine's device")
    args = ap.parse_args()
    if args.smoke:
        global DEVICE, DTYPE
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        DTYPE = torch.float32
        LLAMA_8B.update(SMOKE)
        QWEN_05B.update(SMOKE)
    rec = Recorder(args.out, tree=args.tree)
    count_triton_compiles()
    llama_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="bench-llama8b-"))
    qwen_dir = Path(tempfile.mkdtemp(prefix="bench-qwen05b-"))
    for workload in args.workload or ["W1", "W3", "W5", "W2"]:
        start = time.perf_counter()
        if workload == "W1":
            w1(args, rec, llama_dir)
        elif workload == "W3":
            w3(args, rec, llama_dir)
        elif workload == "W5":
            w5(args, rec, llama_dir)
        elif workload == "W1-fp8":
            w1_fp8(args, rec, llama_dir)
        elif workload == "W1-json":
            from w1_json import w1_json  # imports this module: loaded only when asked for

            w1_json(args, rec, llama_dir)
        elif workload == "W3-ngram":
            w3_ngram(args, rec, llama_dir)
        elif workload == "W3-tp2":
            w3_tp2(args, rec, llama_dir)
        else:
            w2(args, rec, qwen_dir)
        print(json.dumps({"workload": workload, "wall_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    # One module, whether run or imported (w1_json.py imports it): a second copy would
    # miss --smoke's shapes and the Triton compile counter set up here.
    sys.modules["gpu_generate"] = sys.modules[__name__]
    main()
