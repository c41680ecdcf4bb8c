"""W1-loglik: multiple-choice scoring through the loglikelihood task, prefix caching on / off.

Llama-3.1-8B shape with random weights (seeded, as in gpu_generate.py), 10,000 four-choice
items: each a 256-token context of random token ids followed by four continuations of
random lengths (uniform in [4, 24] tokens). The rows go through the row contract's
`loglikelihood` task (`process_table`, `--batch-size` rows per call, as the local runner
feeds a job), once with prefix caching off and once on, in one run. Recorded per system:
rows/s, prompt tokens given / computed against the unique tokens of the set (each context
once, every continuation), and whether the scores of the two runs agree.

With the cache on, the three later choices of an item read their context's whole blocks
from the cache: the tokens computed should stay within 1.3x the unique tokens (recorded
as `computed_over_unique`, `within_1_3x`).

    python benchmarks/loglikelihood.py --out results.jsonl          # an H200
    python benchmarks/loglikelihood.py --smoke                      # tiny shape, CPU is fine
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import gpu_generate as shapes
import pyarrow as pa
import pyarrow.compute as pc
import torch
from common import Recorder, Timer

from batchlm.engine import LLM
from batchlm.operators.rows import RowSpec, process_table

WORKLOAD = "W1-loglik"
NUM_CHOICES = 4


def make_items(num_items: int, context_len: int, cont_lens: tuple[int, int], vocab: int):
    """Rows `{item, choice, context, continuation}` of random token ids (seed 0), the four
    choices of an item next to each other, as a multiple-choice set is laid out."""
    rng = random.Random(0)
    items, choices, contexts, continuations = [], [], [], []
    for i in range(num_items):
        context = [rng.randrange(16, vocab) for _ in range(context_len)]
        for c in range(NUM_CHOICES):
            n = rng.randint(*cont_lens)
            items.append(i)
            choices.append(c)
            contexts.append(context)
            continuations.append([rng.randrange(16, vocab) for _ in range(n)])
    return pa.table(
        {
            "item": pa.array(items, pa.int32()),
            "choice": pa.array(choices, pa.int8()),
            "context": pa.array(contexts, pa.list_(pa.int32())),
            "continuation": pa.array(continuations, pa.list_(pa.int32())),
        }
    )


def unique_tokens(table: pa.Table) -> int:
    """Each context once (the first choice's) plus every continuation."""
    first = pc.equal(table["choice"], 0)
    contexts = pc.list_value_length(table.filter(first)["context"])
    return int(pc.sum(contexts).as_py()) + int(
        pc.sum(pc.list_value_length(table["continuation"])).as_py()
    )


def score(llm: LLM, table: pa.Table, batch_size: int) -> tuple[float, pa.Table]:
    """Seconds, and the scored rows, with the row contract's loglikelihood task."""
    spec = RowSpec(task="loglikelihood")
    parts = []
    with Timer() as t:
        for start in range(0, table.num_rows, batch_size):
            parts.append(process_table(llm, spec, table.slice(start, batch_size)))
    return t.seconds, pa.concat_tables(parts)


def run(args, rec: Recorder, folder: Path) -> None:
    shape = shapes.LLAMA_8B
    table = make_items(
        args.num_items,
        args.context_len,
        (args.min_cont_len, args.max_cont_len),
        shape["vocab_size"],
    )
    if not (folder / "config.json").exists():
        shapes.build_random_model(shape, folder)
        shapes.release()
    unique = unique_tokens(table)
    results: dict[bool, dict] = {}
    scored: dict[bool, pa.Table] = {}
    for caching in (True, False):  # the cache's figures first: the run without is long
        llm = LLM(
            str(folder),
            dtype=str(shapes.DTYPE).removeprefix("torch."),
            skip_tokenizer_init=True,
            max_model_len=args.context_len + args.max_cont_len + 16,
            enable_prefix_caching=caching,
            **({"gpu_memory_utilization": 0.85} if torch.cuda.is_available() else {}),
            **(
                {"max_num_batched_tokens": args.max_num_batched_tokens}
                if args.max_num_batched_tokens
                else {}
            ),
        )
        score(llm, table.slice(0, 8 * NUM_CHOICES), batch_size=args.batch_size)  # warm-up
        llm.reset_prefix_cache()
        seconds, out = score(llm, table, args.batch_size)
        given = int(pc.sum(out["num_input_tokens"]).as_py())
        cached = int(pc.sum(out["num_cached_tokens"]).as_py())
        failed = out.num_rows - out["error"].null_count
        results[caching] = dict(
            seconds=round(seconds, 3),
            rows_per_s=round(out.num_rows / seconds, 1),
            prompt_tokens_given=given,
            prompt_tokens_computed=given - cached,
            computed_tok_per_s=round((given - cached) / seconds, 1),
            computed_over_unique=round((given - cached) / unique, 4),
            failed_rows=failed,
            **shapes.step_budget(llm),
        )
        scored[caching] = out
        print(json.dumps({"workload": WORKLOAD, "prefix_caching": caching, **results[caching]}))
        del llm
        shapes.release()
    diff = pc.max(pc.abs(pc.subtract(scored[True]["logprob"], scored[False]["logprob"]))).as_py()
    greedy_equal = scored[True]["is_greedy"].equals(scored[False]["is_greedy"])
    common = dict(
        workload=WORKLOAD,
        metric="rows_per_s",
        model=f"Llama-3.1-8B shape{' (smoke)' if args.smoke else ''}, random weights",
        num_items=args.num_items,
        num_rows=table.num_rows,
        choices_per_item=NUM_CHOICES,
        context_len=args.context_len,
        continuation_len=[args.min_cont_len, args.max_cont_len],
        batch_size=args.batch_size,
        unique_tokens=unique,
        max_abs_logprob_diff_on_off=diff,
        is_greedy_equal_on_off=greedy_equal,
    )
    off, on = results[False], results[True]
    rec.record(system="batchlm-prefix-caching-off", value=off["rows_per_s"], **off, **common)
    rec.record(
        system="batchlm",
        value=on["rows_per_s"],
        baseline_value=off["rows_per_s"],
        ratio=round(on["rows_per_s"] / off["rows_per_s"], 3),
        within_1_3x=on["computed_over_unique"] <= 1.3,
        **on,
        **common,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-items", type=int, default=10_000)
    ap.add_argument("--context-len", type=int, default=256)
    ap.add_argument("--min-cont-len", type=int, default=4)
    ap.add_argument("--max-cont-len", type=int, default=24)
    ap.add_argument(
        "--batch-size",
        type=int,
        default=8192,
        help="rows per process_table call (a job's batch_size)",
    )
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="engine default if unset"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--model-dir",
        default=None,
        help="keep the random Llama-8B-shaped checkpoint here (reused when it exists)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shape and set on this machine")
    args = ap.parse_args()
    if args.smoke:
        shapes.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        shapes.DTYPE = torch.float32
        shapes.LLAMA_8B.update(shapes.SMOKE)
        args.num_items = min(args.num_items, 48)
        args.batch_size = min(args.batch_size, 64)
    rec = Recorder(args.out)
    folder = Path(args.model_dir or tempfile.mkdtemp(prefix="bench-llama8b-"))
    start = time.perf_counter()
    run(args, rec, folder)
    print(json.dumps({"workload": WORKLOAD, "wall_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
