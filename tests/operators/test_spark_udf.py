"""Spark UDFs and `map_in_arrow`: Parquet in → engine → Parquet out, on a local[2] cluster.

Every row comes back exactly once, equal to a direct `LLM` call; bad rows carry their error;
each Python worker builds its engine once; a task that fails once is retried by Spark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchlm.engine import LLM, LoRARequest, SamplingParams
from batchlm.operators.config import OperatorConfig
from batchlm.operators.fault_injection import SPARK_TRACE_PROPERTY
from batchlm.operators.rows import RowContractError, process_table

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
MAX_RECORDS_PER_BATCH = 32
GEN_MAX_MODEL_LEN = 64
GEN_SAMPLING = {"max_tokens": 4, "temperature": 0.0}


def test_importing_engine_and_operators_loads_no_pyspark():
    code = (
        "import sys, batchlm.engine, batchlm.operators, batchlm.operators.rows\n"
        "import batchlm.operators.config, batchlm.operators.spark_udf\n"
        "print(','.join(m for m in ('pyspark', 'py4j') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# ---- fixtures -------------------------------------------------------------------------------

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("pandas")

from batchlm.operators import spark_udf  # noqa: E402


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    # The JVM and the Python workers it starts inherit this process's environment.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2,2]")  # 2 cores, a failed task is retried once
        .appName("batchlm-test-spark-udf")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(MAX_RECORDS_PER_BATCH))
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def trace(spark, tmp_path):
    """A trace folder for the jobs this test runs (engine builds, batches, injected faults)."""
    folder = tmp_path / "trace"
    folder.mkdir()
    spark.sparkContext.setLocalProperty(SPARK_TRACE_PROPERTY, str(folder))
    yield folder
    spark.sparkContext.setLocalProperty(SPARK_TRACE_PROPERTY, None)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama) -> LLM:
    """The direct-call reference for the generation tests."""
    return LLM(tiny_llama, max_model_len=GEN_MAX_MODEL_LEN)


def _write_parquet(folder: Path, table: pa.Table, num_files: int = 4) -> str:
    folder.mkdir(parents=True)
    step = -(-table.num_rows // num_files)
    for i in range(num_files):
        pq.write_table(table.slice(i * step, step), folder / f"part-{i}.parquet")
    return str(folder)


def _read_sorted(path: str) -> pa.Table:
    table = pq.read_table(path)
    return table.sort_by("id")


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _assert_engine_built_once_per_worker(trace: Path, config: OperatorConfig) -> None:
    key = config.engine_fingerprint()
    builds = [pid for pid, k in _lines(trace / "engine_builds.txt") if k.startswith(key)]
    batches = _lines(trace / "batches.txt")
    worker_pids = {b[0] for b in batches}
    assert builds, "no engine was built"
    assert len(builds) == len(set(builds)), f"a worker built its engine twice: {builds}"
    assert len(builds) <= len(worker_pids), (builds, worker_pids)
    assert len(batches) >= 3 * len(builds), (len(batches), builds)  # far fewer than batches


# ---- generate ---------------------------------------------------------------------------------


def _generation_rows() -> tuple[list[int], list[str | None]]:
    prompts: list[str | None] = [
        f"Item {i}: the {['cat', 'dog', 'bird', 'fish'][i % 4]} saw {i * 7 % 100} apples"
        for i in range(220)
    ]
    prompts[5] = None
    prompts[77] = ""
    prompts[150] = "many words " * GEN_MAX_MODEL_LEN  # longer than max_model_len
    return list(range(len(prompts))), prompts


def test_generate_udf_parquet_round_trip(spark, trace, tiny_llama, tiny_llm, tmp_path):
    ids, prompts = _generation_rows()
    source = _write_parquet(
        tmp_path / "in", pa.table({"id": ids, "prompt": pa.array(prompts, pa.string())})
    )
    config = OperatorConfig.create(
        tiny_llama,
        "generate",
        engine_kwargs={"max_model_len": GEN_MAX_MODEL_LEN},
        sampling_params=GEN_SAMPLING,
        batch_size=16,
    )
    udf = spark_udf.generate_udf(config)
    df = spark.read.parquet(source).repartition(4)
    out_path = str(tmp_path / "out")
    df.withColumn("out", udf("prompt")).select("id", "prompt", "out.*").write.parquet(out_path)

    got = _read_sorted(out_path)
    assert got.column("id").to_pylist() == ids  # every row exactly once
    assert got.schema.field("num_output_tokens").type == pa.int32()
    errors = dict(zip(ids, got.column("error").to_pylist(), strict=True))
    assert "null" in errors[5]
    assert "empty" in errors[77]
    assert f"max_model_len={GEN_MAX_MODEL_LEN}" in errors[150]

    bad = {5, 77, 150}
    good = [i for i in ids if i not in bad]
    expected = tiny_llm.generate(
        [prompts[i] for i in good], SamplingParams(**GEN_SAMPLING), use_tqdm=False
    )
    text = got.column("generated_text").to_pylist()
    num_out = got.column("num_output_tokens").to_pylist()
    num_in = got.column("num_input_tokens").to_pylist()
    for i, ref in zip(good, expected, strict=True):
        assert errors[i] is None, (i, errors[i])
        assert text[i] == ref.outputs[0].text, i
        assert num_out[i] == len(ref.outputs[0].token_ids)
        assert num_in[i] == len(ref.prompt_token_ids)
    for i in bad:
        assert text[i] is None and num_out[i] is None
    _assert_engine_built_once_per_worker(trace, config)


def test_chat_udf_takes_message_structs(spark, tiny_llama, tiny_llm):
    config = OperatorConfig.create(
        tiny_llama,
        "chat",
        engine_kwargs={"max_model_len": GEN_MAX_MODEL_LEN},
        sampling_params=GEN_SAMPLING,
    )
    conversations = [
        [{"role": "user", "content": f"Say {w}"}] for w in ("yes", "no", "maybe", "later")
    ]
    rows = [(i, c) for i, c in enumerate(conversations)] + [(len(conversations), None)]
    df = spark.createDataFrame(rows, "id long, messages array<struct<role:string,content:string>>")
    got = sorted(df.withColumn("out", spark_udf.chat_udf(config)("messages")).collect())

    expected = tiny_llm.chat(conversations, SamplingParams(**GEN_SAMPLING), use_tqdm=False)
    assert [r.out.generated_text for r in got[:-1]] == [e.outputs[0].text for e in expected]
    assert got[-1].out.generated_text is None and "null" in got[-1].out.error


# ---- rows with their own params, logprob columns, loglikelihood ------------------------------

PARAM_CELLS = [
    None,
    {"max_tokens": 2},
    {"temperature": 0.9, "seed": 3},
    {"max_tokens": 0},  # a bad value: this row's error
    {"temperature": 1.1, "seed": 4, "max_tokens": 3},
]
PARAMS_TYPE = "struct<max_tokens:int,temperature:double,seed:int>"


def _param_frame(spark):
    rows = [(i, f"Item {i}: the cat saw", c) for i, c in enumerate(PARAM_CELLS)]
    return spark.createDataFrame(rows, f"id long, prompt string, params {PARAMS_TYPE}")


def _row_params(cell: dict | None) -> SamplingParams:
    return SamplingParams(**{**GEN_SAMPLING, "logprobs": 0, **(cell or {})})


def test_map_in_arrow_rows_with_own_params_and_logprob_columns(spark, tiny_llama, tiny_llm):
    config = OperatorConfig.create(
        tiny_llama,
        "generate",
        engine_kwargs={"max_model_len": GEN_MAX_MODEL_LEN},
        sampling_params=GEN_SAMPLING,
        sampling_params_column="params",
        output_token_ids=True,
        output_logprobs=True,
        cumulative_logprob=True,
    )
    out = spark_udf.map_in_arrow(_param_frame(spark), config)
    assert out.schema["output_logprobs"].dataType.simpleString() == (
        "array<array<struct<token_id:int,logprob:float>>>"
    )
    rows = sorted(out.collect())
    assert "max_tokens=0 must be >= 1" in rows[3].error
    for i in (0, 1, 2, 4):
        (ref,) = tiny_llm.generate([rows[i].prompt], _row_params(PARAM_CELLS[i]), use_tqdm=False)
        c = ref.outputs[0]
        assert rows[i].error is None and rows[i].generated_text == c.text, i
        assert rows[i].output_token_ids == c.token_ids
        assert [[e.token_id for e in p] for p in rows[i].output_logprobs] == [
            list(d) for d in c.logprobs
        ]
        assert rows[i].cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-4)


def test_udfs_take_json_params_and_score_loglikelihoods(spark, tiny_llama, tiny_llm):
    gen_config = OperatorConfig.create(
        tiny_llama,
        "generate",
        engine_kwargs={"max_model_len": GEN_MAX_MODEL_LEN},
        sampling_params=GEN_SAMPLING,
        output_token_ids=True,
    )
    cells = [None, '{"max_tokens": 2}', '{"temperature": 0.7, "seed": 5}', '{"tempreature": 1}']
    df = spark.createDataFrame(
        [(i, f"Item {i}: the dog saw", c) for i, c in enumerate(cells)],
        "id long, prompt string, params string",
    )
    gen = sorted(
        df.select(
            "id", "prompt", spark_udf.generate_udf(gen_config)("prompt", "params").alias("o")
        ).collect()
    )
    assert "did you mean 'temperature'" in gen[3].o.error
    for row, cell in zip(gen[:3], cells[:3], strict=True):
        params = SamplingParams(**{**GEN_SAMPLING, **json.loads(cell or "{}")})
        (ref,) = tiny_llm.generate([row.prompt], params, use_tqdm=False)
        assert row.o.output_token_ids == ref.outputs[0].token_ids

    ll_config = OperatorConfig.create(
        tiny_llama, "loglikelihood", engine_kwargs={"max_model_len": GEN_MAX_MODEL_LEN}
    )
    pairs = [("The cat sat on the", " mat"), ("The cat sat on the", " moon"), ("x", "")]
    df = spark.createDataFrame(
        [(i, c, x) for i, (c, x) in enumerate(pairs)], "id long, q string, a string"
    )
    got = sorted(
        df.select("id", spark_udf.loglikelihood_udf(ll_config)("q", "a").alias("o")).collect()
    )
    expected = process_table(
        tiny_llm,
        ll_config.spec,
        pa.table({"context": [c for c, _ in pairs], "continuation": [x for _, x in pairs]}),
    ).to_pylist()
    for row, want in zip(got, expected, strict=True):
        assert row.o.error == want["error"]
        if want["error"] is None:
            assert row.o.logprob == pytest.approx(want["logprob"], abs=1e-4)
            assert (row.o.is_greedy, row.o.num_tokens) == (want["is_greedy"], want["num_tokens"])


# ---- LoRA adapters ---------------------------------------------------------------------------

LORA_NAMES = [None, "sql", "poem", "sqll", "sql", None, "poem", "poem", "sql"]


def _lora_reference(model: str, adapters: dict[str, str], prompts: list[str]) -> list:
    """`LLM.generate` with each row's `LoRARequest` (None where the name is unknown)."""
    llm = LLM(model, max_model_len=GEN_MAX_MODEL_LEN, enable_lora=True, max_lora_rank=8)
    requests = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), 1)}
    known = [i for i, n in enumerate(LORA_NAMES) if n is None or n in requests]
    outs = llm.generate(
        [prompts[i] for i in known],
        SamplingParams(**GEN_SAMPLING),
        use_tqdm=False,
        lora_request=[requests.get(LORA_NAMES[i]) for i in known],
    )
    llm.shutdown()
    ref: list = [None] * len(prompts)
    for i, out in zip(known, outs, strict=True):
        ref[i] = out.outputs[0].token_ids
    return ref


