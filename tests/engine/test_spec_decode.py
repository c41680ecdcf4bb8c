"""Speculative decoding: greedy output identical to decoding without it (n-gram and draft
model), stops and limits exact, the sampled distribution equal to the target's (chi-square
tests), the options, and the scheduler's accounting of draft positions."""

from __future__ import annotations

import shutil

import pytest
import torch

from batchlm.engine import LLM, SamplingParams, TokensPrompt
from batchlm.engine.config import SchedulerConfig
from batchlm.engine.core.kv_cache import KVCacheManager
from batchlm.engine.core.request import Request
from batchlm.engine.core.scheduler import Scheduler
from batchlm.engine.errors import InvalidParamError
from batchlm.engine.spec_decode import NgramProposer, parse_speculative_options
from batchlm.engine.spec_decode.options import ALIASES
from batchlm.engine.worker.kv_cache_sizing import profile_forward

ENGINE = dict(max_model_len=128, num_gpu_blocks_override=96)


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == f"batchlm:{name}")


def _same_outputs(got, want, logprob_atol: float = 1e-4) -> None:
    for a, b in zip(got, want, strict=True):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert x.text == y.text
            assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
            if y.logprobs is not None:
                for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
                    assert lx.keys() == ly.keys()
                    for t in ly:
                        assert abs(lx[t].logprob - ly[t].logprob) <= logprob_atol
                        assert lx[t].rank == ly[t].rank
        if b.prompt_logprobs is not None:
            assert len(a.prompt_logprobs) == len(b.prompt_logprobs)


# ---- greedy: the same tokens ----------------------------------------------------------

COPY_PROMPTS = [
    "Repeat the sentence exactly.\nSentence: The quick brown fox jumps over the lazy dog "
    "near the river bank.\nRepeated: The quick brown fox",
    "Copy the list: apples, pears, plums, cherries, grapes, lemons, limes.\nCopy: apples, pears,",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
]


def test_ngram_greedy_is_unchanged_on_smollm2(smollm2_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    base = LLM(str(smollm2_dir), **ENGINE)
    want = base.generate(COPY_PROMPTS, params, use_tqdm=False)
    base.shutdown()
    spec = LLM(
        str(smollm2_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        prompt_lookup_min=2,
        prompt_lookup_max=4,
        disable_log_stats=False,
        **ENGINE,
    )
    got = spec.generate(COPY_PROMPTS, params, use_tqdm=False)
    _same_outputs(got, want)
    num_draft_tokens = _metric(spec, "spec_decode_num_draft_tokens")
    num_accepted = _metric(spec, "spec_decode_num_accepted_tokens")
    spec.shutdown()
    # Measured: most drafts of these copy prompts are accepted.
    assert num_accepted > 0.5 * num_draft_tokens > 0


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def engines(target, tiny_model_factory):
    """The target without speculation, and with each kind of draft."""
    made = {
        "none": LLM(target, **ENGINE),
        "ngram": LLM(target, spec_method="ngram", spec_tokens=3, prompt_lookup_max=2, **ENGINE),
        # The target as its own draft accepts (nearly) every draft: many tokens per step.
        "self-draft": LLM(target, spec_model=target, spec_tokens=4, **ENGINE),
        # Another family with the same tokenizer: drafts often rejected.
        "qwen2-draft": LLM(
            target, spec_model=str(tiny_model_factory("qwen2")), spec_tokens=2, **ENGINE
        ),
    }
    yield made
    for llm in made.values():
        llm.shutdown()


PROMPTS = [
    "a b c d e f g a b c d e f g a b c",
    "one two three one two three one two",
    "the quick brown fox",
    "hello",
]


PLAIN = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)


def _variants(stop: str) -> dict[str, SamplingParams]:
    """Greedy parameter sets whose results must not change with speculation; `stop` is a
    piece of the unspeculated output, so it ends a request mid-step."""
    return {
        "plain": PLAIN,
        "logprobs": SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=3),
        "stop-string": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
        "stop-string-kept": SamplingParams(
            temperature=0.0,
            max_tokens=40,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        "penalties": SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            repetition_penalty=1.4,
            frequency_penalty=0.3,
            presence_penalty=0.2,
        ),
        "min-tokens": SamplingParams(temperature=0.0, max_tokens=20, min_tokens=9),
        "n=2-prompt-logprobs": SamplingParams(
            n=2, temperature=0.0, max_tokens=9, ignore_eos=True, prompt_logprobs=2
        ),
    }


