"""`StructuredOutputsParams`: a request's output constraint, with vLLM's names.

Exactly one constraint kind per request: a JSON Schema (`json`), any JSON object
(`json_object=True`), a regular expression (`regex`), one of a list of strings (`choice`),
an EBNF / GBNF or Lark grammar (`grammar`), or xgrammar's structural tags
(`structural_tag`). The grammar engine compiles it when the request is
validated (`LLM.generate` refuses one it cannot compile before any request starts); this
module only checks types and shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidParamError
from .inputs import check_text

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The fields that name a constraint; a request sets exactly one of them."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output to a JSON Schema, a regex, a choice or a grammar.

    Example:
        >>> from batchlm.engine import LLM, SamplingParams, StructuredOutputsParams
        >>> schema = {"type": "object", "properties": {"name": {"type": "string"}}}
        >>> params = SamplingParams(
        ...     max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema)
        ... )
    """

    json: dict[str, Any] | str | None = None
    """A JSON Schema (a dict, or its JSON text); the output is one JSON value it accepts.
    Properties come in the schema's order; objects take no property the schema does not
    declare (xgrammar's strict mode; with the guidance backend, see
    `disable_additional_properties`)."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: EBNF as llama.cpp's GBNF writes it (`root ::= ...`), or Lark
    (no `::=` rule: the guidance backend reads it, and for xgrammar it is converted to EBNF
    as vLLM converts it, `structured_output/lark.py`)."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    disable_any_whitespace: bool = False
    """JSON only: no whitespace between tokens of the JSON (xgrammar then writes `, ` and
    `: ` between items, the guidance backend `,` and `:`). Small models otherwise tend to
    fill their budget with newlines."""
    disable_additional_properties: bool = False
    """JSON only: every object schema without `additionalProperties` gets `false`, so the
    output has only the declared properties (xgrammar's default already)."""
    whitespace_pattern: str | None = None
    """JSON only: a regex for the whitespace allowed between JSON tokens (the guidance
    backend only; `backend="auto"` picks it for such requests)."""
    structural_tag: str | dict[str, Any] | None = None
    """xgrammar's structural tags (JSON text, or its dict): free text in which each
    trigger opens a tagged section constrained by its own schema, either xgrammar's
    `{"type": "structural_tag", "format": ...}` or vLLM's older `{"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}`. Served by the xgrammar backend."""
    backend: str | None = None
    """The grammar engine of this request: None (the engine's), `xgrammar` or `guidance`.
    Under the engine's `backend="auto"` it picks this request's backend; an engine built
    with a named backend refuses another one, as vLLM does (the engine-level option is
    `LLM(structured_outputs_config={"backend": ...})`)."""

    def __post_init__(self) -> None:
        kinds = [name for name in CONSTRAINT_KINDS if _is_set(getattr(self, name))]
        if len(kinds) != 1:
            what = "none is" if not kinds else f"{len(kinds)} are ({', '.join(kinds)})"
            raise InvalidParamError(
                f"structured_outputs needs exactly one constraint, but {what} set; set one "
                f"of {', '.join(CONSTRAINT_KINDS)}"
            )
        self._check_json()
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check_string(name, value)
        if self.choice is not None:
            self._check_choice()
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise InvalidParamError(
                f"structured_outputs.json_object={self.json_object!r} must be True or None"
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParamError(
                    f"structured_outputs.{name}={getattr(self, name)!r} must be True or False"
                )
        if self.structural_tag is not None:
            self._check_structural_tag()
        if self.backend is not None and self.backend not in ("auto", "xgrammar", "guidance"):
            raise InvalidParamError(
                f"structured_outputs.backend={self.backend!r} is unknown; use None (the "
                "engine's), 'xgrammar' or 'guidance'"
            )
        if self.whitespace_pattern is not None:
            _check_string("whitespace_pattern", self.whitespace_pattern)
            if self.kind not in ("json", "json_object"):
                raise InvalidParamError(
                    f"structured_outputs.whitespace_pattern applies to json / json_object, not "
                    f"{self.kind}; drop it"
                )

    @property
    def kind(self) -> str:
        """The constraint's kind: one of `CONSTRAINT_KINDS`."""
        return next(name for name in CONSTRAINT_KINDS if _is_set(getattr(self, name)))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> StructuredOutputsParams:
        """From plain data (a job's `structured_outputs:`, a row's JSON cell).

        Raises:
            InvalidParamError: an unknown key, or any of the constructor's errors.
        """
        if not isinstance(values, Mapping):
            raise InvalidParamError(
                f"structured_outputs must be a mapping of {', '.join(valid_keys())}, got "
                f"{type(values).__name__}: {values!r:.80}"
            )
        unknown = sorted(set(values) - set(valid_keys()))
        if unknown:
            raise InvalidParamError(
                f"structured_outputs has unknown key(s) {unknown}; valid keys: "
                f"{', '.join(valid_keys())}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what `from_dict` takes back)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != f.default
        }

    def _check_json(self) -> None:
        schema = self.json
        if schema is None:
            return
        if isinstance(schema, str):
            _check_string("json", schema)
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidParamError(
                    f"structured_outputs.json is not valid JSON ({e.msg} at line {e.lineno}, "
                    f"column {e.colno}): {self.json!r:.80}; pass a JSON Schema object"
                ) from None
        if not isinstance(schema, dict):
            raise InvalidParamError(
                f"structured_outputs.json must be a JSON Schema object (a dict or its JSON "
                f"text), got {type(schema).__name__}: {schema!r:.80}"
            )

    def _check_structural_tag(self) -> None:
        tag = self.structural_tag
        if isinstance(tag, str):
            _check_string("structural_tag", tag)
            try:
                tag = json.loads(tag)
            except json.JSONDecodeError as e:
                raise InvalidParamError(
                    f"structured_outputs.structural_tag is not valid JSON ({e.msg} at line "
                    f"{e.lineno}, column {e.colno}): {self.structural_tag!r:.80}"
                ) from None
        if not isinstance(tag, dict) or not tag:
            raise InvalidParamError(
                f"structured_outputs.structural_tag must be a JSON object (a dict or its JSON "
                f"text), got {type(tag).__name__}: {tag!r:.80}"
            )

    def _check_choice(self) -> None:
        choice = self.choice
        if not isinstance(choice, (list, tuple)) or not choice:
            raise InvalidParamError(
                f"structured_outputs.choice={choice!r:.80} must be a non-empty list of strings"
            )
        for i, option in enumerate(choice):
            if not isinstance(option, str) or not option:
                raise InvalidParamError(
                    f"structured_outputs.choice[{i}]={option!r:.80} must be a non-empty string"
                )
            check_text(option, f"structured_outputs.choice[{i}]", InvalidParamError)


def valid_keys() -> tuple[str, ...]:
    """The fields `StructuredOutputsParams` takes (the keys of its plain-data form)."""
    return tuple(f.name for f in fields(StructuredOutputsParams))


def _is_set(value: Any) -> bool:
    # json_object=False sets nothing (vLLM counts it; here it simply means "not this kind").
    return value is not None and value is not False


def _check_string(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidParamError(
            f"structured_outputs.{name}={value!r:.80} must be a non-empty string"
        )
    check_text(value, f"structured_outputs.{name}", InvalidParamError)
