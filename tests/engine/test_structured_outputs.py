"""Structured outputs on SmolLM2: every constrained output valid (JSON against its schema
with `jsonschema`, regex full matches, choices, grammars accepted by xgrammar's own
matcher), greedy and seeded sampling, in one batch with free requests whose tokens equal a
run without the constrained ones; the same tokens under preemption, async scheduling and
ngram speculation; logprobs of the constrained distribution; bad constraints refused
before anything runs; the guidance backend."""

from __future__ import annotations

import json
import math
import re
import time

import jsonschema
import pytest

from batchlm.engine import LLM, SamplingParams, StructuredOutputsParams
from batchlm.engine.errors import InvalidParamError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
"""Small and bounded: any output it accepts fits in `MAX_TOKENS["json"]` tokens, even one
character per token (a random model's)."""
REGEX = r"[A-Z][a-z]{2,8}, [0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= num op num\nop ::= "+" | "-" | "*"\nnum ::= [1-9] [0-9]?'
NAMES = [
    "Anna", "Bob", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun",
    "Kofi", "Lena", "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara",
    "Umar", "Vera", "Wen", "Ximena", "Yusuf",
]  # fmt: skip
NUM_PROMPTS = 50
"""Per kind: half greedy, half seeded sampling."""

CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
MAX_TOKENS = {"json": 40, "regex": 16, "choice": 10, "grammar": 8}


def prompt_of(kind: str, i: int) -> str:
    name = NAMES[i % len(NAMES)]
    if kind == "json":
        # The example gives ngram speculation something to copy.
        return f'As {{"name": "Ann", "age": 31}}: {name} #{i}'
    if kind == "regex":
        return f"Name, age #{i}:"
    if kind == "choice":
        return f"Review #{i} by {name}. Sentiment:"
    return f"Sum #{i}:"


def params_of(kind: str, i: int, n: int = 1) -> SamplingParams:
    common = dict(max_tokens=MAX_TOKENS[kind], structured_outputs=CONSTRAINTS[kind], n=n)
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, **common)
    # Sampling rules after the grammar mask: top-k, top-p, and a penalty on some.
    penalty = 1.3 if i % 4 == 1 else 1.0
    return SamplingParams(
        temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i, repetition_penalty=penalty, **common
    )


def workload(num_per_kind: int) -> list[tuple[str, str, SamplingParams]]:
    return [
        (kind, prompt_of(kind, i), params_of(kind, i))
        for i in range(num_per_kind)
        for kind in CONSTRAINTS
    ]


FREE = [
    ("The capital of France is", SamplingParams(temperature=0.0, max_tokens=12)),
    ("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ("List three fruits:", SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=2)),
    ("def fib(n):", SamplingParams(temperature=1.0, seed=6, top_p=0.9, max_tokens=12)),
]


@pytest.fixture(scope="module")
def xgr_info(smollm2_dir):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])


def check_valid(kind: str, completion, xgr_info) -> None:
    """The completion is complete and obeys its constraint (checked without the engine)."""
    text = completion.text
    assert completion.finish_reason == "stop", (kind, text)
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr_info).compile_grammar(GRAMMAR))
        ids = [t for t in completion.token_ids if t != 2]
        assert all(matcher.accept_token(t) for t in ids) and matcher.is_completed(), text


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    llm = LLM(str(smollm2_dir), max_model_len=256, disable_log_stats=False, max_logprobs=40)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mixed(llm):
    """One batch: 50 prompts per kind (greedy and sampled), n=3 samples of a few, and the
    free requests; and the free requests alone."""
    work = workload(NUM_PROMPTS)
    samples = [("json", prompt_of("json", 100 + i), params_of("json", 1, n=3)) for i in range(3)]
    prompts = [p for _, p, _ in work + samples] + [p for p, _ in FREE]
    params = [s for _, _, s in work + samples] + [s for _, s in FREE]
    compiles = llm.llm_engine.structured.cache.num_compiles
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    compiles = llm.llm_engine.structured.cache.num_compiles - compiles
    alone = llm.generate([p for p, _ in FREE], [s for _, s in FREE], use_tqdm=False)
    return work + samples, outs, alone, compiles, seconds


def test_every_output_obeys_its_constraint(mixed, xgr_info, llm):
    work, outs, _, compiles, _ = mixed
    for (kind, _, params), out in zip(work, outs, strict=False):
        assert len(out.outputs) == params.n
        for completion in out.outputs:
            check_valid(kind, completion, xgr_info)
    # The n samples of a prompt each follow the grammar on their own.
    for out in outs[len(work) - 3 : len(work)]:
        assert len({c.text for c in out.outputs}) > 1
    # One compile per distinct constraint, whatever the number of requests; no matcher left.
    assert compiles == len(CONSTRAINTS)
    assert llm.llm_engine.structured.num_requests == 0


