"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against Hugging Face
transformers on tiny seeded random checkpoints: greedy tokens under an ample cache, forced
preemption, chunked prefill and shared prefixes; both checkpoint forms of the experts; two
ranks over gloo; and `load_format="dummy"`.

The models are small (vocabulary 512, 2-4 layers of width 64) and take token-id prompts, so
no tokenizer is needed."""

from __future__ import annotations

import shutil

import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import InvalidParamError

from .hf_reference import hf_greedy
from .probes import record_partial_prefills

MAX_TOKENS = 12
VOCAB = 512

TINY_MOE_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
    tie_word_embeddings=False,
)

# name → (transformers config class name, overrides)
TINY_MOE: dict[str, tuple[str, dict]] = {
    "mixtral": (
        "MixtralConfig",
        {
            "num_hidden_layers": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
        },
    ),
    # Shared expert in layers 0 and 2, a dense MLP in layer 1; q/k/v biases; the routing
    # weights not renormalised (Qwen2-MoE's default).
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "intermediate_size": 64,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
        },
    ),
    # Experts in layers 1 and 3 (every second layer), dense MLPs in 0 and 2; q/k norms.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "intermediate_size": 64,
            "decoder_sparse_step": 2,
            "norm_topk_prob": True,
        },
    ),
}
FAMILIES = list(TINY_MOE)


def hf_model(name: str):
    import transformers

    cls_name, overrides = TINY_MOE[name]
    config = getattr(transformers, cls_name)(**{**TINY_MOE_COMMON, **overrides})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from the identity, so that their weights matter
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """name → folder of a checkpoint saved by `save_pretrained` (one tensor per expert)."""
    root = tmp_path_factory.mktemp("tiny-moe")
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = root / name
            hf_model(name).save_pretrained(made[name])
        return made[name]

    return get


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


MIXED = random_prompts([3, 9, 17, 30, 41, 55, 70, 5, 12, 24], seed=1)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), max_model_len=128, seed=0, skip_tokenizer_init=True, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_under_every_schedule(family, moe_model):
    path = moe_model(family)
    expected = hf_greedy(path, MIXED, MAX_TOKENS)

    ample = engine(path)
    assert run(ample, MIXED) == expected
    assert ample.llm_engine.stats().num_preemptions == 0
    ample.shutdown()

    # 8 blocks (128 tokens) for 10 sequences of up to 82 tokens: preempt and recompute.
    small = engine(path, num_gpu_blocks_override=8)
    assert run(small, MIXED) == expected
    assert small.llm_engine.stats().num_preemptions > 0
    small.shutdown()

    # A 16-token step budget: longer prompts are prefilled in chunks.
    chunked = engine(path, max_num_batched_tokens=16, max_num_seqs=4)
    chunks = record_partial_prefills(chunked)
    assert run(chunked, MIXED) == expected
    assert chunks, "no prompt was chunked"
    chunked.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefixes_hit_the_prefix_cache(family, moe_model):
    path = moe_model(family)
    prefix = random_prompts([50], seed=2)[0]
    prompts = [prefix + tail for tail in random_prompts([3 + i for i in range(8)], seed=3)]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    llm = engine(path, max_num_seqs=2)  # later requests arrive after the prefix is cached
    assert run(llm, prompts) == expected
    assert llm.llm_engine.stats().prefix_cache_hits >= 7 * 48
    assert run(llm, prompts) == expected
    llm.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_expert_tensors_load_as_per_expert_ones(family, moe_model, tmp_path):
    """transformers 5.x holds experts fused in memory (`experts.gate_up_proj [E, 2I, H]`,
    `experts.down_proj [E, H, I]`, Mixtral's block as `mlp`) but saves them one tensor per
    expert; a checkpoint written from the in-memory state dict loads to the same tokens."""
    save_fused(family, moe_model, tmp_path)
    prompts = MIXED[:4]
    assert run(engine(tmp_path), prompts) == hf_greedy(moe_model(family), prompts, MAX_TOKENS)


def save_fused(family: str, moe_model, folder) -> None:
    """The checkpoint as transformers holds it in memory (fused expert tensors)."""
    from safetensors.torch import save_file

    state = hf_model(family).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    shutil.copy(moe_model(family) / "config.json", folder)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")


def test_saved_checkpoints_hold_one_tensor_per_expert(moe_model):
    from safetensors import safe_open

    with safe_open(str(moe_model("mixtral") / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_two_ranks_read_their_rows_of_fused_expert_tensors(moe_model, tmp_path):
    """Each rank slices its intermediate rows out of the fused `gate_up_proj` (gate rows
    and up rows alike) and `down_proj` columns: Mixtral over two ranks gives HF's tokens."""
    save_fused("mixtral", moe_model, tmp_path)
    prompts = MIXED[:4]
    two_ranks = engine(tmp_path, tensor_parallel_size=2)
    assert run(two_ranks, prompts) == hf_greedy(moe_model("mixtral"), prompts, MAX_TOKENS)
    two_ranks.shutdown()


def test_two_ranks_give_the_greedy_tokens_of_one(moe_model):
    """Each rank holds half of every expert's (and the shared expert's) intermediate rows;
    the routed and shared partial sums are reduced once, by the next norm."""
    path = moe_model("qwen2-moe")
    prompts = MIXED[:4]
    one = run(engine(path), prompts)
    two_ranks = engine(path, tensor_parallel_size=2)
    reduces = two_ranks.collective_rpc(lambda w: w.model.model.layers[0].mlp.reduce_output)
    assert reduces == [False, False]
    assert run(two_ranks, prompts) == one
    two_ranks.shutdown()


@pytest.mark.parametrize("family", ["qwen3-moe", "llama"])
def test_dummy_weights_need_only_config_json(family, moe_model, tmp_path):
    """`load_format="dummy"`: the model is built from config.json alone, with seeded random
    weights (the same on every load), for the MoE families and the dense ones alike."""
    import transformers

    if family == "llama":
        config = transformers.LlamaConfig(**TINY_MOE_COMMON, num_hidden_layers=2)
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(tmp_path)
    else:
        shutil.copy(moe_model(family) / "config.json", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    first = run(engine(tmp_path, load_format="dummy"), MIXED[:3])
    assert [len(t) for t in first] == [MAX_TOKENS] * 3
    assert run(engine(tmp_path, load_format="dummy"), MIXED[:3]) == first


def test_an_unknown_load_format_names_the_valid_ones(moe_model):
    with pytest.raises(InvalidParamError, match="load_format='bogus'.*'auto', 'dummy'"):
        engine(moe_model("mixtral"), load_format="bogus")