def test_rows_across_lora_adapters(spark, tiny_llama, tiny_llama_adapters):
    from pyspark.sql import functions as F

    config = OperatorConfig.create(
        tiny_llama,
        "generate",
        engine_kwargs={"max_model_len": GEN_MAX_MODEL_LEN},
        sampling_params=GEN_SAMPLING,
        lora_modules=tiny_llama_adapters,
        output_token_ids=True,
        batch_size=4,
    )
    prompts = [f"Item {i}: the bird saw" for i in range(len(LORA_NAMES))]
    df = spark.createDataFrame(
        list(zip(range(len(prompts)), prompts, LORA_NAMES, strict=True)),
        "id long, prompt string, lora string",
    ).coalesce(1)  # one task: one engine to build
    expected = _lora_reference(tiny_llama, tiny_llama_adapters, prompts)
    udf = spark_udf.generate_udf(config)("prompt", F.lit(None).cast("string"), "lora")
    for rows in (
        sorted(spark_udf.map_in_arrow(df, config).collect()),
        [r.o for r in sorted(df.select("id", udf.alias("o")).collect())],
    ):
        assert "'sqll' is not among the job's lora_modules ('sql', 'poem')" in rows[3].error
        for i, row in enumerate(rows):
            if i != 3:
                assert row.error is None and row.output_token_ids == expected[i], i
    with pytest.raises(RowContractError, match="column 'lora' names a LoRA adapter per row"):
        spark_udf.map_in_arrow(df, OperatorConfig.create(tiny_llama, "generate"))


