"""Structured outputs as vLLM 0.26 has them: `structural_tag` (xgrammar's structural tags,
its own format and vLLM's older one), the request's `backend` against the engine's, Lark
grammars converted to EBNF as vLLM's `convert_lark_to_ebnf` converts them (the expected
EBNF below is that function's output on the same grammars), and schemas whose keywords
xgrammar would not enforce refused on xgrammar and served by guidance under `auto`."""

from __future__ import annotations

import json
import re

import pytest

from batchlm.engine import LLM, SamplingParams, StructuredOutputsParams
from batchlm.engine.config import StructuredOutputsConfig
from batchlm.engine.errors import InvalidParamError
from batchlm.engine.structured_output.grammar_spec import grammar_spec
from batchlm.engine.structured_output.lark import LarkConversionError, is_lark, lark_to_ebnf
from batchlm.engine.structured_output.schema_support import xgrammar_unsupported_features
from batchlm.engine.structured_output.selector import backend_for

SO = StructuredOutputsParams

# Lark → vLLM 0.26's EBNF for the same grammar.
LARK_TO_EBNF = [
    ("rule: 'hello'", 'root ::= rule\nrule ::= "hello"'),
    (
        "// a comment\n?start: expr\nexpr: term ('+' term)*\n    | term\n"
        "term: NUMBER # trailing comment\nNUMBER: /[0-9]+/",
        'root ::= start\nstart ::= expr\nexpr ::= term ("+" term)* | term\n'
        "term ::= NUMBER\nNUMBER ::= /[0-9]+/",
    ),
    (
        'start: select_statement\nselect_statement: "SELECT " column " FROM " table\n'
        'column: "col_1" | "col_2"\ntable: "table_1" | "table_2"',
        'root ::= start\nstart ::= select_statement\nselect_statement ::= "SELECT " column '
        '" FROM " table\ncolumn ::= "col_1" | "col_2"\ntable ::= "table_1" | "table_2"',
    ),
]
LARK_ERRORS = [
    ("a: 'x", "Error on line 1: Mismatched quotes in rule 'a' on line 1"),
    ("| 'x'", "No valid rules found in grammar"),
    ("a: b", "Referenced rules are not defined: b"),
    ("", "Grammar string cannot be empty"),
    ("# only comment", "No valid rules found in grammar"),
]


@pytest.mark.parametrize("lark, ebnf", LARK_TO_EBNF)
def test_lark_converts_as_vllm_converts_it(lark, ebnf):
    assert is_lark(lark) and lark_to_ebnf(lark) == ebnf


@pytest.mark.parametrize("lark, message", LARK_ERRORS)
def test_lark_conversion_errors_are_vllms(lark, message):
    with pytest.raises(LarkConversionError) as e:
        lark_to_ebnf(lark)
    assert str(e.value) == message


def test_ebnf_is_not_taken_for_lark():
    assert not is_lark("root ::= 'x'")
    assert is_lark("# x ::= y\nrule: 'a'")  # a rule in a comment does not count
    assert not is_lark("")


def test_xgrammar_unsupported_keywords_are_vllms_list():
    nested = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "multipleOf": 3},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "when": {"type": "string", "format": "date-time"},
            "blob": {"type": "string", "format": "binary"},
            "any": {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^a"}}]},
        },
    }
    assert xgrammar_unsupported_features(nested) == [
        "integer.multipleOf",
        "array.uniqueItems",
        "string.format='binary'",
        "object.propertyNames",
    ]
    assert xgrammar_unsupported_features({"type": "object", "properties": {}}) == []


