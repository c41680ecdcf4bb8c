"""Exact tests of the KV cache manager: block ids, ref counts, LRU eviction, prefix hits.

Pure Python, no model. Every expected value is derived by hand from the documented rules:
a fresh pool hands out ids in order; fresh blocks come from the front of the free queue and
lose their hash; freed blocks join the tail, a request's last block first; a full block's
hash chains its parent's; a lookup never covers a request's last token.
"""

from __future__ import annotations

import pytest

from batchlm.engine.core.kv_cache import BlockPool, KVCacheManager, hash_block
from batchlm.engine.core.request import Request
from batchlm.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_manager(
    num_blocks: int, block_size: int = BLOCK_SIZE, enable_prefix_caching: bool = True
) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching)


def make_request(request_id: str, token_ids) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(), (), 0)


def prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Allocate a new request's whole prompt as the scheduler does; returns the new ids."""
    computed = manager.get_computed_blocks(request)
    num_new_tokens = request.num_tokens - computed.num_computed_tokens
    new_ids = manager.allocate_slots(request, num_new_tokens, computed)
    assert new_ids is not None
    request.num_computed_tokens = request.num_tokens
    return new_ids


def decode(manager: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """Append a sampled token and make room for its KV, as one decode step does."""
    request.append_output_token(token_id)
    new_ids = manager.allocate_slots(request, 1)
    if new_ids is not None:
        request.num_computed_tokens += 1
    return new_ids


def free_queue(manager: KVCacheManager) -> list[int]:
    """Free block ids, the next to be evicted first."""
    return manager.pool.free_block_ids()


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [manager.pool.ref_cnt(i) for i in range(manager.pool.num_blocks)]


def hashed(manager: KVCacheManager, request_id: str) -> list[bool]:
    """Per block of the request's table: does it carry a hash (is it full and cached)?"""
    return [block.block_hash is not None for block in manager.req_blocks[request_id]]


# ---- BlockPool -------------------------------------------------------------------------


def test_block_pool_rejects_an_empty_pool():
    with pytest.raises(ValueError, match="num_blocks=0 must be >= 1"):
        BlockPool(0, enable_caching=True)


def test_fresh_pool_hands_out_block_ids_in_order():
    pool = BlockPool(5, enable_caching=True)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 4]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, 0 free"):
        pool.allocate(1)


def test_blocks_come_into_being_on_first_use_in_the_order_of_a_full_queue():
    """A pool of millions of blocks holds objects only for the blocks used so far, and
    hands out ids in the order a queue holding every id from the start would: unused ids
    first, then freed blocks, least recently freed first."""
    pool = BlockPool(50_000_000, enable_caching=True)
    assert pool.num_free_blocks == 50_000_000 and pool.blocks == []
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2] and len(pool.blocks) == 3
    pool.free([a[2], a[0]])
    assert pool.num_free_blocks == 50_000_000 - 1
    assert [pool.ref_cnt(i) for i in range(5)] == [0, 1, 0, 0, 0]
    assert [b.block_id for b in pool.allocate(2)] == [3, 4] and len(pool.blocks) == 5
    small = BlockPool(6, enable_caching=True)
    blocks = small.allocate(3)
    small.free([blocks[2], blocks[0]])
    assert small.free_block_ids() == [3, 4, 5, 2, 0]
    # The never-used blocks go before the freed ones, which follow least recently freed
    # first.
    assert [b.block_id for b in small.allocate(4)] == [3, 4, 5, 2]
    assert small.free_block_ids() == [0] and len(small.blocks) == 6


def test_fresh_manager_hands_out_block_ids_in_order():
    manager = make_manager(8)
    assert prefill(manager, make_request("a", range(100, 110))) == [0, 1, 2]
    assert prefill(manager, make_request("b", range(200, 203))) == [3]
    assert prefill(manager, make_request("c", range(300, 305))) == [4, 5]
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.block_ids("b") == [3]
    assert manager.block_ids("c") == [4, 5]
    assert free_queue(manager) == [6, 7]
    assert manager.block_ids("unknown") == []


# ---- allocate_slots --------------------------------------------------------------------


