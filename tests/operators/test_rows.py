"""The row contract: declared schemas, column checks, per-row errors, results equal to `LLM`.

Real models: SmolLM2 (generate, chat), MiniLM (embed, bi-encoder score) and MiniLM's body
with a seeded random three-label head (classify).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.loader import resolve_model
from batchlm.operators.rows import (
    MissingColumnsError,
    ModelInfo,
    RowContractError,
    RowSpec,
    empty_output,
    output_fields,
    output_schema,
    process_table,
)

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
SAMPLING = {"max_tokens": 4, "temperature": 0.0}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM(SMOLLM2, max_model_len=64)


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(MINILM)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> LLM:
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel

    source = resolve_model(MINILM)
    out = tmp_path_factory.mktemp("cls3")
    config = BertConfig.from_pretrained(source, num_labels=3, id2label=LABELS)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    model.bert.load_state_dict(BertModel.from_pretrained(source).state_dict(), strict=False)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return LLM(str(out))


def _invalid_utf8_strings() -> pa.Array:
    """A string column ["fine", <bytes that are not UTF-8>] (Arrow does not check on read)."""
    data = b"fine" + b"bad\xff\xfe"
    offsets = np.array([0, 4, 9], dtype=np.int32)
    return pa.Array.from_buffers(
        pa.string(), 2, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)]
    )


# ---- specs and schemas ----------------------------------------------------------------------


def test_declared_schema_per_task():
    info = ModelInfo(hidden_size=384, num_labels=3, id2label=LABELS)

    def columns(spec: RowSpec) -> list[tuple[str, pa.DataType]]:
        return [(f.name, f.type) for f in output_fields(spec, info)]

    generated = [
        ("generated_text", pa.string()),
        ("finish_reason", pa.string()),
        ("num_input_tokens", pa.int32()),
        ("num_output_tokens", pa.int32()),
        ("error", pa.string()),
    ]
    assert columns(RowSpec(task="generate")) == generated
    assert columns(RowSpec(task="chat")) == generated
    assert columns(RowSpec(task="embed")) == [
        ("embedding", pa.list_(pa.float32(), 384)),
        ("error", pa.string()),
    ]
    matryoshka = RowSpec(task="embed", pooling_params={"dimensions": 64})
    assert columns(matryoshka)[0] == ("embedding", pa.list_(pa.float32(), 64))
    assert columns(RowSpec(task="score")) == [("score", pa.float64()), ("error", pa.string())]
    assert columns(RowSpec(task="classify")) == [
        ("probs", pa.list_(pa.float32(), 3)),
        ("label", pa.string()),
        ("error", pa.string()),
    ]


def test_output_schema_keeps_input_columns_first():
    spec = RowSpec(task="score")
    info = ModelInfo(hidden_size=384)
    source = pa.schema([("id", pa.int64()), ("text", pa.string()), ("text_pair", pa.string())])
    schema = output_schema(spec, info, source)
    assert schema.names == ["id", "text", "text_pair", "score", "error"]
    empty = empty_output(spec, info, source)
    assert empty.num_rows == 0 and empty.schema == schema


def test_missing_columns_error_names_them_and_what_the_input_has():
    with pytest.raises(MissingColumnsError) as e:
        output_schema(
            RowSpec(task="score"), ModelInfo(8), pa.schema([("id", pa.int64()), ("q", pa.string())])
        )
    assert "['text', 'text_pair']" in str(e.value) and "['id', 'q']" in str(e.value)
    spec = RowSpec(task="generate", prompt_column="question")
    with pytest.raises(MissingColumnsError, match=r"\['question'\]"):
        process_table(None, spec, pa.table({"prompt": ["hi"]}), ModelInfo(8))


def test_output_column_collision_is_an_error():
    source = pa.schema([("text", pa.string()), ("embedding", pa.string()), ("error", pa.string())])
    with pytest.raises(RowContractError, match=r"\['embedding', 'error'\] would be overwritten"):
        output_schema(RowSpec(task="embed"), ModelInfo(384), source)


def test_spec_validation():
    with pytest.raises(RowContractError, match="task='summarize' is unknown"):
        RowSpec(task="summarize")
    with pytest.raises(RowContractError, match="n=2"):
        RowSpec(task="generate", sampling_params={"n": 2})
    with pytest.raises(RowContractError, match="not task='embed'"):
        RowSpec(task="embed", sampling_params={"max_tokens": 3})
    with pytest.raises(
        RowContractError, match=r"unknown key\(s\) 'max_token' \(did you mean 'max_tokens'\?\)"
    ) as e:
        RowSpec(task="generate", sampling_params={"max_token": 3})
    valid = str(e.value).split("valid keys: ")[1].split(", ")
    assert "temperature" in valid and "_stop_strs" not in valid  # no derived fields
    assert "bad_words_token_ids" not in valid
    spec = RowSpec(task="generate", sampling_params=SAMPLING)
    assert RowSpec(**spec.to_dict()) == spec
    assert spec.fingerprint() == RowSpec(**spec.to_dict()).fingerprint()
    assert spec.fingerprint() != RowSpec(task="generate").fingerprint()


# ---- generation -------------------------------------------------------------------------------


def test_generate_rows_match_llm_and_bad_rows_carry_their_error(smollm2):
    prompts = ["The capital of France is", "", None, "word " * 100, "1, 2, 3,", "Hello"]
    table = pa.table({"id": list(range(6)), "prompt": pa.array(prompts, pa.string())})
    spec = RowSpec(task="generate", sampling_params=SAMPLING)
    out = process_table(smollm2, spec, table)
    assert out.schema == output_schema(spec, ModelInfo.from_llm(smollm2), table.schema)
    rows = out.to_pylist()
    good = [0, 4, 5]
    expected = smollm2.generate(
        [prompts[i] for i in good], SamplingParams(**SAMPLING), use_tqdm=False
    )
    for i, ref in zip(good, expected, strict=True):
        assert rows[i]["error"] is None
        assert rows[i]["generated_text"] == ref.outputs[0].text
        assert rows[i]["finish_reason"] == ref.outputs[0].finish_reason
        assert rows[i]["num_input_tokens"] == len(ref.prompt_token_ids)
        assert rows[i]["num_output_tokens"] == len(ref.outputs[0].token_ids)
    assert rows[1]["error"].startswith("the input is empty; a prompt needs at least one token")
    assert rows[2]["error"] == "column 'prompt' is null in this row"
    assert "more than max_model_len=64" in rows[3]["error"]
    assert not rows[3]["error"].startswith("prompts[")  # no position from the engine call
    for i in (1, 2, 3):
        assert rows[i]["generated_text"] is None and rows[i]["num_output_tokens"] is None
    assert [r["id"] for r in rows] == list(range(6))


def test_generate_wrong_types_and_invalid_utf8(smollm2):
    spec = RowSpec(task="generate", sampling_params=SAMPLING)
    bad_bytes = process_table(smollm2, spec, pa.table({"prompt": _invalid_utf8_strings()}))
    assert bad_bytes["error"][0].as_py() is None
    assert "not valid UTF-8" in bad_bytes["error"][1].as_py()
    numbers = process_table(smollm2, spec, pa.table({"prompt": [7, 8]}))
    assert numbers["error"].to_pylist() == [
        "column 'prompt' holds a int, not a string: 7",
        "column 'prompt' holds a int, not a string: 8",
    ]


def test_token_id_prompts(smollm2):
    ids = smollm2.get_tokenizer()("The capital of France is")["input_ids"]
    spec = RowSpec(task="generate", sampling_params=SAMPLING)
    table = pa.table({"prompt": pa.array([ids, [10**9]], pa.list_(pa.int64()))})
    out = process_table(smollm2, spec, table).to_pylist()
    ref = smollm2.generate([{"prompt_token_ids": ids}], SamplingParams(**SAMPLING), use_tqdm=False)
    assert out[0]["generated_text"] == ref[0].outputs[0].text
    assert "outside the vocabulary" in out[1]["error"]


def test_chat_rows_from_structs_and_json(smollm2):
    conversation = [{"role": "user", "content": "Name a colour."}]
    structs = pa.array(
        [conversation, None],
        pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    )
    spec = RowSpec(task="chat", sampling_params=SAMPLING)
    out = process_table(smollm2, spec, pa.table({"messages": structs})).to_pylist()
    text = pa.table({"messages": [json.dumps(conversation), "{not json"]})
    out_json = process_table(smollm2, spec, text).to_pylist()
    ref = smollm2.chat([conversation], SamplingParams(**SAMPLING), use_tqdm=False)
    assert out[0]["generated_text"] == out_json[0]["generated_text"] == ref[0].outputs[0].text
    assert out[1]["error"] == "column 'messages' is null in this row"
    assert "not JSON messages" in out_json[1]["error"]


# ---- pooling ----------------------------------------------------------------------------------


def test_embed_rows_match_llm(minilm):
    texts = ["A man is eating food.", None, "", "Paris " * 400, "hello"]
    table = pa.table({"doc": pa.array(texts, pa.string()), "n": list(range(5))})
    spec = RowSpec(task="embed", text_column="doc")
    out = process_table(minilm, spec, table)
    assert out.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert out.column_names == ["doc", "n", "embedding", "error"]
    rows = out.to_pylist()
    good = [0, 2, 3, 4]  # empty text is [CLS] [SEP]; long text is cut to 256 tokens
    ref = minilm.embed([texts[i] for i in good], use_tqdm=False)
    for i, r in zip(good, ref, strict=True):
        assert rows[i]["error"] is None
        np.testing.assert_allclose(rows[i]["embedding"], r.outputs.embedding, atol=1e-5)
    assert rows[1]["embedding"] is None
    assert rows[1]["error"] == "column 'doc' is null in this row"


def test_embed_wrong_types_and_invalid_utf8(minilm):
    spec = RowSpec(task="embed")
    out = process_table(minilm, spec, pa.table({"text": _invalid_utf8_strings()}))
    embeddings, errors = out["embedding"].to_pylist(), out["error"].to_pylist()
    ref = minilm.embed(["fine"], use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(embeddings[0], ref, atol=1e-5)
    assert embeddings[1] is None and "not valid UTF-8" in errors[1]
    numbers = process_table(minilm, spec, pa.table({"text": [1.5]}))
    assert numbers["error"][0].as_py() == "column 'text' holds a float, not a string: 1.5"


def test_score_rows_match_llm(minilm):
    queries = ["How many people live in Berlin?", "What is Paris?", None]
    docs = ["Berlin has 3.5 million inhabitants.", "Paris is the capital of France.", "x"]
    table = pa.table({"text": queries, "text_pair": docs})
    out = process_table(minilm, RowSpec(task="score"), table)
    assert out.schema.field("score").type == pa.float64()
    ref = minilm.score(queries[:2], docs[:2], use_tqdm=False)
    got = out["score"].to_pylist()
    assert got[:2] == pytest.approx([r.outputs.score for r in ref], abs=1e-6)
    assert got[2] is None
    assert out["error"].to_pylist() == [None, None, "column 'text' is null in this row"]


def test_classify_rows_match_llm(classifier):
    texts = ["I loved it.", "It was fine.", None, "Terrible service."]
    table = pa.table({"text": pa.array(texts, pa.string())})
    spec = RowSpec(task="classify")
    info = ModelInfo.from_llm(classifier)
    assert info.num_labels == 3 and info.id2label == LABELS
    out = process_table(classifier, spec, table)
    assert out.schema.field("probs").type == pa.list_(pa.float32(), 3)
    assert out.schema.field("label").type == pa.string()
    rows = out.to_pylist()
    good = [0, 1, 3]
    ref = classifier.classify([texts[i] for i in good], use_tqdm=False)
    for i, r in zip(good, ref, strict=True):
        np.testing.assert_allclose(rows[i]["probs"], r.outputs.probs, atol=1e-5)
        assert rows[i]["label"] == LABELS[int(np.argmax(r.outputs.probs))]
        assert rows[i]["error"] is None
    assert rows[2]["probs"] is None and rows[2]["label"] is None
    assert rows[2]["error"] == "column 'text' is null in this row"


def test_a_batch_of_only_bad_rows_keeps_the_declared_schema(minilm):
    table = pa.table({"text": pa.array([None, None], pa.string())})
    spec = RowSpec(task="embed")
    out = process_table(minilm, spec, table)
    assert out.schema == output_schema(spec, ModelInfo.from_llm(minilm), table.schema)
    assert out["embedding"].null_count == 2
    empty = process_table(minilm, spec, table.slice(0, 0))
    assert empty.num_rows == 0 and empty.schema == out.schema
