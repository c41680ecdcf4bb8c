"""embed / classify / score / encode against sentence-transformers and transformers."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch

from batchlm.engine import LLM, PoolingParams, SamplingParams
from batchlm.engine.errors import InvalidParamError, InvalidPromptError, UnsupportedModelError
from batchlm.engine.loader import resolve_model

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Two men pushed carts through the woods.",
    "hello",
    "Paris is the capital and most populous city of France. " * 40,  # > 256 tokens
]
PAIRS_Q = "How many people live in Berlin?"
PAIRS_D = [
    "Berlin had a population of 3,520,031 registered inhabitants.",
    "Berlin is well known for its museums.",
    "The capital of France is Paris.",
]


@pytest.fixture(scope="module")
def minilm_dir():
    return resolve_model(MINILM)


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return LLM(MINILM)


@pytest.fixture(scope="module")
def cross_encoder_dir(minilm_dir, tmp_path_factory):
    """MiniLM body + a seeded random one-label head: the real cross-encoder code path."""
    return _classifier_from_minilm(minilm_dir, tmp_path_factory.mktemp("ce"), num_labels=1)


def _classifier_from_minilm(minilm_dir, out, num_labels):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel

    config = BertConfig.from_pretrained(minilm_dir, num_labels=num_labels)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    body = BertModel.from_pretrained(minilm_dir)
    model.bert.load_state_dict(body.state_dict(), strict=False)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(out)
    return out


def test_embeddings_match_sentence_transformers(minilm, minilm_dir):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    expected = st.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=False)
    outs = minilm.embed(SENTENCES, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == (len(SENTENCES), 384)
    cos = torch.nn.functional.cosine_similarity(got, expected.float(), dim=-1)
    assert cos.min().item() >= 0.9999, cos
    # Token ids are those of the tokenizer's own call, the long sentence cut at
    # sentence-transformers' max_seq_length (256).
    expected_ids = st.tokenizer(SENTENCES, truncation=True, max_length=256)["input_ids"]
    assert [o.prompt_token_ids for o in outs] == expected_ids
    assert len(outs[-1].prompt_token_ids) == 256
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_bi_encoder_score_is_cosine(minilm, minilm_dir):
    from sentence_transformers import SentenceTransformer, util

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    q, d = st.encode([PAIRS_Q], convert_to_tensor=True), st.encode(PAIRS_D, convert_to_tensor=True)
    expected = util.cos_sim(q, d)[0]
    one_to_n = [o.outputs.score for o in minilm.score(PAIRS_Q, PAIRS_D, use_tqdm=False)]
    assert torch.allclose(torch.tensor(one_to_n), expected.float(), atol=1e-4)
    n_to_n = minilm.score([PAIRS_Q] * 3, PAIRS_D, use_tqdm=False)
    assert [o.outputs.score for o in n_to_n] == pytest.approx(one_to_n, abs=1e-6)
    one = minilm.score(PAIRS_Q, PAIRS_D[0], use_tqdm=False)
    assert len(one) == 1 and one[0].outputs.score == pytest.approx(one_to_n[0], abs=1e-6)
    with pytest.raises(InvalidPromptError, match="2 texts in data_1 and 3 in data_2"):
        minilm.score([PAIRS_Q] * 2, PAIRS_D)


def test_cross_encoder_scores_match_transformers(cross_encoder_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(cross_encoder_dir).eval()
    tok = AutoTokenizer.from_pretrained(cross_encoder_dir)
    with torch.inference_mode():
        logits = hf(**tok([PAIRS_Q] * 3, PAIRS_D, padding=True, return_tensors="pt")).logits
    expected = torch.sigmoid(logits[:, 0])
    llm = LLM(str(cross_encoder_dir))
    got = torch.tensor([o.outputs.score for o in llm.score(PAIRS_Q, PAIRS_D, use_tqdm=False)])
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)
    raw = llm.score(PAIRS_Q, PAIRS_D, pooling_params=PoolingParams(use_activation=False))
    assert torch.allclose(torch.tensor([o.outputs.score for o in raw]), logits[:, 0], atol=1e-4)


def test_classifier_probabilities_match_transformers(minilm_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = _classifier_from_minilm(minilm_dir, tmp_path / "cls3", num_labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    texts = SENTENCES[:5]
    with torch.inference_mode():
        expected = hf(**tok(texts, padding=True, return_tensors="pt")).logits.softmax(-1)
    llm = LLM(str(folder))
    got = torch.tensor([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    assert torch.allclose(got, expected, atol=1e-4)
    with pytest.raises(InvalidParamError, match="one label"):
        llm.score(PAIRS_Q, PAIRS_D)


def test_decoder_last_token_embeddings_match_transformers(tiny_model_factory):
    from transformers import AutoModel

    path = tiny_model_factory("qwen2")
    llm = LLM(str(path), runner="pooling", convert="embed")
    tok = llm.get_tokenizer()
    texts = ["red green blue", "one two three four five six seven", "a"]
    outs = llm.embed(texts, PoolingParams(normalize=False), use_tqdm=False)
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for text, out in zip(texts, outs, strict=True):
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.inference_mode():
            expected = hf(ids).last_hidden_state[0, -1]
        assert torch.allclose(torch.tensor(out.outputs.embedding), expected, atol=1e-4)


def test_decoder_classifier_matches_transformers(tiny_model_factory, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    base = tiny_model_factory("llama")
    config = LlamaConfig.from_pretrained(base, num_labels=4)
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    hf = LlamaForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path / "llama-cls")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "llama-cls")
    llm = LLM(str(tmp_path / "llama-cls"))
    texts = ["red green blue", "one two three four five six seven"]
    got = [o.outputs.probs for o in llm.classify(texts, use_tqdm=False)]
    tok = AutoTokenizer.from_pretrained(base)
    for text, probs in zip(texts, got, strict=True):
        with torch.inference_mode():
            expected = hf(torch.tensor([tok(text)["input_ids"]])).logits[0].softmax(-1)
        assert torch.allclose(torch.tensor(probs), expected, atol=1e-4)


def test_matryoshka_dimensions(minilm, minilm_dir, tmp_path, monkeypatch):
    with pytest.raises(InvalidParamError, match="matryoshka"):
        minilm.embed(["x"], PoolingParams(dimensions=128))
    folder = tmp_path / "mrl"
    shutil.copytree(minilm_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [384, 128]
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder))
    full = llm.embed(SENTENCES[:3], PoolingParams(normalize=False), use_tqdm=False)
    cut = llm.embed(SENTENCES[:3], PoolingParams(dimensions=128), use_tqdm=False)
    for f, c in zip(full, cut, strict=True):
        expected = torch.nn.functional.normalize(torch.tensor(f.outputs.embedding[:128]), dim=0)
        assert torch.allclose(torch.tensor(c.outputs.embedding), expected, atol=1e-6)
    matrix = llm.embed_matrix(SENTENCES[:3], PoolingParams(dimensions=128), use_tqdm=False)
    assert matrix.shape == (3, 128)
    np.testing.assert_array_equal(matrix, np.array([c.outputs.embedding for c in cut], np.float32))
    mixed = [PoolingParams(dimensions=128), PoolingParams()]
    with pytest.raises(InvalidParamError, match=r"one embedding width.*\[128, 384\]"):
        llm.embed_matrix(SENTENCES[:2], mixed, use_tqdm=False)
    # Chunked (as large calls on CUDA are; chunks of 3 for 7 prompts), one width per chunk:
    # each output keeps its own.
    halves = [PoolingParams(dimensions=128)] * 3 + [PoolingParams()] * 4
    whole = llm.embed(SENTENCES[:7], halves, use_tqdm=False)
    monkeypatch.setattr(type(llm), "_tokenize_chunk_size", lambda self: 3)
    chunked = llm.embed(SENTENCES[:7], halves, use_tqdm=False)
    assert [len(o.outputs.embedding) for o in chunked] == [128] * 3 + [384] * 4
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding)
        )


def test_encode_rows_are_tensors_of_their_own_when_read_and_pickled(minilm):
    """encode's per-text tensors are rows of the call's matrix, made when read; a pickled
    output carries its own row, not the matrix."""
    texts = ["hello world", "a b c d", "the quick brown fox"]
    outs = minilm.encode(texts, pooling_task="embed", use_tqdm=False)
    matrix = minilm.embed_matrix(texts, use_tqdm=False)
    for row, out in zip(matrix, outs, strict=True):
        assert isinstance(out.outputs.data, torch.Tensor) and out.outputs.data.shape == (384,)
        assert out.outputs.data is out.outputs.data  # made once, then kept
        np.testing.assert_array_equal(out.outputs.data.numpy(), row)
    clone = pickle.loads(pickle.dumps(outs[1]))
    assert torch.equal(clone.outputs.data, outs[1].outputs.data)
    assert clone.outputs.data.untyped_storage().nbytes() == 384 * 4
    assert clone.prompt_token_ids == outs[1].prompt_token_ids


def test_encode_and_wrong_task_errors(minilm, tiny_model_factory):
    with pytest.raises(InvalidParamError, match=r"PoolerConfig\(task=\"token_embed\"\)"):
        minilm.encode(["hello world"], pooling_task="token_embed")
    embed = minilm.encode(["hello world"], pooling_task="embed", use_tqdm=False)[0]
    assert embed.outputs.data.shape == (384,)
    with pytest.raises(InvalidParamError, match="loaded for pooling"):
        minilm.generate(["hi"], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidParamError, match="can classify"):
        minilm.classify(["hi"])
    with pytest.raises(InvalidParamError, match="pooling_task='nope'"):
        minilm.encode(["hi"], pooling_task="nope")
    generative = LLM(str(tiny_model_factory("llama")), max_model_len=64)
    with pytest.raises(InvalidParamError, match="runner='pooling'"):
        generative.embed(["hi"])
    with pytest.raises(UnsupportedModelError, match="runner='pooling'"):
        LLM(MINILM, runner="generate")


def test_over_long_input_is_refused_unless_truncated(minilm):
    ids = [101] + [2000] * 600 + [102]
    with pytest.raises(InvalidPromptError, match=r"prompts\[1\] has 602 tokens"):
        minilm.embed(["fine", {"prompt_token_ids": ids}])
    out = minilm.embed([{"prompt_token_ids": ids}], truncate_prompt_tokens=100, use_tqdm=False)
    assert len(out[0].prompt_token_ids) == 100


def test_chunked_tokenization_gives_the_same_results(minilm, monkeypatch):
    """Large calls on CUDA tokenize a chunk ahead of the device; forced here with chunks of 3,
    the outputs, their order and error indices equal a single unchunked call."""
    texts = [f"{s} ({i})" for i, s in enumerate(SENTENCES * 3)]
    params = [PoolingParams(normalize=i % 2 == 0) for i in range(len(texts))]
    expected = minilm.embed(texts, params, use_tqdm=False)
    expected_probs = minilm.encode(texts, use_tqdm=False, pooling_task="embed")
    monkeypatch.setattr(type(minilm), "_tokenize_chunk_size", lambda self: 3)
    got = minilm.embed(texts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding)
        )
    got_data = minilm.encode(texts, use_tqdm=False, pooling_task="embed")
    torch.testing.assert_close(
        torch.stack([o.outputs.data for o in got_data]),
        torch.stack([o.outputs.data for o in expected_probs]),
    )
    # embed_matrix: encode's vectors (same chunks, same batches) as one array, in input order.
    matrix = minilm.embed_matrix(texts, use_tqdm=False)
    assert matrix.dtype == np.float32 and matrix.shape == (len(texts), 384)
    np.testing.assert_array_equal(matrix, torch.stack([o.outputs.data for o in got_data]).numpy())
    bad = [*texts[:7], {"prompt_token_ids": [101] + [2000] * 600 + [102]}, *texts[7:]]
    with pytest.raises(InvalidPromptError, match=r"prompts\[7\] has 602 tokens"):
        minilm.embed(bad, use_tqdm=False)


def test_token_budget_batches_equal_a_greedy_packer():
    """Batches: inputs sorted longest first (ties in input order), cut greedily where the next
    would pass the token budget or the sequence cap; every input exactly once."""
    import random
    from types import SimpleNamespace

    from batchlm.engine.worker.pooling_runner import PoolingInput, PoolingRunner

    rng = random.Random(0)
    inputs = [PoolingInput([1] * rng.choice([1, 2, 5, 17, 40, 300])) for _ in range(500)]
    runner = object.__new__(PoolingRunner)
    runner.device = torch.device("cpu")
    for budget, max_seqs in ((256, 1000), (100, 7), (4096, 32)):
        runner.config = SimpleNamespace(
            scheduler=SimpleNamespace(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
        )
        expected, batch, tokens = [], [], 0
        for i in sorted(range(len(inputs)), key=lambda i: -len(inputs[i].token_ids)):
            n = len(inputs[i].token_ids)
            if batch and (tokens + n > budget or len(batch) >= max_seqs):
                expected.append(batch)
                batch, tokens = [], 0
            batch.append(i)
            tokens += n
        expected.append(batch)
        got = list(runner._batches(inputs))
        assert [b for b, _ in got] == expected
        for b, lens in got:
            assert lens.tolist() == [len(inputs[i].token_ids) for i in b]


def test_lora_request_none_is_accepted_and_an_adapter_refused(minilm):
    plain = [o.outputs.embedding for o in minilm.embed(SENTENCES[:2], use_tqdm=False)]
    same = minilm.embed(SENTENCES[:2], use_tqdm=False, lora_request=None)
    assert [o.outputs.embedding for o in same] == plain
    for call in (
        lambda: minilm.embed(SENTENCES[:2], lora_request="my-adapter"),
        lambda: minilm.encode(SENTENCES[:2], lora_request="my-adapter"),
        lambda: minilm.score(SENTENCES[0], SENTENCES[1:3], lora_request="my-adapter"),
    ):
        with pytest.raises(
            InvalidParamError, match=r"lora_request='my-adapter': \w+\(\) runs the base"
        ):
            call()


# ---- one engine shape, vLLM's options on the pooling calls --------------------------------


def test_reset_prefix_cache_on_a_pooling_model(minilm):
    """A pooling engine keeps no KV cache: nothing to forget, True as vLLM answers (it raised
    AttributeError on an engine built without a cache)."""
    assert minilm.reset_prefix_cache() is True
    out = minilm.embed(["hello"], use_tqdm=False)[0].outputs.embedding
    assert len(out) == 384


def test_score_keeps_the_callers_pooling_params(minilm_dir, tmp_path):
    """An embedding model's score is the cosine of the embeddings the caller's params make
    (its matryoshka `dimensions` were dropped)."""
    folder = tmp_path / "mrl"
    shutil.copytree(minilm_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [384, 64]
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder))
    params = PoolingParams(dimensions=64)
    got = [o.outputs.score for o in llm.score(PAIRS_Q, PAIRS_D, pooling_params=params)]
    vectors = [
        torch.tensor(o.outputs.embedding)
        for o in llm.embed([PAIRS_Q, *PAIRS_D], PoolingParams(dimensions=64), use_tqdm=False)
    ]
    expected = [float(vectors[0] @ v) for v in vectors[1:]]
    assert got == pytest.approx(expected, abs=1e-6)
    full = [o.outputs.score for o in llm.score(PAIRS_Q, PAIRS_D)]
    assert max(abs(a - b) for a, b in zip(got, full, strict=True)) > 1e-3
    llm.shutdown()


class _CountingBar:
    """A progress-bar factory's bar that records what it was told."""

    made: list[_CountingBar] = []

    def __init__(self, total: int, desc: str, unit: str) -> None:
        self.total, self.desc, self.unit, self.updates, self.closed = total, desc, unit, [], False
        _CountingBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.updates.append(n)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def minilm_two_per_batch():
    llm = LLM(MINILM, max_num_seqs=2)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("call", ["embed", "encode", "classify_refused", "score"])
