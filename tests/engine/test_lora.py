"""LoRA adapters against PEFT: greedy tokens equal `PeftModel.generate` per adapter, in calls
that mix more adapters than `max_loras` with base-model prompts, under every schedule
(forced preemption, chunked prefill, async scheduling), prefix caching, two tensor-parallel
ranks, fused checkpoint projections (Phi-3), fp8 base weights, and the real SmolLM2.

Adapters are made by PEFT (`LoraConfig(init_lora_weights=False)`) at several ranks, with
rsLoRA, `all-linear` and rank / alpha patterns."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, LoRARequest, SamplingParams
from batchlm.engine.errors import InvalidParamError

from .lora_reference import make_adapter, peft_greedy

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def random_prompts(n: int, seed: int, lengths=(5, 40)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    return [
        torch.randint(3, 49000, (lo + (i * 7) % (hi - lo),), generator=gen).tolist()
        for i in range(n)
    ]


def block_edge_prompts(seed: int) -> list[list[int]]:
    """Prompts one token short of a full block (16): each needs a new block at its first
    generated token, so a small cache must preempt."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 49000, (n,), generator=gen).tolist() for n in (15, 31, 15, 31, 47, 15, 31)
    ]


def generate(llm: LLM, prompts, loras, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    for out, lora in zip(outs, loras, strict=True):
        assert out.lora_request == lora
    return [o.outputs[0].token_ids for o in outs]


def expected_tokens(base, prompts, loras, max_tokens=MAX_TOKENS) -> list[list[int]]:
    return [
        peft_greedy(base, lora.lora_path if lora else None, [p], max_tokens)[0]
        for p, lora in zip(prompts, loras, strict=True)
    ]


def record_step_adapters(llm: LLM) -> tuple[list[set[int]], list[str]]:
    """Each step's distinct adapter ids, and request ids in the order first scheduled."""
    scheduler = llm.llm_engine.scheduler
    original = scheduler.schedule
    steps: list[set[int]] = []
    first: list[str] = []

    def schedule(ahead: bool = False):
        out = original(ahead=ahead)
        steps.append({s.lora_request.lora_int_id for s in out.scheduled if s.lora_request})
        first.extend(s.request_id for s in out.scheduled if s.request_id not in first)
        return out

    scheduler.schedule = schedule
    return steps, first


@pytest.fixture(scope="module")
def llama(tiny_model_factory, tmp_path_factory):
    """The tiny Llama and three adapters: rank 8 on every projection, rank 4 rsLoRA on q, v
    and down, and rank 16 with rank and alpha patterns."""
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("llama-loras")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    paths = [
        make_adapter(base, root / "all-linear", r=8, seed=1),
        make_adapter(
            base, root / "rslora", r=4, target_modules=["q_proj", "v_proj", "down_proj"],
            use_rslora=True, seed=2,
        ),
        make_adapter(
            base, root / "patterns", r=16, target_modules=every, seed=3,
            rank_pattern={"down_proj": 4, "k_proj": 8}, alpha_pattern={"o_proj": 64},
        ),
    ]  # fmt: skip
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    return base, loras


SCHEDULES = {
    "ample": {},
    "preemption": {"num_gpu_blocks_override": 8},
    "chunked": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "async": {"async_scheduling": True},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mixed_adapters_and_base_prompts_match_peft(schedule, llama):
    """Three adapters and the base model in one call over two slots: every prompt's tokens
    are PEFT's for its adapter; no step runs more than two adapters, and requests start in
    the order they came (the adapters wait their turn)."""
    base, (a, b, c) = llama
    prompts = block_edge_prompts(seed=0)
    loras = [a, None, b, c, a, c, b]
    llm = LLM(
        str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128,
        **SCHEDULES[schedule],
    )  # fmt: skip
    steps, first = record_step_adapters(llm)
    assert generate(llm, prompts, loras) == expected_tokens(base, prompts, loras)
    assert max(len(s) for s in steps) == 2
    assert first == sorted(first, key=int)
    stats = llm.llm_engine.stats()
    if schedule == "preemption":
        assert stats.num_preemptions > 0
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.num_kv_blocks


def test_one_slot_serves_adapters_in_turn_and_the_host_cache_rereads(llama):
    """max_loras=1, max_cpu_loras=2 and three adapters: each step runs one adapter (beside
    base-model requests), the call completes, and an adapter dropped from the host cache is
    read again from its folder."""
    base, (a, b, c) = llama
    prompts = random_prompts(6, seed=1)
    loras = [a, b, None, c, a, b]
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=2, max_model_len=128)
    steps, first = record_step_adapters(llm)
    assert generate(llm, prompts, loras) == expected_tokens(base, prompts, loras)
    assert max(len(s) for s in steps) == 1
    assert first == sorted(first, key=int)
    cache = llm.llm_engine.runner.lora.cache
    assert len(cache.ids()) == 2 and cache.num_loads > 3


def test_prefix_cache_keeps_adapters_apart(llama):
    """One prompt of three full blocks under two adapters and the base model: three token
    sequences, no block shared across them; the same adapter again hits its own blocks."""
    base, (a, b, _) = llama
    prompt = random_prompts(1, seed=2, lengths=(50, 51))[0]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_model_len=128)
    engine = llm.llm_engine
    runs = {}
    for lora in (a, b, None):
        hits = engine.stats().prefix_cache_hits
        runs[lora] = generate(llm, [prompt], [lora])[0]
        assert engine.stats().prefix_cache_hits == hits  # nothing shared with earlier runs
        assert runs[lora] == expected_tokens(base, [prompt], [lora])[0]
    assert len({tuple(t) for t in runs.values()}) == 3
    hits = engine.stats().prefix_cache_hits
    assert generate(llm, [prompt], [a])[0] == runs[a]
    assert engine.stats().prefix_cache_hits - hits >= 48


