"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against Hugging Face
transformers on tiny seeded random checkpoints: greedy tokens under an ample cache, forced
preemption, chunked prefill and shared prefixes; both checkpoint forms of the experts; two
ranks over gloo; and `load_format="dummy"`.

The models are small (vocabulary 512, 2-4 layers of width 64) and take token-id prompts, so
no tokenizer is needed."""

from __future__ import annotations

import shutil
from typing import NamedTuple

import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import InvalidParamError, UnsupportedModelError

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


# ---- fp8 experts ---------------------------------------------------------------------

SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
SCORED = random_prompts([20, 31, 44, 57, 12, 25, 38, 50], seed=5)


def teacher_forced_scores(llm: LLM, prompts: list[list[int]]) -> list[dict]:
    """The logprob dict (token id → Logprob) of every prompt position after the first, then
    of the first generated token, over all prompts."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SCORE, use_tqdm=False)
    return [e for o in outs for e in o.prompt_logprobs[1:] + [o.outputs[0].logprobs[0]]]


class Agreement(NamedTuple):
    top1: float
    """Share of positions whose most likely token is the same."""
    mean_top5_overlap: float
    """Tokens two top-5s share, on average."""
    mean_logprob_diff: float
    """Mean |difference| of the logprobs of the tokens in both top-5s."""


def agreement(want: list[dict], got: list[dict]) -> Agreement:
    """How two models' teacher-forced scores of the same positions agree (as the dense fp8
    tests of `test_quantization.py` measure it: free-running continuations part at the
    first near-tie and compare different texts from there on)."""
    assert len(want) == len(got)

    def top(entry: dict, k: int) -> set[int]:
        return {t for t, lp in entry.items() if lp.rank <= k}

    top1 = sum(top(a, 1) == top(b, 1) for a, b in zip(want, got, strict=True)) / len(want)
    pairs = list(zip(want, got, strict=True))
    overlap = [len(top(a, 5) & top(b, 5)) for a, b in pairs]
    diffs = [abs(a[t].logprob - b[t].logprob) for a, b in pairs for t in top(a, 5) & top(b, 5)]
    return Agreement(top1, sum(overlap) / len(overlap), sum(diffs) / len(diffs))


# Measured on the tiny models (fp32 on CPU, 277 positions; the dense projections are in fp8
# too): top-1 agreement 0.85 (Qwen3-MoE) / 0.92 (Mixtral), mean top-5 overlap 4.49 / 4.56,
# mean logprob difference 0.045 / 0.040. Vocabulary 512 and random weights: many near-ties.
FP8_MIN_TOP1 = 0.78
FP8_MIN_MEAN_TOP5_OVERLAP = 4.2
FP8_MAX_MEAN_LOGPROB_DIFF = 0.08


