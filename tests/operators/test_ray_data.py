"""Ray Data operators end to end: Parquet → engine actors → Parquet, against direct `LLM` calls.

One local Ray (2 CPUs, no dashboard, no usage stats) serves the module. The actors write
their counts to a stats folder, which is how the tests see inside them (engine builds,
batches, batches in the engine at once).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchlm.engine import LLM, LoRARequest, SamplingParams
from batchlm.operators.fault_injection import ActorFault, FaultPlan
from batchlm.operators.ray_data import (
    GenerateActor,
    ProcessorConfig,
    build_processor,
    map_batches_kwargs,
)
from batchlm.operators.rows import RowContractError, output_fields, process_table

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
GEN_ENGINE = {"max_model_len": 128}
SAMPLING = {"max_tokens": 8, "temperature": 0.0}
NUM_GOOD = 200
# Bad rows, placed so that they land in different batches: empty, null, over-long.
BAD_AT = {13: "", 101: None, 170: "word " * 600}
WORDS = ["river", "lantern", "orchard", "copper", "meadow", "harbor", "violet", "granite"]


def _good_text(i: int) -> str:
    return f"{WORDS[i % 8]} {i} and"  # short: the CPU test budget goes on prefill


def _rows() -> tuple[list[int], list[str | None]]:
    """203 ids with their texts: `NUM_GOOD` good ones and the bad ones at `BAD_AT`."""
    texts: list[str | None] = []
    good = iter(range(NUM_GOOD))
    for i in range(NUM_GOOD + len(BAD_AT)):
        texts.append(BAD_AT[i] if i in BAD_AT else _good_text(next(good)))
    return list(range(len(texts))), texts


def _write_parts(folder: Path, table: pa.Table, num_parts: int = 4) -> Path:
    folder.mkdir(parents=True)
    step = -(-table.num_rows // num_parts)
    for k in range(num_parts):
        pq.write_table(table.slice(k * step, step), folder / f"part-{k}.parquet")
    return folder


def _stats(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def _release(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()


def _good_ids(ids: list[int]) -> list[int]:
    return [i for i in ids if i not in BAD_AT]


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    # No usage report to the network; engine actors get both cores (Ray would give an actor
    # of one CPU a single thread, and the engine is the only busy process here).
    env = {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "2"}
    set_here = [k for k in env if k not in os.environ]
    for k in set_here:
        os.environ[k] = env[k]
    import ray
    import ray.data

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        object_store_memory=256 * 1024 * 1024,
    )
    ctx = ray.data.DataContext.get_current()
    progress_bars, ctx.enable_progress_bars = ctx.enable_progress_bars, False
    try:
        yield ray
    finally:
        ctx.enable_progress_bars = progress_bars
        ray.shutdown()
        for k in set_here:
            os.environ.pop(k, None)


@pytest.fixture(scope="module")
def generate_reference() -> dict[int, tuple[str, str, int, int]]:
    """Direct `LLM.generate` on the good rows: id → (text, finish_reason, in, out tokens)."""
    ids, texts = _rows()
    good = _good_ids(ids)
    llm = LLM(SMOLLM2, **GEN_ENGINE)
    outs = llm.generate([texts[i] for i in good], SamplingParams(**SAMPLING), use_tqdm=False)
    ref = {
        i: (
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            len(o.prompt_token_ids),
            len(o.outputs[0].token_ids),
        )
        for i, o in zip(good, outs, strict=True)
    }
    del llm
    gc.collect()
    return ref


@pytest.fixture(scope="module")
def embed_reference() -> dict[int, np.ndarray]:
    """Direct `LLM.embed` on the non-null rows: id → vector. As in sentence-transformers,
    empty text is valid ([CLS] [SEP]) and over-long text is cut to the model's length."""
    ids, texts = _rows()
    good = [i for i in ids if texts[i] is not None]
    llm = LLM(MINILM)
    outs = llm.embed([texts[i] for i in good], use_tqdm=False)
    ref = {i: np.asarray(o.outputs.embedding, np.float32) for i, o in zip(good, outs, strict=True)}
    del llm
    gc.collect()
    return ref


@pytest.fixture(scope="module")
def embed_input(tmp_path_factory) -> Path:
    ids, texts = _rows()
    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "text": pa.array(texts, pa.string()),
            "lang": pa.array(["en" if i % 2 else "fr" for i in ids], pa.string()),
        }
    )
    return _write_parts(tmp_path_factory.mktemp("embed") / "in", table)


def _embed_config(tmp_path: Path, **kwargs) -> ProcessorConfig:
    return ProcessorConfig.create(
        MINILM, "embed", batch_size=25, stats_dir=str(tmp_path / "stats"), **kwargs
    )


# ---- no Ray needed -------------------------------------------------------------------------