def test_allocate_slots_returns_exactly_the_new_block_ids():
    manager = make_manager(10)
    request = make_request("a", range(100, 110))
    assert manager.allocate_slots(request, 10) == [0, 1, 2]  # ceil(10 / 4) blocks
    request.num_computed_tokens = 10
    request.append_output_token(50)
    request.append_output_token(51)
    assert manager.allocate_slots(request, 2) == []  # 12 tokens still fit in 3 blocks
    request.num_computed_tokens = 12
    request.append_output_token(52)
    assert manager.allocate_slots(request, 1) == [3]  # token 13 opens block 4
    assert manager.block_ids("a") == [0, 1, 2, 3]
    assert manager.num_free_blocks == 6


def test_chunked_allocation_grows_per_chunk_and_hashes_only_full_blocks():
    manager = make_manager(8)
    request = make_request("a", range(100, 110))
    assert manager.allocate_slots(request, 3) == [0]
    request.num_computed_tokens = 3
    assert hashed(manager, "a") == [False]  # 3 of 4 slots written
    assert manager.allocate_slots(request, 4) == [1]
    request.num_computed_tokens = 7
    assert hashed(manager, "a") == [True, False]
    assert manager.allocate_slots(request, 3) == [2]
    request.num_computed_tokens = 10
    assert hashed(manager, "a") == [True, True, False]
    assert len(request.block_hashes) == 2


def test_allocate_slots_short_pool_returns_none_and_changes_nothing():
    manager = make_manager(3)
    a = make_request("a", range(100, 108))
    assert prefill(manager, a) == [0, 1]

    # A new request needing 2 blocks with 1 free: refused, and not tracked at all.
    b = make_request("b", range(200, 208))
    computed = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 8, computed) is None
    assert manager.block_ids("b") == []
    assert "b" not in manager.req_blocks
    assert "b" not in manager.num_cached_blocks
    assert free_queue(manager) == [2]
    assert ref_cnts(manager) == [1, 1, 0]

    # A running request grows into the last block, then is refused with its table intact.
    assert decode(manager, a, 1) == [2]  # token 9 opens block 3
    for token_id in (2, 3, 4):  # tokens 10-12 fill block 3
        assert decode(manager, a, token_id) == []
    assert decode(manager, a, 5) is None  # token 13 needs a 4th block
    assert manager.block_ids("a") == [0, 1, 2]
    assert ref_cnts(manager) == [1, 1, 1]
    assert manager.num_free_blocks == 0


def test_free_prefix_hits_count_against_available_blocks():
    manager = make_manager(6)
    prompt = list(range(10, 19))  # 9 tokens: blocks 0 and 1 full and cached, block 2 not
    a = make_request("a", prompt)
    assert prefill(manager, a) == [0, 1, 2]
    manager.free(a)
    assert free_queue(manager) == [3, 4, 5, 2, 1, 0]
    assert prefill(manager, make_request("c", range(90, 94))) == [3]
    assert free_queue(manager) == [4, 5, 2, 1, 0]

    # 21 tokens: hits on blocks 0 and 1 (both in the free queue), 4 new blocks needed.
    # 5 blocks are free, but taking the 2 hits out of the queue leaves only 3.
    b = make_request("b", prompt[:8] + list(range(30, 43)))
    computed = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in computed.blocks] == [0, 1]
    assert computed.num_computed_tokens == 8
    assert manager.allocate_slots(b, 13, computed) is None
    assert free_queue(manager) == [4, 5, 2, 1, 0]
    assert ref_cnts(manager) == [0, 0, 0, 1, 0, 0]
    assert manager.pool.get_cached_block(b.block_hashes[0]) is manager.pool.blocks[0]
    assert manager.pool.get_cached_block(b.block_hashes[1]) is manager.pool.blocks[1]
    assert "b" not in manager.req_blocks

    # 17 tokens: same hits, 3 new blocks needed, exactly 3 available.
    b2 = make_request("b2", prompt[:8] + list(range(30, 39)))
    computed = manager.get_computed_blocks(b2)
    assert [blk.block_id for blk in computed.blocks] == [0, 1]
    assert manager.allocate_slots(b2, 9, computed) == [4, 5, 2]
    assert manager.block_ids("b2") == [0, 1, 4, 5, 2]
    assert ref_cnts(manager) == [1, 1, 1, 1, 1, 1]
    assert manager.num_free_blocks == 0
    assert hashed(manager, "b2") == [True, True, True, True, False]


