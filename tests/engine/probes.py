"""Hooks that record what the engine did, for assertions about scheduling."""

from __future__ import annotations

from batchlm.engine import LLM


def record_partial_prefills(llm: LLM) -> list[str]:
    """Wrap the scheduler so that every request scheduled for a prompt chunk that does not
    reach its last token (a chunked prefill) is appended to the returned list."""
    scheduler = llm.llm_engine.scheduler
    original = scheduler.schedule
    partial: list[str] = []

    def schedule(ahead: bool = False):
        out = original(ahead=ahead)
        partial.extend(s.request_id for s in out.scheduled if not s.needs_sample)
        return out

    scheduler.schedule = schedule
    return partial