def test_importing_the_operators_loads_no_ray():
    code = (
        "import sys\n"
        "import batchlm.operators, batchlm.operators.rows, batchlm.operators.config\n"
        "import batchlm.operators.engine_loop, batchlm.operators.ray_data\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_map_batches_kwargs_bound_retries_and_follow_tensor_parallel(monkeypatch):
    from batchlm.operators import ray_data

    config = ProcessorConfig.create(
        MINILM,
        "embed",
        batch_size=16,
        concurrency=3,
        max_batch_retries=4,
        ray_remote_args={"num_cpus": 0.5},
        engine_kwargs={"tensor_parallel_size": 2},
    )
    monkeypatch.setattr(ray_data, "_has_gpus", lambda: False)
    kwargs = map_batches_kwargs(config)
    assert kwargs["fn_constructor_kwargs"] == {"config": config}
    assert (kwargs["batch_size"], kwargs["compute"].min_size, kwargs["num_gpus"]) == (16, 3, 0.0)
    # Actor options reach Ray through ray_remote_args_fn, resources as named parameters:
    # map_batches' **ray_remote_args are deprecated from Ray 2.60.
    assert kwargs["ray_remote_args_fn"]() == {"max_restarts": -1, "max_task_retries": 4}
    assert kwargs["batch_format"] == "pyarrow" and kwargs["num_cpus"] == 0.5
    assert not set(kwargs) - {
        "fn_constructor_kwargs",
        "batch_size",
        "batch_format",
        "num_gpus",
        "num_cpus",
        "ray_remote_args_fn",
        "compute",
    }
    autoscaling = ProcessorConfig.create(MINILM, "embed", concurrency=(1, 4))
    compute = map_batches_kwargs(autoscaling)["compute"]
    assert (compute.min_size, compute.max_size) == (1, 4)
    with pytest.raises(RowContractError, match=r"concurrency=\(4, 1\)"):
        ProcessorConfig.create(MINILM, "embed", concurrency=(4, 1))
    monkeypatch.setattr(ray_data, "_has_gpus", lambda: True)
    assert map_batches_kwargs(config)["num_gpus"] == 2.0
    assert map_batches_kwargs(config, num_gpus=0.5)["num_gpus"] == 0.5


def test_config_and_actor_mistakes_fail_before_any_engine_is_built():
    with pytest.raises(RowContractError, match="max_tasks_per_actor=0"):
        ProcessorConfig.create(MINILM, "embed", max_tasks_per_actor=0)
    with pytest.raises(RowContractError, match="unknown option.*'batchsize'"):
        ProcessorConfig.create(MINILM, "embed", batchsize=3)
    with pytest.raises(RowContractError, match="use EmbedActor"):
        GenerateActor(ProcessorConfig.create(MINILM, "embed"))


# ---- Parquet in, Parquet out ------------------------------------------------------------------


def test_generate_parquet_round_trip_matches_direct_llm(ray_local, tmp_path, generate_reference):
    ids, texts = _rows()
    table = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "question": pa.array(texts, pa.string()),
            "weight": pa.array([i / 4 for i in ids], pa.float64()),
        }
    )
    source = _write_parts(tmp_path / "in", table)
    config = ProcessorConfig.create(
        SMOLLM2,
        "generate",
        engine_kwargs=GEN_ENGINE,
        sampling_params=SAMPLING,
        batch_size=32,
        stats_dir=str(tmp_path / "stats"),
    )
    processor = build_processor(config, preprocess=lambda row: {**row, "prompt": row["question"]})
    processor(ray_local.data.read_parquet(str(source))).write_parquet(str(tmp_path / "out"))

    out = pq.read_table(tmp_path / "out")
    # The declared columns, with the declared types, after the passed-through ones.
    declared = output_fields(config.spec, config.model_info())
    assert out.schema.names[-len(declared) :] == [f.name for f in declared]
    for f in declared:
        assert out.schema.field(f.name).type == f.type, f.name
    rows = {r["id"]: r for r in out.to_pylist()}
    assert sorted(out["id"].to_pylist()) == ids  # every row exactly once
    for i in ids:
        row = rows[i]
        assert (row["question"], row["prompt"], row["weight"]) == (texts[i], texts[i], i / 4)
        if i in BAD_AT:
            assert row["generated_text"] is None and row["num_output_tokens"] is None
        else:
            got = (
                row["generated_text"],
                row["finish_reason"],
                row["num_input_tokens"],
                row["num_output_tokens"],
            )
            assert got == generate_reference[i], i
            assert row["error"] is None
    assert "empty" in rows[13]["error"]
    assert "null" in rows[101]["error"]
    assert "max_model_len=128" in rows[170]["error"]

    (stats,) = _stats(tmp_path / "stats")  # one actor for the whole job
    assert stats["num_engine_builds"] == 1
    assert stats["num_calls"] == stats["num_batches"] >= 7  # 203 rows / 32 per batch
    assert stats["num_rows"] == len(ids)
    assert stats["max_batches_in_engine"] >= 2  # batches overlapped inside the engine


