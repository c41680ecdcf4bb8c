"""Structured outputs piece by piece, without a model: the params' checks, the canonical spec
the cache keys on, the backend options, the grammar cache, the bitmask applied on the
device against xgrammar's own kernel, the matcher's resynchronisation, and the layout of a
step's mask rows (drafts, tokens in flight)."""

from __future__ import annotations

import json

import pytest
import torch

from batchlm.engine import SamplingParams, StructuredOutputsParams
from batchlm.engine.config import StructuredOutputsConfig
from batchlm.engine.core.request import Request
from batchlm.engine.core.scheduler import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from batchlm.engine.errors import InvalidParamError
from batchlm.engine.structured_output import StructuredOutputManager, selector
from batchlm.engine.structured_output.backend import GrammarCompileError
from batchlm.engine.structured_output.grammar_cache import GrammarCache
from batchlm.engine.structured_output.grammar_spec import GrammarSpec, grammar_spec
from batchlm.engine.structured_output.request_matcher import RequestMatcher
from batchlm.engine.worker.grammar_mask import GrammarBitmask, apply_grammar, unpack_bitmask
from batchlm.engine.worker.runner_output import ModelRunnerOutput, PendingOutput

SO = StructuredOutputsParams
CONFIG = StructuredOutputsConfig()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "exactly one constraint, but none is set"),
        ({"json": {}, "regex": "a"}, r"but 2 are \(json, regex\)"),
        ({"json_object": False}, "none is set"),
        ({"json": "{bad"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1, 2]"}, "must be a JSON Schema object"),
        ({"json": 3}, "must be a JSON Schema object"),
        ({"regex": ""}, "regex='' must be a non-empty string"),
        ({"grammar": 5}, "grammar=5 must be a non-empty string"),
        ({"choice": []}, "must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, r"choice\[1\]=1 must be a non-empty string"),
        ({"choice": ["a", "\ud800"]}, "lone surrogate"),
        ({"json_object": "yes"}, "json_object='yes' must be True or None"),
        ({"regex": "a", "disable_any_whitespace": 1}, "must be True or False"),
        ({"regex": "a", "whitespace_pattern": " "}, "applies to json / json_object, not regex"),
    ],
)
def test_params_are_checked_at_construction(kwargs, match):
    with pytest.raises(InvalidParamError, match=match):
        SO(**kwargs)


def test_sampling_params_take_the_params_or_a_dict_of_them():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == SO(choice=["a", "b"])
    assert params.clone().structured_outputs == params.structured_outputs
    assert SO(json_object=True).kind == "json_object"
    assert SO.from_dict(SO(regex="x", disable_any_whitespace=True).to_dict()) == SO(
        regex="x", disable_any_whitespace=True
    )
    with pytest.raises(InvalidParamError, match=r"unknown key\(s\) \['jsn'\]; valid keys: json"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(InvalidParamError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs=5)


def test_the_spec_is_canonical():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    as_dict = grammar_spec(SO(json=schema), CONFIG)
    assert grammar_spec(SO(json=json.dumps(schema, indent=2)), CONFIG) == as_dict
    # Key order is part of the grammar (xgrammar writes properties in the schema's order).
    swapped = {"type": "object", "properties": {"a": {}, "b": {"type": "integer"}}}
    assert grammar_spec(SO(json=swapped), CONFIG) != as_dict
    assert grammar_spec(SO(json_object=True), CONFIG) == GrammarSpec("json", '{"type":"object"}')
    compact = grammar_spec(SO(json_object=True, disable_any_whitespace=True), CONFIG)
    assert not compact.any_whitespace
    engine_wide = StructuredOutputsConfig(disable_any_whitespace=True)
    assert grammar_spec(SO(json_object=True), engine_wide) == compact
    assert grammar_spec(SO(choice=["a", 'b"']), CONFIG).choices == ["a", 'b"']


def test_disable_additional_properties_closes_every_object_schema():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {}}},  # a property so named
            "open": {"type": "object", "additionalProperties": True},
            "items": {"type": "array", "items": {"properties": {"y": {}}}},
        },
        "enum": [{"type": "object"}],  # data, left alone
    }
    spec = grammar_spec(SO(json=schema, disable_additional_properties=True), CONFIG)
    out = json.loads(spec.text)
    assert out["additionalProperties"] is False
    assert set(out["properties"]) == {"properties", "open", "items"}
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["properties"]["items"]["items"]["additionalProperties"] is False
    assert out["enum"] == [{"type": "object"}]


