"""The `batchlm` command (also `python3 -m batchlm.pipelines`).

Exit codes: 0 done; 1 the job failed while running; 2 the job cannot start (bad YAML,
unknown key, bad value, missing input, wrong column, unknown model, output folder holding
another job's results or not writable). Every exit-2 check happens before any model weights
load.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .job import JobPlan

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_DESCRIPTION = """\
batchlm runs offline LLM inference over files: it reads rows from Parquet, JSONL or CSV,
runs a task (generate, chat, embed, score, classify, loglikelihood) with a local model, and
writes the rows with their results to a folder of Parquet files, one per input file.

A job is a YAML file. The smallest one:

  input: conf/data/prompts        # a file, a folder or a glob
  task: generate
  model: HuggingFaceTB/SmolLM2-135M-Instruct
  sampling_params: {temperature: 0, max_tokens: 32}
  output: out/answers             # a folder

Start with:  batchlm run conf/generate_demo.yaml
"""

_RUN_DESCRIPTION = """\
Run a job. Shards (input files) already written by an earlier run of the same job are
skipped, so a crashed or interrupted job is resumed by running it again. If the job's
model, task, params or input changed since, batchlm refuses to mix old and new results:
pick another output folder, or pass --overwrite to start over.

Job keys (see the README's "Jobs" section):
  input               path (file, folder or glob), format (auto|parquet|jsonl|csv),
                      columns (e.g. {prompt: question}; roles: prompt, messages, text,
                      text_pair, context, continuation, sampling_params), rows_per_shard
  task                generate | chat | embed | score | classify | loglikelihood
  model               a model folder, a .gguf file, or a bundled name
  engine              LLM(...) options: dtype, max_model_len, max_num_seqs, ...
  sampling_params     generate / chat: temperature, max_tokens, top_p, stop, seed, ...
                      (a row's own, in the sampling_params column, are merged over them)
  pooling_params      embed / score / classify: normalize, dimensions, ...
  structured_outputs  generate / chat: json (a JSON Schema), regex, choice, grammar, ...
                      for every row; a row's own in input.columns.structured_outputs
  output              path (a folder), compression
  runner              local | ray | spark
  output_token_ids, output_logprobs, cumulative_logprob, prompt_logprobs
                      generate / chat: true adds that column
  batch_size, concurrency, num_gpus, max_batch_retries, truncate_prompt_tokens,
  chat_template, chat_template_kwargs
"""

_RUN_EPILOG = """\
examples:
  batchlm run conf/generate_demo.yaml
  batchlm run conf/embed_demo.yaml --runner ray --output out/embeddings
  batchlm run job.yaml --set sampling_params.max_tokens=64 --set input.columns.prompt=question

exit codes: 0 done, 1 failed while running, 2 the job cannot start (the message says why)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchlm",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run a job described by a YAML file (resumes where an earlier run stopped)",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("job", metavar="JOB.yaml", help="the job file")
    run.add_argument(
        "--runner",
        choices=("local", "ray", "spark"),
        help="where the engine runs (overrides the job's runner; default local)",
    )
    run.add_argument("--output", metavar="PATH", help="output folder (overrides output.path)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one job key; the value is read as YAML (repeatable)",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the output folder's earlier results and start over",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="check the job and show its shards without running anything",
    )
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "run":
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Imported here so that `batchlm --help` answers without loading torch.
    from .job import plan_job, run_job
    from .output import OutputConflictError
    from .spec import JobSpecError, load_job

    try:
        job = load_job(args.job, args.overrides)
        changes = {k: v for k, v in (("runner", args.runner), ("output", args.output)) if v}
        if changes:
            job = job.with_overrides(**changes)
        _say(f"checking {args.job}: task {job.task}, model {job.model}")
        plan = plan_job(job)
    except JobSpecError as e:
        return _fail(str(e), EXIT_USAGE)
    if args.dry_run:
        print(_describe_plan(plan))
        return EXIT_OK
    try:
        summary = run_job(
            job, overwrite=args.overwrite, progress=not args.quiet, plan=plan, announce=_say
        )
    except OutputConflictError as e:
        return _fail(str(e), EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail("interrupted; run the same command again to resume", 130)
    except Exception as e:  # noqa: BLE001 - the message is for the user; the trace is below
        logging.getLogger("batchlm").exception("the job failed")
        return _fail(
            f"{type(e).__name__}: {e}\nshards written so far are kept; run again to resume",
            EXIT_FAILED,
        )
    print(summary.format())
    return EXIT_OK


def _describe_plan(plan: JobPlan) -> str:
    from .output import OutputFolder

    out = OutputFolder(plan.job.output.path, plan.manifest)
    lines = [
        f"job hash  {plan.manifest['job_hash']}",
        f"task      {plan.job.task} with {plan.job.model} on the {plan.job.runner} runner",
        f"output    {out.path}",
        f"shards    {len(plan.shards)}",
    ]
    for shard in plan.shards:
        state = "written" if out.is_done(shard.name) else "to run"
        lines.append(f"  {shard.name:<40} {state:<8} {shard.file.path}")
    return "\n".join(lines)


def _say(message: str) -> None:
    print(f"batchlm: {message}", file=sys.stderr, flush=True)


def _fail(message: str, code: int) -> int:
    print(f"batchlm: error: {message}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