# ---- ref counts and LRU order ----------------------------------------------------------


def test_shared_prefix_ref_counts():
    manager = make_manager(8)
    a = make_request("a", range(100, 109))
    assert prefill(manager, a) == [0, 1, 2]
    assert ref_cnts(manager) == [1, 1, 1, 0, 0, 0, 0, 0]

    b = make_request("b", list(range(100, 108)) + [200, 201, 202])
    computed = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in computed.blocks] == [0, 1]
    assert computed.num_computed_tokens == 8
    assert ref_cnts(manager)[:2] == [1, 1]  # a lookup takes no reference
    assert manager.allocate_slots(b, 3, computed) == [3]
    assert manager.block_ids("b") == [0, 1, 3]
    assert ref_cnts(manager) == [2, 2, 1, 1, 0, 0, 0, 0]

    manager.free(a)
    assert ref_cnts(manager) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert free_queue(manager) == [4, 5, 6, 7, 2]  # only a's private block is free
    assert manager.block_ids("a") == []

    manager.free(b)
    assert ref_cnts(manager) == [0] * 8
    assert free_queue(manager) == [4, 5, 6, 7, 2, 3, 1, 0]

    manager.free(make_request("unknown", [1]))  # nothing allocated: a no-op
    assert free_queue(manager) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_free_is_tail_first_and_lru_across_requests():
    manager = make_manager(8)
    a = make_request("a", range(100, 108))
    b = make_request("b", range(200, 212))
    c = make_request("c", range(300, 304))
    assert prefill(manager, a) == [0, 1]
    assert prefill(manager, b) == [2, 3, 4]
    assert prefill(manager, c) == [5]
    assert free_queue(manager) == [6, 7]

    manager.free(b)
    assert free_queue(manager) == [6, 7, 4, 3, 2]
    manager.free(a)
    assert free_queue(manager) == [6, 7, 4, 3, 2, 1, 0]
    manager.free(c)
    assert free_queue(manager) == [6, 7, 4, 3, 2, 1, 0, 5]

    # Never-used blocks first, then b's (freed first) from its last block, then a's, then c's.
    assert prefill(manager, make_request("d", range(400, 412))) == [6, 7, 4]
    assert prefill(manager, make_request("e", range(500, 520))) == [3, 2, 1, 0, 5]
    assert manager.num_free_blocks == 0


def test_prefix_hit_moves_block_out_of_the_queue_and_back_to_the_tail():
    manager = make_manager(4)
    a = make_request("a", range(100, 105))  # block 0 full and cached, block 1 partial
    assert prefill(manager, a) == [0, 1]
    manager.free(a)
    assert free_queue(manager) == [2, 3, 1, 0]

    b = make_request("b", list(range(100, 104)) + [7])
    assert prefill(manager, b) == [2]  # hit on block 0, which leaves the queue
    assert manager.block_ids("b") == [0, 2]
    assert free_queue(manager) == [3, 1]
    manager.free(b)
    assert free_queue(manager) == [3, 1, 2, 0]


# ---- hashes and prefix hits ------------------------------------------------------------


def test_evicted_block_loses_its_hash():
    manager = make_manager(4)
    prompt = list(range(100, 109))
    a = make_request("a", prompt)
    assert prefill(manager, a) == [0, 1, 2]
    h0, h1 = a.block_hashes
    manager.free(a)
    assert free_queue(manager) == [3, 2, 1, 0]

    x = make_request("x", range(600, 612))
    assert prefill(manager, x) == [3, 2, 1]  # block 1 is reused: h1 is forgotten
    assert manager.pool.get_cached_block(h1) is None
    assert manager.pool.blocks[1].block_hash == x.block_hashes[2]
    assert manager.pool.get_cached_block(h0) is manager.pool.blocks[0]

    # The same prompt again: block 0 still hits, block 1 misses.
    computed = manager.get_computed_blocks(make_request("b", prompt))
    assert [blk.block_id for blk in computed.blocks] == [0]
    assert computed.num_computed_tokens == 4

    manager.free(x)
    assert free_queue(manager) == [0, 1, 2, 3]
    assert prefill(manager, make_request("y", range(700, 716))) == [0, 1, 2, 3]
    assert manager.pool.get_cached_block(h0) is None
    assert manager.pool.blocks[0].block_hash != h0
    computed = manager.get_computed_blocks(make_request("c", prompt))
    assert computed.blocks == []
    assert computed.num_computed_tokens == 0


