"""Shared helpers for the reliability tests: the engine's health after a bad call."""

from __future__ import annotations

from typing import Any


def assert_no_leaks(llm: Any) -> None:
    """No request is left in the engine and every KV block is back in the free pool."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests(), engine.scheduler.requests
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks, (
        f"{engine.num_kv_blocks - engine.kv_cache.num_free_blocks} KV blocks leaked"
    )
    assert not engine.kv_cache.req_blocks, "a request still owns blocks"
