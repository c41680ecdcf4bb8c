"""JSON Schema keywords a grammar backend would not enforce, as vLLM 0.26 lists them.

xgrammar compiles a schema with these keywords but ignores them, so its outputs could
break the schema: vLLM refuses such a schema on the xgrammar backend, and under `auto`
serves it with guidance instead. batchlm does the same (`selector.backend_for`), before
any request starts.
"""

from __future__ import annotations

from typing import Any

XGRAMMAR_STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
"""The string `format`s xgrammar enforces."""

_ARRAY_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains")
_OBJECT_KEYWORDS = ("patternProperties", "propertyNames")


def xgrammar_unsupported_features(schema: Any) -> list[str]:
    """The keywords of `schema` (at any depth) xgrammar does not enforce, as `type.keyword`
    (empty when it enforces them all)."""
    found: list[str] = []
    for node in _schema_nodes(schema):
        kind = node.get("type")
        if kind in ("integer", "number") and "multipleOf" in node:
            found.append(f"{kind}.multipleOf")
        if kind == "array":
            found += [f"array.{k}" for k in _ARRAY_KEYWORDS if k in node]
        if kind == "string" and "format" in node and node["format"] not in XGRAMMAR_STRING_FORMATS:
            found.append(f"string.format={node['format']!r}")
        if kind == "object":
            found += [f"object.{k}" for k in _OBJECT_KEYWORDS if k in node]
    return list(dict.fromkeys(found))


def _schema_nodes(schema: Any):
    """Every dict of a schema, depth first: the values that are dicts, and the dicts in
    values that are lists (the walk vLLM's check makes)."""
    if not isinstance(schema, dict):
        return
    yield schema
    for value in schema.values():
        if isinstance(value, dict):
            yield from _schema_nodes(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    yield from _schema_nodes(item)