def test_lookup_always_leaves_a_token_to_compute():
    manager = make_manager(8, block_size=16)
    prompt = list(range(1000, 1032))
    a = make_request("a", prompt)
    assert prefill(manager, a) == [0, 1]
    assert hashed(manager, "a") == [True, True]

    # Both blocks of the 32-token prompt are cached, but only the first one hits.
    b = make_request("b", prompt)
    computed = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in computed.blocks] == [0]
    assert computed.num_computed_tokens == 16
    assert manager.allocate_slots(b, 16, computed) == [2]
    assert manager.block_ids("b") == [0, 2]
    assert ref_cnts(manager)[:3] == [2, 1, 1]
    # Block 2 holds the same tokens as block 1; the first one computed stays the cached one.
    assert manager.pool.blocks[2].block_hash == a.block_hashes[1]
    assert manager.pool.get_cached_block(a.block_hashes[1]) is manager.pool.blocks[1]

    def num_hit_tokens(token_ids) -> int:
        return manager.get_computed_blocks(make_request("q", token_ids)).num_computed_tokens

    assert num_hit_tokens(prompt + [7]) == 32
    assert num_hit_tokens(prompt[:31]) == 16
    assert num_hit_tokens(prompt[:17]) == 16
    assert num_hit_tokens(prompt[:16]) == 0


def test_chained_hash_needs_the_whole_prefix_to_match():
    manager = make_manager(8)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(manager, a)
    assert a.block_hashes[0] == hash_block(None, [1, 2, 3, 4])
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], [5, 6, 7, 8])

    # Same tokens in block 2, different block 1: block 2's hash differs, nothing hits.
    b = make_request("b", [11, 12, 13, 14, 5, 6, 7, 8, 9])
    computed = manager.get_computed_blocks(b)
    assert computed.blocks == []
    assert computed.num_computed_tokens == 0
    assert b.block_hashes[1] != a.block_hashes[1]
    assert manager.pool.get_cached_block(b.block_hashes[1]) is None

    # Same block 1, different block 2: only block 1 hits.
    c = make_request("c", [1, 2, 3, 4, 15, 16, 17, 18, 9])
    computed = manager.get_computed_blocks(c)
    assert [blk.block_id for blk in computed.blocks] == [0]
    assert computed.num_computed_tokens == 4


def test_prefix_cache_counters_in_tokens():
    manager = make_manager(8)
    prefill(manager, make_request("a", range(100, 109)))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (9, 0)
    prefill(manager, make_request("b", list(range(100, 108)) + [200, 201, 202]))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (20, 8)
    prefill(manager, make_request("c", range(100, 117)))  # 17 tokens, hits blocks 0 and 1
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (37, 16)


def test_usage_is_the_fraction_of_referenced_blocks():
    manager = make_manager(8)
    assert manager.usage == 0.0
    a = make_request("a", range(100, 109))
    prefill(manager, a)
    assert manager.usage == 3 / 8
    b = make_request("b", list(range(100, 108)) + [200, 201, 202])
    prefill(manager, b)  # shares blocks 0 and 1, adds block 3
    assert manager.usage == 4 / 8
    manager.free(a)
    assert manager.usage == 3 / 8
    manager.free(b)
    assert manager.usage == 0.0  # cached blocks in the free queue are not in use
    assert len(manager.pool.cached) == 2


# ---- decode growth ---------------------------------------------------------------------


