"""SamplingParams validation, and every logits processor (penalties, logit_bias,
allowed_token_ids, bad_words, min_tokens) and the sampling mask checked against an
independent computation on Hugging Face logits, step by step under greedy decoding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from batchlm.engine import LLM, InvalidParamError, SamplingParams
from batchlm.engine.worker.sampler import Sampler, SamplingMetadata, apply_logits_processing

from .hf_reference import load_hf

PROMPTS = ["one two three four five six", "the quick brown fox", "red green blue", "a"]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    return LLM(path, max_model_len=128, seed=0, return_sampling_mask=True)


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(path, prompt_ids) -> list[list[int]]:
    """Greedy tokens without any processing."""
    return [reference_greedy(path, p, identity) for p in prompt_ids]


@torch.inference_mode()
def hf_next_logits(path: str, ids: list[int]) -> torch.Tensor:
    """`[vocab]` float32 logits of the token after `ids`."""
    return load_hf(path)(torch.tensor([ids])).logits[0, -1].float()


def reference_greedy(path, prompt, process, num_tokens=NUM_TOKENS, stop_ids=()):
    """Greedy decoding on HF logits, with `process(logits, prompt, output)` applied first."""
    out: list[int] = []
    for _ in range(num_tokens):
        logits = process(hf_next_logits(path, prompt + out).clone(), prompt, out)
        out.append(int(logits.argmax()))
        if out[-1] in stop_ids:
            break
    return out


def identity(logits, prompt, out):
    return logits


def penalize(logits, prompt, out, presence=0.0, frequency=0.0, repetition=1.0):
    """The HF / vLLM formulas, one token at a time."""
    for t in set(prompt) | set(out):
        value = logits[t].item()
        logits[t] = value / repetition if value > 0 else value * repetition
    for t, count in Counter(out).items():
        logits[t] -= frequency * count + presence
    return logits


def engine_tokens(llm, prompt_ids, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, **kwargs)


@pytest.mark.parametrize(
    "penalties",
    [
        dict(presence=2.0),
        dict(presence=-2.0),
        dict(frequency=1.5),
        dict(frequency=-1.0),
        dict(repetition=1.5),
        dict(repetition=0.4),
        dict(repetition=1.3, frequency=0.5, presence=-0.5),
    ],
)
def test_penalties_match_reference(llm, path, prompt_ids, plain, penalties):
    params = greedy(
        presence_penalty=penalties.get("presence", 0.0),
        frequency_penalty=penalties.get("frequency", 0.0),
        repetition_penalty=penalties.get("repetition", 1.0),
    )
    # Rows with and without penalties in one batch (the penalty tensors cover a subset).
    got = engine_tokens(llm, prompt_ids, [params, greedy(), params, params])
    expected = [
        plain[i]
        if i == 1
        else reference_greedy(path, prompt, lambda lg, p, o: penalize(lg, p, o, **penalties))
        for i, prompt in enumerate(prompt_ids)
    ]
    assert got == expected
    assert any(e != b for e, b in zip(expected, plain, strict=True)), "penalty had no effect"


def test_logit_bias_matches_reference(llm, path, prompt_ids, plain):
    plain = [out[0] for out in plain]
    boosts = {t: b for t, b in ((1453, 0.5), (41086, 1.0), (5331, 0.3)) if t not in plain[:2]}
    # -1e6 is clamped to -100; string keys are token ids too.
    params = greedy(logit_bias={plain[0]: -1e6, str(plain[1]): -50.0, **boosts})
    assert params.logit_bias == {plain[0]: -100.0, plain[1]: -50.0, **boosts}

    def process(logits, prompt, out):
        for t, b in {plain[0]: -100.0, plain[1]: -50.0, **boosts}.items():
            logits[t] += b
        return logits

    expected = [reference_greedy(path, p, process) for p in prompt_ids]
    assert engine_tokens(llm, prompt_ids, params) == expected
    assert expected[0][0] != plain[0] and expected[1][0] != plain[1]


def test_allowed_token_ids_match_reference(llm, path, prompt_ids, plain):
    rng = np.random.default_rng(0)
    allowed = sorted({int(t) for t in rng.integers(0, 49152, size=40)} | {29284})
    params = greedy(allowed_token_ids=allowed)

    def process(logits, prompt, out):
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    expected = [reference_greedy(path, p, process) for p in prompt_ids]
    got = engine_tokens(llm, prompt_ids, [params, greedy(), params, params])
    assert got[0] == expected[0] and got[2:] == expected[2:]
    assert got[1] == plain[1]
    assert all(t in allowed for i in (0, 2, 3) for t in got[i])


def _word_forms(tok, word: str) -> list[list[int]]:
    """The bad-word rule written out: the word as is, plus its spaced form when that is a
    different token sequence of the same length."""
    plain = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    forms = [plain]
    if spaced[0] != plain[0] and len(spaced) == len(plain):
        forms.append(spaced)
    return forms


def test_bad_words_match_reference(llm, path, prompt_ids, plain):
    tok = llm.get_tokenizer()
    # A one-token word the model generates, and a two-token word whose tokens it generates
    # in a row (so the ban only bites after the first token).
    single = next(
        tok.decode([t])
        for out in plain
        for t in out
        if tok.decode([t]).strip() and [t] in _word_forms(tok, tok.decode([t]))
    )
    double = next(
        tok.decode([a, b])
        for out in plain
        for a, b in zip(out[1:], out[2:], strict=False)
        if [a, b] in _word_forms(tok, tok.decode([a, b]))
    )
    params = greedy(bad_words=[single, double])
    params.resolve_bad_words(tok)
    forms = _word_forms(tok, single) + _word_forms(tok, double)
    assert params.bad_words_token_ids == forms

    def process(logits, prompt, out):
        for ids in forms:
            if len(ids) == 1 or (len(out) >= len(ids) - 1 and out[-(len(ids) - 1) :] == ids[:-1]):
                logits[ids[-1]] = float("-inf")
        return logits

    expected = [reference_greedy(path, p, process) for p in prompt_ids]
    assert engine_tokens(llm, prompt_ids, params) == expected
    assert expected != plain
    for out in expected:
        for ids in forms:
            assert all(out[i : i + len(ids)] != ids for i in range(len(out)))


def test_min_tokens_delays_eos_and_stop_tokens(llm, path, prompt_ids):
    eos = llm.get_tokenizer().eos_token_id
    # EOS is the argmax at every step once biased: without min_tokens it ends at once.
    first = llm.generate(
        [{"prompt_token_ids": prompt_ids[0]}],
        SamplingParams(temperature=0.0, logit_bias={eos: 50.0}),
        use_tqdm=False,
    )[0].outputs[0]
    assert first.token_ids == [eos] and first.finish_reason == "stop"

    def process(min_tokens, banned, bias):
        def fn(logits, prompt, out):
            for t, b in bias.items():
                logits[t] += b
            if len(out) < min_tokens:
                logits[banned] = float("-inf")
            return logits

        return fn

    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, logit_bias={eos: 50.0})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    for prompt, out in zip(prompt_ids, outs, strict=True):
        c = out.outputs[0]
        expected = reference_greedy(
            path, prompt, process(3, [eos], {eos: 50.0}), num_tokens=10, stop_ids=(eos,)
        )
        assert c.token_ids == expected and len(expected) == 4 and expected[-1] == eos
        assert c.finish_reason == "stop"

    # A biased stop token is held back the same way, and ends the completion after.
    stop_id = 1453
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        min_tokens=2,
        stop_token_ids=[stop_id],
        logit_bias={stop_id: 40.0},
    )
    c = llm.generate([{"prompt_token_ids": prompt_ids[1]}], params, use_tqdm=False)[0].outputs[0]
    expected = reference_greedy(
        path,
        prompt_ids[1],
        process(2, [stop_id, eos], {stop_id: 40.0}),
        num_tokens=10,
        stop_ids=(stop_id, eos),
    )
    assert c.token_ids == expected == [*expected[:2], stop_id]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id


# ---- sampling mask ----------------------------------------------------------------------


def test_sampling_mask_greedy_is_the_argmax(llm, prompt_ids):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy(), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.sampling_mask == [[t] for t in c.token_ids]


def test_sampling_mask_top_k_is_the_k_highest(llm, path, prompt_ids):
    sampled = SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=6, ignore_eos=True)
    # A greedy row in the same batch keeps its one-token mask.
    params = [sampled, greedy(), sampled, sampled]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    for i, (prompt, o) in enumerate(zip(prompt_ids, outs, strict=True)):
        c = o.outputs[0]
        assert len(c.sampling_mask) == len(c.token_ids)
        for step, (token, mask) in enumerate(zip(c.token_ids, c.sampling_mask, strict=True)):
            assert token in mask and mask == sorted(mask)
            if i == 1:
                assert mask == [token]
                continue
            logits = hf_next_logits(path, prompt + c.token_ids[:step])
            top = logits.topk(6)
            if top.values[4] - top.values[5] > 1e-4:  # skip a near tie at the boundary
                assert mask == sorted(top.indices[:5].tolist())


def test_sampling_mask_top_p_and_min_p_match_reference(llm, path, prompt_ids):
    # A low temperature makes the distribution peaked, so the sets stay small.
    cases = [
        dict(temperature=0.1, top_p=0.8),
        dict(temperature=0.1, min_p=0.2),
        dict(temperature=0.2, top_k=8, top_p=0.9),
    ]
    for case in cases:
        params = SamplingParams(seed=5, max_tokens=5, ignore_eos=True, **case)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        for prompt, o in zip(prompt_ids, outs, strict=True):
            c = o.outputs[0]
            for step, (token, mask) in enumerate(zip(c.token_ids, c.sampling_mask, strict=True)):
                assert token in mask
                logits = hf_next_logits(path, prompt + c.token_ids[:step])
                sure, unsure = _reference_keep(logits, **case)
                assert sure <= set(mask) <= sure | unsure, (case, step)


def _reference_keep(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, tol=1e-4):
    """Tokens surely kept, and tokens within `tol` of a boundary (either way is right).

    Top-k, renormalise, then keep each token whose strictly-better mass is below top_p,
    then drop tokens below min_p times the best probability.
    """
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    if top_k:
        sorted_probs, order = sorted_probs[:top_k], order[:top_k]
    kept = sorted_probs / sorted_probs.sum()
    mass_before = kept.cumsum(0) - kept
    sure = mass_before < top_p - tol
    unsure = ~sure & (mass_before < top_p + tol)
    sure[0], unsure[0] = True, False
    if min_p:
        ratio = sorted_probs / sorted_probs[0]
        near = (ratio - min_p).abs() < tol * min_p
        unsure |= sure & near
        sure &= (ratio >= min_p) & ~near
    return set(order[sure].tolist()), set(order[unsure].tolist())


def test_sampling_mask_follows_allowed_bad_words_and_min_tokens(llm, prompt_ids):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4, min_tokens=4, bad_words=["bard"])
    params.resolve_bad_words(tok)
    banned = {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
    assert banned
    allowed = sorted({*range(1000, 1040), *banned, eos})
    params.allowed_token_ids = allowed
    c = llm.generate([{"prompt_token_ids": prompt_ids[0]}], params, use_tqdm=False)[0].outputs[0]
    # Every allowed token survives (no top-k / top-p), except bad words and, below
    # min_tokens, EOS. A -100 bias leaves a finite logit, so it does not filter.
    assert c.sampling_mask == [sorted(set(allowed) - banned - {eos})] * 4


def test_sampler_mask_matches_reference_on_synthetic_logits():
    torch.manual_seed(0)
    vocab = 37  # not a multiple of 8: exercises the bit padding
    logits = torch.randn(6, vocab) * 2
    params = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=1.3, top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
    ]
    meta = SamplingMetadata.build(params, {}, vocab, torch.device("cpu"), return_sampling_mask=True)
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    bits = np.unpackbits(out.sampling_mask_bits.numpy(), axis=1, bitorder="little")[:, :vocab]
    for row, p in enumerate(params):
        got = set(np.flatnonzero(bits[row]).tolist())
        if p.is_greedy:
            assert got == {int(logits[row].argmax())}
            continue
        sure, unsure = _reference_keep(logits[row], p.temperature, p.top_k, p.top_p, p.min_p)
        assert sure <= got <= sure | unsure, row
        assert int(out.sampled_token_ids[row]) in got


# ---- processors on synthetic logits -----------------------------------------------------


def test_processing_is_skipped_when_no_row_uses_it():
    params = [SamplingParams(), SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5)]
    meta = SamplingMetadata.build(
        params,
        {},
        50,
        torch.device("cpu"),
        output_token_ids=[[1, 2], [3, 4]],
        eos_token_ids=[(2,), (2,)],
    )
    assert meta.processing is None  # min_tokens already reached
    meta = SamplingMetadata.build(
        params,
        {},
        50,
        torch.device("cpu"),
        output_token_ids=[[1, 2], [3]],
        eos_token_ids=[(2,), (2,)],
    )
    assert meta.processing is not None and meta.processing.penalty_rows is None


def test_processing_matches_per_row_reference_on_synthetic_logits():
    torch.manual_seed(1)
    vocab = 30
    logits = torch.randn(5, vocab) * 3  # positive and negative logits
    prompts = [[1, 2, 3, 3], [4, 5], [6], [7, 8, 9], [10]]
    outputs = [[2, 2, 11, 12], [5, 13, 13, 13], [], [14, 15], [16, 17]]
    params = [
        SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3),
        SamplingParams(repetition_penalty=0.6, logit_bias={0: 3.0, 13: -1.0}),
        SamplingParams(allowed_token_ids=[3, 4, 5], min_tokens=2, stop_token_ids=[4]),
        SamplingParams(),
        SamplingParams(bad_words=["x"], frequency_penalty=-2.0),
    ]
    params[4].bad_words_token_ids = [[20], [17, 21], [16, 22], [99, 17, 23]]
    eos = [(29,), (29,), (5,), (29,), (29,)]
    meta = SamplingMetadata.build(
        params,
        {},
        vocab,
        torch.device("cpu"),
        output_token_ids=outputs,
        prompt_token_ids=prompts,
        eos_token_ids=eos,
    )
    got = apply_logits_processing(logits.clone(), meta.processing)

    expected = logits.clone()
    expected[0] = penalize(expected[0], prompts[0], outputs[0], -0.3, 0.4, 1.7)
    expected[1] = penalize(expected[1], prompts[1], outputs[1], repetition=0.6)
    expected[1, 0] += 3.0
    expected[1, 13] -= 1.0
    row2 = torch.full((vocab,), float("-inf"))
    row2[[3, 4, 5]] = logits[2, [3, 4, 5]]
    row2[[4, 5]] = float("-inf")  # stop token and EOS, below min_tokens
    expected[2] = row2
    expected[4] = penalize(expected[4], prompts[4], outputs[4], frequency=-2.0)
    expected[4, [20, 21]] = float("-inf")  # one-token word; [17, 21] completes after 17
    torch.testing.assert_close(got, expected)


# ---- validation ---------------------------------------------------------------------------

BAD_VALUES = [
    ("n", 0),
    ("n", 1.5),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", float("nan")),
    ("presence_penalty", "1"),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", float("inf")),
    ("frequency_penalty", True),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("repetition_penalty", None),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", 1.5),
    ("min_p", -0.1),
    ("seed", 1.5),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 1.5),
    ("prompt_logprobs", "2"),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 2.5),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"x": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {1: "a"}),
    ("logit_bias", {1: float("nan")}),
    ("logit_bias", {True: 1.0}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("allowed_token_ids", ["a"]),
    ("allowed_token_ids", [1.5]),
    ("allowed_token_ids", 5),
    ("bad_words", [""]),
    ("bad_words", ["  "]),
    ("bad_words", [3]),
    ("bad_words", "word"),
    ("ignore_eos", "yes"),
    ("detokenize", 1),
]


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_values_raise_naming_the_field(name, value):
    with pytest.raises(InvalidParamError, match=name):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens_raises():
    with pytest.raises(InvalidParamError, match="min_tokens=5 must be <= max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_good_values_and_defaults():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None
    assert p.prompt_logprobs is None and p.truncate_prompt_tokens is None
    assert not p.has_penalties and p.bad_words_token_ids == []
    p = SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.01,
        logit_bias={"7": 150, 8: -1e9},
        allowed_token_ids=(1, 2),
        bad_words=["a", "a", "b"],
        prompt_logprobs=0,
        truncate_prompt_tokens=-1,
    )
    assert p.logit_bias == {7: 100.0, 8: -100.0}
    assert p.allowed_token_ids == [1, 2] and p.bad_words == ["a", "b"]
    q = p.clone()
    q.logit_bias[7] = 0.0
    q.bad_words_token_ids.append([1])
    assert p.logit_bias[7] == 100.0 and p.bad_words_token_ids == []


def test_verify_token_ids_names_field_and_id():
    SamplingParams(
        stop_token_ids=[9], logit_bias={9: 1}, allowed_token_ids=[0, 9]
    ).verify_token_ids(10)
    cases = [
        ("stop_token_ids", SamplingParams(stop_token_ids=[3, 10])),
        ("logit_bias", SamplingParams(logit_bias={10: 1.0})),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=[1, 12])),
    ]
    bad_words = SamplingParams(bad_words=["x"])
    bad_words.bad_words_token_ids = [[1, 11]]
    cases.append(("bad_words", bad_words))
    for name, params in cases:
        with pytest.raises(InvalidParamError, match=rf"{name} has token id 1[012]\b"):
            params.verify_token_ids(10)


def test_generate_rejects_ids_outside_the_vocabulary(llm):
    for params in (
        SamplingParams(logit_bias={49152: 1.0}),
        SamplingParams(allowed_token_ids=[5, 10**6]),
    ):
        with pytest.raises(InvalidParamError, match="outside the vocabulary"):
            llm.generate(["hello"], params, use_tqdm=False)
