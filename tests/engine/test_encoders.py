"""Encoder models (BERT, XLM-R), packed variable-length attention, pooling, and
sentence-transformers configs (CPU, float32).

References: a per-sequence attention loop for `varlen_attention`; Hugging Face transformers
and sentence-transformers on the same weights for the models (the packaged all-MiniLM-L6-v2,
a cross-encoder built from its body with a seeded random head, tiny random XLM-R models).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchlm.engine.attention.varlen import VarlenPlan, varlen_attention, varlen_attention_ref
from batchlm.engine.errors import UnsupportedModelError
from batchlm.engine.loader.resolve import resolve_model
from batchlm.engine.loader.st_config import (
    SentenceTransformersConfig,
    read_sentence_transformers_config,
)
from batchlm.engine.loader.weights import build_model
from batchlm.engine.models.bert import BertForSequenceClassification, BertModel
from batchlm.engine.models.layers.pooler import PoolingType, pool
from batchlm.engine.models.xlm_roberta import XLMRobertaForSequenceClassification, XLMRobertaModel

transformers = pytest.importorskip("transformers")

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "hi",
    "",
    "Packed layouts put every sequence back to back, so attention must stay within each one.",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Encoders see the whole sentence at once; decoders only see what came before.",
    "Ünïcödé, punctuation!? and numbers 12345 mixed in.",
    "short",
    "Sentence embeddings are compared with cosine similarity in semantic search systems.",
    "A very long document about batch inference. " * 60,  # > 256 tokens: truncated
    "Mean pooling averages the final hidden states of all tokens.",
    "Why?",
]
PAIRS = [
    ("How many people live in Berlin?", "Berlin has a population of 3.5 million."),
    ("How many people live in Berlin?", "Berlin is well known for its museums."),
    ("What is a cross-encoder?", "A cross-encoder reads both texts together " * 5),
    ("a", "b"),
    ("Is the sky blue?", "Yes."),
]


def _packed(token_lists: list[list[int]], type_lists: list[list[int]] | None = None):
    """input_ids, positions, token_type_ids (or None) and cu_seqlens of a packed batch."""
    cu = [0]
    for tokens in token_lists:
        cu.append(cu[-1] + len(tokens))
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    positions = torch.tensor([p for tokens in token_lists for p in range(len(tokens))])
    types = None
    if type_lists is not None:
        types = torch.tensor([t for tt in type_lists for t in tt], dtype=torch.long)
    return ids, positions, types, cu


def _build(cls, folder: Path):
    config = transformers.AutoConfig.from_pretrained(folder)
    return build_model(cls, folder, torch.float32, torch.device("cpu"), config=config)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return resolve_model(MINILM)


@pytest.fixture(scope="module")
def cross_encoder_factory(minilm_dir, tmp_path_factory):
    """A BertForSequenceClassification: MiniLM's body (with its pooler), a seeded head."""
    from safetensors.torch import load_file

    made: dict[int, Path] = {}

    def get(num_labels: int) -> Path:
        if num_labels in made:
            return made[num_labels]
        config = transformers.AutoConfig.from_pretrained(minilm_dir, num_labels=num_labels)
        model = transformers.BertForSequenceClassification(config)
        body = load_file(str(minilm_dir / "model.safetensors"))
        result = model.bert.load_state_dict(body, strict=False)
        assert not result.missing_keys, result.missing_keys
        torch.manual_seed(0)
        torch.nn.init.normal_(model.classifier.weight, std=0.2)
        torch.nn.init.normal_(model.classifier.bias, std=0.2)
        out = tmp_path_factory.mktemp(f"cross-encoder-{num_labels}")
        model.save_pretrained(out)
        transformers.AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(out)
        made[num_labels] = out
        return out

    return get


TINY_XLMR = dict(
    vocab_size=250,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=66,
    type_vocab_size=1,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def tiny_xlmr(tmp_path_factory) -> dict[str, Path]:
    """A tiny random XLMRobertaModel (with pooler) and an XLMRobertaForSequenceClassification."""
    root = tmp_path_factory.mktemp("tiny-xlmr")
    torch.manual_seed(1234)
    base = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**TINY_XLMR))
    base.save_pretrained(root / "base")
    config = transformers.XLMRobertaConfig(**TINY_XLMR, num_labels=3)
    transformers.XLMRobertaForSequenceClassification(config).save_pretrained(root / "cls")
    return {"base": root / "base", "cls": root / "cls"}


