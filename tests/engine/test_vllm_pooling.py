"""Pooling as vLLM 0.26 documents it: `PoolingParams(use_activation=False)` gives an
embedding model's unnormalised vectors (against sentence-transformers without its Normalize
module), token-id prompts in every form vLLM accepts (a bare list of ints is one prompt),
`encode` serving the model's one task with vLLM's errors for the others, and
`pooler_config` (pooling type, task, request defaults)."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, PoolingParams
from batchlm.engine.errors import InvalidParamError, InvalidPromptError

from .st_reference import st_modules

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TEXTS = ["A man is eating food.", "The girl is carrying a baby.", "hello"]


@pytest.fixture(scope="module")
def minilm_dir():
    from batchlm.engine.loader import resolve_model

    return resolve_model(MINILM)


@pytest.fixture(scope="module")
def minilm():
    llm = LLM(MINILM)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def st_without_normalize(minilm_dir):
    """The same pipeline without its Normalize module: the unnormalised reference."""
    from sentence_transformers import SentenceTransformer

    m = st_modules()
    transformer = m.Transformer(str(minilm_dir), max_seq_length=256)
    pooling = m.Pooling(384, pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def test_use_activation_false_gives_unnormalised_embeddings(minilm, st_without_normalize):
    expected = st_without_normalize.encode(TEXTS, convert_to_tensor=True).float()
    assert not torch.allclose(expected.norm(dim=-1), torch.ones(3), atol=1e-2)
    raw = minilm.embed(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in raw])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    unit = torch.tensor([o.outputs.embedding for o in minilm.embed(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(unit, torch.nn.functional.normalize(expected), atol=1e-5, rtol=0)
    # Per prompt, and through encode: the same vectors.
    mixed = minilm.encode(
        TEXTS[:2],
        pooling_params=[PoolingParams(use_activation=False), PoolingParams()],
        use_tqdm=False,
    )
    torch.testing.assert_close(mixed[0].outputs.data, got[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed[1].outputs.data, unit[1], atol=1e-6, rtol=0)
    with pytest.raises(InvalidParamError, match="disagree"):
        minilm.embed(TEXTS, PoolingParams(normalize=True, use_activation=False))
    # An engine-wide default, as vLLM's PoolerConfig(use_activation=False).
    llm = LLM(MINILM, pooler_config={"use_activation": False})
    torch.testing.assert_close(torch.from_numpy(llm.embed_matrix(TEXTS)), got, atol=1e-6, rtol=0)
    llm.shutdown()


def test_token_id_prompts_in_every_vllm_form(minilm):
    tok = minilm.get_tokenizer()
    ids = [tok(t)["input_ids"] for t in TEXTS]
    want = minilm.embed_matrix(TEXTS)
    forms = {
        "bare list of ints (one prompt)": (ids[0], want[:1]),
        "list of lists of ints": (ids, want),
        "TokensPrompt dicts": ([{"prompt_token_ids": i} for i in ids], want),
        "a TokensPrompt alone": ({"prompt_token_ids": ids[1]}, want[1:2]),
        "texts and ids mixed": ([TEXTS[0], ids[1], {"prompt": TEXTS[2]}], want),
    }
    for name, (prompts, expected) in forms.items():
        outs = minilm.embed(prompts, use_tqdm=False)
        got = torch.tensor([o.outputs.embedding for o in outs])
        torch.testing.assert_close(got, torch.from_numpy(expected), atol=1e-6, rtol=0, msg=name)
        encoded = minilm.encode(prompts, use_tqdm=False)
        assert len(encoded) == len(expected), name
    assert minilm.embed(ids[0], use_tqdm=False)[0].prompt_token_ids == ids[0]
    with pytest.raises(InvalidPromptError, match=r"prompts\[0\] is a int"):
        minilm.embed([5, "five"])


def test_token_type_ids_reach_a_cross_encoder(tmp_path, minilm_dir):
    from .test_pooling_api import _classifier_from_minilm

    folder = _classifier_from_minilm(minilm_dir, tmp_path / "ce", num_labels=1)
    llm = LLM(str(folder))
    tok = llm.get_tokenizer()
    pair = tok("How many people live in Berlin?", "Berlin has 3.5 million inhabitants.")
    prompt = {"prompt_token_ids": pair["input_ids"], "token_type_ids": pair["token_type_ids"]}
    by_ids = llm.classify([prompt], use_tqdm=False)[0].outputs.probs
    by_text = llm.score(
        "How many people live in Berlin?", "Berlin has 3.5 million inhabitants.", use_tqdm=False
    )[0].outputs.score
    assert by_ids[0] == pytest.approx(by_text, abs=1e-6)
    without = llm.classify([pair["input_ids"]], use_tqdm=False)[0].outputs.probs
    assert without[0] != pytest.approx(by_text, abs=1e-6)  # the segment ids matter
    with pytest.raises(InvalidPromptError, match=r"\['token_type_ids'\] must be a list of 18 ints"):
        llm.classify([{"prompt_token_ids": pair["input_ids"], "token_type_ids": [0]}])
    llm.shutdown()


def test_encode_serves_the_models_task_and_refuses_others_as_vllm(minilm, tmp_path, minilm_dir):
    with pytest.raises(InvalidParamError, match=r"Try switching the model's pooling_task"):
        minilm.encode(TEXTS, pooling_task="token_embed")
    with pytest.raises(InvalidParamError, match="Classification API is not supported by this"):
        minilm.encode(TEXTS, pooling_task="classify")
    with pytest.raises(InvalidParamError, match="Classification API is not supported by this"):
        minilm.classify(TEXTS)
    with pytest.raises(InvalidParamError, match="token_classify.*Classification API is not"):
        minilm.encode(TEXTS, pooling_task="token_classify")
    from .test_pooling_api import _classifier_from_minilm

    classifier = LLM(str(_classifier_from_minilm(minilm_dir, tmp_path / "c3", num_labels=3)))
    for call in (
        lambda: classifier.embed(TEXTS),
        lambda: classifier.encode(TEXTS, pooling_task="token_embed"),
    ):
        with pytest.raises(InvalidParamError, match="Embedding API is not supported by this"):
            call()
    with pytest.raises(InvalidParamError, match=r"\['dimensions'\] parameters"):
        classifier.classify(TEXTS, PoolingParams(dimensions=8))
    logits = classifier.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    probs = classifier.classify(TEXTS, use_tqdm=False)
    for raw, p in zip(logits, probs, strict=True):
        torch.testing.assert_close(
            torch.tensor(raw.outputs.probs).softmax(-1), torch.tensor(p.outputs.probs)
        )
    classifier.shutdown()


def test_pooler_config_serves_token_embed_and_sets_the_pooling(minilm_dir, st_without_normalize):
    llm = LLM(MINILM, pooler_config={"task": "token_embed"})
    outs = llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    # Every token's final state, L2-normalised (vLLM's token_embed), against the states
    # sentence-transformers' Transformer module gives.
    features = st_without_normalize.tokenize(TEXTS)
    with torch.no_grad():
        states = st_without_normalize[0](features)["token_embeddings"]
    for i, out in enumerate(outs):
        n = int(features["attention_mask"][i].sum())
        expected = torch.nn.functional.normalize(states[i, :n].float(), dim=-1)
        torch.testing.assert_close(out.outputs.data, expected, atol=1e-4, rtol=1e-4)
    raw = llm.encode(TEXTS[:1], PoolingParams(use_activation=False), pooling_task="token_embed")
    n = int(features["attention_mask"][0].sum())
    torch.testing.assert_close(raw[0].outputs.data, states[0, :n].float(), atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidParamError, match=r'PoolerConfig\(task="embed"\)'):
        llm.embed(TEXTS)
    llm.shutdown()
    # CLS pooling instead of the folder's mean: the first token's state.
    cls = LLM(MINILM, pooler_config={"pooling_type": "CLS", "use_activation": False})
    got = torch.from_numpy(cls.embed_matrix(TEXTS))
    with torch.no_grad():
        torch.testing.assert_close(got, states[:, 0].float(), atol=1e-4, rtol=1e-4)
    assert cls.model_config.pooler_config.pooling_type == "CLS"
    cls.shutdown()
    for bad, match in [
        ({"normalize": False}, "Parameter `normalize` was removed; use `use_activation`"),
        ({"task": "classify"}, r"Unsupported task: 'classify'"),
        ({"pooling_type": "STEP"}, "pooling_type='STEP' is not supported"),
        ({"step_tag_id": 3}, "step_tag_id=3 is not supported"),
        ({"pooling_type": "CLS", "seq_pooling_type": "MEAN"}, "Cannot set both"),
        ({"dimenzions": 3}, r"unknown key\(s\) \['dimenzions'\]"),
    ]:
        with pytest.raises(InvalidParamError, match=match):
            LLM(MINILM, pooler_config=bad)


def test_dimensions_are_checked_as_vllm_checks_them(minilm):
    with pytest.raises(InvalidParamError, match="does not support Matryoshka embeddings"):
        minilm.embed(TEXTS, PoolingParams(dimensions=8))
