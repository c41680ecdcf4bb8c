"""Errors a vLLM caller matches: each keeps batchlm's message (which prompt, which value,
the fix), contains vLLM 0.26's phrase for the same error (`vllm/v1/engine/input_processor.py`,
`renderers/params.py`, `entrypoints/llm.py`, `entrypoints/pooling/offline.py`,
`sampling_params.py`), and is a `ValueError` as vLLM's are. After each, the engine keeps
serving."""

from __future__ import annotations

import re

import pytest

from batchlm.engine import LLM, PoolingParams, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
MINILM = "sentence-transformers/all-MiniLM-L6-v2"

# (name, call on a generative LLM, batchlm's part, vLLM's phrase)
GENERATIVE_CASES = [
    (
        "empty prompt",
        lambda llm: llm.generate(["ok", {"prompt_token_ids": []}], GREEDY),
        r"prompts\[1\] is empty",
        "The decoder prompt cannot be empty",
    ),
    (
        "token id out of vocabulary",
        lambda llm: llm.generate([{"prompt_token_ids": [5, 10**6]}], GREEDY),
        r"prompts\[0\] has token id 1000000 outside the vocabulary",
        "Token id 1000000 is out of vocabulary",
    ),
    (
        "prompt longer than the context",
        lambda llm: llm.generate([{"prompt_token_ids": [5] * 65}], GREEDY),
        r"prompts\[0\] has 65 tokens, more than max_model_len=64",
        "This model's maximum context length is 64 tokens",
    ),
    (
        "pooling call on a generative model",
        lambda llm: llm.embed(["hi"]),
        r"embed\(\) needs a pooling model",
        r"LLM.embed\(\) is only supported for pooling models",
    ),
    (
        "too many logprobs",
        lambda llm: llm.generate(["hi"], SamplingParams(logprobs=21)),
        "exceeds the engine's max_logprobs=20",
        "Requested sample logprobs of 21, which is greater than max allowed: 20",
    ),
    (
        "priority under fcfs",
        lambda llm: llm.generate(["a", "b"], GREEDY, priority=[0, 2]),
        r"priority=\[0, 2\]",
        "Got priority 2 but Priority scheduling is not enabled",
    ),
    (
        "priority of another length",
        lambda llm: llm.generate(["a", "b"], GREEDY, priority=[0]),
        "priority has 1 values for 2 prompts",
        r"The lengths of prompts \(2\) and priority \(1\) must be the same",
    ),
    (
        "bad pause mode",
        lambda llm: llm.sleep(level=0, mode="soon"),
        r"sleep\(mode='soon'\)",
        "Invalid pause mode: soon",
    ),
]

POOLING_CASES = [
    (
        "empty input",
        lambda llm: llm.embed(["ok", {"prompt_token_ids": []}]),
        r"prompts\[1\] is empty",
        "The decoder prompt cannot be empty",
    ),
    (
        "token id out of vocabulary",
        lambda llm: llm.embed([[101, 10**6, 102]]),
        r"prompts\[0\] has token id 1000000 outside the vocabulary",
        "Token id 1000000 is out of vocabulary",
    ),
    (
        "input longer than the context",
        lambda llm: llm.embed([[101] * 600]),
        r"prompts\[0\] has 600 tokens, more than the model's maximum 512",
        "This model's maximum context length is 512 tokens",
    ),
    (
        "classification on an embedding model",
        lambda llm: llm.classify(["hi"]),
        "classify\\(\\) needs a model that can classify",
        "Classification API is not supported by this model",
    ),
    (
        "a task the model serves when built for it",
        lambda llm: llm.encode(["hi"], pooling_task="token_embed"),
        "build it with LLM\\(..., pooler_config=",
        r"Try switching the model's pooling_task via `PoolerConfig\(task=\"token_embed\"\)`",
    ),
    (
        "generation on a pooling model",
        lambda llm: llm.generate(["hi"]),
        r"generate\(\) needs a generative model",
        r"LLM.generate\(\) is only supported for generative models",
    ),
    (
        "matryoshka dimensions on a model without them",
        lambda llm: llm.embed(["hi"], pooling_params=PoolingParams(dimensions=3)),
        "needs a matryoshka model",
        "does not support Matryoshka embeddings; dimensions must be unset",
    ),
]


@pytest.fixture(scope="module")
def generative(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=64)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def pooling():
    llm = LLM(MINILM)
    yield llm
    llm.shutdown()


def _check(llm, call, ours, theirs):
    with pytest.raises(ValueError) as e:
        call(llm)
    message = str(e.value)
    assert re.search(ours, message), message
    assert re.search(theirs, message), message


@pytest.mark.parametrize(
    "name, call, ours, theirs", GENERATIVE_CASES, ids=[c[0] for c in GENERATIVE_CASES]
)
def test_generative_errors_carry_vllms_phrase(generative, name, call, ours, theirs):
    _check(generative, call, ours, theirs)
    assert not generative.llm_engine.has_unfinished_requests()
    out = generative.generate(["still serving"], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "name, call, ours, theirs", POOLING_CASES, ids=[c[0] for c in POOLING_CASES]
)
def test_pooling_errors_carry_vllms_phrase(pooling, name, call, ours, theirs):
    _check(pooling, call, ours, theirs)
    assert len(pooling.embed(["still serving"], use_tqdm=False)[0].outputs.embedding) == 384


def test_embedding_call_on_a_classifier_carries_vllms_phrase(tmp_path):
    from batchlm.engine.loader import resolve_model

    from .test_pooling_api import _classifier_from_minilm

    llm = LLM(str(_classifier_from_minilm(resolve_model(MINILM), tmp_path, num_labels=2)))
    _check(
        llm,
        lambda m: m.embed(["hi"]),
        r"embed\(\) needs a model that can embed, but this one does classify",
        "Embedding API is not supported by this model",
    )
    llm.shutdown()