@pytest.fixture(scope="module")
def phi3(tiny_model_factory, tmp_path_factory):
    """The tiny Phi-3 (q|k|v and gate|up fused in the checkpoint) and two adapters."""
    base = tiny_model_factory("phi3")
    root = tmp_path_factory.mktemp("phi3-loras")
    paths = [
        make_adapter(base, root / "all-linear", r=8, seed=4),
        make_adapter(
            base, root / "qkv-down", r=4, target_modules=["qkv_proj", "down_proj"], seed=5
        ),
    ]
    return base, [LoRARequest(f"phi3-{p.name}", 10 + i, str(p)) for i, p in enumerate(paths)]


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_two_ranks_split_the_adapters_with_their_layers(family, request):
    """tensor_parallel_size=2 over gloo: each rank holds its rows of B (per q / k / v, or of
    each part of a fused projection) and its columns of A (row-parallel o / down)."""
    base, loras = request.getfixturevalue(family)
    prompts = random_prompts(4, seed=3, lengths=(5, 30))
    per_prompt = [loras[0], None, loras[1], loras[0]]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_model_len=128, tensor_parallel_size=2)
    try:
        assert generate(llm, prompts, per_prompt) == expected_tokens(base, prompts, per_prompt)
    finally:
        llm.shutdown()


def test_fused_projections_match_peft(phi3):
    base, (a, b) = phi3
    prompts = random_prompts(5, seed=4, lengths=(5, 30))
    loras = [a, b, None, b, a]
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_model_len=128)
    assert generate(llm, prompts, loras) == expected_tokens(base, prompts, loras)


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_quantized_base_weights_with_an_adapter(method, llama, tmp_path):
    """quantization='fp8' (dequantised at load on CPU) or 'int8' (weight-only, converted in
    each matmul) with a float32 adapter: PEFT over the same dequantised base weights."""
    from transformers import AutoModelForCausalLM

    from batchlm.engine.models.layers.quant import FP8_DTYPE, dequantize, quantize_per_row

    base, (a, _, _) = llama
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.weight"):
                q = quantize_per_row(param.data, FP8_DTYPE if method == "fp8" else torch.int8)
                param.copy_(dequantize(q.values, q.scale, torch.float32))
    model.save_pretrained(tmp_path / f"{method}-reference")
    prompts = random_prompts(3, seed=5)
    loras = [a, None, a]
    llm = LLM(str(base), enable_lora=True, quantization=method, max_model_len=128)
    expected = expected_tokens(tmp_path / f"{method}-reference", prompts, loras)
    assert generate(llm, prompts, loras) == expected
    assert expected != expected_tokens(base, prompts, loras)  # the quantisation changed some


def test_smollm2_with_an_adapter_matches_peft(smollm2_dir, tmp_path):
    adapter = make_adapter(
        smollm2_dir, tmp_path / "smollm2-lora", r=8, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    lora = LoRARequest("smollm2", 1, str(adapter))
    llm = LLM(str(smollm2_dir), enable_lora=True, max_lora_rank=8, max_model_len=256)
    tok = llm.get_tokenizer()
    prompts = [tok(t)["input_ids"] for t in ("The capital of France is", "Write a haiku about")]
    loras = [lora, None]
    got = generate(
        llm, prompts, loras, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    assert got == expected_tokens(smollm2_dir, prompts, loras, max_tokens=8)
    assert got[0] != expected_tokens(smollm2_dir, prompts[:1], [None], max_tokens=8)[0]


def test_mixture_of_experts_attention_and_shared_expert(tmp_path):
    """Qwen2-MoE (q/k/v biases, a dense MLP layer, a shared expert beside the routed ones):
    an adapter on the attention and the dense and shared-expert MLPs matches PEFT; one that
    also adapts the shared expert's gate (`all-linear`) is refused naming it."""
    from .test_moe import hf_model

    base = tmp_path / "qwen2-moe"
    hf_model("qwen2-moe").save_pretrained(base)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoRARequest(
        "moe", 1, str(make_adapter(base, tmp_path / "moe", r=8, target_modules=projections))
    )
    gated = LoRARequest("gated", 2, str(make_adapter(base, tmp_path / "gated", r=8)))
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (6, 19, 11)]
    loras = [lora, None, lora]
    llm = LLM(str(base), enable_lora=True, max_model_len=128)
    assert generate(llm, prompts, loras) == expected_tokens(base, prompts, loras)
    with pytest.raises(
        InvalidParamError, match="'gated'.*gate 'model.layers.0.mlp.shared_expert_gate'"
    ):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, lora_request=gated)