def expert_layers(llm: LLM) -> list:
    from batchlm.engine.models.layers.moe import FusedMoE

    return [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_fp8_experts_agree_with_full_precision(family, moe_model):
    """`quantization="fp8"`: the experts are stored in e4m3 with per-channel scales (on CPU
    too: the reference dequantises the experts each step reads), the routers stay in
    full precision, and the scores stay close to the full-precision model's."""
    path = moe_model(family)
    full = engine(path)
    want = teacher_forced_scores(full, SCORED)
    full_bytes = sum(m.experts.w13.nbytes + m.experts.w2.nbytes for m in expert_layers(full))
    full.shutdown()
    fp8 = engine(path, quantization="fp8")
    layers = expert_layers(fp8)
    assert layers
    for moe in layers:
        experts = moe.experts
        assert experts.w13.dtype == experts.w2.dtype == torch.float8_e4m3fn
        assert experts.w13_scale.shape == experts.w13.shape[:2]  # [experts, 2 * inter]
        assert experts.w2_scale.shape == experts.w2.shape[:2]  # [experts, hidden]
        assert moe.gate.weight.dtype == torch.float32
    fp8_bytes = sum(m.experts.w13.nbytes + m.experts.w2.nbytes for m in layers)
    assert fp8_bytes * 4 == full_bytes
    got = teacher_forced_scores(fp8, SCORED)
    fp8.shutdown()
    measured = agreement(want, got)
    assert measured.top1 >= FP8_MIN_TOP1, measured
    assert measured.mean_top5_overlap >= FP8_MIN_MEAN_TOP5_OVERLAP, measured
    assert measured.mean_logprob_diff <= FP8_MAX_MEAN_LOGPROB_DIFF, measured


def test_fp8_with_dummy_weights(moe_model, tmp_path):
    """W6's fp8 run: random weights from config.json alone, then quantised."""
    shutil.copy(moe_model("qwen3-moe") / "config.json", tmp_path)
    llm = engine(tmp_path, load_format="dummy", quantization="fp8")
    assert all(m.experts.w2.dtype == torch.float8_e4m3fn for m in expert_layers(llm))
    assert [len(t) for t in run(llm, MIXED[:2])] == [MAX_TOKENS] * 2


def test_int8_leaves_the_experts_in_the_model_dtype(moe_model):
    llm = engine(moe_model("mixtral"), quantization="int8")
    moe = expert_layers(llm)[0]
    assert moe.experts.w13.dtype == torch.float32 and moe.experts.w13_scale is None
    assert llm.llm_engine.runner.model.model.layers[0].self_attn.o_proj.weight.dtype == torch.int8
    llm.shutdown()


def test_fp8_checkpoints_of_moe_models_are_refused(moe_model, tmp_path):
    import json

    source = moe_model("qwen3-moe")
    for f in source.iterdir():
        shutil.copy(f, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts checkpoints quantized"):
        engine(tmp_path)


# ---- on a GPU: the Triton kernels in bfloat16, CUDA graphs, fp8 experts -----------------

# A small model of each family with a clear next-token top (the embedding and LM head drawn
# wider than HF's initialisation, as in test_hf_bf16.py), saved in bfloat16.
GPU_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8192,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
GPU_FAMILIES = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=128,
            intermediate_size=512,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256),
    ),
}
GPU_PROMPT_LENS = (7, 33, 120, 300)
# Measured on CPU in bfloat16 (235 positions; the dense projections dequantised there, so
# on the GPU, whose fp8 matmuls also quantise activations, the figures are a little lower):
# top-1 agreement 0.90 / 0.89 (Qwen3-MoE / Mixtral), mean top-5 overlap 4.61 / 4.65, mean
# logprob difference 0.053 / 0.056.
GPU_FP8_MIN_TOP1 = 0.8
GPU_FP8_MIN_MEAN_TOP5_OVERLAP = 4.3
GPU_FP8_MAX_MEAN_LOGPROB_DIFF = 0.1


@pytest.fixture(scope="module")
def gpu_moe_model(tmp_path_factory):
    """family → (folder of the bfloat16 checkpoint, the HF model in bfloat16)."""
    import transformers

    from .test_hf_bf16 import EMBEDDING_STD

    made = {}

    def get(family: str):
        if family not in made:
            cls_name, overrides = GPU_FAMILIES[family]
            config = getattr(transformers, cls_name)(**GPU_SHAPE, **overrides)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                model.model.embed_tokens.weight.normal_(0.0, EMBEDDING_STD)
                model.lm_head.weight.normal_(0.0, EMBEDDING_STD)
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight"):
                        param.add_(0.2 * torch.randn_like(param))
            model = model.to(dtype=torch.bfloat16).eval()
            folder = tmp_path_factory.mktemp(f"gpu-{family}")
            model.save_pretrained(folder)
            made[family] = (folder, model)
        return made[family]

    return get


def gpu_engine(folder, **options) -> LLM:
    return LLM(
        str(folder), dtype="bfloat16", max_model_len=512, seed=0, skip_tokenizer_init=True,
        **options,
    )  # fmt: skip


def free_engine(llm: LLM) -> None:
    import gc

    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(GPU_FAMILIES))
