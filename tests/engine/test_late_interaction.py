"""Late interaction (ColBERT): token vectors and MaxSim scores against transformers + PyTorch.

Two tiny seeded random checkpoints, the two ways such models ship:
- `HF_ColBERT` (as `colbert-ir/colbertv2.0`): a BERT checkpoint under `bert.` (with its
  pooler) plus a bias-free `linear.weight` projection;
- a PyLate sentence-transformers folder: a ModernBERT Transformer module, then PyLate's Dense
  module (weights in `pytorch_model.bin`), no Pooling.
References: the same weights through transformers' model, the projection and an L2
normalisation in plain PyTorch; MaxSim as a loop over pairs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from batchlm.engine import LLM, PoolingParams
from batchlm.engine.errors import InvalidParamError, UnsupportedModelError
from batchlm.engine.loader.pooling_heads import load_pooling_heads
from batchlm.engine.loader.resolve import resolve_model
from batchlm.engine.loader.st_config import read_sentence_transformers_config
from batchlm.engine.worker.late_interaction import maxsim, maxsim_ref

transformers = pytest.importorskip("transformers")

QUERIES = ["How many people live in Berlin?", "what is late interaction"]
DOCS = [
    "Berlin had a population of 3,520,031 registered inhabitants in an area of 891 km2.",
    "Berlin is well known for its museums.",
    "Late interaction compares every query token with every document token, then sums.",
]
DIM = 16


def _tokenizer():
    minilm = resolve_model("sentence-transformers/all-MiniLM-L6-v2")
    return transformers.AutoTokenizer.from_pretrained(minilm)


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    """(folder, transformers body, projection weight) of a tiny `HF_ColBERT` checkpoint."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("hf-colbert")
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(11)
    body = transformers.BertModel(config).eval()  # with its pooler, as HF_ColBERT saves it
    weight = torch.randn(DIM, 32) * 0.3
    tensors = {f"bert.{k}": v.contiguous() for k, v in body.state_dict().items()}
    save_file({**tensors, "linear.weight": weight}, str(folder / "model.safetensors"))
    config.architectures = ["HF_ColBERT"]
    config.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder, body, weight


@pytest.fixture(scope="module")
def pylate(tmp_path_factory):
    """(folder, transformers body, projection weight) of a tiny PyLate ModernBERT folder."""
    folder = tmp_path_factory.mktemp("pylate")
    config = transformers.ModernBertConfig(
        vocab_size=30522,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        local_attention=8,
        global_attn_every_n_layers=2,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=101,
        cls_token_id=101,
        eos_token_id=102,
        sep_token_id=102,
    )
    torch.manual_seed(12)
    body = transformers.ModernBertModel(config).eval()
    body.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    weight = torch.randn(DIM, 64) * 0.2
    (folder / "1_Dense").mkdir()
    torch.save({"linear.weight": weight}, folder / "1_Dense" / "pytorch_model.bin")
    dense = {
        "in_features": 64,
        "out_features": DIM,
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }
    (folder / "1_Dense" / "config.json").write_text(json.dumps(dense))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    return folder, body, weight


def _reference_vectors(folder: Path, body, weight, texts, normalize=True) -> list[torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    out = []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            projected = body(input_ids=ids).last_hidden_state[0] @ weight.T  # [len, DIM]
        out.append(F.normalize(projected, dim=-1) if normalize else projected)
    return out


def test_maxsim_matches_a_loop_over_pairs():
    torch.manual_seed(0)
    lens = [3, 1, 17, 40, 8, 2]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    vectors = F.normalize(torch.randn(int(offsets[-1]), 8), dim=-1)
    parts = vectors.split(lens)
    queries, docs = [0, 0, 1, 2, 5, 4, 3], [1, 2, 3, 3, 0, 4, 5]
    pairs = zip(queries, docs, strict=True)
    expected = torch.stack([maxsim_ref(parts[q], parts[d]) for q, d in pairs])
    for budget in (1 << 26, 200, 1):  # one chunk, several, one pair each
        got = maxsim(vectors, offsets, queries, docs, max_elements=budget)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["hf_colbert", "pylate"])
