"""Structured outputs: requests constrained to a JSON Schema, a regex, a choice or a grammar.

A grammar engine does the matching (xgrammar, or llguidance as `guidance`); this package
binds it to the engine: constraints compiled once per spec (`grammar_cache.py`), one matcher
per request on the host (`request_matcher.py`), and each step's token bitmask
(`manager.py`), which the runner applies to the logits on the device
(`worker/grammar_mask.py`).
"""

from .manager import StructuredOutputManager
from .selector import BACKENDS, parse_structured_outputs_config

__all__ = ["StructuredOutputManager", "BACKENDS", "parse_structured_outputs_config"]
