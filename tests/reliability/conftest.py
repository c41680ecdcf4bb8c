"""Shared helpers for the reliability tests: the engine's health after a bad call."""

from __future__ import annotations

from typing import Any

import pytest


def assert_no_leaks(llm: Any) -> None:
    """No request is left in the engine and every KV block is back in the free pool."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests(), engine.scheduler.requests
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks, (
        f"{engine.num_kv_blocks - engine.kv_cache.num_free_blocks} KV blocks leaked"
    )
    assert not engine.kv_cache.req_blocks, "a request still owns blocks"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These tests run thousands of tiny forward passes; on a busy 2-core machine the
    synchronisation of torch's intra-op threads costs more than the work, so they run on one
    thread (restored afterwards). The code paths are the same."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