# ---- pooling -------------------------------------------------------------------------------


def _embedding_rows() -> tuple[list[int], list[str | None]]:
    texts: list[str | None] = [f"Sentence number {i} is about topic {i % 13}." for i in range(210)]
    texts[3] = None
    # Longer than the model's 256 tokens: truncated (as sentence-transformers does), not refused.
    texts[100] = "Paris is the capital and most populous city of France. " * 40
    return list(range(len(texts))), texts


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(MINILM)


def test_embed_map_in_arrow_parquet_round_trip(spark, trace, minilm, tmp_path):
    ids, texts = _embedding_rows()
    source = _write_parquet(
        tmp_path / "in", pa.table({"id": ids, "text": pa.array(texts, pa.string())})
    )
    config = OperatorConfig.create(MINILM, "embed", batch_size=16)
    df = spark.read.parquet(source).repartition(4)
    out = spark_udf.map_in_arrow(df, config)
    field = out.schema["embedding"]
    assert field.metadata[spark_udf.FIXED_SIZE_KEY] == 384
    assert out.columns == ["id", "text", "embedding", "error"]
    out_path = str(tmp_path / "out")
    out.write.parquet(out_path)

    got = _read_sorted(out_path)
    assert got.column("id").to_pylist() == ids
    assert got.column("text").to_pylist() == texts  # passed through
    errors = got.column("error").to_pylist()
    assert "null" in errors[3]
    good = [i for i in ids if i != 3]
    expected = minilm.embed([texts[i] for i in good], use_tqdm=False)
    embeddings = got.column("embedding").to_pylist()
    assert embeddings[3] is None
    got_good = np.array([embeddings[i] for i in good], dtype=np.float32)
    ref = np.array([e.outputs.embedding for e in expected], dtype=np.float32)
    assert got_good.shape == (len(good), 384)
    np.testing.assert_allclose(got_good, ref, atol=1e-5, rtol=0)
    assert all(errors[i] is None for i in good)
    _assert_engine_built_once_per_worker(trace, config)


