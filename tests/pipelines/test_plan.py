"""Job spec parsing, shard planning and the output folder's rules, without a model."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchlm.pipelines import JobSpec, JobSpecError, OutputConflictError, load_job
from batchlm.pipelines.output import MANIFEST_NAME, OutputFolder, job_manifest
from batchlm.pipelines.shards import find_input_files, plan_shards, read_shard
from batchlm.pipelines.spec import COLUMN_ROLES, InputSpec, job_keys

from .conftest import MINILM, REPO, sentences, write_job, write_jsonl

# ---- spec -----------------------------------------------------------------------------------


def test_spec_shorthand_columns_and_round_trip(tmp_path):
    job = JobSpec.from_dict(
        {
            "input": {"path": "data/", "columns": {"text": "q", "text_pair": "doc"}},
            "task": "score",
            "model": MINILM,
            "output": "out/",
            "pooling_params": {"normalize": True},
        }
    )
    assert job.output.path == "out/" and job.runner == "local" and job.batch_size == 64
    config = job.to_operator_config()
    assert config.spec.text_column == "q" and config.spec.text_pair_column == "doc"
    assert config.spec.input_columns == ("q", "doc")
    assert JobSpec.from_dict(job.to_dict()) == job
    assert job.with_overrides(runner="ray", output="elsewhere").output.path == "elsewhere"
    with pytest.raises(JobSpecError, match="runner: 'mpi' is unknown"):
        job.with_overrides(runner="mpi")


def test_concurrency_is_a_count_or_an_autoscaling_range():
    base = {"input": "data/", "task": "embed", "model": MINILM, "output": "out/"}
    job = JobSpec.from_dict({**base, "runner": "ray", "concurrency": [1, 4]})
    assert job.to_operator_config().concurrency == (1, 4)
    assert job.to_operator_config().max_concurrency == 4
    assert JobSpec.from_dict(job.to_dict()) == job
    with pytest.raises(JobSpecError, match=r"concurrency=\(4, 1\) must be an integer >= 1 or"):
        JobSpec.from_dict({**base, "concurrency": [4, 1]})
    with pytest.raises(JobSpecError, match="concurrency: expected an integer or a list of 2"):
        JobSpec.from_dict({**base, "concurrency": "two"})


def test_batch_invariant_is_a_job_engine_option():
    """`engine: {batch_invariant: true}` reaches the engine's device config; a value that is
    not a boolean is refused when the job is read, naming the key."""
    from batchlm.engine.engine_args import EngineArgs

    base = {"input": "data/", "task": "embed", "model": MINILM, "output": "out/"}
    job = JobSpec.from_dict({**base, "engine": {"batch_invariant": True}})
    config = job.to_operator_config()
    args = EngineArgs.from_kwargs(config.model, **config.engine_kwargs)
    assert args.create_engine_config().device.batch_invariant is True
    with pytest.raises(JobSpecError, match="batch_invariant"):
        JobSpec.from_dict({**base, "engine": {"batch_invariant": "yes"}})


def test_set_overrides_are_yaml_values(tmp_path):
    path = write_job(
        tmp_path / "job.yaml",
        {"input": "in.jsonl", "task": "generate", "model": "m", "output": "out"},
    )
    job = load_job(
        path,
        [
            "sampling_params.max_tokens=8",
            "sampling_params.stop=[foo, bar]",
            "input.columns.prompt=question",
            "engine.enable_prefix_caching=false",
            "output.compression=snappy",
        ],
    )
    assert job.sampling_params == {"max_tokens": 8, "stop": ["foo", "bar"]}
    assert job.input.path == "in.jsonl" and job.config.spec.prompt_column == "question"
    assert job.engine == {"enable_prefix_caching": False}
    assert job.output == type(job.output)("out", "snappy")


def _readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_every_job_key_is_in_the_readme():
    """The README's "Jobs" section lists every key with its default, in one YAML block."""
    section = _readme_section("## Jobs")
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Jobs section has one YAML block of every key"
    documented = yaml.safe_load(blocks[0])
    listed = set(documented)
    for name in ("input", "output"):
        listed |= {f"{name}.{key}" for key in documented[name]}
    missing = [key for key in job_keys() if key not in listed]
    assert not missing, f"README.md's Jobs section lacks {missing}"
    assert listed <= set(job_keys()), f"README.md lists unknown keys {listed - set(job_keys())}"
    (columns_line,) = [line for line in blocks[0].splitlines() if "columns:" in line]
    roles = [role for role in COLUMN_ROLES if role not in re.findall(r"\w+", columns_line)]
    assert not roles, f"README.md's input.columns line lacks the role(s) {roles}"
    JobSpec.from_dict(documented)  # the documented job is a valid one


def test_every_job_key_is_in_the_run_help(capsys):
    from batchlm.pipelines import cli

    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    words = set(re.findall(r"\w+", capsys.readouterr().out))
    missing = [key for key in job_keys() if key.rsplit(".", 1)[-1] not in words]
    assert not missing, f"'batchlm run --help' does not name {missing}"


# ---- shards ---------------------------------------------------------------------------------


