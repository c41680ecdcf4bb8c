"""Large pooling calls tokenized by worker processes give exactly the in-process results.

The workers are forced on (BATCHLM_TOKENIZE_WORKERS=2) with chunks of 8 prompts, so a call
of 40 prompts runs five chunks through them; the reference is the same chunked call with the
workers off, whose batches are the same, so the embeddings are equal bit for bit.
"""

from __future__ import annotations

import gc
import os
import random
import signal

import psutil
import pytest
import torch
from tokenizers import Tokenizer

from batchlm.engine import LLM, PoolingParams
from batchlm.engine.errors import InvalidPromptError
from batchlm.engine.tokenize_pool import TokenizePool, TokenizePoolError

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
CHUNK = 8
MAX_MODEL_LEN = 128
WORDS = "the cat sat on a mat while Ünïcödé ROBOTS embed tokens 3,520,031 times".split()


def make_texts(num: int, seed: int = 0, max_words: int = 30) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, max_words))) for _ in range(num)]
    texts[3] = ""  # [CLS] [SEP] only
    return texts


@pytest.fixture(scope="module")
def minilm_llm():
    # A short maximum, so that an over-long text is an error rather than cut at 256.
    llm = LLM(MINILM, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


@pytest.fixture
def chunked(monkeypatch):
    """Chunks of CHUNK prompts, and a record of every batch the workers tokenize."""
    monkeypatch.setattr(LLM, "_tokenize_chunk_size", lambda self: CHUNK)
    batches: list[int] = []
    encode = TokenizePool.encode

    def spy(self, texts, max_len, lower):
        batches.append(len(texts))
        return encode(self, texts, max_len, lower)

    monkeypatch.setattr(TokenizePool, "encode", spy)
    return batches


@pytest.fixture
def minilm(minilm_llm, chunked, monkeypatch):
    """The module's LLM with its workers started (the call that starts them tokenizes its
    first chunk in process), and `chunked` emptied."""
    if minilm_llm._tokenize_pool is None:
        monkeypatch.setenv("BATCHLM_TOKENIZE_WORKERS", "2")
        minilm_llm.embed(make_texts(3 * CHUNK), use_tqdm=False)
        assert chunked == [CHUNK, CHUNK]
        chunked.clear()
    return minilm_llm


def both_ways(monkeypatch, call):
    """`call()` with the workers off, then on."""
    monkeypatch.setenv("BATCHLM_TOKENIZE_WORKERS", "0")
    expected = call()
    monkeypatch.setenv("BATCHLM_TOKENIZE_WORKERS", "2")
    return expected, call()


def assert_same_embeddings(got, expected):
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    assert all(type(o.prompt_token_ids) is list for o in got)
    assert all(type(t) is int for t in got[0].prompt_token_ids)
    for a, b in zip(got, expected, strict=True):
        assert a.outputs.embedding == b.outputs.embedding


def test_workers_give_the_in_process_ids_and_embeddings(minilm, chunked, monkeypatch):
    texts = make_texts(40)
    prompts: list = list(texts)
    prompts[10] = {"prompt_token_ids": [101, 7592, 2088, 102]}
    prompts[21] = {"prompt": "A TextPrompt dict"}
    params = [PoolingParams(normalize=i % 3 != 0) for i in range(len(prompts))]

    expected, got = both_ways(monkeypatch, lambda: minilm.embed(prompts, params, use_tqdm=False))
    assert chunked == [8, 7, 8, 8, 8]  # prompt 10 (in chunk 1) is token ids
    assert_same_embeddings(got, expected)
    tokenizer = minilm.get_tokenizer()
    assert got[0].prompt_token_ids == tokenizer(texts[0])["input_ids"]
    assert got[3].prompt_token_ids == [101, 102]
    assert got[10].prompt_token_ids == [101, 7592, 2088, 102]

    chunked.clear()
    expected, got = both_ways(
        monkeypatch, lambda: minilm.encode(texts, use_tqdm=False, pooling_task="embed")
    )
    assert chunked == [CHUNK] * 5
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    assert torch.equal(
        torch.stack([o.outputs.data for o in got]), torch.stack([o.outputs.data for o in expected])
    )


def test_workers_truncate_like_the_tokenizer(minilm, chunked, monkeypatch):
    texts = make_texts(30, seed=1, max_words=150)  # most over 20 tokens, some over 128
    expected, got = both_ways(
        monkeypatch, lambda: minilm.embed(texts, truncate_prompt_tokens=20, use_tqdm=False)
    )
    assert chunked
    assert_same_embeddings(got, expected)
    assert max(len(o.prompt_token_ids) for o in got) == 20
    assert all(o.prompt_token_ids[-1] == 102 for o in got)  # [SEP] kept, as the tokenizer does

    # Per-prompt truncation: the largest explicit one applies to the whole call.
    params = [PoolingParams(truncate_prompt_tokens=12 if i == 5 else None) for i in range(30)]
    expected, got = both_ways(monkeypatch, lambda: minilm.embed(texts, params, use_tqdm=False))
    assert_same_embeddings(got, expected)
    assert max(len(o.prompt_token_ids) for o in got) == 12


def test_an_over_long_text_is_named_by_its_index(minilm, chunked, monkeypatch):
    texts = make_texts(30, seed=2)
    texts[21] = " ".join(["cat"] * 150)  # 152 tokens: over MAX_MODEL_LEN, under the cut (256)

    def call():
        with pytest.raises(InvalidPromptError) as error:
            minilm.embed(texts, use_tqdm=False)
        return str(error.value)

    expected, got = both_ways(monkeypatch, call)
    assert chunked  # the workers tokenized the chunk that failed
    assert got == expected
    assert got.startswith(
        f"prompts[21] has 152 tokens, more than the model's maximum {MAX_MODEL_LEN}"
    )


def test_small_calls_tokenize_in_process(minilm, chunked, monkeypatch):
    monkeypatch.setenv("BATCHLM_TOKENIZE_WORKERS", "2")
    texts = make_texts(2 * CHUNK)
    out = minilm.embed(texts, use_tqdm=False)
    assert len(out) == 2 * CHUNK
    assert chunked == []


def test_a_dead_worker_leaves_the_call_to_the_in_process_tokenizer(minilm, chunked, monkeypatch):
    monkeypatch.setattr(minilm, "_is_tokenize_pool_failed", False)  # restored afterwards
    texts = make_texts(40, seed=3)
    expected, got = both_ways(monkeypatch, lambda: minilm.embed(texts, use_tqdm=False))
    assert_same_embeddings(got, expected)
    pool = minilm._tokenize_pool
    os.kill(pool.pids[0], signal.SIGKILL)
    psutil.Process(pool.pids[0]).wait(timeout=10)
    got = minilm.embed(texts, use_tqdm=False)
    assert_same_embeddings(got, expected)
    assert minilm._tokenize_pool is None  # later calls tokenize in process
    assert not any(psutil.pid_exists(pid) for pid in pool.pids)


def test_workers_end_with_the_llm(chunked, monkeypatch):
    monkeypatch.setenv("BATCHLM_TOKENIZE_WORKERS", "2")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}

    def workers() -> set[int]:
        return {p.pid for p in me.children(recursive=True)} - before

    texts = make_texts(3 * CHUNK)
    llm = LLM(MINILM)
    llm.embed(texts[: 2 * CHUNK], use_tqdm=False)
    assert workers() == set()  # started by the first large call only
    llm.embed(texts, use_tqdm=False)
    assert chunked == [CHUNK, CHUNK]  # the first chunk is tokenized while the workers load
    pids = set(llm._tokenize_pool.pids)
    assert len(pids) == 2 and workers() == pids
    llm.shutdown()
    assert workers() == set()
    assert not any(psutil.pid_exists(pid) for pid in pids)

    llm = LLM(MINILM)
    llm.embed(texts, use_tqdm=False)
    assert len(workers()) == 2
    del llm
    gc.collect()
    assert workers() == set()


def test_pool_encodes_like_the_rust_tokenizer_and_survives_a_bad_batch(minilm_llm):
    backend = minilm_llm.get_tokenizer().backend_tokenizer
    texts = make_texts(20, seed=4)
    pool = TokenizePool(backend.to_str(), num_workers=1)
    try:
        got = pool.encode(texts, 6, lower=True)
        with pytest.raises(TokenizePoolError, match="TypeError"):
            pool.encode([1, 2], None, lower=False)  # the worker raises and goes on
        assert not pool.is_closed
        again = pool.encode(texts, None, lower=False)
    finally:
        pool.close()
    reference = Tokenizer.from_str(backend.to_str())
    reference.no_padding()
    reference.enable_truncation(6)
    expected = [e.ids for e in reference.encode_batch([t.lower() for t in texts])]
    assert got.lens.tolist() == [len(ids) for ids in expected]
    assert got.token_ids.tolist() == [t for ids in expected for t in ids]
    reference.no_truncation()
    expected = [e.ids for e in reference.encode_batch(texts)]
    assert again.token_ids.tolist() == [t for ids in expected for t in ids]
    assert pool.is_closed and not any(psutil.pid_exists(pid) for pid in pool.pids)