def test_embed_and_score_udfs(spark, minilm):
    texts = ["A man is eating food.", "A man is riding a horse.", None, "The girl sings."]
    docs = ["Someone eats.", "A rider on a horse.", "x", None]
    df = spark.createDataFrame(
        list(zip(range(4), texts, docs, strict=True)), "id long, q string, d string"
    )
    embed = spark_udf.embed_udf(OperatorConfig.create(MINILM, "embed"))
    score = spark_udf.score_udf(OperatorConfig.create(MINILM, "score"))
    assert embed.embedding_dim == 384
    # One query each: two UDFs in one select run in two Python workers per task.
    embedded = sorted(df.select("id", embed("q").alias("e")).collect())
    scored = sorted(df.select("id", score("q", "d").alias("s")).collect())
    rows = [(e.id, e.e, s.s) for e, s in zip(embedded, scored, strict=True)]
    ref_embed = minilm.embed([texts[0], texts[1]], use_tqdm=False)
    ref_score = minilm.score([texts[0], texts[1]], [docs[0], docs[1]], use_tqdm=False)
    for (_, got_e, got_s), e, s in zip(rows[:2], ref_embed, ref_score, strict=True):
        np.testing.assert_allclose(got_e.embedding, e.outputs.embedding, atol=1e-5)
        assert got_s.score == pytest.approx(s.outputs.score, abs=1e-5)
        assert got_e.error is None and got_s.error is None
    assert rows[2][1].embedding is None and "'text'" in rows[2][1].error
    assert rows[3][2].score is None and "'text_pair'" in rows[3][2].error


