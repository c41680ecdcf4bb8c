"""int4 checkpoints end to end: tiny random models of two families (and Phi-3's fused
tensors, an MoE family's attention) quantized round to nearest in each format (group 32,
symmetric and not, activation order), and SmolLM2 in groups of 64. batchlm's greedy tokens
equal Hugging Face's float32 model carrying the dequantized weights, under preemption,
chunked prefill and two ranks over gloo; `load_format="dummy"` builds int4 layers from a
config alone; int4 experts are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import UnsupportedModelError

from ..conftest import TINY_COMMON
from .hf_reference import hf_greedy
from .int4_checkpoints import Int4Spec, pack_gptq, quantize_checkpoint, rtn
from .probes import record_partial_prefills

MAX_TOKENS = 8
VOCAB = TINY_COMMON["vocab_size"]


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = prompts_of([13, 29, 45, 61, 70, 3], seed=1)  # most cross a block boundary

CASES = {
    "llama-gptq-sym-actorder": ("llama", Int4Spec("gptq", 32, True, True)),
    "llama-awq": ("llama", Int4Spec("awq", 32, False, False)),
    "llama-ct-channel": ("llama", Int4Spec("compressed-tensors", None, True, False)),
    "qwen2-gptq_v2-asym": ("qwen2", Int4Spec("gptq_v2", 32, False, False)),
    "qwen2-ct-asym-actorder": ("qwen2", Int4Spec("compressed-tensors", 32, False, True)),
    "phi3-gptq_v2-asym-actorder": ("phi3", Int4Spec("gptq_v2", 32, False, True)),
}


@pytest.fixture(scope="module")
def int4_model(tiny_model_factory, tmp_path_factory):
    """case → (int4 checkpoint, the same model dequantized in float32)."""
    root = tmp_path_factory.mktemp("int4")
    made = {}

    def get(case: str):
        if case not in made:
            family, spec = CASES[case]
            made[case] = (root / case, root / f"{case}-dequantized")
            quantize_checkpoint(tiny_model_factory(family), *made[case], spec)
        return made[case]

    return get


@pytest.fixture(scope="module")
def expected(int4_model):
    """(case, number of prompts) → HF's greedy tokens on the dequantized weights (each
    computed once per module)."""
    done = {}

    def get(case: str, num_prompts: int = len(PROMPTS)):
        if (case, num_prompts) not in done:
            done[case, num_prompts] = hf_greedy(
                int4_model(case)[1], PROMPTS[:num_prompts], MAX_TOKENS
            )
        return done[case, num_prompts]

    return get


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def engine(path, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 128)
    return LLM(str(path), seed=0, skip_tokenizer_init=True, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_on_the_dequantized_weights(case, int4_model, expected):
    quantized, _ = int4_model(case)
    llm = engine(quantized)
    assert llm.llm_engine.config.model.quantization.method == "int4"
    assert run(llm, PROMPTS) == expected(case)
    llm.shutdown()


def test_layers_hold_the_dequantized_weights_exactly(int4_model, tiny_model_factory):
    """The CPU path's weights (dequantized once at load, features back in activation order)
    equal the reference's, bit for bit: q|k|v merged, o_proj alone."""
    quantized, dequantized = int4_model("qwen2-ct-asym-actorder")
    llm = engine(quantized)
    attn = llm.llm_engine.runner.model.model.layers[1].self_attn
    ref = load_file(dequantized / "model.safetensors")
    prefix = "model.layers.1.self_attn"
    qkv = torch.cat([ref[f"{prefix}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(attn.qkv_proj.weight, qkv)
    assert torch.equal(attn.o_proj.weight, ref[f"{prefix}.o_proj.weight"])
    # Quantization moved every weight: the reference is not the original model.
    original = load_file(tiny_model_factory("qwen2") / "model.safetensors")
    assert not torch.equal(attn.o_proj.weight, original[f"{prefix}.o_proj.weight"])
    llm.shutdown()


def test_preemption_and_chunked_prefill(int4_model, expected):
    """Asymmetric, activation-ordered compressed-tensors weights under recompute
    preemption and chunked prefill."""
    case = "qwen2-ct-asym-actorder"
    quantized, _ = int4_model(case)
    # 6 blocks (96 tokens) for 6 sequences of up to 78 tokens: preempt and recompute.
    small = engine(quantized, num_gpu_blocks_override=6, max_model_len=96)
    assert run(small, PROMPTS) == expected(case)
    assert small.llm_engine.stats().num_preemptions > 0
    small.shutdown()
    chunked = engine(quantized, max_num_batched_tokens=16, max_num_seqs=4)
    chunks = record_partial_prefills(chunked)
    assert run(chunked, PROMPTS) == expected(case)
    assert chunks, "no prompt was chunked"
    chunked.shutdown()


def test_two_ranks_over_gloo(int4_model, expected):
    """Phi-3, activation-ordered: the row-parallel layers' ranks each hold members of every
    group (a `g_idx`, every group's scales), and the fused q|k|v and gate|up tensors give
    each rank its rows of every part."""
    case = "phi3-gptq_v2-asym-actorder"
    quantized, _ = int4_model(case)
    llm = engine(quantized, tensor_parallel_size=2)
    assert run(llm, PROMPTS[:4]) == expected(case, 4)
    llm.shutdown()


# ---- mixture of experts ---------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """Qwen3-MoE with its attention and dense MLPs in int4, the experts in full precision."""
    from .test_moe import hf_model

    root = tmp_path_factory.mktemp("int4-moe")
    hf_model("qwen3-moe").save_pretrained(root / "source")
    quantize_checkpoint(root / "source", root / "int4", root / "ref", Int4Spec("gptq", 32, False))
    return root


def test_moe_attention_in_int4(moe_checkpoint):
    prompts = [[t % 512 for t in p] for p in PROMPTS[:4]]
    llm = engine(moe_checkpoint / "int4")
    assert run(llm, prompts) == hf_greedy(moe_checkpoint / "ref", prompts, MAX_TOKENS)
    llm.shutdown()


def test_int4_experts_are_refused_by_name(moe_checkpoint, tmp_path):
    """An expert packed like the attention (GPTQ) is named; nothing is loaded."""
    from safetensors.torch import save_file

    folder = tmp_path / "experts"
    shutil.copytree(moe_checkpoint / "int4", folder)
    state = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.0.gate_proj"
    qz = rtn(state.pop(f"{name}.weight"), 32, False, None, torch.float16, min_zero=1)
    for leaf, value in pack_gptq(qz, v1=True).items():
        state[f"{name}.{leaf}"] = value
    save_file(state, folder / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"layer model.layers.1.mlp.experts is int4"):
        engine(folder)


# ---- dummy weights ------------------------------------------------------------------


def test_dummy_weights_from_a_config(int4_model, tmp_path):
    """`load_format="dummy"` with an int4 quantization_config: random int4 layers (each
    row of a group holds at most 16 values), no weight file read."""
    quantized, _ = int4_model("qwen2-gptq_v2-asym")
    config = json.loads((quantized / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = engine(tmp_path, load_format="dummy")
    assert len(run(llm, PROMPTS[:2])[0]) == MAX_TOKENS
    weight = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj.weight  # [64, 128]
    assert max(len(row.unique()) for row in weight[:, :32]) <= 16 < len(weight[0].unique())
    llm.shutdown()
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts layer .* is int4"):
        engine(moe, load_format="dummy")


# ---- SmolLM2 ----------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_in_groups_of_64(smollm2_dir, tmp_path):
    """SmolLM2-135M (576-wide rows: 128 does not divide them) quantized GPTQ-style in groups
    of 64 with activation order: the same greedy tokens as its dequantized weights in HF."""
    spec = Int4Spec("gptq", 64, True, True)
    quantize_checkpoint(smollm2_dir, tmp_path / "int4", tmp_path / "ref", spec)
    llm = LLM(str(tmp_path / "int4"), max_model_len=256, seed=0)
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
             "The three primary colors are"]  # fmt: skip
    prompts = [tok(t)["input_ids"] for t in texts]
    got = run(llm, prompts)
    assert got == hf_greedy(tmp_path / "ref", prompts, MAX_TOKENS)
    llm.shutdown()
