"""ModernBERT encoders (CPU, float32) against transformers and sentence-transformers.

Tiny seeded random checkpoints: 3 layers alternating global and local attention, a local
window (8, so 4 tokens on either side) shorter than most inputs, distinct rope thetas, and the
all-MiniLM-L6-v2 tokenizer (its vocabulary and [CLS] / [SEP] ids).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from batchlm.engine import LLM, PoolingParams
from batchlm.engine.errors import InvalidParamError, UnsupportedModelError
from batchlm.engine.loader.resolve import resolve_model
from batchlm.engine.loader.weights import build_model
from batchlm.engine.models.layers.pooler import PoolingType, pool
from batchlm.engine.models.modernbert import (
    ModernBertForSequenceClassification,
    ModernBertModel,
    layer_types_of,
)

from .st_reference import st_modules

transformers = pytest.importorskip("transformers")

TINY_MODERNBERT = dict(
    vocab_size=30522,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
    local_attention=8,
    global_attn_every_n_layers=2,
    global_rope_theta=1000.0,
    local_rope_theta=100.0,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=101,
    cls_token_id=101,
    eos_token_id=102,
    sep_token_id=102,
)
TEXTS = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground, far away from the city.",
    "hi",
    "Local attention sees four tokens on either side; global attention sees the whole input.",
    "Two men pushed carts through the woods.",
    "Sentence embeddings are compared with cosine similarity in semantic search systems today.",
]
QUERY = "How many people live in Berlin?"
DOCS = [
    "Berlin had a population of 3,520,031 registered inhabitants in an area of 891 km2.",
    "Berlin is well known for its museums.",
    "The capital of France is Paris.",
]


def _config(**overrides):
    return transformers.ModernBertConfig(**{**TINY_MODERNBERT, **overrides})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """`base` (plain HF folder), `st` (mean pooling + Normalize), `cls3` (3 labels, mean
    pooling) and `ce` (one label, CLS pooling), each with the MiniLM tokenizer."""
    from sentence_transformers import SentenceTransformer

    st = st_modules()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        resolve_model("sentence-transformers/all-MiniLM-L6-v2")
    )
    root = tmp_path_factory.mktemp("modernbert")
    torch.manual_seed(1234)
    transformers.ModernBertModel(_config()).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    for name, labels, pooling in (("cls3", 3, "mean"), ("ce", 1, "cls")):
        config = _config(num_labels=labels, classifier_pooling=pooling)
        transformers.ModernBertForSequenceClassification(config).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    body = st.Transformer(str(root / "base"), max_seq_length=64)
    modules = [body, st.Pooling(64, pooling_mode="mean"), st.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "st"))
    return {name: root / name for name in ("base", "st", "cls3", "ce")}


def _packed(token_lists: list[list[int]]):
    cu = [0]
    for tokens in token_lists:
        cu.append(cu[-1] + len(tokens))
    ids = torch.tensor([t for tokens in token_lists for t in tokens])
    positions = torch.tensor([p for tokens in token_lists for p in range(len(tokens))])
    return ids, positions, cu


def _hf_batch(folder: Path, texts: list[str]):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return tokenizer(texts, padding=True, return_tensors="pt", return_token_type_ids=False)


def test_layer_types_and_rope_from_old_and_new_configs(folders):
    config = transformers.AutoConfig.from_pretrained(folders["base"])
    assert layer_types_of(config) == ["full_attention", "sliding_attention", "full_attention"]
    # A config written before `layer_types` / `rope_parameters` (transformers < 5).
    old = SimpleNamespace(
        num_hidden_layers=4,
        global_attn_every_n_layers=3,
        global_rope_theta=160000.0,
        local_rope_theta=None,
        max_position_embeddings=64,
    )
    assert layer_types_of(old) == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ]
    from batchlm.engine.models.modernbert import _rope_spec

    assert _rope_spec(old, "sliding_attention", 16).theta == 160000.0  # falls back to global
    assert _rope_spec(config, "sliding_attention", 16).theta == 100.0
    assert _rope_spec(config, "full_attention", 16).theta == 1000.0
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        layer_types_of(SimpleNamespace(num_hidden_layers=2, layer_types=["full_attention", "x"]))


def test_hidden_states_match_transformers_and_local_layers_matter(folders):
    folder = folders["base"]
    hf = transformers.ModernBertModel.from_pretrained(folder).eval()
    batch = _hf_batch(folder, TEXTS)
    with torch.no_grad():
        expected = hf(**batch).last_hidden_state
    token_lists = [ids[mask.bool()].tolist() for ids, mask in zip(*batch.values(), strict=True)]
    assert max(len(t) for t in token_lists) > 2 * TINY_MODERNBERT["local_attention"]

    config = transformers.AutoConfig.from_pretrained(folder)
    model = build_model(ModernBertModel, folder, torch.float32, torch.device("cpu"), config=config)
    ids, positions, cu = _packed(token_lists)
    with torch.inference_mode():
        hidden = model(ids, positions, None, cu)
    for i, tokens in enumerate(token_lists):
        torch.testing.assert_close(
            hidden[cu[i] : cu[i + 1]], expected[i, : len(tokens)], atol=1e-4, rtol=0
        )
    # The same weights with every layer global give other states: the window is in effect.
    for layer in model.layers:
        layer.attn.window = None
    with torch.inference_mode():
        everywhere = model(ids, positions, None, cu)
    assert (everywhere - hidden).abs().max() > 1e-2


def test_sentence_transformers_folder_embeddings(folders):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(folders["st"]), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    llm = LLM(str(folders["st"]))
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert got.shape == expected.shape == (len(TEXTS), 64)
    cosine = F.cosine_similarity(got, expected.float(), dim=-1)
    assert cosine.min() >= 0.9999, cosine
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    q = llm.embed([QUERY], use_tqdm=False)[0].outputs.embedding
    d = [o.outputs.embedding for o in llm.embed(DOCS, use_tqdm=False)]
    assert scores == pytest.approx([float(torch.tensor(q) @ torch.tensor(v)) for v in d], abs=1e-6)


def test_plain_folder_pools_cls(folders):
    """Without a sentence-transformers pipeline ModernBERT pools its first token ([CLS])."""
    folder = folders["base"]
    hf = transformers.ModernBertModel.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = F.normalize(hf(**_hf_batch(folder, TEXTS)).last_hidden_state[:, 0], dim=-1)
    llm = LLM(str(folder))
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert F.cosine_similarity(got, expected, dim=-1).min() >= 0.9999


def test_classifier_probabilities_and_scores_match_transformers(folders):
    hf = transformers.ModernBertForSequenceClassification.from_pretrained(folders["cls3"]).eval()
    with torch.no_grad():
        expected = hf(**_hf_batch(folders["cls3"], TEXTS)).logits.softmax(-1)
    llm = LLM(str(folders["cls3"]))
    assert llm.llm_engine.pooling_runner.model.default_pooling_type is PoolingType.MEAN
    got = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    with pytest.raises(InvalidParamError, match="token_embed"):
        llm.encode(TEXTS[:1], pooling_task="token_embed")

    ce = folders["ce"]
    hf = transformers.ModernBertForSequenceClassification.from_pretrained(ce).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(ce)
    pairs = tokenizer([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")
    pairs.pop("token_type_ids", None)
    with torch.no_grad():
        logits = hf(**pairs).logits[:, 0]
    llm = LLM(str(ce))
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), logits.sigmoid(), atol=1e-4, rtol=0)
    raw = llm.score(QUERY, DOCS, pooling_params=PoolingParams(use_activation=False))
    torch.testing.assert_close(
        torch.tensor([o.outputs.score for o in raw]), logits, atol=1e-4, rtol=0
    )


def test_classifier_head_from_packed_states(folders):
    """`classify` on pooled packed states equals transformers' logits (both pooling kinds)."""
    for name in ("cls3", "ce"):
        folder = folders[name]
        hf = transformers.ModernBertForSequenceClassification.from_pretrained(folder).eval()
        batch = _hf_batch(folder, TEXTS)
        with torch.no_grad():
            expected = hf(**batch).logits
        config = transformers.AutoConfig.from_pretrained(folder)
        model = build_model(
            ModernBertForSequenceClassification,
            folder,
            torch.float32,
            torch.device("cpu"),
            config=config,
        )
        token_lists = [ids[m.bool()].tolist() for ids, m in zip(*batch.values(), strict=True)]
        ids, positions, cu = _packed(token_lists)
        with torch.inference_mode():
            hidden = model(ids, positions, None, cu)
            logits = model.classify(pool(hidden, cu, model.default_pooling_type))
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_cuda_matches_transformers(folders, dtype):
    """The flash path (with its window) and the Triton rotary kernel against transformers'
    SDPA in the same dtype."""
    folder = folders["st"]
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cuda", model_kwargs={"dtype": dtype})
    expected = st.encode(TEXTS * 8, convert_to_tensor=True).float()
    llm = LLM(str(folder), dtype=dtype, device="cuda")
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS * 8, use_tqdm=False)])
    cosine = F.cosine_similarity(got.cuda(), expected, dim=-1)
    assert cosine.min() >= 0.999, cosine
    ce = LLM(str(folders["cls3"]), dtype=dtype, device="cuda")
    hf = transformers.ModernBertForSequenceClassification.from_pretrained(
        folders["cls3"], dtype=dtype
    ).cuda()
    batch = _hf_batch(folders["cls3"], TEXTS).to("cuda")
    with torch.no_grad():
        probs = hf(**batch).logits.float().softmax(-1).cpu()
    got = torch.tensor([o.outputs.probs for o in ce.classify(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(got, probs, atol=2e-2, rtol=0)