def test_embed_parquet_round_trip_matches_direct_llm(
    ray_local, tmp_path, embed_input, embed_reference
):
    config = _embed_config(tmp_path)
    build_processor(config)(ray_local.data.read_parquet(str(embed_input))).write_parquet(
        str(tmp_path / "out")
    )
    out = pq.read_table(tmp_path / "out")
    source = pq.read_table(embed_input)
    assert out.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert out.schema == build_processor(config).output_schema(source.schema)
    ids, texts = _rows()
    assert sorted(out["id"].to_pylist()) == ids
    rows = {r["id"]: r for r in out.to_pylist()}
    for i in ids:
        assert rows[i]["text"] == texts[i]
        assert rows[i]["lang"] == ("en" if i % 2 else "fr")
        if i in embed_reference:
            assert rows[i]["error"] is None
            np.testing.assert_allclose(rows[i]["embedding"], embed_reference[i], atol=1e-5)
        else:
            assert rows[i]["embedding"] is None and rows[i]["error"]
    assert [i for i in ids if rows[i]["error"]] == [101]
    assert rows[101]["error"] == "column 'text' is null in this row"
    stats = _stats(tmp_path / "stats")
    assert [s["num_engine_builds"] for s in stats] == [1]
    assert stats[0]["num_calls"] >= 8  # 203 rows / 25 per batch, one engine for all


def test_actor_killed_mid_job_restarts_and_every_row_comes_once(
    ray_local, tmp_path, embed_input, embed_reference
):
    config = _embed_config(tmp_path)
    marker = tmp_path / "exits"
    fault = FaultPlan(actor=ActorFault(on_call=3, kind="exit", marker=str(marker), times=1))
    processor = build_processor(
        config,
        postprocess=lambda r: {
            "id": r["id"],
            "head": None if r["embedding"] is None else float(r["embedding"][0]),
            "error": r["error"],
        },
        runtime_env={"env_vars": fault.env()},
    )
    processor(ray_local.data.read_parquet(str(embed_input))).write_parquet(str(tmp_path / "out"))

    assert len(marker.read_text().splitlines()) == 1  # the actor process did die once
    out = pq.read_table(tmp_path / "out")
    ids, _ = _rows()
    assert sorted(out["id"].to_pylist()) == ids
    for row in out.to_pylist():
        if row["id"] in embed_reference:
            assert row["error"] is None
            assert abs(row["head"] - embed_reference[row["id"]][0]) < 1e-5
        else:
            assert row["head"] is None and row["error"]
    stats = _stats(tmp_path / "stats")
    assert len(stats) == 2  # the first process and its restart
    assert all(s["num_engine_builds"] == 1 for s in stats)


def test_engine_failing_on_every_retry_fails_the_job_with_the_error(
    ray_local, tmp_path, embed_input
):
    config = _embed_config(tmp_path, max_batch_retries=1)
    marker = str(tmp_path / "faults")
    fault = FaultPlan(actor=ActorFault(on_call=1, kind="raise", marker=marker, times=1000))
    processor = build_processor(config, runtime_env={"env_vars": fault.env()})
    ds = processor(ray_local.data.read_parquet(str(embed_input)))
    with pytest.raises(Exception) as e:
        ds.write_parquet(str(tmp_path / "out"))
    message = str(e.value)
    assert "failed on 2 engine(s) (max_batch_retries=1)" in message
    assert "injected engine failure" in message


# ---- rows with their own params, logprob columns, loglikelihood -------------------------------


def _param_rows() -> pa.Table:
    """40 prompts; every row its own params (a struct): lengths, seeds, temperatures; one row
    with a bad value."""
    cells = [
        {"max_tokens": 2 + i % 5, "temperature": 0.8 if i % 3 else 0.0, "seed": i}
        for i in range(40)
    ]
    cells[17] = {"max_tokens": 0, "temperature": None, "seed": None}
    params = pa.array(
        cells,
        pa.struct(
            [("max_tokens", pa.int64()), ("temperature", pa.float64()), ("seed", pa.int64())]
        ),
    )
    prompts = [f"{WORDS[i % 8]} number {i} is" for i in range(40)]
    return pa.table({"id": pa.array(range(40), pa.int64()), "prompt": prompts, "params": params})