def test_backend_options(monkeypatch):
    parse = selector.parse_structured_outputs_config
    assert parse(None) == StructuredOutputsConfig()
    assert parse({"backend": "guidance"}).backend == "guidance"
    with pytest.raises(InvalidParamError, match=r"backend='outlines' is unknown; use one of"):
        parse({"backend": "outlines"})
    with pytest.raises(InvalidParamError, match=r"unknown key\(s\) \['backnd'\]"):
        parse({"backnd": "auto"})
    with pytest.raises(InvalidParamError, match="must be True or False"):
        parse({"disable_any_whitespace": "no"})
    json_spec = GrammarSpec("json", "{}")
    pattern_spec = GrammarSpec("json", "{}", whitespace_pattern=" ")
    assert selector.backend_for(CONFIG, json_spec) == "xgrammar"
    assert selector.backend_for(CONFIG, pattern_spec) == "guidance"
    with pytest.raises(InvalidParamError, match="whitespace_pattern, which needs the guidance"):
        selector.backend_for(StructuredOutputsConfig("xgrammar"), pattern_spec)
    # An unavailable backend: refused when named, skipped by auto.
    monkeypatch.setattr(selector, "is_installed", lambda name: name == "guidance")
    with pytest.raises(InvalidParamError, match=r"needs the xgrammar package.*pip install"):
        parse({"backend": "xgrammar"})
    assert selector.backend_for(CONFIG, json_spec) == "guidance"
    monkeypatch.setattr(selector, "is_installed", lambda name: False)
    with pytest.raises(InvalidParamError, match="none is installed: pip install 'xgrammar"):
        selector.backend_for(CONFIG, json_spec)


def test_grammar_cache_keeps_grammars_and_errors_by_spec():
    cache = GrammarCache(max_entries=2)
    specs = [GrammarSpec("regex", str(i)) for i in range(3)]

    def bad():
        raise GrammarCompileError("no")

    assert cache.get("x", specs[0], lambda: "g0") == "g0"
    assert cache.get("x", specs[0], lambda: "other") == "g0"
    for _ in range(2):
        with pytest.raises(GrammarCompileError, match="no"):
            cache.get("x", specs[1], bad)
    assert cache.num_compiles == 2
    cache.get("x", specs[0], lambda: "g0")  # most recently used: survives the next one
    cache.get("x", specs[2], lambda: "g2")
    assert len(cache) == 2
    assert cache.get("x", specs[0], lambda: "new") == "g0"
    assert cache.get("x", specs[1], lambda: "fixed") == "fixed"  # was evicted
    assert cache.get("y", specs[0], lambda: "other backend") == "other backend"


@pytest.mark.parametrize("vocab", [64, 100, 49152])
@pytest.mark.parametrize("rows", ["all", "some"])
def test_bitmask_on_the_logits_matches_xgrammar(vocab, rows):
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(vocab)
    num_rows = 5
    logits = torch.randn(num_rows, vocab, generator=gen)
    masked_rows = list(range(num_rows)) if rows == "all" else [1, 3]
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (len(masked_rows), -(-vocab // 32)), generator=gen, dtype=torch.int32
    )
    want = logits.clone()
    full = torch.full((num_rows, bitmask.shape[1]), -1, dtype=torch.int32)
    full[masked_rows] = bitmask
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=vocab)
    got = logits.clone()
    mask = GrammarBitmask(torch.tensor(masked_rows).numpy(), bitmask)
    apply_grammar(got, lambda: mask)
    assert torch.equal(got, want)
    allowed = unpack_bitmask(bitmask, vocab)
    assert allowed.shape == (len(masked_rows), vocab)
    assert allowed[0, 5] == bool((int(bitmask[0, 0]) >> 5) & 1)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def xgrammar_backend(tokenizer):
    return selector.create_backend("xgrammar", tokenizer, 49152, [2])


@pytest.fixture(scope="module")
def guidance_backend(tokenizer):
    return selector.create_backend("guidance", tokenizer, 49152, [2])


BACKEND_CASES = [
    (GrammarSpec("json", '{"type":"object","properties":{"a":{"type":"integer"}}}'), '{"a": 12}'),
    (GrammarSpec("regex", "[0-9]{3}-[a-z]+"), "123-ab"),
    (GrammarSpec("choice", '["red", "green"]'), "green"),
    (GrammarSpec("grammar", 'root ::= "(" [a-z]+ ")"'), "(abc)"),
]
BAD_SPECS = [
    GrammarSpec("json", '{"type":"foo"}'),
    GrammarSpec("regex", "(ab"),
    GrammarSpec("grammar", "root ::= missing"),
]


@pytest.mark.parametrize("name", ["xgrammar", "guidance"])
def test_each_backend_serves_every_kind_and_refuses_bad_ones(name, tokenizer, request):
    backend = request.getfixturevalue(f"{name}_backend")
    bitmask = torch.empty((1, 1536), dtype=torch.int32)
    for spec, text in BACKEND_CASES:
        matcher = RequestMatcher(backend.matcher(backend.compile(spec), [2]), backend)
        ids = tokenizer.encode(text, add_special_tokens=False)
        backend.fill_bitmasks([matcher.matcher], bitmask, [0])
        assert ids[0] in _allowed(bitmask, 0) and 2 not in _allowed(bitmask, 0), spec
        assert matcher.sync(ids), spec
        if not matcher.matcher.is_terminated():  # guidance stops once nothing can follow
            backend.fill_bitmasks([matcher.matcher], bitmask, [0])
            assert 2 in _allowed(bitmask, 0), spec  # complete: the stop token may come
        assert not matcher.sync([*ids[:-1], tokenizer.convert_tokens_to_ids("!")]), spec
        assert matcher.tokens == ids[:-1]
    for spec in BAD_SPECS:
        with pytest.raises(GrammarCompileError):
            backend.compile(spec)


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return set(torch.nonzero(unpack_bitmask(bitmask[row : row + 1], 49152)[0]).flatten().tolist())


