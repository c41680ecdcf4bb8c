"""W1-json of BENCHMARKS.md (run through `gpu_generate.py --workload W1-json`): W1's batch
with one JSON schema on every request against the same batch unconstrained, both batchlm,
one engine, one run; the schema and inputs are shared with vLLM's side
(`vllm_w1_json.py`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import gpu_generate as gen
from common import Recorder, Timer, grammar_library_version
from gpu_generate import (
    LLAMA_8B,
    build_random_model,
    compiles_in_last_run,
    make_llm,
    prompts_of,
    release,
    run_batchlm,
    step_budget,
)
from synthetic_tokenizer import build_tokenizer
from timeline import StepLog

from batchlm.engine import LLM, SamplingParams, StructuredOutputsParams

RECORDS_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 24},
                    "tags": {
                        "type": "array",
                        "maxItems": 3,
                        "items": {"enum": ["red", "green", "blue"]},
                    },
                },
                "required": ["id", "name", "tags"],
            },
        }
    },
    "required": ["records"],
}
"""W1-json's schema: no output of 256 tokens completes it (64 records at least), so every
request writes 256 tokens, through keys, bounded integers, strings and enums."""


def w1_json_inputs(folder: Path) -> tuple[Path, list[list[int]]]:
    """W1-json's synthetic tokenizer and prompts, with the model made in `folder` if it
    holds none (shared with the vLLM baseline, `vllm_w1_json.py`)."""
    if not (folder / "config.json").exists():
        build_random_model(LLAMA_8B, folder)
        release()
    vocab = LLAMA_8B["vocab_size"]
    tokenizer = build_tokenizer(
        Path(tempfile.mkdtemp(prefix="bench-tokenizer-")),
        vocab,
        LLAMA_8B["bos_token_id"],
        LLAMA_8B["eos_token_id"],
    )
    return tokenizer, prompts_of([512] * 256, vocab, 0)


def w1_json(args, rec: Recorder, folder: Path) -> None:
    """W1's batch with `RECORDS_SCHEMA` on every request against the same batch
    unconstrained, both batchlm, same engine, same run."""
    tokenizer, prompts = w1_json_inputs(folder)
    vocab = LLAMA_8B["vocab_size"]
    llm = make_llm(
        folder, args, max_num_seqs=256, tokenizer=str(tokenizer), skip_tokenizer_init=False
    )
    free = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    constraint = StructuredOutputsParams(json=RECORDS_SCHEMA, disable_any_whitespace=True)
    constrained = free.clone()
    constrained.structured_outputs = constraint
    with Timer() as compile_timer:  # the tokenizer's vocabulary read, the schema compiled
        run_batchlm(llm, prompts[:1], SamplingParams(max_tokens=1, structured_outputs=constraint))
    for params in (free, constrained):  # warm-up as W1's
        short = params.clone()
        short.max_tokens = 4
        run_batchlm(llm, prompts[:64], short)
    with StepLog(llm.llm_engine) as free_steps:
        free_s, _ = run_batchlm(llm, prompts, free)
    with StepLog(llm.llm_engine) as json_steps:
        json_s, outs = run_batchlm(llm, prompts, constrained)
    if args.profile:
        profile_pair(llm, prompts, free, constrained, path=args.profile)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_tokens == 256 * 256, f"constrained outputs wrote {num_tokens} tokens"
    free_tps, json_tps = 256 * 256 / free_s, num_tokens / json_s
    common = dict(
        workload="W1-json",
        metric="output_tok_per_s",
        model="Llama-3.1-8B shape, random weights",
        dtype=str(gen.DTYPE).removeprefix("torch."),
        num_requests=256,
        prompt_len=512,
        output_len=256,
        async_scheduling=llm.llm_engine.config.scheduler.async_scheduling,
        tokenizer=f"synthetic byte-level BPE of {vocab} tokens (both runs detokenize)",
        **step_budget(llm),
        xgrammar=grammar_library_version(),
    )
    rec.record(
        system="batchlm-unconstrained", value=round(free_tps, 1), seconds=round(free_s, 3), **common
    )
    rec.record(
        system="batchlm",
        value=round(json_tps, 1),
        seconds=round(json_s, 3),
        baseline_value=round(free_tps, 1),
        ratio=round(json_tps / free_tps, 3),
        backend="xgrammar",
        schema="records: >= 64 objects of a bounded integer, a string <= 24 chars, enum tags",
        disable_any_whitespace=True,
        first_request_seconds=round(compile_timer.seconds, 3),
        triton_compiles_in_run=compiles_in_last_run(),
        steps_unconstrained=free_steps.summary(),
        steps_constrained=json_steps.summary(),
        **common,
    )
    del llm
    release()


def profile_pair(llm: LLM, prompts, *params: SamplingParams, path: str, tokens: int = 16) -> None:
    """Each of `params` over the prompts for `tokens` tokens under torch.profiler: the
    device's kernels and copies by total time, one table each, into `path`."""
    from torch.profiler import ProfilerActivity, profile

    with open(path, "w") as f:
        for p in params:
            short = p.clone()
            short.max_tokens = tokens
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_batchlm(llm, prompts, short)
            table = prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=30, max_name_column_width=70
            )
            kind = "constrained" if p.structured_outputs else "unconstrained"
            f.write(f"# {kind}, {len(prompts)} requests x {tokens} tokens\n{table}\n")