def test_rows_with_their_own_params_and_logprob_columns(ray_local, tmp_path, tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    table = _param_rows()
    source = _write_parts(tmp_path / "in", table)
    config = ProcessorConfig.create(
        model,
        "generate",
        engine_kwargs={"max_model_len": 64},
        sampling_params={"max_tokens": 8, "logprobs": 2},
        sampling_params_column="params",
        output_token_ids=True,
        output_logprobs=True,
        batch_size=8,
    )
    build_processor(config)(ray_local.data.read_parquet(str(source))).write_parquet(
        str(tmp_path / "out")
    )
    out = pq.read_table(tmp_path / "out").sort_by("id")
    for f in output_fields(config.spec, config.model_info()):
        assert out.schema.field(f.name).type == f.type, f.name

    llm = LLM(model, max_model_len=64)
    expected = process_table(llm, config.spec, table)  # the row contract in this process
    _release(llm)
    assert "max_tokens=0 must be >= 1" in out["error"][17].as_py()
    assert out["error"].null_count == 39
    for got, want in zip(out.to_pylist(), expected.to_pylist(), strict=True):
        assert got["output_token_ids"] == want["output_token_ids"], got["id"]
        assert got["num_output_tokens"] == 2 + got["id"] % 5 or got["error"]
        for a, b in zip(got["output_logprobs"] or [], want["output_logprobs"] or [], strict=True):
            assert [e["token_id"] for e in a] == [e["token_id"] for e in b]
            assert [e["logprob"] for e in a] == pytest.approx([e["logprob"] for e in b], abs=1e-4)


def test_loglikelihood_rows(ray_local, tmp_path, tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    contexts = [f"The {WORDS[i % 8]} stands near the {WORDS[(i + 3) % 8]}, and" for i in range(12)]
    rows = [(c, f" {w}") for c in contexts for w in ("it rains", "a bird sings", "")]
    table = pa.table(
        {"id": range(len(rows)), "context": [c for c, _ in rows], "choice": [x for _, x in rows]}
    )
    source = _write_parts(tmp_path / "in", table, num_parts=2)
    config = ProcessorConfig.create(
        model,
        "loglikelihood",
        engine_kwargs={"max_model_len": 64},
        continuation_column="choice",
        batch_size=9,
    )
    build_processor(config)(ray_local.data.read_parquet(str(source))).write_parquet(
        str(tmp_path / "out")
    )
    out = pq.read_table(tmp_path / "out").sort_by("id")
    llm = LLM(model, max_model_len=64)
    expected = process_table(llm, config.spec, table)
    _release(llm)
    for got, want in zip(out.to_pylist(), expected.to_pylist(), strict=True):
        if want["error"]:
            assert got["error"] == want["error"] and "continuation is empty" in got["error"]
            continue
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4), got["id"]
        assert (got["is_greedy"], got["num_tokens"]) == (want["is_greedy"], want["num_tokens"])


def test_rows_across_lora_adapters(ray_local, tmp_path, tiny_model_factory, tiny_llama_adapters):
    model = str(tiny_model_factory("llama"))
    names = [None, "sql", "poem", "sqll", "sql", None, "poem", "poem", "sql", None, "sql", "poem"]
    prompts = [f"The {WORDS[i % 8]} number {i} is" for i in range(len(names))]
    table = pa.table({"id": pa.array(range(len(names)), pa.int64()), "q": prompts, "ad": names})
    source = _write_parts(tmp_path / "in", table, num_parts=2)
    config = ProcessorConfig.create(
        model,
        "generate",
        engine_kwargs={"max_model_len": 64},
        sampling_params={"max_tokens": 6, "temperature": 0.0},
        prompt_column="q",
        lora_modules=tiny_llama_adapters,
        lora_column="ad",
        output_token_ids=True,
        batch_size=4,
        stats_dir=str(tmp_path / "stats"),
    )
    build_processor(config)(ray_local.data.read_parquet(str(source))).write_parquet(
        str(tmp_path / "out")
    )
    out = pq.read_table(tmp_path / "out").sort_by("id").to_pylist()
    assert [s["num_engine_builds"] for s in _stats(tmp_path / "stats")] == [1]

    # LLM.generate with each row's LoRARequest (ids in the order of lora_modules).
    llm = LLM(model, max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    requests = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(tiny_llama_adapters.items(), 1)}
    known = [i for i, n in enumerate(names) if n is None or n in requests]
    refs = llm.generate(
        [prompts[i] for i in known],
        SamplingParams(max_tokens=6, temperature=0.0),
        use_tqdm=False,
        lora_request=[requests.get(names[i]) for i in known],
    )
    _release(llm)
    assert "'sqll' is not among the job's lora_modules ('sql', 'poem')" in out[3]["error"]
    for i, ref in zip(known, refs, strict=True):
        assert out[i]["error"] is None and out[i]["output_token_ids"] == ref.outputs[0].token_ids
