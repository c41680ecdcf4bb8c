"""Which grammar backend serves a request: `structured_outputs_config` read and checked, the
backend for each spec, and the backend objects built on demand.

`auto` prefers xgrammar (masks precomputed per grammar state: the cheapest per step) and
turns to guidance for what only it serves (`whitespace_pattern`) or when xgrammar is not
installed; a backend named outright must be installed, checked when the `LLM` is built.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from ..config import StructuredOutputsConfig
from ..errors import InvalidParamError
from .backend import GrammarBackend
from .grammar_spec import GrammarSpec
from .schema_support import xgrammar_unsupported_features

logger = logging.getLogger(__name__)

TESTED_XGRAMMAR = "0.2.9"
"""The xgrammar release the engine is tested and measured with. Older ones fill the step's
masks far more slowly (0.2.7 ran W1-json at 0.34× its free batch on an H200, 0.2.9 at 0.96×)."""

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


def backend_for(
    config: StructuredOutputsConfig, spec: GrammarSpec, requested: str | None = None
) -> str:
    """The backend that serves `spec`: the request's (`requested`), the engine's named
    one, or under `auto` xgrammar unless only guidance serves the spec (a whitespace
    pattern, a schema with keywords xgrammar would not enforce) or xgrammar is not
    installed.

    Raises:
        InvalidParamError: a request's backend other than the engine's named one, a spec
            the backend cannot serve, or no installed backend (the message says what to
            install or use).
    """
    if requested not in (None, "auto"):
        if config.backend not in ("auto", requested):
            raise InvalidParamError(
                f"structured_outputs with backend={requested!r}, and this LLM was built with "
                f"structured_outputs_config backend={config.backend!r}: Request-level "
                "structured output backend selection is not supported. The request specified "
                f"'{requested}', but vLLM was initialised with '{config.backend}'. Drop the "
                "request's backend, or build the LLM with structured_outputs_config="
                f"{{'backend': {requested!r}}} (or 'auto')"
            )
        _check_serves(requested, spec, f"the request's backend={requested!r}")
        if not is_installed(requested):
            raise InvalidParamError(
                f"structured_outputs backend={requested!r} needs the {_MODULES[requested]} "
                f"package, which is not installed: {_INSTALL[requested]}"
            )
        return requested
    if config.backend != "auto":
        _check_serves(config.backend, spec, f"structured_outputs_config backend={config.backend!r}")
        return config.backend
    if spec.kind == "structural_tag":
        order: tuple[str, ...] = ("xgrammar",)
    elif spec.whitespace_pattern is not None or _xgrammar_misses(spec):
        order = ("guidance",)
    else:
        order = ("xgrammar", "guidance")
    for name in order:
        if is_installed(name):
            return name
    needed = " or ".join(_INSTALL[name] for name in order)
    raise InvalidParamError(
        f"structured_outputs, which need a grammar engine, and none is installed: {needed}"
    )


def _xgrammar_misses(spec: GrammarSpec) -> list[str]:
    """The schema keywords xgrammar would not enforce (json specs)."""
    return xgrammar_unsupported_features(json.loads(spec.text)) if spec.kind == "json" else []


def _check_serves(backend: str, spec: GrammarSpec, chosen_by: str) -> None:
    """Raise when `backend` cannot serve `spec` as it should."""
    if backend == "xgrammar" and spec.whitespace_pattern is not None:
        raise InvalidParamError(
            f"structured_outputs with whitespace_pattern, which needs the guidance backend, "
            f"and {chosen_by}; drop whitespace_pattern or use backend='auto' / 'guidance'"
        )
    if backend == "guidance" and spec.kind == "structural_tag":
        raise InvalidParamError(
            f"structured_outputs with structural_tag, which the xgrammar backend serves, "
            f"and {chosen_by}; use backend='auto' or 'xgrammar'"
        )
    missing = _xgrammar_misses(spec) if backend == "xgrammar" else []
    if missing:
        raise InvalidParamError(
            f"structured_outputs whose json schema uses {', '.join(missing)}, which xgrammar "
            f"would not enforce, and {chosen_by}: The provided JSON schema contains features "
            "not supported by xgrammar. Use backend='auto' or 'guidance' (llguidance), or "
            "drop those keywords"
        )


def create_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> GrammarBackend:
    """The backend `name`, bound to the engine's tokenizer and vocabulary."""
    if name == "xgrammar":
        from importlib.metadata import version

        from .xgrammar_backend import XgrammarBackend

        warning = old_xgrammar_warning(version("xgrammar"))
        if warning is not None:
            logger.warning(warning)
        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    from .guidance_backend import GuidanceBackend

    return GuidanceBackend(tokenizer, vocab_size, stop_token_ids)


def old_xgrammar_warning(installed: str) -> str | None:
    """A warning when the installed xgrammar is older than `TESTED_XGRAMMAR` (None
    otherwise): it works, but constrained requests run much slower."""
    from packaging.version import Version

    if Version(installed) >= Version(TESTED_XGRAMMAR):
        return None
    return (
        f"xgrammar {installed} is older than {TESTED_XGRAMMAR}, the version batchlm is tested "
        "with: structured outputs work, but the per-step token masks are much slower (on an "
        "H200, 0.34x of the unconstrained throughput instead of 0.96x); pip install "
        f"'xgrammar>={TESTED_XGRAMMAR},<0.3'"
    )