def test_backend_choice_follows_vllm():
    auto, xgr, guid = (StructuredOutputsConfig(backend=b) for b in ("auto", "xgrammar", "guidance"))
    multiple = grammar_spec(SO(json={"type": "integer", "multipleOf": 7}), auto)
    plain = grammar_spec(SO(json={"type": "integer"}), auto)
    tag = grammar_spec(SO(structural_tag={"structures": [], "triggers": []}), auto)
    assert backend_for(auto, plain) == "xgrammar"
    assert backend_for(auto, multiple) == "guidance"  # what xgrammar would not enforce
    assert backend_for(auto, tag) == "xgrammar"
    assert backend_for(auto, plain, "guidance") == "guidance"  # the request's own
    assert backend_for(xgr, plain, "xgrammar") == "xgrammar"
    with pytest.raises(InvalidParamError, match="features not supported by xgrammar"):
        backend_for(xgr, multiple)
    with pytest.raises(InvalidParamError, match="Request-level structured output backend sel"):
        backend_for(xgr, plain, "guidance")
    with pytest.raises(InvalidParamError, match="structural_tag.*use backend='auto'"):
        backend_for(guid, tag)
    with pytest.raises(InvalidParamError, match="backend='lmfe' is unknown"):
        SO(regex="a", backend="lmfe")
    with pytest.raises(InvalidParamError, match="structural_tag is not valid JSON"):
        SO(structural_tag="{nope")
    with pytest.raises(InvalidParamError, match=r"exactly one constraint, but 2"):
        SO(regex="a", structural_tag={"structures": [], "triggers": []})


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=256)
    yield llm
    llm.shutdown()


def _generate(llm, structured, max_tokens=48, n=4):
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=max_tokens, n=n, structured_outputs=structured
    )
    return [c for c in llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs]


def test_structural_tags_constrain_the_tagged_section(llm):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<f>",
            "content": {"type": "regex", "pattern": "[0-9]{1,3}"},
            "end": "</f>",
        },
    }
    for structured in (SO(structural_tag=json.dumps(tag)), SO(structural_tag=tag)):
        for out in _generate(llm, structured, max_tokens=32):
            assert out.finish_reason == "stop", out.text
            assert re.fullmatch(r"<f>[0-9]{1,3}</f>", out.text), out.text
    # vLLM's older format: free text, each trigger opening a constrained section.
    legacy = {
        "structures": [{"begin": "<n>", "schema": {"type": "integer"}, "end": "</n>"}],
        "triggers": ["<n>"],
    }
    outs = _generate(llm, SO(structural_tag=legacy), max_tokens=12, n=2)
    assert len(outs) == 2
    for out in outs:
        for section in re.findall(r"<n>(.*?)(?:</n>|$)", out.text, re.S):
            assert re.fullmatch(r"-?\d*", section.strip()), out.text


def test_lark_grammar_end_to_end_and_the_requests_backend(llm):
    lark = '?start: answer\nanswer: "yes" | "no" | "maybe"'
    for backend in (None, "xgrammar", "guidance"):
        for out in _generate(llm, SO(grammar=lark, backend=backend), max_tokens=8):
            assert out.text in ("yes", "no", "maybe"), (backend, out.text)
    assert set(llm.llm_engine.structured._backends) == {"xgrammar", "guidance"}


def test_schemas_xgrammar_would_not_enforce(llm, tiny_model_factory):
    schema = {"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 99}
    for out in _generate(llm, SO(json=schema), max_tokens=12):  # auto: guidance serves it
        assert out.finish_reason == "stop" and int(out.text) % 7 == 0, out.text
    strict = LLM(
        str(tiny_model_factory("llama")),
        max_model_len=256,
        structured_outputs_config={"backend": "xgrammar"},
    )
    bad = SamplingParams(max_tokens=4, structured_outputs=SO(json=schema))
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(InvalidParamError, match=r"prompts\[1\].*integer.multipleOf.*not supported"):
        strict.generate(["a", "b"], [good, bad])
    assert not strict.llm_engine.has_unfinished_requests()
    assert len(strict.generate(["a"], good, use_tqdm=False)[0].outputs[0].token_ids) == 4
    strict.shutdown()