def test_classify_udf_probs_and_labels(spark, tiny_llama, tmp_path):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    labels = {0: "red", 1: "green", 2: "blue"}
    hf_config = LlamaConfig.from_pretrained(tiny_llama, num_labels=3, id2label=labels)
    hf_config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    folder = tmp_path / "llama-cls"
    LlamaForSequenceClassification(hf_config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(folder)

    texts = ["red green blue", "one two three four", None, "a b c"]
    df = spark.createDataFrame(list(enumerate(texts)), "id long, text string")
    udf = spark_udf.classify_udf(OperatorConfig.create(str(folder), "classify"))
    assert udf.output_fields[0].type.list_size == 3
    rows = sorted(df.withColumn("out", udf("text")).collect())

    ref = LLM(str(folder)).classify([t for t in texts if t is not None], use_tqdm=False)
    got = [r.out for r in rows if r.text is not None]
    for out, expected in zip(got, ref, strict=True):
        np.testing.assert_allclose(out.probs, expected.outputs.probs, atol=1e-5)
        assert out.label == labels[int(np.argmax(expected.outputs.probs))]
    assert rows[2].out.probs is None and rows[2].out.label is None and rows[2].out.error


def test_failed_task_is_retried_and_output_is_complete(spark, trace, tmp_path):
    ids = list(range(200))
    source = _write_parquet(
        tmp_path / "in", pa.table({"id": ids, "text": [f"row {i}" for i in ids]})
    )
    (trace / "fail_once_partition_1").touch()
    config = OperatorConfig.create(MINILM, "embed")
    df = spark.read.parquet(source).repartition(4)
    out_path = str(tmp_path / "out")
    spark_udf.map_in_arrow(df, config).write.parquet(out_path)

    assert not (trace / "fail_once_partition_1").exists()  # the failure happened
    attempts = {(int(p), int(a)) for _, p, a, _ in _lines(trace / "batches.txt")}
    assert (1, 0) in attempts and (1, 1) in attempts
    got = _read_sorted(out_path)
    assert got.column("id").to_pylist() == ids
    assert got.column("error").null_count == len(ids)


# ---- without a cluster -----------------------------------------------------------------------


class _BrokenEngine:
    """Queues requests; its first engine step fails as a lost device would."""

    def __init__(self) -> None:
        self.shut_down = False
        self.aborted: list[str] = []
        scheduler = types.SimpleNamespace(max_num_seqs=4)
        self.llm_engine = types.SimpleNamespace(
            config=types.SimpleNamespace(scheduler=scheduler),
            step=self._step,
            abort_requests=self.aborted.extend,
            is_shut_down=False,
        )

    def enqueue(self, prompts, params):
        return [str(i) for i in range(len(prompts))]

    def _step(self):
        raise RuntimeError("device lost")

    def shutdown(self):
        self.shut_down = True


def test_engine_failure_fails_the_task_naming_model_and_partition(monkeypatch):
    from batchlm.operators.rows import ModelInfo

    config = OperatorConfig.create("some/model", "generate", batch_size=2)
    engine = _BrokenEngine()
    key = f"{config.engine_fingerprint()}@cpu"
    monkeypatch.setitem(spark_udf._ENGINES, key, engine)
    table = pa.table({"prompt": ["a", "b", "c"]})
    batches = spark_udf.process_batches(config, ModelInfo(hidden_size=8), iter([table]))
    with pytest.raises(
        RuntimeError,
        match=r"model 'some/model' failed in partition -1, attempt 0, after 0 batch\(es\) of 2 "
        r"rows: RuntimeError: device lost",
    ):
        next(batches)
    assert engine.shut_down and key not in spark_udf._ENGINES  # the retry gets a fresh engine
    assert engine.aborted  # the requests in flight were dropped


def test_udf_factory_checks_the_task():
    from batchlm.operators.rows import RowContractError

    with pytest.raises(RowContractError, match="task='generate'"):
        spark_udf.generate_udf(OperatorConfig.create(MINILM, "embed"))


class _FakeTaskContext:
    def __init__(self, gpus: list[str]) -> None:
        self.gpus = gpus

    def resources(self):
        from pyspark.resource import ResourceInformation

        return {"gpu": ResourceInformation("gpu", self.gpus)} if self.gpus else {}


def test_device_follows_the_tasks_gpu(monkeypatch):
    config = OperatorConfig.create(MINILM, "embed")
    monkeypatch.setattr(spark_udf, "_task_context", lambda: _FakeTaskContext([]))
    assert spark_udf.task_device(config) == "cpu"
    monkeypatch.setattr(spark_udf, "_task_context", lambda: _FakeTaskContext(["1", "2"]))
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    assert spark_udf.task_device(config) == "cuda:1"
    tp = OperatorConfig.create(MINILM, "embed", engine_kwargs={"tensor_parallel_size": 2})
    assert spark_udf.task_device(tp) == "cuda:1,2"  # each rank on one of the task's GPUs
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)  # isolated: renumbered from 0
    assert spark_udf.task_device(tp) == "cuda:0,1"
    tp3 = OperatorConfig.create(MINILM, "embed", engine_kwargs={"tensor_parallel_size": 3})
    with pytest.raises(RowContractError, match="spark.task.resource.gpu.amount=3"):
        spark_udf.task_device(tp3)
    pinned = OperatorConfig.create(MINILM, "embed", engine_kwargs={"device": "cpu"})
    assert spark_udf.task_device(pinned) == "cpu"
    monkeypatch.setattr(spark_udf, "_task_context", lambda: None)  # outside a Spark task
    assert spark_udf.task_device(config) == "cpu"
