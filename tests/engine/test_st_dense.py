"""sentence-transformers `Dense` modules after pooling, against sentence-transformers' `encode`.

A tiny seeded random BERT body (the all-MiniLM-L6-v2 tokenizer) with mean pooling, two Dense
modules (32 → 24 GELU without bias, stored as `pytorch_model.bin`; 24 → 16 Tanh) and Normalize.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchlm.engine import LLM, PoolingParams
from batchlm.engine.errors import UnsupportedModelError
from batchlm.engine.loader.pooling_heads import load_pooling_heads
from batchlm.engine.loader.resolve import resolve_model
from batchlm.engine.loader.st_config import read_sentence_transformers_config

from .st_reference import st_modules

transformers = pytest.importorskip("transformers")

TEXTS = [
    "A man is eating food.",
    "The girl is carrying a baby.",
    "hello",
    "Dense projections map the pooled vector to a smaller space before it is normalised.",
]
TANH = "torch.nn.modules.activation.Tanh"


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory) -> Path:
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer

    st = st_modules()

    root = tmp_path_factory.mktemp("st-dense")
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(7)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(root / "body")
    minilm = resolve_model("sentence-transformers/all-MiniLM-L6-v2")
    transformers.AutoTokenizer.from_pretrained(minilm).save_pretrained(root / "body")
    modules = [
        st.Transformer(str(root / "body"), max_seq_length=64),
        st.Pooling(32, pooling_mode="mean"),
        st.Dense(32, 24, bias=False, activation_function=torch.nn.GELU()),
        st.Dense(24, 16, activation_function=torch.nn.Tanh()),
        st.Normalize(),
    ]
    for dense in modules[2:4]:
        torch.nn.init.normal_(dense.linear.weight, std=0.5)
    out = root / "st"
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    # The first Dense module's weights in the older file format.
    first = out / "2_Dense"
    torch.save(load_file(str(first / "model.safetensors")), first / "pytorch_model.bin")
    (first / "model.safetensors").unlink()
    return out


def test_st_config_reads_dense_modules(dense_folder):
    st = read_sentence_transformers_config(dense_folder)
    assert st is not None and st.normalize and not st.is_late_interaction
    assert [(d.in_features, d.out_features, d.bias) for d in st.dense_modules] == [
        (32, 24, False),
        (24, 16, True),
    ]
    assert [d.activation.rsplit(".", 1)[1] for d in st.dense_modules] == ["GELU", "Tanh"]


def test_dense_embeddings_match_sentence_transformers(dense_folder, tmp_path):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(dense_folder), device="cpu")
    expected = st.encode(TEXTS, convert_to_tensor=True).float()
    llm = LLM(str(dense_folder))
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert got.shape == (len(TEXTS), 16)
    cosine = F.cosine_similarity(got, expected, dim=-1)
    assert cosine.min() >= 0.9999, cosine
    assert (got - expected).abs().max() < 1e-5
    # score() on an embedding model stays the cosine of its (projected) embeddings.
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    assert scores == pytest.approx((expected[1:] @ expected[0]).tolist(), abs=1e-5)


def test_matryoshka_truncates_the_projected_vector(dense_folder, tmp_path):
    import shutil

    folder = tmp_path / "mrl"
    shutil.copytree(dense_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 8]
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder))
    full = llm.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False)
    cut = llm.embed(TEXTS, PoolingParams(dimensions=8), use_tqdm=False)
    for f, c in zip(full, cut, strict=True):
        assert len(f.outputs.embedding) == 16
        expected = F.normalize(torch.tensor(f.outputs.embedding[:8]), dim=0)
        torch.testing.assert_close(torch.tensor(c.outputs.embedding), expected)


def _pipeline(root: Path, *modules: tuple[str, dict | None]) -> Path:
    """A folder whose modules.json lists a Transformer then `modules` (type, config)."""
    root.mkdir(parents=True)
    listed = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    for i, (kind, config) in enumerate(modules, start=1):
        path = f"{i}_{kind.rsplit('.', 1)[1]}"
        listed.append({"idx": i, "name": str(i), "path": path, "type": kind})
        (root / path).mkdir()
        if config is not None:
            (root / path / "config.json").write_text(json.dumps(config))
    (root / "modules.json").write_text(json.dumps(listed))
    return root


POOLING = ("sentence_transformers.models.Pooling", {"pooling_mode": "mean"})
NORMALIZE = ("sentence_transformers.models.Normalize", None)


def _dense(**config) -> tuple[str, dict]:
    return ("sentence_transformers.models.Dense", {"in_features": 8, "out_features": 4, **config})


@pytest.mark.parametrize(
    "modules,message",
    [
        ((POOLING, NORMALIZE, _dense()), "after Normalize"),
        ((POOLING, _dense(use_residual=True)), "use_residual"),
        ((POOLING, _dense(activation_function="torch.nn.modules.activation.Softmax")), "Softmax"),
        ((POOLING, _dense(activation_function="my_package.MyAct")), "my_package.MyAct"),
        ((POOLING, _dense(module_input_name="token_embeddings")), "with a Pooling"),
        ((_dense(),), "without a Pooling"),
        ((_dense(module_input_name="token_embeddings"), POOLING), "one Pooling module"),
        (
            (
                _dense(module_input_name="token_embeddings"),
                ("sentence_transformers.multi_vector_encoder.modules.MultiVectorMask", {}),
            ),
            "MultiVectorMask",
        ),
    ],
    ids=[
        "dense-after-normalize",
        "residual",
        "softmax",
        "custom-activation",
        "token-dense-after-pooling",
        "sentence-dense-without-pooling",
        "pooling-after-dense",
        "multi-vector-mask",
    ],
)
def test_pipelines_that_are_refused(tmp_path, modules, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_sentence_transformers_config(_pipeline(tmp_path / "st", *modules))


def test_dense_weights_must_fit(tmp_path):
    folder = _pipeline(tmp_path / "st", POOLING, _dense(activation_function=TANH))
    st = read_sentence_transformers_config(folder)
    assert st is not None
    cpu = torch.device("cpu")
    with pytest.raises(UnsupportedModelError, match="in_features=8, but its input has 16"):
        load_pooling_heads(folder, "BertModel", "embed", 16, st, cpu)
    with pytest.raises(UnsupportedModelError, match="has no weights"):
        load_pooling_heads(folder, "BertModel", "embed", 8, st, cpu)
    from safetensors.torch import save_file

    save_file({"linear.weight": torch.zeros(4, 9)}, str(folder / "2_Dense" / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="cannot load the Dense module weights"):
        load_pooling_heads(folder, "BertModel", "embed", 8, st, cpu)
    with pytest.raises(UnsupportedModelError, match="classifier"):
        load_pooling_heads(folder, "BertForSequenceClassification", "classify", 8, st, cpu)
