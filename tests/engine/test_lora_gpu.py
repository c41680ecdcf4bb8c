"""LoRA on a GPU: bfloat16 agreement with PEFT (the Triton kernels: the fused one-launch path
at batch 1, shrink + expand at larger batches, CUDA graphs), and CUDA graphs against eager
with adapters.

The model is a small random Llama (no tokenizer: token-id prompts), its embedding drawn wide
enough that the next-token distribution has a clear top."""

from __future__ import annotations

import gc

import pytest
import torch

from batchlm.engine import LLM, LoRARequest, SamplingParams

from .greedy import assert_same_greedy
from .lora_reference import make_adapter

pytestmark = pytest.mark.gpu

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)
LOGPROB_ATOL = 0.5
"""Per logprob: bfloat16 on both sides, other kernels and summation orders."""
MEAN_ATOL = 0.12
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("lora-gpu")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.1)
    model.save_pretrained(root / "base")
    base = root / "base"
    loras = [
        LoRARequest("all-16", 1, str(make_adapter(base, root / "a", r=16, seed=1))),
        LoRARequest("qv-8", 2, str(make_adapter(base, root / "b", r=8, seed=2,
                                                target_modules=["q_proj", "v_proj"]))),
        LoRARequest("rs-4", 3, str(make_adapter(base, root / "c", r=4, seed=3, use_rslora=True))),
    ]  # fmt: skip
    return base, loras


def prompts(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(3, 4096, (5 + 13 * i % 90,), generator=gen).tolist()}
        for i in range(n)
    ]


def free(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@torch.inference_mode()
def assert_close_to_peft(base, outputs, loras) -> None:
    """On batchlm's own continuation, PEFT (bfloat16, CUDA) agrees at every position: the
    chosen token is PEFT's argmax or within LOGPROB_ATOL of it, and batchlm's top-5
    logprobs are PEFT's within LOGPROB_ATOL (MEAN_ATOL on average)."""
    import peft
    from transformers import AutoModelForCausalLM

    models = {}
    diffs = []
    for out, lora in zip(outputs, loras, strict=True):
        key = lora.lora_path if lora else None
        if key not in models:
            hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).cuda()
            models[key] = (peft.PeftModel.from_pretrained(hf, key) if key else hf).eval()
        completion = out.outputs[0]
        ids = out.prompt_token_ids + completion.token_ids
        logits = models[key](input_ids=torch.tensor([ids], device="cuda")).logits[0].float()
        reference = torch.log_softmax(logits, -1)[len(out.prompt_token_ids) - 1 : -1].cpu()
        for position, (chosen, top) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            row = reference[position]
            assert row.max() - row[chosen] <= LOGPROB_ATOL, (lora, position)
            for token_id, lp in top.items():
                diff = abs(lp.logprob - row[token_id].item())
                assert diff <= LOGPROB_ATOL, (lora, position, token_id, diff)
                diffs.append(diff)
    assert sum(diffs) / len(diffs) <= MEAN_ATOL


def test_bf16_tokens_agree_with_peft(model_and_adapters):
    base, (a, b, c) = model_and_adapters
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    llm = LLM(str(base), dtype="bfloat16", skip_tokenizer_init=True, enable_lora=True,
              max_loras=2, max_lora_rank=16, gpu_memory_utilization=0.3)  # fmt: skip
    try:
        graphs = llm.llm_engine.runner.decode_graphs
        batch = prompts(12, seed=0)
        loras = [a, b, None, c] * 3  # three adapters over two slots, and the base model
        outs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
        assert_close_to_peft(base, outs, loras)
        one = llm.generate(batch[:1], params, use_tqdm=False, lora_request=b)  # fused kernel
        assert_close_to_peft(base, one, [b])
        assert graphs.num_lora_replays > 0
    finally:
        free(llm)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    ("dtype", "speculative"),
    [("float32", None), ("bfloat16", None), ("bfloat16", NGRAM)],
)
def test_cuda_graphs_match_eager_with_adapters(dtype, speculative, model_and_adapters):
    """Rounds of 1, 3, 5 and 17 requests (fused and tiled kernels, padded graphs; with
    n-gram speculation, verification graphs of 4 tokens per row) with adapters and
    base-model prompts, then a round without adapters (the plain graphs)."""
    base, (a, b, c) = model_and_adapters
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    rounds = [
        (prompts(n, seed=n), [[a, b, None, c][i % 4] for i in range(n)]) for n in (1, 3, 5, 17)
    ]
    if speculative:  # passages that repeat, so that n-gram lookup proposes
        rounds = [
            ([{"prompt_token_ids": p["prompt_token_ids"][:9] * 3} for p in ps], ls)
            for ps, ls in rounds
        ]
    results = {}
    for eager in (True, False):
        llm = LLM(str(base), dtype=dtype, skip_tokenizer_init=True, enable_lora=True,
                  max_loras=3, enforce_eager=eager, gpu_memory_utilization=0.3,
                  speculative_config=speculative)  # fmt: skip
        try:
            graphs = llm.llm_engine.runner.decode_graphs
            outs = [
                llm.generate(batch, params, use_tqdm=False, lora_request=loras)
                for batch, loras in rounds
            ]
            if graphs is not None:
                lora_replays, replays = graphs.num_lora_replays, graphs.num_replays
                assert lora_replays > 0
                assert graphs.num_row_replays > 0 or not speculative
            outs.append(llm.generate(prompts(4, seed=9), params, use_tqdm=False))
            if graphs is not None:
                assert graphs.num_lora_replays == lora_replays
                assert graphs.num_replays > replays
            results[eager] = outs
        finally:
            free(llm)
    for graph_round, eager_round in zip(results[False], results[True], strict=True):
        assert_same_greedy(graph_round, eager_round, dtype)