def test_pooling_calls_show_progress(minilm_two_per_batch, call):
    """use_tqdm takes a bar factory, as in generate; the bar counts the call's inputs and
    moves as each batch (two inputs here) is done."""
    llm = minilm_two_per_batch
    _CountingBar.made.clear()
    texts = SENTENCES[:5]
    if call == "classify_refused":  # a refused call makes no bar
        with pytest.raises(InvalidParamError):
            llm.classify(texts, use_tqdm=_CountingBar)
        assert _CountingBar.made == []
        return
    if call == "score":
        llm.score(texts[0], texts[1:], use_tqdm=_CountingBar)  # each distinct text once
    else:
        getattr(llm, call)(texts, use_tqdm=_CountingBar)
    (bar,) = _CountingBar.made
    assert (bar.total, bar.updates, bar.closed, bar.unit) == (5, [2, 2, 1], True, "texts")


def test_token_classify_is_refused_by_name(minilm):
    with pytest.raises(InvalidParamError, match="pooling_task='token_classify'.*not supported"):
        minilm.encode(["hi"], pooling_task="token_classify")


@pytest.mark.parametrize("include_prompt", [True, False])
def test_default_prompt_and_include_prompt_as_sentence_transformers(
    minilm_dir, tmp_path, include_prompt
):
    """A folder whose config names a default prompt: it goes before every text, and with
    `include_prompt: false` its tokens leave the mean, as sentence-transformers' encode does
    (include_prompt was read and not applied)."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "prompted"
    shutil.copytree(minilm_dir, folder)
    st_config = {"prompts": {"query": "query: ", "doc": ""}, "default_prompt_name": "query"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    pooling["include_prompt"] = include_prompt
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    st = SentenceTransformer(str(folder), device="cpu")
    expected = st.encode(SENTENCES[:5], convert_to_tensor=True).float()
    llm = LLM(str(folder))
    outs = llm.embed(SENTENCES[:5], use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() >= 0.9999
    prompt_ids = st.tokenizer("query: ")["input_ids"][:-1]
    assert all(o.prompt_token_ids[: len(prompt_ids)] == prompt_ids for o in outs)
    without = LLM(str(minilm_dir)).embed(SENTENCES[:5], use_tqdm=False)
    plain = torch.tensor([o.outputs.embedding for o in without])
    assert torch.nn.functional.cosine_similarity(got, plain, dim=-1).max() < 0.9999
    llm.shutdown()