def test_bf16_top5_close_to_hf_on_gpu(family, gpu_moe_model):
    """The routing and expert kernels with the engine's defaults (CUDA graphs): greedy
    tokens and top-5 logprobs against HF's on batchlm's continuation, as in
    test_hf_bf16.py."""
    from .test_hf_bf16 import assert_top5_close_to_hf

    folder, hf = gpu_moe_model(family)
    assert_top5_close_to_hf(
        folder, hf, GPU_SHAPE["vocab_size"], GPU_PROMPT_LENS, "cuda", skip_tokenizer_init=True
    )
    hf.to("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("family", list(GPU_FAMILIES))
def test_graphs_match_eager_on_gpu(family, quantization, gpu_moe_model):
    """Decode steps replayed from CUDA graphs (3, 5 and 17 requests padded to 4, 8 and 24
    rows: the padded rows are routed too) give the tokens of the same engine run eagerly.
    The launch of the expert GEMMs depends on the padded row count only through its
    power-of-two bucket, which a graph's size shares with the batch it holds."""
    from .greedy import assert_same_greedy

    folder, _ = gpu_moe_model(family)
    gen = torch.Generator().manual_seed(4)
    rounds = [
        [
            {"prompt_token_ids": torch.randint(3, 8192, (5 + 7 * i,), generator=gen).tolist()}
            for i in range(n)
        ]
        for n in (3, 5, 17)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    outputs = {}
    for eager in (True, False):
        llm = gpu_engine(folder, quantization=quantization, enforce_eager=eager, max_num_seqs=32)
        graphs = llm.llm_engine.runner.decode_graphs
        assert (graphs is None) == eager
        outputs[eager] = [llm.generate(r, params, use_tqdm=False) for r in rounds]
        if graphs is not None:
            assert graphs.num_replays > 0
        if quantization:
            assert expert_layers(llm)[0].experts.w13.dtype == torch.float8_e4m3fn
        free_engine(llm)
    identical = total = 0
    for graph_outs, eager_outs in zip(outputs[False], outputs[True], strict=True):
        assert_same_greedy(graph_outs, eager_outs, "bfloat16")
        for g, e in zip(graph_outs, eager_outs, strict=True):
            identical += g.outputs[0].token_ids == e.outputs[0].token_ids
            total += 1
    assert identical >= 0.75 * total, f"{identical} of {total} sequences identical"


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(GPU_FAMILIES))
def test_fp8_experts_run_on_gpu(family, gpu_moe_model):
    """fp8 expert weights through the Triton kernels (with fp8 dense projections), against
    the bfloat16 engine, teacher-forced; the experts take half the memory."""
    folder, _ = gpu_moe_model(family)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 8192, (n,), generator=gen).tolist() for n in (20, 45, 70, 100)]
    bf16 = gpu_engine(folder)
    want = teacher_forced_scores(bf16, prompts)
    bf16_bytes = sum(m.experts.w13.nbytes + m.experts.w2.nbytes for m in expert_layers(bf16))
    free_engine(bf16)
    fp8 = gpu_engine(folder, quantization="fp8")
    layers = expert_layers(fp8)
    assert all(m.experts.w13.dtype == torch.float8_e4m3fn for m in layers)
    assert all(m.experts.w13.is_cuda and m.gate.weight.dtype == torch.bfloat16 for m in layers)
    assert sum(m.experts.w13.nbytes + m.experts.w2.nbytes for m in layers) * 2 == bf16_bytes
    got = teacher_forced_scores(fp8, prompts)
    free_engine(fp8)
    measured = agreement(want, got)
    print(f"fp8 experts against bfloat16 on the GPU: {measured}")
    assert measured.top1 >= GPU_FP8_MIN_TOP1, measured
    assert measured.mean_top5_overlap >= GPU_FP8_MIN_MEAN_TOP5_OVERLAP, measured
    assert measured.mean_logprob_diff <= GPU_FP8_MAX_MEAN_LOGPROB_DIFF, measured