def test_folder_glob_and_file_discovery(tmp_path):
    write_jsonl(tmp_path / "d" / "b.jsonl", sentences(0, 2))
    write_jsonl(tmp_path / "d" / "sub" / "a.jsonl", sentences(2, 2))
    write_jsonl(tmp_path / "d" / ".hidden.jsonl", sentences(4, 1))
    write_jsonl(tmp_path / "d" / "_tmp" / "c.jsonl", sentences(5, 1))
    (tmp_path / "d" / "notes.txt").write_text("not input")
    files = find_input_files(InputSpec(str(tmp_path / "d")))
    assert [Path(f.path).name for f in files] == ["b.jsonl", "a.jsonl"]
    shards = plan_shards(files, None)
    assert [s.name for s in shards] == ["part-00000-b", "part-00001-a"]
    assert [s.num_rows for s in shards] == [2, 2]
    # A glob is taken as written: it skips dot-files only.
    files = find_input_files(InputSpec(str(tmp_path / "d" / "**" / "*.jsonl")))
    assert [Path(f.path).name for f in files] == ["c.jsonl", "b.jsonl", "a.jsonl"]
    with pytest.raises(JobSpecError, match="cannot tell the format"):
        find_input_files(InputSpec(str(tmp_path / "d" / "notes.txt")))
    assert find_input_files(InputSpec(str(tmp_path / "d" / "notes.txt"), format="csv"))


def test_parquet_split_into_row_group_shards(tmp_path):
    table = pa.Table.from_pylist(sentences(0, 35))
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=10)
    files = find_input_files(InputSpec(str(tmp_path / "big.parquet")))
    shards = plan_shards(files, rows_per_shard=20)
    assert [(s.name, s.row_groups, s.num_rows) for s in shards] == [
        ("part-00000-big-rg00000", (0, 2), 20),
        ("part-00001-big-rg00002", (2, 4), 15),
    ]
    assert pa.concat_tables(read_shard(s) for s in shards).equals(table)
    assert [s.row_groups for s in plan_shards(files, rows_per_shard=100)] == [None]


# ---- output folder --------------------------------------------------------------------------


def manifest(job_hash: str = "a") -> dict:
    return job_manifest({}, job_hash, "i", {}, ["part-00000-x"]) | {"job_hash": job_hash}


def test_output_refuses_foreign_files_and_unknown_parts(tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "report.csv").write_text("x")
    with pytest.raises(OutputConflictError, match=r"did not write \(report.csv\)"):
        OutputFolder(tmp_path / "o", manifest()).prepare(overwrite=True)
    (tmp_path / "o" / "report.csv").unlink()
    (tmp_path / "o" / "part-00000-x.parquet").write_text("old")
    with pytest.raises(OutputConflictError, match="no _batchlm_manifest.json"):
        OutputFolder(tmp_path / "o", manifest()).prepare(overwrite=False)
    out = OutputFolder(tmp_path / "o", manifest())
    out.prepare(overwrite=True)
    assert sorted(p.name for p in out.path.iterdir()) == [".batchlm.lock", MANIFEST_NAME]
    out.close()


def test_output_lock_and_atomic_shards(tmp_path):
    out = OutputFolder(tmp_path / "o", manifest())
    out.prepare(overwrite=False)
    with pytest.raises(OutputConflictError, match="another batchlm process"):
        OutputFolder(tmp_path / "o", manifest()).prepare(overwrite=False)
    schema = pa.schema([("id", pa.int64())])
    with pytest.raises(RuntimeError), out.shard_writer("part-00000-x", schema) as writer:
        writer.write(pa.table({"id": [1, 2]}))
        raise RuntimeError("the engine died mid-shard")
    assert not out.is_done("part-00000-x")
    assert [p.name for p in out.path.iterdir() if p.name.startswith(".tmp-")] == []
    with out.shard_writer("part-00000-x", schema) as writer:
        writer.write(pa.table({"id": [1, 2]}))
    assert pq.read_table(out.path).column("id").to_pylist() == [1, 2]
    out.close()
    (tmp_path / "o" / ".tmp-part-00001-y.parquet.999").write_text("left by a killed run")
    again = OutputFolder(tmp_path / "o", manifest())
    again.prepare(overwrite=False)
    assert not (tmp_path / "o" / ".tmp-part-00001-y.parquet.999").exists()
    again.close()
    with pytest.raises(OutputConflictError, match="job hash a there, b now"):
        OutputFolder(tmp_path / "o", manifest("b")).prepare(overwrite=False)


def test_batches_are_gathered_into_row_groups_written_in_order(tmp_path, monkeypatch):
    from batchlm.pipelines import shard_writer

    monkeypatch.setattr(shard_writer, "ROW_GROUP_ROWS", 10)
    out = OutputFolder(tmp_path / "o", manifest())
    out.prepare(overwrite=False)
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    with out.shard_writer("part-00000-x", schema) as writer:
        for start in range(0, 47, 4):  # 12 batches of 4 rows (the last of 3)
            ids = list(range(start, min(start + 4, 47)))
            writer.write(pa.table({"id": ids, "text": [str(i) for i in ids]}))
        assert writer.num_rows == 47
    written = pq.ParquetFile(out.part_path("part-00000-x"))
    # Row groups of 12 rows (three batches reach 10) and the last 11 rows at close.
    sizes = [written.metadata.row_group(i).num_rows for i in range(written.num_row_groups)]
    assert sizes == [12, 12, 12, 11]
    table = written.read()
    assert table.column("id").to_pylist() == list(range(47))
    assert table.column("text").to_pylist() == [str(i) for i in range(47)]
    out.close()


