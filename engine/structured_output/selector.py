"""Which grammar backend serves a request: `structured_outputs_config` read and checked, the
backend for each spec, and the backend objects built on demand.

`auto` prefers xgrammar (masks precomputed per grammar state: the cheapest per step) and
turns to guidance for what only it serves (`whitespace_pattern`) or when xgrammar is not
installed; a backend named outright must be installed, checked when the `LLM` is built.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from ..config import StructuredOutputsConfig
from ..errors import InvalidParamError
from .backend import GrammarBackend
from .grammar_spec import GrammarSpec

BACKENDS = ("auto", "xgrammar", "guidance")

_MODULES = {"xgrammar": "xgrammar", "guidance": "llguidance"}
"""Backend → the module it imports."""

_INSTALL = {
    "xgrammar": "pip install 'xgrammar>=0.2.9,<0.3' (or pip install 'batchlm[structured]')",
    "guidance": "pip install 'llguidance>=1.9.1,<2' (or pip install 'batchlm[structured]')",
}


def is_installed(backend: str) -> bool:
    """Whether the backend's library can be imported (without importing it)."""
    return importlib.util.find_spec(_MODULES[backend]) is not None


def parse_structured_outputs_config(value: Mapping[str, Any] | None) -> StructuredOutputsConfig:
    """`LLM(structured_outputs_config=...)` → the checked config.

    Raises:
        InvalidParamError: not a mapping, an unknown key, a value of the wrong type, an
            unknown backend, or a backend named outright that is not installed.
    """
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, StructuredOutputsConfig):
        config = value
    else:
        valid = [f.name for f in fields(StructuredOutputsConfig)]
        if not isinstance(value, Mapping):
            raise InvalidParamError(
                f"structured_outputs_config={value!r} must be a dict with keys {valid}"
            )
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise InvalidParamError(
                f"structured_outputs_config has unknown key(s) {unknown}; valid keys: {valid}"
            )
        config = StructuredOutputsConfig(**value)
    if config.backend not in BACKENDS:
        raise InvalidParamError(
            f"structured_outputs_config backend={config.backend!r} is unknown; use one of "
            f"{list(BACKENDS)}"
        )
    for name in ("disable_any_whitespace", "disable_additional_properties"):
        if not isinstance(getattr(config, name), bool):
            raise InvalidParamError(
                f"structured_outputs_config {name}={getattr(config, name)!r} must be True or False"
            )
    if config.backend != "auto" and not is_installed(config.backend):
        raise InvalidParamError(
            f"structured_outputs_config backend={config.backend!r} needs the "
            f"{_MODULES[config.backend]} package, which is not installed: "
            f"{_INSTALL[config.backend]}, or use backend='auto'"
        )
    return config


def backend_for(config: StructuredOutputsConfig, spec: GrammarSpec) -> str:
    """The backend that serves `spec`.

    Raises:
        InvalidParamError: no installed backend serves it (the message says what to install).
    """
    if config.backend != "auto":
        if config.backend == "xgrammar" and spec.whitespace_pattern is not None:
            raise InvalidParamError(
                "structured_outputs with whitespace_pattern, which needs the guidance backend, "
                "and this LLM was built with structured_outputs_config backend='xgrammar'; "
                "drop whitespace_pattern or use backend='auto' / 'guidance'"
            )
        return config.backend
    order = ("guidance",) if spec.whitespace_pattern is not None else ("xgrammar", "guidance")
    for name in order:
        if is_installed(name):
            return name
    needed = " or ".join(_INSTALL[name] for name in order)
    raise InvalidParamError(
        f"structured_outputs, which need a grammar engine, and none is installed: {needed}"
    )


def create_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> GrammarBackend:
    """The backend `name`, bound to the engine's tokenizer and vocabulary."""
    if name == "xgrammar":
        from .xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    from .guidance_backend import GuidanceBackend

    return GuidanceBackend(tokenizer, vocab_size, stop_token_ids)