def test_token_vectors_and_maxsim_scores_match_transformers(kind, colbert, pylate):
    folder, body, weight = colbert if kind == "hf_colbert" else pylate
    llm = LLM(str(folder))
    assert llm.llm_engine.pooling_runner.task == "token_embed"
    texts = [*QUERIES, *DOCS]
    reference = dict(zip(texts, _reference_vectors(folder, body, weight, texts), strict=True))
    outs = llm.encode(texts, pooling_task="token_embed", use_tqdm=False)
    for text, out in zip(texts, outs, strict=True):
        assert out.outputs.data.shape == reference[text].shape
        assert (out.outputs.data - reference[text]).abs().max() <= 1e-5

    raw = llm.encode(DOCS[:1], PoolingParams(normalize=False), pooling_task="token_embed")
    expected = _reference_vectors(folder, body, weight, DOCS[:1], normalize=False)[0]
    assert (raw[0].outputs.data - expected).abs().max() <= 1e-5

    def expect(pairs):
        return torch.stack([maxsim_ref(reference[q], reference[d]) for q, d in pairs])

    one = llm.score(QUERIES[0], DOCS[0], use_tqdm=False)
    one_to_n = llm.score(QUERIES[0], DOCS, use_tqdm=False)
    n_to_n = llm.score([QUERIES[0], QUERIES[1], QUERIES[1]], DOCS, use_tqdm=False)
    for outs, pairs in (
        (one, [(QUERIES[0], DOCS[0])]),
        (one_to_n, [(QUERIES[0], d) for d in DOCS]),
        (n_to_n, list(zip([QUERIES[0], QUERIES[1], QUERIES[1]], DOCS, strict=True))),
    ):
        got = torch.tensor([o.outputs.score for o in outs])
        assert (got - expect(pairs)).abs().max() <= 1e-5, (got, expect(pairs))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert one_to_n[1].prompt_token_ids == tokenizer(QUERIES[0])["input_ids"]


def test_wrong_tasks_are_refused_clearly(colbert):
    folder, _, _ = colbert
    llm = LLM(str(folder))
    with pytest.raises(InvalidParamError, match=r"encode\(pooling_task='token_embed'\) or score"):
        llm.embed(QUERIES)
    with pytest.raises(InvalidParamError, match="token vectors.*Embedding API is not supported"):
        llm.encode(QUERIES, pooling_task="embed")
    with pytest.raises(InvalidParamError, match="can classify"):
        llm.classify(QUERIES)
    with pytest.raises(UnsupportedModelError, match="convert='embed' does not apply"):
        LLM(str(folder), convert="embed")


def test_unknown_variants_are_refused(colbert, pylate, tmp_path):
    folder, _, _ = colbert
    # An HF_ColBERT checkpoint without its projection.
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no-linear"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["linear.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="no usable token projection linear.weight"):
        LLM(str(broken))
    # vLLM's architecture overrides name no checkpoint format: pointed to the two that exist.
    renamed = tmp_path / "renamed"
    shutil.copytree(pylate[0], renamed)
    config = json.loads((renamed / "config.json").read_text())
    config["architectures"] = ["ColBERTModernBertModel"]
    (renamed / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="Late-interaction models load as HF_ColBERT"):
        LLM(str(renamed))
    # An HF_ColBERT checkpoint that also lists token Dense modules: ambiguous.
    st = read_sentence_transformers_config(pylate[0])
    assert st is not None and st.is_late_interaction and st.pooling_type is None
    with pytest.raises(UnsupportedModelError, match="keep one of the two"):
        load_pooling_heads(folder, "HF_ColBERT", "token_embed", 32, st, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_cuda(pylate, dtype):
    """ModernBERT body in half precision (flash attention with its window), projection and
    MaxSim on the device, against the float32 transformers reference."""
    folder, body, weight = pylate
    texts = [*QUERIES, *DOCS]
    reference = dict(zip(texts, _reference_vectors(folder, body, weight, texts), strict=True))
    llm = LLM(str(folder), dtype=dtype, device="cuda")
    outs = llm.encode(texts, pooling_task="token_embed", use_tqdm=False)
    for text, out in zip(texts, outs, strict=True):
        assert (out.outputs.data.cpu() - reference[text]).abs().max() <= 5e-2
    got = torch.tensor([o.outputs.score for o in llm.score(QUERIES[0], DOCS, use_tqdm=False)])
    expected = torch.stack([maxsim_ref(reference[QUERIES[0]], reference[d]) for d in DOCS])
    torch.testing.assert_close(got, expected, atol=0.1, rtol=2e-2)