def test_decode_allocates_at_block_boundaries_and_hashes_full_blocks():
    manager = make_manager(8)
    request = make_request("a", range(100, 106))
    assert prefill(manager, request) == [0, 1]
    assert hashed(manager, "a") == [True, False]
    assert len(request.block_hashes) == 1

    # (position of the sampled token, new block ids, blocks hashed once its KV is written)
    expected = [
        (6, [], [True, False]),
        (7, [], [True, True]),
        (8, [2], [True, True, False]),
        (9, [], [True, True, False]),
        (10, [], [True, True, False]),
        (11, [], [True, True, True]),
        (12, [3], [True, True, True, False]),
        (13, [], [True, True, True, False]),
    ]
    for position, new_ids, is_hashed in expected:
        token_id = 500 + position
        assert decode(manager, request, token_id) == new_ids, position
        assert request.num_computed_tokens == position + 1
        assert hashed(manager, "a") == is_hashed, position
    assert manager.block_ids("a") == [0, 1, 2, 3]
    tokens = request.all_token_ids
    assert request.block_hashes[1] == hash_block(request.block_hashes[0], tokens[4:8])
    assert manager.pool.blocks[2].block_hash == hash_block(request.block_hashes[1], tokens[8:12])

    # Blocks filled by generated tokens are shared like prompt blocks.
    computed = manager.get_computed_blocks(make_request("b", tokens[:12] + [1]))
    assert [blk.block_id for blk in computed.blocks] == [0, 1, 2]


# ---- prefix caching off ----------------------------------------------------------------


def test_prefix_caching_disabled_never_hashes_or_hits():
    manager = make_manager(8, enable_prefix_caching=False)
    prompt = list(range(100, 109))
    a = make_request("a", prompt)
    assert prefill(manager, a) == [0, 1, 2]
    assert hashed(manager, "a") == [False, False, False]
    assert a.block_hashes == []

    b = make_request("b", prompt)
    computed = manager.get_computed_blocks(b)
    assert computed.blocks == []
    assert computed.num_computed_tokens == 0
    assert prefill(manager, b) == [3, 4, 5]

    manager.free(a)
    assert free_queue(manager) == [6, 7, 2, 1, 0]
    assert prefill(manager, make_request("c", prompt)) == [6, 7, 2]
    assert manager.pool.cached == {}
    assert all(block.block_hash is None for block in manager.pool.blocks)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    manager = make_manager(4)
    prompt = list(range(100, 109))
    a = make_request("a", prompt)
    prefill(manager, a)
    assert manager.reset_prefix_cache() is False
    assert len(manager.pool.cached) == 2
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.pool.cached == {}
    assert all(block.block_hash is None for block in manager.pool.blocks)
    assert manager.get_computed_blocks(make_request("b", prompt)).blocks == []


def table_rows(manager: KVCacheManager) -> dict[str, list[int]]:
    """Each request's row of the manager's block table, trimmed of trailing zeros past its
    blocks (which must all be zero)."""
    rows = {}
    for rid, row in manager.block_rows.items():
        n = len(manager.block_ids(rid))
        assert not manager.block_table[row, n:].any(), f"{rid}: stale ids past its blocks"
        rows[rid] = manager.block_table[row, :n].tolist()
    return rows


def test_block_table_rows_follow_block_ids_through_growth_hits_and_reuse():
    manager = make_manager(200)
    requests = {}
    # 20 requests (more rows than the table starts with), the first of 80 tokens (more
    # blocks than it starts with), two sharing a cached prefix.
    for i in range(20):
        tokens = range(80) if i == 0 else [1000 + i] * 8 + list(range(i, i + 4))
        requests[f"r{i}"] = make_request(f"r{i}", tokens)
        prefill(manager, requests[f"r{i}"])
    shared = make_request("shared", range(80))
    hit = prefill(manager, shared)
    assert manager.block_ids("shared")[:19] == manager.block_ids("r0")[:19]
    assert hit == manager.block_ids("shared")[19:]
    assert manager.block_table.shape[0] >= 21 and manager.block_table.shape[1] >= 20
    assert table_rows(manager) == {rid: manager.block_ids(rid) for rid in manager.block_rows}
    # Decode steps that cross block boundaries append to the rows.
    for _ in range(6):
        for request in requests.values():
            assert decode(manager, request, 7) is not None
    assert table_rows(manager) == {rid: manager.block_ids(rid) for rid in manager.block_rows}
    # A finished request's row is cleared and handed to the next request.
    row = manager.block_rows["r0"]
    manager.free(requests["r0"])
    assert "r0" not in manager.block_rows
    assert not manager.block_table[row].any()
    late = make_request("late", [5] * 6)
    prefill(manager, late)
    assert manager.block_rows["late"] == row
    assert table_rows(manager)["late"] == manager.block_ids("late")
