"""`batch_invariant=True`: a request's tokens and logprobs do not depend on what runs
beside it. For each of the four main decoder families (Llama, Mistral with a sliding
window, Qwen2, Qwen3), one seeded sampled request and one greedy request are run alone,
then inside a batch of 32 random others, in reversed order, with a token budget that
chunks every prompt, and again after their prompts are in the prefix cache: tokens and
every logprob bitwise equal.

On the CPU the mode matters too: PyTorch's CPU matmul sums a row in another order at
another number of rows, and the reference attention groups and pads sequences by the
batch, so without the mode a request's logprobs change with its batch
(`test_without_the_mode_logprobs_depend_on_the_batch`).
"""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

FAMILIES = ["llama", "mistral-window", "qwen2", "qwen3"]
MAX_TOKENS = 10
NUM_OTHERS = 32


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49000, (length,), generator=gen).tolist()


TARGETS = [
    # A seeded sampled request and a greedy one, prompts over several KV blocks.
    ({"prompt_token_ids": _prompt(45, 1)}, dict(temperature=0.9, top_p=0.95, seed=7)),
    ({"prompt_token_ids": _prompt(37, 2)}, dict(temperature=0.0)),
]


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, **kwargs)


def _others(n: int = NUM_OTHERS) -> list[tuple[dict, SamplingParams]]:
    """n random requests: prompts of 3 to 60 tokens, greedy, seeded or unseeded sampling."""
    gen = torch.Generator().manual_seed(99)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 61, (1,), generator=gen))
        kind = i % 3
        params = (
            _params(temperature=0.0)
            if kind == 0
            else _params(temperature=0.8, seed=1000 + i)
            if kind == 1
            else _params(temperature=1.0, top_k=20)
        )
        out.append(({"prompt_token_ids": _prompt(length, 500 + i)}, params))
    return out


def _results(llm: LLM, requests: list[tuple[dict, SamplingParams]]) -> list[tuple]:
    """Each request's (token ids, logprobs as {token: value} per position)."""
    prompts = [r[0] for r in requests]
    params = [r[1] for r in requests]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def _targets() -> list[tuple[dict, SamplingParams]]:
    return [(prompt, _params(**kw)) for prompt, kw in TARGETS]


def _llm(path, batch_invariant: bool = True, **kwargs) -> LLM:
    return LLM(str(path), seed=0, max_model_len=128, batch_invariant=batch_invariant, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_alone_equals_it_inside_any_batch(family, tiny_model_factory):
    path = tiny_model_factory(family)
    targets, others = _targets(), _others()
    n = len(targets)

    llm = _llm(path, enable_prefix_caching=False)
    alone = _results(llm, targets)
    batch = targets[:1] + others[: NUM_OTHERS // 2] + targets[1:] + others[NUM_OTHERS // 2 :]
    inside = _results(llm, batch)
    inside = [inside[0], inside[1 + NUM_OTHERS // 2]]
    reversed_ = _results(llm, batch[::-1])
    reversed_ = [reversed_[-1], reversed_[-2 - NUM_OTHERS // 2]]
    llm.shutdown()
    assert inside == alone, "inside a batch of 32 others"
    assert reversed_ == alone, "in reversed order"

    # Every prompt chunked (8 tokens a step, decode rows of others beside the chunks),
    # then the targets again, their prompts now read from the prefix cache.
    llm = _llm(path, enable_prefix_caching=True, max_num_batched_tokens=8, max_num_seqs=8)
    chunked = _results(llm, others[:8] + targets + others[8:16])[8 : 8 + n]
    outs = llm.generate([t[0] for t in targets], [t[1] for t in targets], use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outs), "the prompts came from the cache"
    cached = _results(llm, targets)
    llm.shutdown()
    assert chunked == alone, "chunked prompts"
    assert cached == alone, "after a prefix-cache hit"


def test_without_the_mode_logprobs_depend_on_the_batch(tiny_model_factory):
    """The property above does not come for free on the CPU: the same comparison without
    the mode finds a difference (so the tests above can fail)."""
    path = tiny_model_factory("llama")
    targets, others = _targets(), _others()
    llm = _llm(path, batch_invariant=False, enable_prefix_caching=False)
    alone = _results(llm, targets)
    inside = _results(llm, targets + others)[: len(targets)]
    llm.shutdown()
    assert inside != alone


def test_the_option_is_checked(tiny_model_factory):
    from batchlm.engine.errors import InvalidParamError

    with pytest.raises(InvalidParamError, match="batch_invariant='yes' must be True or False"):
        _llm(tiny_model_factory("llama"), batch_invariant="yes")
