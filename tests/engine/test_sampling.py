"""Sampling: seeded reproducibility, the distribution actually sampled, stop conditions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.worker.sampler import Sampler, SamplingMetadata, row_argmax


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(str(tiny_model_factory("llama")), max_model_len=128, seed=0)


PROMPTS = ["red green blue", "one two three four five six", "the quick brown fox", "a"]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_request_is_independent_of_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=500, seed=7, max_tokens=12)
    alone = tokens(llm.generate([PROMPTS[1]], seeded, use_tqdm=False))[0]
    others = SamplingParams(temperature=0.9, max_tokens=20)
    # In a batch, first and last, next to unseeded and differently seeded requests.
    mixed = llm.generate(
        PROMPTS,
        [others, seeded, SamplingParams(temperature=1.0, seed=8, max_tokens=5), others],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    reordered = llm.generate(
        [PROMPTS[1], *PROMPTS], [seeded, others, others, others, others], use_tqdm=False
    )
    assert reordered[0].outputs[0].token_ids == alone
    # A different seed gives a different sequence (12 tokens from a 49k vocabulary).
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, top_k=500, seed=8, max_tokens=12)
    assert tokens(llm.generate([PROMPTS[1]], other_seed, use_tqdm=False))[0] != alone


def test_seeded_request_survives_preemption(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    ample = LLM(path, max_model_len=128)
    tight = LLM(path, max_model_len=128, num_gpu_blocks_override=8)
    prompts = [" ".join(["word"] * (10 + 7 * i)) for i in range(6)]
    expected = tokens(ample.generate(prompts, seeded, use_tqdm=False))
    assert tokens(tight.generate(prompts, seeded, use_tqdm=False)) == expected
    assert tight.llm_engine.stats().num_preemptions > 0


def test_greedy_ignores_seed_and_batch(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    b = tokens(llm.generate(PROMPTS[::-1], greedy, use_tqdm=False))[::-1]
    assert a == b


def _reference_probs(logits, temperature, top_k, top_p, min_p):
    """Straightforward per-row reference: top-k, renormalise, top-p, renormalise, min-p."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if top_k:
        order = order[:top_k]
    kept = probs[order] / probs[order].sum()
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for idx, p in zip(order, kept.tolist(), strict=True):
        keep[idx] = True
        mass += p
        if mass >= top_p:
            break
    p = torch.where(keep, probs, 0.0)
    p = p / p.sum()
    if min_p:
        p = torch.where(p >= min_p * p.max(), p, 0.0)
        p = p / p.sum()
    return p


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 6, 0.9, 0.0),
        (1.0, 0, 1.0, 0.2),
    ],
)
def test_sampler_draws_from_the_truncated_distribution(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    vocab, draws = 12, 40000
    logits = torch.randn(vocab) * 1.5
    expected = _reference_probs(logits, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    meta = SamplingMetadata.build([params] * draws, {}, vocab, torch.device("cpu"))
    sampler = Sampler(torch.Generator().manual_seed(1))
    sampled = sampler(logits.expand(draws, vocab).contiguous(), meta).sampled_token_ids
    counts = torch.bincount(sampled, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "sampled a token the rules exclude"
    support = expected > 0
    exp_counts = expected[support].double() * draws
    chi2 = ((counts[support] - exp_counts) ** 2 / exp_counts).sum().item()
    dof = int(support.sum()) - 1
    # chi-square critical value at p = 0.001 is below 3.3 * dof + 8 for dof <= 11
    assert chi2 < 3.3 * dof + 8, (chi2, dof)


def test_stop_strings_stop_tokens_and_lengths(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and base.stop_reason is None
    assert len(base.token_ids) == 12

    tok = llm.get_tokenizer()
    # Stop at the text of the 5th generated token.
    stop_text = tok.decode(base.token_ids[4:5]).strip() or tok.decode(base.token_ids[4:6])
    cut = base.text.find(stop_text)
    assert cut > 0
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop_text])
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop_text
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < 12

    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        stop=stop_text,
        include_stop_str_in_output=True,
    )
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[: cut + len(stop_text)]

    stop_id = base.token_ids[6]
    first = base.token_ids.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == tok.decode(base.token_ids[:first], skip_special_tokens=True)


def test_outputs_in_input_order_with_logprobs(llm):
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4, logprobs=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=True)
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        c = o.outputs[0]
        assert o.finished and len(c.logprobs) == len(c.token_ids)
        for token_id, entry in zip(c.token_ids, c.logprobs, strict=True):
            assert token_id in entry and 3 <= len(entry) <= 4
            ranks = sorted(lp.rank for t, lp in entry.items() if t != token_id or lp.rank <= 3)
            assert ranks[:3] == [1, 2, 3]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_straddling_a_token_boundary(llm, include):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = llm.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    # A stop string made of the end of token k and the start of token k + 1 (as decoded in
    # context), occurring nowhere earlier: no single token contains it.
    for k in range(2, 10):
        before, upto, after = (tok.decode(base.token_ids[:i]) for i in (k, k + 1, k + 2))
        if len(upto) - len(before) < 2 or len(after) - len(upto) < 2:
            continue
        stop = after[len(upto) - 2 : len(upto) + 2]
        if base.text.find(stop) == len(upto) - 2:
            break
    else:
        pytest.fail("no token boundary to straddle in the reference output")
    cut = len(upto) - 2
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[: cut + (len(stop) if include else 0)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids[: k + 2]


def test_argmax_only_steps_read_logits_in_the_model_dtype(tiny_model_factory):
    """Greedy rows with nothing else reading the logits take the LM head's bf16 output
    as is; anything that reads values (logprobs, penalties, sampling) gets float32."""
    cpu = torch.device("cpu")
    greedy = SamplingParams(temperature=0.0)

    def meta(*params):
        return SamplingMetadata.build(
            list(params), {}, 50, cpu, output_token_ids=[[]] * len(params)
        )

    assert meta(greedy, greedy).is_argmax_only
    assert not meta(greedy, SamplingParams(temperature=0.7)).is_argmax_only
    assert not meta(greedy, SamplingParams(temperature=0.0, logprobs=2)).is_argmax_only
    assert not meta(SamplingParams(temperature=0.0, repetition_penalty=1.2)).is_argmax_only

    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", max_model_len=128, seed=0)
    try:
        prompts = ["red green blue", "one two three four five six", "the quick brown fox"]
        fast = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
        # With logprobs every logit is upcast first: the argmax is the same token.
        full = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=1), use_tqdm=False
        )
        model = llm.llm_engine.runner.model
        hidden = torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16)
        raw = model.compute_logits(hidden, upcast=False)
        assert raw.dtype == torch.bfloat16
        assert torch.equal(raw.float(), model.compute_logits(hidden))
    finally:
        llm.shutdown()
    assert tokens(fast) == tokens(full)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("width", [128256, 151936, 49152, 32000, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_argmax_is_the_first_maximum(width, dtype, device):
    """The two-pass argmax (few rows, wide vocabularies) against torch.argmax, with the
    maximum repeated inside a chunk and across chunks, and NaN rows."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=gen).to(dtype).to(device)
    x[1, [5, 7, width - 1]] = 9.0  # ties inside the first chunk and in the last
    x[2, [width - 1, width // 2]] = 9.0  # ties in two chunks: the earlier index wins
    x[3, width // 3] = float("nan")
    x[4] = 0.0  # all equal: index 0
    for rows in (x, x[:1], x[2:3], x.to(torch.float32)[:, : width - 3]):
        assert torch.equal(row_argmax(rows), rows.argmax(dim=-1))
    wide = torch.cat([x, x], dim=1)[:, :width]  # a slice of wider rows (TP gathered logits)
    assert torch.equal(row_argmax(wide), wide.argmax(dim=-1))


@pytest.mark.parametrize("min_p", [0.0, 0.05])
@pytest.mark.parametrize("mask", [False, True])
def test_skipped_passes_change_no_token_and_no_mask(min_p, mask):
    """A batch with no greedy row skips the greedy argmax (and the surviving-token mask when
    it is not asked for): the tokens and masks are those of the sampler running every pass,
    from the same generator state."""
    torch.manual_seed(0)
    vocab = 64
    params = [SamplingParams(temperature=t, min_p=min_p) for t in (0.6, 1.0, 1.4, 0.3)] * 8
    logits = torch.randn(len(params), vocab) * 2
    meta = SamplingMetadata.build(params, {}, vocab, torch.device("cpu"), return_sampling_mask=mask)
    assert not meta.any_greedy
    every_pass = dataclasses.replace(meta, any_greedy=True)
    got = Sampler(torch.Generator().manual_seed(3))(logits, meta)
    expected = Sampler(torch.Generator().manual_seed(3))(logits, every_pass)
    assert torch.equal(got.sampled_token_ids, expected.sampled_token_ids)
    if mask:
        assert torch.equal(got.sampling_mask_bits, expected.sampling_mask_bits)
    else:
        assert got.sampling_mask_bits is None and expected.sampling_mask_bits is None