def test_free_requests_are_unchanged_by_constrained_ones(mixed):
    _, outs, alone, _, _ = mixed
    for got, want in zip(outs[-len(FREE) :], alone, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text


@pytest.mark.parametrize(
    "options",
    [
        # A cache far too small for the batch: requests are preempted and recomputed; with
        # async scheduling, whose tokens in flight the masks are filled from (the steps
        # that preempt wait for the one in flight).
        dict(async_scheduling=True, block_size=4, num_gpu_blocks_override=32),
        dict(spec_method="ngram", spec_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4),
    ],
    ids=["async-preemption", "ngram"],
)
def test_same_tokens_under_preemption_and_ngram(smollm2_dir, mixed, xgr_info, options):
    work, outs, _, _, _ = mixed
    chosen = list(range(4 * 4))  # the first 4 prompts of each kind, 2 of them sampled
    llm = LLM(str(smollm2_dir), max_model_len=128, disable_log_stats=False, **options)
    got = llm.generate([work[i][1] for i in chosen], [work[i][2] for i in chosen], use_tqdm=False)
    speculative = "spec_method" in options
    for i, out in zip(chosen, got, strict=True):
        kind, _, params = work[i]
        check_valid(kind, out.outputs[0], xgr_info)
        if params.temperature == 0.0 or not speculative:  # rejection sampling draws anew
            assert out.outputs[0].token_ids == outs[i].outputs[0].token_ids, (kind, i)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    if "num_gpu_blocks_override" in options:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if speculative:
        assert metrics["batchlm:spec_decode_num_accepted_tokens"] > 0
    assert llm.llm_engine.structured.num_requests == 0
    llm.shutdown()


def test_logprobs_are_those_of_the_constrained_distribution(llm):
    prompt = "Review: a wonderful, moving film.\nSentiment:"
    params = SamplingParams(
        temperature=0.0,
        max_tokens=4,
        logprobs=40,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]
    allowed = {t: lp.logprob for t, lp in first.items() if lp.logprob > -math.inf}
    assert 1 < len(allowed) < 40  # every allowed token is among the top 40, the rest -inf
    tokenizer = llm.get_tokenizer()
    assert all(any(c.startswith(tokenizer.decode([t])) for c in CHOICES) for t in allowed)
    assert math.isclose(sum(math.exp(v) for v in allowed.values()), 1.0, abs_tol=1e-4)
    # The unconstrained logprob of each allowed token (the prompt's logprob of the token
    # appended to it), renormalised over the allowed ones, is what was reported.
    ids = tokenizer(prompt)["input_ids"]
    raw_outs = llm.generate(
        [{"prompt_token_ids": ids + [t]} for t in allowed],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    raw = {t: o.prompt_logprobs[-1][t].logprob for t, o in zip(allowed, raw_outs, strict=True)}
    norm = math.log(sum(math.exp(v) for v in raw.values()))
    for t, value in allowed.items():
        assert value == pytest.approx(raw[t] - norm, abs=2e-3), tokenizer.decode([t])


def _so(**kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(**kwargs)
    )


BAD_CONSTRAINTS = [
    ("schema type", dict(json={"type": "foo"}), r'json schema xgrammar cannot compile: .*"foo"'),
    (
        "schema pattern",
        dict(json={"type": "string", "pattern": "(("}),
        "json schema xgrammar cannot compile: Regex parsing error",
    ),
    ("regex", dict(regex="(ab"), "regex xgrammar cannot compile: Regex parsing error"),
    ("grammar", dict(grammar="root ::= missing"), 'grammar xgrammar cannot.*Rule "missing"'),
    ("grammar syntax", dict(grammar="root ::= ("), "grammar xgrammar cannot compile"),
]


GOOD = _so(choice=CHOICES)


@pytest.fixture(scope="module")
def good_tokens(llm):
    """A good request's tokens, computed before any bad one."""
    return llm.generate(["Sentiment:"], GOOD, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("name,kwargs,match", BAD_CONSTRAINTS, ids=[b[0] for b in BAD_CONSTRAINTS])
def test_bad_constraint_raises_naming_the_request_and_the_engine_keeps_serving(
    llm, good_tokens, name, kwargs, match
):
    params = [GOOD, _so(regex="[0-9]+"), _so(**kwargs)]
    with pytest.raises(InvalidParamError, match=r"prompts\[2\] has structured_outputs.*" + match):
        llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.structured.num_requests == 0
    # The same bad constraint again: refused from the cache, not compiled twice.
    compiles = llm.llm_engine.structured.cache.num_compiles
    with pytest.raises(InvalidParamError, match=r"prompts\[0\] has .*" + match):
        llm.generate(["c"], _so(**kwargs), use_tqdm=False)
    assert llm.llm_engine.structured.cache.num_compiles == compiles
    assert llm.generate(["Sentiment:"], GOOD, use_tqdm=False)[0].outputs[0].token_ids == good_tokens


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = llm.generate(["Is water wet? Answer:"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) < 16


def test_two_ranks_with_async_scheduling_give_the_tokens_of_one(tiny_model_factory, xgr_info):
    """Rank 0 holds the matchers and alone samples; the other rank only runs its share of
    the forward, reading the tokens in flight rank 0 broadcasts."""
    path = str(tiny_model_factory("llama"))
    work = workload(2)
    prompts, params = [p for _, p, _ in work], [s for _, _, s in work]
    one = LLM(path, max_model_len=128, async_scheduling=False, gpu_memory_utilization=0.4)
    want = one.generate(prompts, params, use_tqdm=False)
    one.shutdown()
    two = LLM(
        path,
        max_model_len=128,
        tensor_parallel_size=2,
        async_scheduling=True,
        gpu_memory_utilization=0.4,
    )
    try:
        got = two.generate(prompts, params, use_tqdm=False)
    finally:
        two.shutdown()
    for (kind, _, _), a, b in zip(work, got, want, strict=True):
        check_valid(kind, a.outputs[0], xgr_info)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, kind


def test_whitespace_pattern_picks_the_guidance_backend(llm):
    """The guidance backend end to end (its grammar stops without an EOS token: the request
    ends on the token that completes it, whose text is kept)."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=PERSON, whitespace_pattern=r"\n?"),
    )
    out = llm.generate([prompt_of("json", 7)], params, use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), PERSON)
    assert " " not in out.text  # between JSON tokens only what the pattern allows
    assert "guidance" in llm.llm_engine.structured._backends
