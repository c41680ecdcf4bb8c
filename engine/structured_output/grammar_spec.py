"""`GrammarSpec`: a request's constraint in the one canonical form the grammar cache keys on.

Two requests whose constraints compile to the same grammar get equal specs: a schema given
as a dict and as its JSON text, with or without extra whitespace, is one spec (its keys
keep their order: xgrammar writes properties in the schema's order, so order is part of
the grammar). The engine-wide options of `StructuredOutputsConfig` are folded in here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..config import StructuredOutputsConfig
from ..structured_outputs_params import StructuredOutputsParams

ANY_JSON_OBJECT = '{"type": "object"}'
"""The schema of `json_object=True`."""

_NOT_SCHEMAS = ("enum", "const", "default", "examples")
"""Schema keywords whose values are data, not schemas (left as they are)."""
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Schema keywords whose values map names to schemas (the names are not keywords)."""


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint, canonical and hashable."""

    kind: str
    """`json` (`json_object` becomes the schema of any object), `regex`, `choice`,
    `grammar` or `structural_tag`."""
    text: str
    """The schema as compact JSON, the regex or the grammar; for `choice`, the choices as a
    JSON list; for `structural_tag`, the tag as compact JSON."""
    any_whitespace: bool = True
    """json: whitespace may appear between JSON tokens."""
    whitespace_pattern: str | None = None
    """json: the regex of that whitespace (guidance backend)."""

    @property
    def choices(self) -> list[str]:
        """`choice`: the strings."""
        return json.loads(self.text)

    def describe(self) -> str:
        """A short name of the constraint for messages (`json schema`, `regex`, ...)."""
        return {"json": "json schema"}.get(self.kind, self.kind)


def grammar_spec(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> GrammarSpec:
    """The canonical spec of a request's constraint under the engine's options."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json.loads(ANY_JSON_OBJECT) if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if params.disable_additional_properties or config.disable_additional_properties:
            schema = without_additional_properties(schema)
        return GrammarSpec(
            "json",
            json.dumps(schema, ensure_ascii=False, separators=(",", ":")),
            any_whitespace=not (params.disable_any_whitespace or config.disable_any_whitespace),
            whitespace_pattern=params.whitespace_pattern,
        )
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(list(params.choice), ensure_ascii=False))
    if kind == "structural_tag":
        tag = params.structural_tag
        tag = json.loads(tag) if isinstance(tag, str) else tag
        return GrammarSpec(kind, json.dumps(tag, ensure_ascii=False, separators=(",", ":")))
    return GrammarSpec(kind, getattr(params, kind))


def without_additional_properties(schema: Any) -> Any:
    """A copy of `schema` in which every object schema (`"type": "object"` or with
    `properties`) that does not say `additionalProperties` says `false`."""
    if isinstance(schema, list):
        return [without_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _NOT_SCHEMAS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: without_additional_properties(v) for name, v in value.items()}
        else:
            out[key] = without_additional_properties(value)
    is_object = out.get("type") == "object" or isinstance(out.get("properties"), dict)
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