def test_float_columns_are_plain_and_read_back_exactly(tmp_path):
    """Embeddings, probabilities and scores are written PLAIN (no dictionary; no encoding
    that common readers lack, such as BYTE_STREAM_SPLIT); every value reads back bit for
    bit."""
    out = OutputFolder(tmp_path / "o", manifest())
    out.prepare(overwrite=False)
    gen = np.random.default_rng(0)
    vectors = gen.standard_normal((50, 8)).astype(np.float32)
    table = pa.table(
        {
            "id": pa.array(range(50)),
            "text": [f"t{i}" for i in range(50)],
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), 8),
            "probs": pa.array([[0.25, 0.75]] * 50, pa.list_(pa.float64())),
            "score": pa.array(gen.standard_normal(50)),
        }
    )
    with out.shard_writer("part-00000-x", table.schema) as writer:
        writer.write(table)
    written = pq.ParquetFile(out.part_path("part-00000-x"))
    group = written.metadata.row_group(0)
    encodings = {
        group.column(i).path_in_schema: group.column(i).encodings for i in range(group.num_columns)
    }
    for path in ("embedding.list.element", "probs.list.element", "score"):
        assert "PLAIN" in encodings[path] and "RLE_DICTIONARY" not in encodings[path], (
            path,
            encodings[path],
        )
        assert "BYTE_STREAM_SPLIT" not in encodings[path]
    assert "RLE_DICTIONARY" in encodings["text"]
    back = written.read()
    assert back.equals(table)
    np.testing.assert_array_equal(
        np.stack(back.column("embedding").to_numpy(zero_copy_only=False)), vectors
    )
    out.close()


def test_a_failed_row_group_write_fails_the_shard_and_leaves_no_file(tmp_path, monkeypatch):
    from batchlm.pipelines import shard_writer

    monkeypatch.setattr(shard_writer, "ROW_GROUP_ROWS", 2)
    out = OutputFolder(tmp_path / "o", manifest())
    out.prepare(overwrite=False)
    schema = pa.schema([("id", pa.int64())])

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        with out.shard_writer("part-00000-x", schema) as writer:
            monkeypatch.setattr(writer._writer, "write_table", full_disk)
            for i in range(3):
                writer.write(pa.table({"id": [i, i]}))
    assert not out.is_done("part-00000-x")
    assert [p.name for p in out.path.iterdir() if p.name.startswith(".tmp-")] == []
    out.close()


# ---- a job over Parquet row-group shards, and --dry-run ---------------------------------------


def test_row_group_shards_end_to_end(tmp_path, capsys):
    from batchlm.pipelines import cli

    pq.write_table(
        pa.Table.from_pylist(sentences(0, 30)), tmp_path / "rows.parquet", row_group_size=8
    )
    job = {
        "input": {"path": str(tmp_path / "rows.parquet"), "rows_per_shard": 16},
        "task": "embed",
        "model": MINILM,
        "output": str(tmp_path / "out"),
        "batch_size": 8,
    }
    path = write_job(tmp_path / "job.yaml", job)
    assert cli.main(["run", str(path), "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert "part-00000-rows-rg00000" in listing and "part-00001-rows-rg00002" in listing
    assert "to run" in listing and not (tmp_path / "out").exists()
    assert cli.main(["run", str(path), "-q"]) == 0
    table = pq.read_table(tmp_path / "out")
    assert table.column("id").to_pylist() == list(range(30))
    assert len(list((tmp_path / "out").glob("part-*.parquet"))) == 2


def test_results_identity_ignores_placement_and_defaults():
    """A job's output identity holds what changes results: placement fields never, and a
    row-contract option only once it leaves its default (so an option added later leaves
    existing output resumable)."""
    from batchlm.operators.config import OperatorConfig
    from batchlm.operators.rows import stable_hash
    from batchlm.pipelines.job import results_fingerprint

    plain = OperatorConfig.create(MINILM, "generate", sampling_params={"max_tokens": 4})
    same = OperatorConfig.create(
        MINILM,
        "generate",
        sampling_params={"max_tokens": 4},
        output_logprobs=False,  # an option at its default
        concurrency=(1, 3),
        max_batch_retries=5,
    )
    assert results_fingerprint(plain) == results_fingerprint(same)
    assert results_fingerprint(plain) == stable_hash(
        {
            "model": MINILM,
            "spec": {"task": "generate", "sampling_params": {"max_tokens": 4}},
        }
    )
    changed = OperatorConfig.create(
        MINILM, "generate", sampling_params={"max_tokens": 4}, output_logprobs=True
    )
    assert results_fingerprint(changed) != results_fingerprint(plain)
