"""`stream_tables`: batches stream through one engine, several in flight, results in input
order and equal to direct `LLM` calls over the same rows."""

from __future__ import annotations

import gc

import pyarrow as pa
import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.operators import row_stream
from batchlm.operators.row_stream import stream_tables
from batchlm.operators.rows import RowSpec

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
# Chat-style prompts whose greedy answers end (at EOS) after very different lengths.
QUESTIONS = [
    "Answer yes or no: is water wet?",
    "Write a long story about a dragon and a knight.",
    "What is 2+2? Reply with the number only.",
    "List ten animals, one per line.",
    "Say hi.",
    "Explain photosynthesis in detail.",
    "Name a colour.",
    "Describe the city of Paris at length.",
    "Reply with the word OK.",
    "Count from one to twenty in words.",
]


@pytest.fixture(scope="module")
def smollm2():
    llm = LLM(SMOLLM2, max_model_len=512, max_num_seqs=8)
    yield llm
    llm.shutdown()


def _slices(table: pa.Table, size: int):
    return [(i, table.slice(start, size)) for i, start in enumerate(range(0, table.num_rows, size))]


def test_generation_streams_batches_in_input_order(smollm2, monkeypatch):
    params = {"temperature": 0, "max_tokens": 40}
    spec = RowSpec(task="chat", sampling_params=params)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    table = pa.table({"messages": messages, "id": list(range(len(QUESTIONS)))})
    expected = smollm2.chat(messages, SamplingParams(**params), use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in expected]
    assert min(lengths) < 12 and max(lengths) == 40  # very different output lengths

    engine = smollm2.llm_engine
    running: list[int] = []
    real_step = engine.step

    def counting_step():
        out = real_step()
        running.append(len(engine.scheduler.running))
        return out

    monkeypatch.setattr(engine, "step", counting_step)
    got = list(stream_tables(smollm2, spec, _slices(table, 2), rows_in_flight=8))
    assert [key for key, _ in got] == list(range(5))
    out = pa.concat_tables([t for _, t in got])
    assert out.column("id").to_pylist() == list(range(len(QUESTIONS)))
    assert out.column("generated_text").to_pylist() == [o.outputs[0].text for o in expected]
    assert out.column("num_output_tokens").to_pylist() == lengths
    assert out.column("error").null_count == len(QUESTIONS)
    # Batches of two rows, yet up to eight requests ran together: the engine was refilled
    # from later batches while the long answers of earlier ones ran.
    assert max(running) > 2
    assert not engine.has_unfinished_requests()


def test_stopping_early_leaves_no_request_in_the_engine(smollm2):
    spec = RowSpec(task="generate", sampling_params={"temperature": 0, "max_tokens": 32})
    table = pa.table({"prompt": QUESTIONS})
    stream = stream_tables(smollm2, spec, _slices(table, 1), rows_in_flight=6)
    key, first = next(stream)
    assert key == 0 and first.num_rows == 1
    assert smollm2.llm_engine.has_unfinished_requests()
    stream.close()  # the caller stops: the requests still running are dropped
    assert not smollm2.llm_engine.has_unfinished_requests()
    kv = smollm2.llm_engine.kv_cache
    assert kv.num_free_blocks == smollm2.llm_engine.num_kv_blocks


def test_the_heap_is_thawed_between_batches(smollm2):
    """The engine's runs freeze the heap; a caller holding the iterator between batches (or
    dropping it without closing it) finds nothing frozen."""
    spec = RowSpec(task="generate", sampling_params={"temperature": 0, "max_tokens": 8})
    table = pa.table({"prompt": QUESTIONS[:4]})
    stream = stream_tables(smollm2, spec, _slices(table, 1), rows_in_flight=2)
    frozen_during = []
    real_step = smollm2.llm_engine.step

    def step():
        frozen_during.append(gc.get_freeze_count())
        return real_step()

    smollm2.llm_engine.step = step
    try:
        next(stream)
        assert gc.get_freeze_count() == 0
        next(stream)
        assert gc.get_freeze_count() == 0
        assert frozen_during and all(n > 0 for n in frozen_during)
        del stream  # dropped, not closed
        assert gc.get_freeze_count() == 0
    finally:
        del smollm2.llm_engine.step
    assert not smollm2.llm_engine.has_unfinished_requests()


def test_pooling_batches_merge_into_large_calls(monkeypatch):
    llm = LLM(MINILM)
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'ships'}" for i in range(40)]
    table = pa.table({"text": texts})
    calls: list[int] = []
    real = row_stream.process_table

    def counting(llm, spec, t, info):
        calls.append(t.num_rows)
        return real(llm, spec, t, info)

    monkeypatch.setattr(row_stream, "process_table", counting)
    monkeypatch.setattr(row_stream, "POOLING_ROWS_PER_CALL", 16)
    got = list(stream_tables(llm, RowSpec(task="embed"), _slices(table, 4), rows_in_flight=8))
    assert [k for k, _ in got] == list(range(10))
    assert calls == [16, 16, 8]  # batches of 4 rows, merged up to 16 per call
    out = pa.concat_tables([t for _, t in got])
    assert out.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    vectors = torch.tensor(out.column("embedding").to_pylist())
    expected = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    assert torch.nn.functional.cosine_similarity(vectors, expected).min() >= 0.99999
    llm.shutdown()
