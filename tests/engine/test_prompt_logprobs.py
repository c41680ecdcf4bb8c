"""prompt_logprobs equal Hugging Face's log-softmax over the prompt, whatever chunked
prefill, prefix caching and preemption do to the schedule."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

from .hf_reference import hf_greedy, load_hf
from .probes import record_partial_prefills

ATOL = 1e-4
WORDS = (
    "river stone glass winter orange planet quiet signal market garden thunder paper "
    "silver engine forest window lantern castle ribbon copper meadow violin harbor"
).split()


@pytest.fixture(scope="module")
def path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def make_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of exactly the given token counts."""
    prompts = []
    for i, n in enumerate(lengths):
        text = " ".join(WORDS[(i + 5 * j) % len(WORDS)] for j in range(n))
        prompts.append(tokenizer(text)["input_ids"][:n])
        assert len(prompts[-1]) == n
    return prompts


@torch.inference_mode()
def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """`[len(prompt) - 1, vocab]`: row j is the distribution of prompt token j + 1."""
    logits = load_hf(path)(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check(path: str, prompt: list[int], got, k: int) -> None:
    """`got` (RequestOutput.prompt_logprobs) against HF, tolerant of near ties."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = hf_prompt_logprobs(path, prompt)
    for pos in range(1, len(prompt)):
        row, token, entry = ref[pos - 1], prompt[pos], got[pos]
        assert token in entry
        assert len(entry) in (k, k + 1) if k else len(entry) == 1
        lp = entry[token]
        assert abs(lp.logprob - row[token].item()) < ATOL, (pos, lp, row[token])
        # The rank counts strictly better tokens; near ties may land either way.
        lo = int((row > row[token] + ATOL).sum()) + 1
        hi = int((row > row[token] - ATOL).sum()) + 1
        assert lo <= lp.rank <= hi, (pos, lp.rank, lo, hi)
        top = sorted(
            (e for t, e in entry.items() if t != token or e.rank <= k), key=lambda e: e.rank
        )
        assert [e.rank for e in top] == list(range(1, k + 1))
        torch.testing.assert_close(
            torch.tensor([e.logprob for e in top]), row.topk(k).values, atol=ATOL, rtol=0
        )
        for t, e in entry.items():
            assert abs(e.logprob - row[t].item()) < ATOL


def test_prompt_logprobs_with_chunked_prefill(path):
    llm = LLM(path, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, seed=0)
    prompts = make_prompts(llm.get_tokenizer(), [1, 2, 17, 40, 63, 30])
    partial = record_partial_prefills(llm)
    ks = [0, 3, 5, 0, 2, 5]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=k)
        for k in ks
    ]
    # A request without prompt logprobs in the same batch gets none.
    params[3] = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert partial, "no prompt was chunked"
    for prompt, out, k, p in zip(prompts, outs, ks, params, strict=True):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check(path, prompt, out.prompt_logprobs, k)
    # Scoring the prompt does not disturb generation.
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 6)


def test_prompt_logprobs_bypass_the_prefix_cache(path):
    llm = LLM(path, max_model_len=128, enable_prefix_caching=True, seed=0)
    prompts = make_prompts(llm.get_tokenizer(), [50, 37])
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in again), "the prompts are cached"

    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.num_cached_tokens == 0
        check(path, prompt, out.prompt_logprobs, 4)


def test_prompt_logprobs_survive_preemption(path):
    # 8 blocks of 16 tokens for four ~40-token prompts growing by 30 tokens: the scheduler
    # preempts and recomputes prompts whose logprobs were already sent.
    llm = LLM(path, max_model_len=128, num_gpu_blocks_override=8, max_num_batched_tokens=32)
    prompts = make_prompts(llm.get_tokenizer(), [40, 41, 42, 43])
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        check(path, prompt, out.prompt_logprobs, 2)


def test_prompt_logprobs_start_scores_the_tail_and_reuses_the_cached_head(path):
    """Four prompts sharing a 40-token head, scored from position 40 on: the head's blocks
    come from the prefix cache (in the same step as the first prompt computes them), the
    scored positions equal HF's, and the earlier ones are None."""
    llm = LLM(path, max_model_len=128, enable_prefix_caching=True, seed=0)
    tokenizer = llm.get_tokenizer()
    head = make_prompts(tokenizer, [40])[0]
    tails = make_prompts(tokenizer, [3, 5, 1, 7])
    prompts = [head + tail for tail in tails]
    params = SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=2, prompt_logprobs_start=len(head)
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # The head's last token is computed by every request (its logits score the first
    # tail token): 32 of its 40 tokens are whole blocks that the cache may serve.
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[: len(head)] == [None] * len(head)
        ref = hf_prompt_logprobs(path, prompt)
        for pos in range(len(head), len(prompt)):
            entry = got[pos][prompt[pos]]
            assert abs(entry.logprob - ref[pos - 1, prompt[pos]].item()) < ATOL
            assert entry.rank == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1


def test_prompt_logprobs_start_past_the_prompt_scores_nothing(path):
    llm = LLM(path, max_model_len=64, seed=0)
    prompt = make_prompts(llm.get_tokenizer(), [5])[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=9)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out.prompt_logprobs == [None] * 5
    with pytest.raises(ValueError, match="prompt_logprobs_start=-1 must be"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)


def test_detokenize_false_leaves_logprob_candidates_undecoded(path):
    llm = LLM(path, max_model_len=64, seed=0)
    prompt = make_prompts(llm.get_tokenizer(), [6])[0]
    outs = {
        flag: llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(
                max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=1, detokenize=flag
            ),
            use_tqdm=False,
        )[0]
        for flag in (True, False)
    }
    plain, raw = outs[True], outs[False]
    assert raw.outputs[0].text == "" and raw.outputs[0].token_ids == plain.outputs[0].token_ids
    for a, b in zip(
        raw.prompt_logprobs[1:] + raw.outputs[0].logprobs,
        plain.prompt_logprobs[1:] + plain.outputs[0].logprobs,
        strict=True,
    ):
        assert {t: (e.logprob, e.rank) for t, e in a.items()} == {
            t: (e.logprob, e.rank) for t, e in b.items()
        }
        assert all(e.decoded_token is None for e in a.values())
        assert all(e.decoded_token is not None for e in b.values())