def _xlmr_tokens(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """`<s> ... </s>` sequences of random ids that avoid the special ids 0..3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        body = torch.randint(4, TINY_XLMR["vocab_size"], (length - 2,), generator=g).tolist()
        out.append([0, *body, 2])
    return out


def _hf_padded(model, token_lists, pad_id: int, type_lists=None):
    """Run an HF model on a right-padded batch."""
    max_len = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for row, tokens in enumerate(token_lists):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
        if type_lists is not None:
            types[row, : len(tokens)] = torch.tensor(type_lists[row])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, token_type_ids=types)


# --------------------------------------------------------------------------- varlen attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize(
    "lengths",
    [[7], [5, 5, 5], [1, 33, 2, 17, 64, 3, 40, 9], [12, 0, 30, 1]],
    ids=["one", "equal", "mixed", "with-empty"],
)
def test_varlen_attention_matches_per_sequence_loop(causal, num_heads, num_kv_heads, lengths):
    torch.manual_seed(0)
    head_dim = 16
    num_tokens = sum(lengths)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    q = torch.randn(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    expected = varlen_attention_ref(q, k, v, cu, scale, causal)
    out = varlen_attention(q, k, v, cu, scale, causal)
    assert out.shape == (num_tokens, num_heads, head_dim)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    plan = VarlenPlan.build(cu, q.device)  # a plan shared by layers gives the same result
    torch.testing.assert_close(varlen_attention(q, k, v, plan, scale, causal), out)


@pytest.mark.parametrize("window", [0, 3, 40])
@pytest.mark.parametrize(
    "lengths",
    [[9, 9], [1, 33, 2, 17, 64, 3, 40, 9], [12, 0, 30, 1]],
    ids=["equal", "mixed", "empty"],
)
def test_varlen_local_attention_matches_per_sequence_loop(window, lengths):
    """Bidirectional local attention (ModernBERT's window) in padded groups: each token sees
    the keys within `window` positions; padding never leaks in."""
    torch.manual_seed(0)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    q = torch.randn(cu[-1], 4, 16)
    k, v = torch.randn(cu[-1], 2, 16), torch.randn(cu[-1], 2, 16)
    expected = varlen_attention_ref(q, k, v, cu, 0.25, causal=False, window=window)
    plan = VarlenPlan.build(cu, "cpu")
    out = varlen_attention(q, k, v, plan, 0.25, causal=False, window=window)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    if window < 3:  # a narrow window differs from full attention
        full = varlen_attention_ref(q, k, v, cu, 0.25, causal=False)
        assert (full - out).abs().max() > 1e-3
    with pytest.raises(ValueError, match="causal=False"):
        varlen_attention(q, k, v, plan, 0.25, causal=True, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 12, 32), (8, 2, 64), (4, 4, 128)])
def test_flash_varlen_path_matches_per_sequence_loop(
    dtype, causal, num_heads, num_kv_heads, head_dim
):
    torch.manual_seed(0)
    lengths = [1, 33, 2, 17, 200, 3, 40, 9, 512]
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    num_tokens = cu[-1]
    q = torch.randn(num_tokens, num_heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    scale = head_dim**-0.5
    plan = VarlenPlan.build(cu, "cuda", torch.tensor(cu, dtype=torch.int32, device="cuda"))
    assert plan._groups is None
    out = varlen_attention(q, k, v, plan, scale, causal)
    assert plan._groups is None, "the flash path must not build padded groups"
    expected = varlen_attention_ref(q.float(), k.float(), v.float(), cu, scale, causal)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    if not causal:  # local attention (ModernBERT) through flash attention's window
        out = varlen_attention(q, k, v, plan, scale, causal, window=64)
        assert plan._groups is None
        expected = varlen_attention_ref(q.float(), k.float(), v.float(), cu, scale, causal, 64)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["CLS", "LAST", "MEAN"])
def test_pool_with_device_boundaries_matches_host_boundaries(kind):
    torch.manual_seed(0)
    cu = [0, 3, 4, 60, 61, 100]
    hidden = torch.randn(100, 16, device="cuda", dtype=torch.float16)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    expected = pool(hidden.cpu().float(), cu, kind)
    torch.testing.assert_close(
        pool(hidden, cu, kind, cu_dev).cpu().float(), expected, atol=2e-3, rtol=2e-3
    )


@pytest.mark.gpu
def test_results_handed_out_are_not_page_locked():
    """encode / classify results leave the copy's page-locked block to the next batch."""
    from batchlm.engine.worker.pooling_runner import _HostCopy

    x = torch.randn(4, 8, device="cuda")
    host = x.to("cpu", non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    assert host.is_pinned()
    (out,) = _HostCopy([host], done).wait_pageable()
    assert not out.is_pinned() and torch.equal(out, x.cpu())


def test_varlen_groups_mixed_lengths_and_rejects_bad_boundaries():
    plan = VarlenPlan.build([0, 100, 101, 160, 170], "cpu")
    assert len(plan.groups) > 1 and not plan.is_single_group
    assert sorted(torch.cat([g.token_index for g in plan.groups]).tolist()) == list(range(170))
    single = VarlenPlan.build([0, 10, 19, 27], "cpu")
    assert single.is_single_group and single.groups[0].token_index.tolist() == list(range(27))
    with pytest.raises(ValueError, match="non-decreasing"):
        VarlenPlan.build([0, 5, 3], "cpu")


# --------------------------------------------------------------------------- pooling


def test_pool_each_type():
    hidden = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    cu = [0, 2, 3, 6]
    torch.testing.assert_close(pool(hidden, cu, PoolingType.CLS), hidden[[0, 2, 3]])
    torch.testing.assert_close(pool(hidden, cu, "last"), hidden[[1, 2, 5]])
    mean = torch.stack([hidden[0:2].mean(0), hidden[2:3].mean(0), hidden[3:6].mean(0)])
    torch.testing.assert_close(pool(hidden, cu, "MEAN"), mean)
    parts = pool(hidden, cu, PoolingType.ALL)
    assert [p.shape[0] for p in parts] == [2, 1, 3]
    torch.testing.assert_close(parts[2], hidden[3:6])
    half = pool(hidden.half(), cu, PoolingType.MEAN)
    assert half.dtype == torch.float16
    with pytest.raises(ValueError, match="not one of"):
        pool(hidden, cu, "max")


# --------------------------------------------------------------------------- st config


def _st_folder(root: Path, pooling: dict | None, extra_modules: tuple[str, ...] = ()) -> Path:
    root.mkdir(parents=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    if pooling is not None:
        modules.append(
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            }
        )
        (root / "1_Pooling").mkdir()
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    for i, kind in enumerate(extra_modules, start=2):
        modules.append({"idx": i, "name": str(i), "path": f"{i}_{kind}", "type": kind})
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 512, "do_lower_case": True})
    )
    return root