def test_matcher_follows_the_tokens_and_never_stays_ahead(xgrammar_backend, tokenizer):
    compiled = xgrammar_backend.compile(GrammarSpec("regex", "[0-9]{3}-[a-z]{2}"))
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "0123456789-abz"}
    matcher = RequestMatcher(xgrammar_backend.matcher(compiled, [2]), xgrammar_backend)
    bitmask = torch.empty((2, 1536), dtype=torch.int32)

    def mask_now() -> set[int]:
        matcher.matcher.fill_next_token_bitmask(bitmask, 0)
        return _allowed(bitmask, 0)

    assert matcher.sync([ids["1"], ids["2"]], in_flight=ids["3"])
    assert matcher.tokens == [ids["1"], ids["2"], ids["3"]] and mask_now() == {ids["-"]}
    # The step that sampled "3" was rolled back; "4" came instead: the tail is replaced.
    assert matcher.sync([ids["1"], ids["2"], ids["4"], ids["-"]])
    assert matcher.tokens[-2:] == [ids["4"], ids["-"]] and ids["a"] in mask_now()
    # Fewer tokens than the matcher holds (a token in flight that never came): rolled back.
    assert matcher.sync([ids["1"]])
    assert matcher.tokens == [ids["1"]] and ids["-"] not in mask_now()
    # A token the grammar refuses: False, and the matcher stays at the longest valid prefix.
    assert not matcher.sync([ids["1"], ids["a"]])
    assert matcher.tokens == [ids["1"]]
    # Drafts: the valid ones counted, each row's mask that of the prefix before it.
    drafts = [ids["2"], ids["3"], ids["-"], ids["9"]]
    assert matcher.num_valid_drafts(drafts) == 3 and matcher.tokens == [ids["1"]]
    rows = torch.empty((5, 1536), dtype=torch.int32)
    matcher.fill_draft_rows(rows, 0, drafts)
    assert ids["2"] in _allowed(rows, 0) and _allowed(rows, 2) == {ids["-"]}
    assert ids["a"] in _allowed(rows, 3) and len(_allowed(rows, 4)) == 49152  # past a refusal
    assert mask_now() == _allowed(rows, 0)  # left where it was


def _scheduled(rid: str, tokens: list[int], output: list[int], spec=(), sample=True):
    return ScheduledRequest(
        rid, tokens + list(spec), 0, [], sample, SamplingParams(), output, spec_token_ids=list(spec)
    )


def test_mask_rows_follow_the_runner_layout(tokenizer):
    manager = StructuredOutputManager(CONFIG, tokenizer, 49152, (2,))
    digits = SamplingParams(structured_outputs=SO(regex="[0-9]+"))
    for rid, params in (("a", digits), ("b", SamplingParams()), ("c", digits)):
        manager.add_request(Request(rid, [5, 6], params, (2,), 0))
    assert manager.num_requests == 2  # the free request has no matcher
    one = tokenizer.convert_tokens_to_ids("1")
    step = SchedulerOutput(
        [
            _scheduled("b", [7], [], spec=[8, 9]),  # rows 0-2, free
            _scheduled("a", [1, 2], [], sample=False),  # a prefill chunk: no row
            _scheduled("c", [PLACEHOLDER_TOKEN], [one]),  # row 3, its last token in flight
        ],
        4,
    )
    source = manager.mask_source(step)
    assert source is not None
    in_flight = PendingOutput.ready(ModelRunnerOutput(sampled={"c": one}))
    mask = manager.mask_source(step, in_flight)()
    assert mask.rows.tolist() == [3] and mask.bitmask.shape == (1, 1536)
    assert manager._matchers["c"].tokens == [one, one]  # the token in flight, accepted ahead
    assert manager.mask_source(SchedulerOutput([_scheduled("b", [7], [])], 1)) is None
    manager.finish(["a", "b", "c"])
    assert manager.num_requests == 0


def test_an_xgrammar_older_than_the_tested_one_is_warned_about():
    from batchlm.engine.structured_output.selector import TESTED_XGRAMMAR, old_xgrammar_warning

    assert old_xgrammar_warning(TESTED_XGRAMMAR) is None
    assert old_xgrammar_warning("0.2.10") is None
    message = old_xgrammar_warning("0.2.7")
    assert "0.2.7" in message and TESTED_XGRAMMAR in message and "pip install" in message