@pytest.fixture(scope="module")
def unspeculated(engines):
    """Variant name → (params, outputs of the target without speculation)."""
    base = engines["none"]
    text = base.generate(PROMPTS[:1], PLAIN, use_tqdm=False)[0].outputs[0].text
    return {
        name: (params, base.generate(PROMPTS, params, use_tqdm=False))
        for name, params in _variants(text[len(text) // 2 :][:4]).items()
    }


@pytest.mark.parametrize("method", ["ngram", "self-draft", "qwen2-draft"])
def test_greedy_outputs_are_unchanged(engines, unspeculated, method):
    for name, (params, want) in unspeculated.items():
        got = engines[method].generate(PROMPTS, params, use_tqdm=False)
        try:
            _same_outputs(got, want)
        except AssertionError as e:
            raise AssertionError(f"{method} / {name}: {e}") from e
        if name == "stop-string":  # the stop string does end a request
            assert want[0].outputs[0].finish_reason == "stop"


def test_max_tokens_and_max_model_len_are_exact(engines):
    """Drafts never run past max_tokens or max_model_len: outputs stop exactly there."""
    for max_tokens in (1, 2, 5, 6):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for method in ("self-draft", "ngram"):
            outs = engines[method].generate(PROMPTS, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    long_prompt = TokensPrompt(prompt_token_ids=[5, 6, 7, 8] * 31 + [5])  # 125 of 128
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    want = engines["none"].generate([long_prompt], params, use_tqdm=False)
    got = engines["self-draft"].generate([long_prompt], params, use_tqdm=False)
    assert len(got[0].outputs[0].token_ids) == 3 and got[0].outputs[0].finish_reason == "length"
    _same_outputs(got, want)


def test_draft_model_acceptance_counts(target):
    llm = LLM(target, spec_model=target, spec_tokens=3, disable_log_stats=False, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    # First token from the prefill, then steps of 3 drafts + 1: 2 steps per request, every
    # draft accepted (the draft is the target).
    assert _metric(llm, "spec_decode_num_drafts") == 2 * len(PROMPTS)
    assert _metric(llm, "spec_decode_num_draft_tokens") == 6 * len(PROMPTS)
    assert _metric(llm, "spec_decode_num_accepted_tokens") == 6 * len(PROMPTS)
    (per_pos,) = [
        m for m in llm.get_metrics() if m.name == "batchlm:spec_decode_num_accepted_tokens_per_pos"
    ]
    assert per_pos.values == [8, 8, 8]
    llm.shutdown()


# ---- sampling: the target's distribution ----------------------------------------------

VOCAB = 12
PROMPT_IDS = [3, 7, 1, 9, 4, 0, 11, 2, 8, 5, 10, 6, 3, 7]  # every id: n-gram drafts always
NUM_SAMPLES = 2000


def _small_vocab_model(root, seed: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.6,  # peaked, varied distributions
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = root / f"vocab{VOCAB}-{seed}"
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-vocab")
    return _small_vocab_model(root, 0), _small_vocab_model(root, 1)


SMALL = dict(
    max_model_len=32,
    skip_tokenizer_init=True,
    max_num_seqs=NUM_SAMPLES,
    max_num_batched_tokens=4 * NUM_SAMPLES,
    num_gpu_blocks_override=2 * NUM_SAMPLES + 8,
    seed=7,
)


def _target_probs(llm: LLM, contexts: list[list[int]], temperature: float, top_k: int):
    """The target's sampling distribution after each context `[len(contexts), VOCAB]`."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=VOCAB)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=PROMPT_IDS + c) for c in contexts], params, use_tqdm=False
    )
    logprobs = torch.tensor(
        [[o.outputs[0].logprobs[0][t].logprob for t in range(VOCAB)] for o in outs]
    )
    scaled = logprobs / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def _chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 draws are pooled."""
    from scipy.stats import chi2

    expected = expected_probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    return float(chi2.sf(statistic, len(obs) - 1))


@pytest.mark.parametrize("method, temperature, top_k", [("ngram", 1.0, 0), ("draft_model", 0.8, 8)])
def test_sampling_keeps_the_target_distribution(small_vocab, method, temperature, top_k):
    """The first three generated tokens of 2000 samples, with and without speculation,
    against the target's exact joint distribution (1728 cells, those expecting fewer than
    5 draws pooled). The 1st token comes from the prefill; the next step verifies two
    drafts, so the 2nd token is a first draft accepted or replaced, and the 3rd a second
    draft accepted or replaced, or drawn after a rejection. (This end-to-end test has
    modest power; `test_rejection_sampler_*` below tests the acceptance rule with 20000
    draws.)"""
    target_path, draft_path = small_vocab
    base = LLM(target_path, **SMALL)
    p1 = _target_probs(base, [[]], temperature, top_k)[0]
    p2_given = _target_probs(base, [[a] for a in range(VOCAB)], temperature, top_k)
    pairs = [[a, b] for a in range(VOCAB) for b in range(VOCAB)]
    p3_given = _target_probs(base, pairs, temperature, top_k).view(VOCAB, VOCAB, VOCAB)
    joint = torch.einsum("a,ab,abc->abc", p1, p2_given, p3_given).flatten()  # [VOCAB ** 3]

    spec_options = (
        {"spec_method": "ngram", "spec_tokens": 2, "prompt_lookup_max": 1}
        if method == "ngram"
        else {"spec_model": draft_path, "spec_tokens": 2}
    )
    spec = LLM(target_path, disable_log_stats=False, **spec_options, **SMALL)
    params = SamplingParams(
        n=NUM_SAMPLES, temperature=temperature, top_k=top_k, max_tokens=4, ignore_eos=True
    )
    prompt = TokensPrompt(prompt_token_ids=PROMPT_IDS)
    for llm in (base, spec):
        samples = torch.tensor([c.token_ids for c in llm.generate([prompt], params)[0].outputs])
        cells = (samples[:, 0] * VOCAB + samples[:, 1]) * VOCAB + samples[:, 2]
        counts = torch.bincount(cells, minlength=VOCAB**3).float()
        p_value = _chi_square_p_value(counts, joint)
        assert p_value > 1e-3, (llm is spec, p_value)
    accepted = _metric(spec, "spec_decode_num_accepted_tokens")
    drafted = _metric(spec, "spec_decode_num_draft_tokens")
    # Two drafts per sample after its first token, and one more after early rejections.
    assert drafted >= 2 * NUM_SAMPLES and 0 < accepted < drafted
    base.shutdown()
    spec.shutdown()


NUM_DRAWS = 20000


@pytest.mark.parametrize("draft", ["point-mass", "draft-model"])
def test_rejection_sampler_keeps_the_target_distribution(draft):
    """20000 requests with two drafts each, verified in one call against fixed target rows
    `p0, p1, p2` (8 tokens, temperature 1): the first token emitted follows `p0`, the
    second (where the first draft was accepted) follows `p1`, and the acceptance rate of
    the first draft is `sum(min(p0, q0))` (a point mass: `p0(d0)`)."""
    from scipy.stats import binomtest

    from batchlm.engine.core.scheduler import ScheduledRequest
    from batchlm.engine.spec_decode.rejection import RejectionSampler, accepted_spans

    vocab = 8
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(3, vocab, generator=gen) * 1.5  # rows 0, 1 and the bonus row
    p = torch.softmax(p_logits, dim=-1)
    params = SamplingParams(temperature=1.0)
    if draft == "point-mass":
        drafts = torch.tensor([[int(p[0].argmin()), int(p[1].argmax())]]).expand(NUM_DRAWS, 2)
        q = None
        accept_rate = float(p[0, drafts[0, 0]])
    else:
        q_rows = torch.softmax(torch.randn(2, vocab, generator=gen), dim=-1)
        drafts = torch.stack(
            [torch.multinomial(q_rows[j], NUM_DRAWS, True, generator=gen) for j in (0, 1)], 1
        )
        q = {i: q_rows for i in range(NUM_DRAWS)}
        accept_rate = float(torch.minimum(p[0], q_rows[0]).sum())
    reqs = [
        ScheduledRequest(str(i), [0, *d], 5, [0], True, params, [], [1, 2, 3, 4, 5], None, d)
        for i, d in enumerate(drafts.tolist())
    ]
    logits = p_logits.repeat(NUM_DRAWS, 1)  # [3 * NUM_DRAWS, vocab]
    rows = RejectionSampler(torch.Generator().manual_seed(1))(logits, reqs, {}, vocab, q)
    token_ids, accepted = rows.token_ids.tolist(), rows.accepted.tolist()
    gained = [token_ids[first : first + n] for first, n in accepted_spans(reqs, accepted)]
    first = torch.tensor([g[0] for g in gained])
    second = torch.tensor([g[1] for g in gained if len(g) > 1])
    assert _chi_square_p_value(torch.bincount(first, minlength=vocab).float(), p[0]) > 1e-3
    assert _chi_square_p_value(torch.bincount(second, minlength=vocab).float(), p[1]) > 1e-3
    num_accepted = sum(len(g) > 1 for g in gained)
    assert binomtest(num_accepted, NUM_DRAWS, accept_rate).pvalue > 1e-3


# ---- options --------------------------------------------------------------------------


def test_options():
    opts = parse_speculative_options(
        {"method": "ngram", "num_speculative_tokens": 3}, dict.fromkeys(ALIASES)
    )
    assert (opts.method, opts.num_speculative_tokens) == ("ngram", 3)
    assert (opts.prompt_lookup_min, opts.prompt_lookup_max) == (5, 5)
    opts = parse_speculative_options(
        None, {**dict.fromkeys(ALIASES), "spec_model": "m", "spec_tokens": 2}
    )
    assert (opts.method, opts.model) == ("draft_model", "m")
    assert parse_speculative_options(None, dict.fromkeys(ALIASES)) is None


@pytest.mark.parametrize(
    "config, aliases, match",
    [
        ({"num_speculative_tokens": 2}, {"spec_tokens": 2}, "spec_tokens=2 and speculative_config"),
        ({"method": "ngram", "num_tokens": 2}, {}, "unknown key.*num_tokens"),
        ({"num_speculative_tokens": 2}, {}, "needs a method"),
        ({"method": "eagle", "num_speculative_tokens": 2}, {}, "'eagle' is not supported"),
        ({"method": "ngram"}, {}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, {}, "must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, {}, "takes no model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, {}, "needs the draft model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2},
            {"prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
    ],
)
def test_option_errors(config, aliases, match):
    with pytest.raises(InvalidParamError, match=match):
        parse_speculative_options(config, {**dict.fromkeys(ALIASES), **aliases})


def test_engine_option_errors(target):
    with pytest.raises(InvalidParamError, match="return_sampling_mask"):
        LLM(target, spec_method="ngram", spec_tokens=2, return_sampling_mask=True)
    with pytest.raises(InvalidParamError, match="draft_model' runs on one device"):
        LLM(target, spec_model=target, spec_tokens=2, tensor_parallel_size=2)


def test_ngram_proposer():
    proposer = NgramProposer(3, min_n=1, max_n=3)
    # The longest suffix n-gram wins ([2, 3] → followed by 9 at its first occurrence).
    assert proposer.propose([1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3], 5) == [9, 8, 2]
    assert proposer.propose([1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3], 2) == [9, 8]
    assert proposer.propose([4, 5, 6], 3) == []  # no earlier occurrence
    assert proposer.propose([4, 5, 4], 3) == [5, 4]  # continuation cut by the sequence end
    assert proposer.propose([4], 3) == []


# ---- scheduler ------------------------------------------------------------------------


def test_scheduler_computes_draft_positions_and_rolls_back_rejected_ones():
    kv_cache = KVCacheManager(16, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv_cache, 64)
    request = Request("a", [1, 2, 3, 4, 5], SamplingParams(), (), 0)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": 6})
    request.spec_token_ids = [7, 8, 9]
    out = scheduler.schedule()
    (sched,) = out.scheduled
    assert (sched.token_ids, sched.start_pos, sched.spec_token_ids) == ([6, 7, 8, 9], 5, [7, 8, 9])
    assert sched.needs_sample and out.num_scheduled_tokens == 4
    assert request.num_computed_tokens == 9 and len(kv_cache.block_ids("a")) == 3
    assert request.spec_token_ids == []  # consumed
    # One draft accepted (7), then 5 drawn: positions of 8 and 9 are recomputed next step.
    scheduler.discard_rejected_drafts("a", 2)
    scheduler.update_from_output(out, {"a": 7})
    scheduler.update_from_output(out, {"a": 5})
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 5]
    assert request.num_computed_tokens == 7 == request.num_tokens - 1
    assert len(kv_cache.block_ids("a")) == 3  # blocks stay allocated
    # A budget that fits only part of the drafts truncates them.
    scheduler.config = SchedulerConfig(max_num_batched_tokens=2)
    request.spec_token_ids = [1, 2, 3]
    (sched,) = scheduler.schedule().scheduled
    assert (sched.token_ids, sched.spec_token_ids) == ([5, 1], [1])


def test_tiny_draft_shares_the_tokenizer(target, tiny_model_factory, tmp_path):
    """A draft folder without tokenizer files works (the target's tokenizer is used)."""
    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_factory("qwen2"), draft)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (draft / name).unlink(missing_ok=True)
    llm = LLM(target, spec_model=str(draft), spec_tokens=2, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 6
    llm.shutdown()


def test_beam_search_is_unchanged(engines):
    """Beam search decodes one token per call: no drafts, the same beams."""
    from batchlm.engine.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    want = engines["none"].beam_search(PROMPTS[:2], params)
    got = engines["self-draft"].beam_search(PROMPTS[:2], params)
    for a, b in zip(got, want, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


@pytest.mark.slow
def test_ngram_with_tensor_parallel(engines, target):
    """Rank 0 verifies; the other rank runs the same forward and LM-head rows."""
    llm = LLM(
        target,
        spec_method="ngram",
        spec_tokens=3,
        prompt_lookup_max=2,
        tensor_parallel_size=2,
        disable_log_stats=False,
        **ENGINE,
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _metric(llm, "spec_decode_num_draft_tokens") > 0  # the repeating prompts
    llm.shutdown()
    _same_outputs(got, engines["none"].generate(PROMPTS, params, use_tqdm=False))


def test_profiling_forward_runs_the_draft_on_the_dummy_prompts(target):
    """The KV-cache profiling forward (what a CUDA engine runs before sizing its cache)
    feeds the draft model the dummy prompts too, then the draft forgets them."""
    llm = LLM(target, spec_model=target, spec_tokens=3, **ENGINE)
    runner = llm.llm_engine.runner
    drafter = runner.spec.drafter
    calls = []
    original = drafter._forward

    def counting(reqs):
        calls.append(sum(len(r.token_ids) for r in reqs))
        return original(reqs)

    drafter._forward = counting
    profile_forward(runner, 40)
    assert calls == [40]
    assert not drafter.num_computed
    llm.shutdown()


@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram"},
        {"method": "[ngram]"},
        {"method": "ngram_gpu"},
        {"model": "[ngram]"},
        {"model": "ngram"},
        {"method": "ngram", "model": "[ngram]"},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_every_vllm_spelling_of_ngram(config):
    """vLLM 0.26's `SpeculativeConfig` reads all of these as the ngram method (its
    `model="[ngram]"` is a placeholder, not a draft model's path)."""
    opts = parse_speculative_options(
        {**config, "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        dict.fromkeys(ALIASES),
    )
    assert (opts.method, opts.model, opts.num_speculative_tokens) == ("ngram", None, 3)
    assert (opts.prompt_lookup_min, opts.prompt_lookup_max) == (2, 4)


def test_vllms_other_keys_are_taken_at_their_defaults():
    config = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "draft_tensor_parallel_size": 1,
        "enforce_eager": None,
        "rejection_sample_method": "standard",
        "parallel_drafting": False,
    }
    assert parse_speculative_options(config, dict.fromkeys(ALIASES)).method == "ngram"
    with pytest.raises(InvalidParamError, match=r"\['parallel_drafting'\]=True is not supp"):
        parse_speculative_options({**config, "parallel_drafting": True}, dict.fromkeys(ALIASES))
    with pytest.raises(InvalidParamError, match="provided but without speculative model"):
        parse_speculative_options({"num_speculative_tokens": 2}, dict.fromkeys(ALIASES))


def test_ngram_placeholder_model_runs_ngram_with_unchanged_greedy_tokens(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    prompts = ["one two one two one two one", "a b c a b c a b"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(path, max_model_len=128)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    spec = {"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(path, max_model_len=128, speculative_config=spec)
    config = llm.llm_engine.config.speculative
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 1, 1)
    assert config.draft_model is None and llm.llm_engine.spec is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    llm.shutdown()
