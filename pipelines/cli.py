"""The `batchlm` command (also `python3 -m batchlm.pipelines`): `run` (a YAML job) and
`run-batch` (an OpenAI batch file, as `vllm run-batch`).

Exit codes: 0 done; 1 the job failed while running; 2 the job cannot start (bad YAML,
unknown key, bad value, missing input, wrong column, unknown model, output folder holding
another job's results or not writable, a store that refuses or cannot be reached). Every
exit-2 check happens before any model weights load. In a batch file, a line that cannot run
is that line's error in the output, not an exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
                      text_pair, context, continuation, sampling_params,
                      structured_outputs, lora, image), rows_per_shard
  task                generate | chat | embed | score | classify | loglikelihood
  model               a model folder, a .gguf file, or a bundled name
  engine              LLM(...) options: dtype, max_model_len, max_num_seqs, ...
  sampling_params     generate / chat: temperature, max_tokens, top_p, stop, seed, ...
                      (a row's own, in the sampling_params column, are merged over them)
  pooling_params      embed / score / classify: normalize, dimensions, ...
  structured_outputs  generate / chat: json (a JSON Schema), regex, choice, grammar, ...
                      for every row; a row's own in input.columns.structured_outputs
  lora_modules        generate / chat / loglikelihood: LoRA adapters, {name: folder};
                      each row names its own in the lora column (null: the base model)
  output              path (a folder), compression
  runner              local | ray | spark
  output_token_ids, output_logprobs, cumulative_logprob, prompt_logprobs
                      generate / chat: true adds that column
  keep_images         generate / chat: true writes the image column to the output too
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
    _add_run_batch(commands)
    return parser


_RUN_BATCH_DESCRIPTION = """\
Run an OpenAI batch file, as `vllm run-batch` does. Each input line is
{"custom_id", "method": "POST", "url", "body"} for /v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/score or /v1/rerank; each output line is {"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}, in input order. A line that
cannot run gets its error; the others run. The file is streamed (bounded memory), and the
output appears whole when every line is in. -i and -o take local paths or store URIs
(s3://, gs://, abfs://, hdfs://, ...). Every LLM(...) option is a flag (--max-model-len 4096,
--tensor-parallel-size 2, --no-enable-prefix-caching; values are read as YAML).
"""

_RUN_BATCH_EPILOG = """\
examples:
  batchlm run-batch -i requests.jsonl -o results.jsonl --model HuggingFaceTB/SmolLM2-135M-Instruct
  batchlm run-batch -i s3://bucket/in.jsonl -o s3://bucket/out.jsonl --model s3://bucket/models/m/

exit codes: 0 done (failed lines are in the output), 1 failed while running, 2 cannot start
"""


def _add_run_batch(commands: Any) -> None:
    batch = commands.add_parser(
        "run-batch",
        help="run an OpenAI batch file (vllm run-batch's format)",
        description=_RUN_BATCH_DESCRIPTION,
        epilog=_RUN_BATCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # the flags it does not know are LLM(...) options
    )
    batch.add_argument("-i", "--input-file", required=True, metavar="PATH", help="input lines")
    batch.add_argument("-o", "--output-file", required=True, metavar="PATH", help="output lines")
    batch.add_argument("--model", required=True, help="a model folder, .gguf, name or URI")
    batch.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names a line's body.model may use, the first in responses (default: --model)",
    )
    batch.add_argument(
        "--lines-in-flight",
        type=int,
        metavar="N",
        help="most lines read and not yet written (default: from the engine's batch size)",
    )
    batch.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def engine_options(extra: Sequence[str]) -> dict[str, Any]:
    """`LLM(...)` keyword arguments from command-line flags: `--max-model-len 4096` or
    `--max-model-len=4096` (values read as YAML), `--enforce-eager` / `--no-enforce-eager`.

    Raises:
        ValueError: a flag that is not an `LLM(...)` option.
    """
    import dataclasses

    import yaml

    from batchlm.engine.engine_args import EngineArgs
    from batchlm.operators.row_params import unknown_keys

    names = [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    out: dict[str, Any] = {}
    items = list(extra)
    while items:
        item = items.pop(0)
        if not item.startswith("--"):
            raise ValueError(f"unexpected argument {item!r}")
        key, sep, value = item[2:].partition("=")
        name = key.replace("-", "_")
        if name not in names and name.startswith("no_") and name[3:] in names and not sep:
            out[name[3:]] = False
            continue
        if name not in names:
            raise ValueError(f"unknown option --{key}: {unknown_keys([name], names)}")
        if not sep:
            if not items or items[0].startswith("--"):
                out[name] = True  # a switch (`--enforce-eager`)
                continue
            value = items.pop(0)
        out[name] = yaml.safe_load(value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "run-batch":
        args.engine_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command not in ("run", "run-batch"):
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "run-batch":
        return _run_batch(args)
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


def _run_batch(args: argparse.Namespace) -> int:
    from batchlm.engine.errors import InvalidParamError, ModelNotFoundError, UnsupportedModelError
    from batchlm.engine.loader.remote import RemoteStoreError, is_remote, open_store

    from .run_batch import run_batch

    try:
        engine_kwargs = engine_options(args.engine_args)
    except ValueError as e:
        return _fail(f"engine options: {e}", EXIT_USAGE)
    try:
        _check_batch_paths(args.input_file, args.output_file, is_remote, open_store)
    except (RemoteStoreError, OSError) as e:
        return _fail(str(e), EXIT_USAGE)
    _say(f"loading {args.model}")
    from batchlm.engine import LLM

    try:
        llm = LLM(args.model, **engine_kwargs)
    except (ModelNotFoundError, InvalidParamError, UnsupportedModelError, RemoteStoreError) as e:
        return _fail(str(e), EXIT_USAGE)
    except (TypeError, ValueError) as e:
        return _fail(f"engine options: {e}", EXIT_USAGE)
    names = tuple(args.served_model_name or (args.model,))
    try:
        summary = run_batch(
            llm,
            args.input_file,
            args.output_file,
            model_name=names[0],
            served_names=names,
            lines_in_flight=args.lines_in_flight,
            progress=not args.quiet,
        )
    except KeyboardInterrupt:
        return _fail("interrupted; no output was written", 130)
    except Exception as e:  # noqa: BLE001 - the message is for the user; the trace is below
        logging.getLogger("batchlm").exception("the batch failed")
        return _fail(f"{type(e).__name__}: {e}; no output was written", EXIT_FAILED)
    finally:
        llm.shutdown()
    print(summary.format())
    return EXIT_OK


def _check_batch_paths(input_file: str, output_file: str, is_remote: Any, open_store: Any) -> None:
    """The input exists and the output's folder or bucket answers, before any model loads."""
    import pyarrow.fs as pafs

    if is_remote(input_file):
        if open_store(input_file).info().type != pafs.FileType.File:
            raise FileNotFoundError(f"-i {input_file}: no such file on the store")
    elif not Path(input_file).expanduser().is_file():
        raise FileNotFoundError(f"-i {input_file}: no such file")
    if is_remote(output_file):
        from .output_store import open_output_store

        open_output_store(output_file.rstrip("/").rpartition("/")[0]).open()


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
