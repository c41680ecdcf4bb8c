"""Speculative decoding: draft tokens (n-gram prompt lookup or a draft model) verified by the
target model with rejection sampling, so that outputs keep the target's distribution."""

from __future__ import annotations

from .ngram import NgramProposer
from .options import SpeculativeOptions, parse_speculative_options

__all__ = ["NgramProposer", "SpeculativeOptions", "parse_speculative_options"]