def test_st_config_of_minilm(minilm_dir, tmp_path):
    assert read_sentence_transformers_config(minilm_dir) == SentenceTransformersConfig(
        pooling_type=PoolingType.MEAN,
        normalize=True,
        max_seq_length=256,
        do_lower_case=False,
        include_prompt=True,
    )
    assert read_sentence_transformers_config(tmp_path) is None  # no modules.json


def test_st_config_synthetic_folders(tmp_path):
    legacy_cls = {"word_embedding_dimension": 8, "pooling_mode_cls_token": True}
    st = read_sentence_transformers_config(_st_folder(tmp_path / "cls", legacy_cls))
    assert st is not None and st.pooling_type is PoolingType.CLS
    assert not st.normalize and st.max_seq_length == 512 and st.do_lower_case

    current_last = {"embedding_dimension": 8, "pooling_mode": "lasttoken", "include_prompt": False}
    normalize = ("sentence_transformers.base.modules.Normalize",)
    st = read_sentence_transformers_config(_st_folder(tmp_path / "last", current_last, normalize))
    assert st is not None and st.pooling_type is PoolingType.LAST
    assert st.normalize and not st.include_prompt

    st = read_sentence_transformers_config(_st_folder(tmp_path / "nopool", None))
    assert st is not None and st.pooling_type is None

    legacy_max = {"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}
    with pytest.raises(UnsupportedModelError, match="'max'"):
        read_sentence_transformers_config(_st_folder(tmp_path / "max", legacy_max))
    with pytest.raises(UnsupportedModelError, match="exactly one"):
        read_sentence_transformers_config(
            _st_folder(tmp_path / "two", {"pooling_mode": ["cls", "mean"]})
        )
    custom = ("my_package.MyModule",)
    with pytest.raises(UnsupportedModelError, match="my_package.MyModule"):
        read_sentence_transformers_config(_st_folder(tmp_path / "custom", current_last, custom))


# --------------------------------------------------------------------------- BERT


def test_minilm_embeddings_match_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer

    st_config = read_sentence_transformers_config(minilm_dir)
    assert st_config is not None and st_config.max_seq_length is not None
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    encoded = tokenizer(SENTENCES, truncation=True, max_length=st_config.max_seq_length)
    token_lists = encoded["input_ids"]
    assert max(len(t) for t in token_lists) == st_config.max_seq_length  # one was truncated

    model = _build(BertModel, minilm_dir)
    assert model.default_pooling_type is PoolingType.CLS  # the ST config overrides it
    ids, positions, _, cu = _packed(token_lists)
    with torch.inference_mode():
        hidden = model(ids, positions, None, cu)
    assert hidden.shape == (cu[-1], 384)
    ours = F.normalize(pool(hidden, cu, st_config.pooling_type), dim=-1)

    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    expected = torch.as_tensor(reference.encode(SENTENCES, normalize_embeddings=True))
    cosine = (ours * expected).sum(-1)
    assert cosine.min() >= 0.9999, cosine
    assert (ours - expected).abs().max() < 1e-5


@pytest.mark.parametrize("num_labels", [1, 3])
def test_bert_cross_encoder_logits_match_hf(cross_encoder_factory, num_labels):
    folder = cross_encoder_factory(num_labels)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    first, second = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    hf = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    batch = tokenizer(first, second, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        expected = hf(**batch).logits

    model = _build(BertForSequenceClassification, folder)
    assert model.num_labels == num_labels
    assert model.default_pooling_type is PoolingType.CLS
    encoded = tokenizer(first, second, truncation=True)
    assert any(1 in types for types in encoded["token_type_ids"])
    ids, positions, types, cu = _packed(encoded["input_ids"], encoded["token_type_ids"])
    with torch.inference_mode():
        hidden = model(ids, positions, types, cu)
        logits = model.classify(pool(hidden, cu, model.default_pooling_type))
    assert logits.shape == (len(PAIRS), num_labels)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_bert_without_pooler_in_checkpoint_loads(tmp_path):
    """A checkpoint without `pooler.*` (add_pooling_layer=False) loads; hidden states match."""
    config = transformers.BertConfig(
        vocab_size=120,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_act="gelu_new",
    )
    torch.manual_seed(7)
    hf = transformers.BertModel(config, add_pooling_layer=False).eval()
    hf.save_pretrained(tmp_path)
    model = _build(BertModel, tmp_path)
    g = torch.Generator().manual_seed(1)
    token_lists = [torch.randint(1, 120, (n,), generator=g).tolist() for n in (3, 30, 1, 12)]
    expected = _hf_padded(hf, token_lists, pad_id=0).last_hidden_state
    ids, positions, _, cu = _packed(token_lists)
    with torch.inference_mode():
        hidden = model(ids, positions, None, cu)
    for i, tokens in enumerate(token_lists):
        torch.testing.assert_close(
            hidden[cu[i] : cu[i + 1]], expected[i, : len(tokens)], atol=1e-4, rtol=0
        )


# --------------------------------------------------------------------------- XLM-R


def test_xlm_roberta_hidden_states_match_hf(tiny_xlmr):
    hf = transformers.XLMRobertaModel.from_pretrained(tiny_xlmr["base"]).eval()
    token_lists = _xlmr_tokens([5, 64, 2, 17, 33])
    expected = _hf_padded(hf, token_lists, pad_id=TINY_XLMR["pad_token_id"]).last_hidden_state
    model = _build(XLMRobertaModel, tiny_xlmr["base"])
    assert model.max_positions == 64
    ids, positions, _, cu = _packed(token_lists)
    with torch.inference_mode():
        hidden = model(ids, positions, None, cu)
    for i, tokens in enumerate(token_lists):
        torch.testing.assert_close(
            hidden[cu[i] : cu[i + 1]], expected[i, : len(tokens)], atol=1e-4, rtol=0
        )


def test_xlm_roberta_classification_logits_match_hf(tiny_xlmr):
    hf = transformers.XLMRobertaForSequenceClassification.from_pretrained(tiny_xlmr["cls"]).eval()
    token_lists = _xlmr_tokens([9, 3, 40, 21], seed=1)
    expected = _hf_padded(hf, token_lists, pad_id=TINY_XLMR["pad_token_id"]).logits
    model = _build(XLMRobertaForSequenceClassification, tiny_xlmr["cls"])
    assert model.num_labels == 3
    ids, positions, _, cu = _packed(token_lists)
    with torch.inference_mode():
        hidden = model(ids, positions, None, cu)
        logits = model.classify(pool(hidden, cu, model.default_pooling_type))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
