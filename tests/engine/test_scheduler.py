"""Exact tests of the token-budget scheduler, driven by hand without a model.

Each test builds Requests, calls `schedule()` and feeds sampled tokens back through
`update_from_output`, asserting every ScheduledRequest field, block id and queue. Expected
values are derived by hand from the documented rules: running requests first (oldest
first), then waiting ones first come, first served; a prompt longer than the remaining
budget is chunked; when the cache cannot grow a running request the newest running one is
preempted, freed tail first, and recomputed from scratch later; fresh blocks come from the
front of the KV cache's free queue.
"""

from __future__ import annotations

import pytest

from batchlm.engine.config import SchedulerConfig
from batchlm.engine.core.kv_cache import KVCacheManager
from batchlm.engine.core.request import Request, RequestStatus
from batchlm.engine.core.scheduler import Scheduler, SchedulerOutput
from batchlm.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(
    *,
    num_blocks: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    max_model_len: int = 64,
    long_context_len: int | None = None,
) -> Scheduler:
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    return Scheduler(config, kv_cache, max_model_len, long_context_len)


def add(
    scheduler: Scheduler, request_id: str, prompt, eos_token_id: int | None = None, **params
) -> Request:
    request = Request(
        request_id,
        list(prompt),
        SamplingParams(**params),
        () if eos_token_id is None else (eos_token_id,),
        scheduler.num_unfinished_requests,
    )
    scheduler.add_request(request)
    return request


def steps(out: SchedulerOutput) -> list[tuple[str, list[int], int, list[int], bool]]:
    """(request_id, token_ids, start_pos, block_ids, needs_sample) per scheduled request.

    block_ids is the live block table: copy it now, before a later step grows it. Each
    request's row of the step's `block_table` must hold the same ids, then zeros.
    """
    for s in out.scheduled:
        row = out.block_table[s.block_row].tolist()
        assert s.block_row >= 0
        assert row == list(s.block_ids) + [0] * (len(row) - len(s.block_ids)), s.request_id
    return [
        (s.request_id, list(s.token_ids), s.start_pos, list(s.block_ids), s.needs_sample)
        for s in out.scheduled
    ]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def ref_cnts(scheduler: Scheduler) -> list[int]:
    pool = scheduler.kv_cache.pool
    return [pool.ref_cnt(i) for i in range(pool.num_blocks)]


def free_queue(scheduler: Scheduler) -> list[int]:
    return scheduler.kv_cache.pool.free_block_ids()


def test_prefill_then_decode_until_max_tokens():
    sched = make_scheduler()
    a = add(sched, "a", range(100, 106), max_tokens=3)

    out = sched.schedule()
    assert steps(out) == [("a", list(range(100, 106)), 0, [0, 1], True)]
    assert out.num_scheduled_tokens == 6
    assert out.finished_request_ids == set()
    assert out.preempted_request_ids == []
    assert out.scheduled[0].sampling_params is a.sampling_params
    assert sched.update_from_output(out, {"a": 7}) == [a]
    assert a.output_token_ids == [7]
    assert a.status == RequestStatus.RUNNING
    assert a.num_cached_tokens == 0

    out = sched.schedule()
    assert steps(out) == [("a", [7], 6, [0, 1], True)]
    assert out.num_scheduled_tokens == 1
    assert out.scheduled[0].output_token_ids is a.output_token_ids
    sched.update_from_output(out, {"a": 8})

    out = sched.schedule()
    assert steps(out) == [("a", [8], 7, [0, 1], True)]
    assert sched.update_from_output(out, {"a": 9}) == [a]
    assert a.output_token_ids == [7, 8, 9]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.status.finish_reason == "length"
    assert not sched.has_unfinished_requests()
    assert sched.running == []
    assert sched.kv_cache.num_free_blocks == 16
    assert sched.kv_cache.block_ids("a") == []

    out = sched.schedule()
    assert out.is_empty
    assert out.num_scheduled_tokens == 0
    assert out.finished_request_ids == {"a"}
    assert sched.schedule().finished_request_ids == set()  # reported once


def test_running_requests_first_then_waiting_first_come_first_served():
    sched = make_scheduler()
    a = add(sched, "a", range(100, 105), max_tokens=8)
    b = add(sched, "b", range(200, 203), max_tokens=8)

    out = sched.schedule()
    assert steps(out) == [
        ("a", list(range(100, 105)), 0, [0, 1], True),
        ("b", [200, 201, 202], 0, [2], True),
    ]
    assert out.num_scheduled_tokens == 8
    assert sched.update_from_output(out, {"a": 1, "b": 2}) == [a, b]

    add(sched, "c", range(300, 304), max_tokens=8)
    add(sched, "d", range(400, 402), max_tokens=8)
    out = sched.schedule()
    assert steps(out) == [
        ("a", [1], 5, [0, 1], True),
        ("b", [2], 3, [2], True),
        ("c", list(range(300, 304)), 0, [3], True),
        ("d", [400, 401], 0, [4], True),
    ]
    assert out.num_scheduled_tokens == 8
    assert ids(sched.running) == ["a", "b", "c", "d"]


def test_add_request_rejects_a_duplicate_id():
    sched = make_scheduler()
    add(sched, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="request_id='a' is already in the engine"):
        add(sched, "a", [4, 5])


# ---- token budget and chunked prefill ----------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, "a", range(100, 120), max_tokens=2)

    out = sched.schedule()
    assert steps(out) == [("a", list(range(100, 108)), 0, [0, 1], False)]
    assert out.num_scheduled_tokens == 8
    assert sched.update_from_output(out, {}) == []
    assert a.num_computed_tokens == 8

    out = sched.schedule()
    assert steps(out) == [("a", list(range(108, 116)), 8, [0, 1, 2, 3], False)]
    assert out.num_scheduled_tokens == 8
    sched.update_from_output(out, {})

    out = sched.schedule()
    assert steps(out) == [("a", list(range(116, 120)), 16, [0, 1, 2, 3, 4], True)]
    assert out.num_scheduled_tokens == 4
    assert sched.update_from_output(out, {"a": 1}) == [a]

    out = sched.schedule()
    assert steps(out) == [("a", [1], 20, [0, 1, 2, 3, 4, 5], True)]
    sched.update_from_output(out, {"a": 2})
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv_cache.num_free_blocks == 16


def test_chunked_prefill_fills_the_budget_left_by_running_requests():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, "a", range(100, 106), max_tokens=4)
    b = add(sched, "b", range(200, 206), max_tokens=4)
    c = add(sched, "c", [300], max_tokens=4)

    out = sched.schedule()
    assert steps(out) == [
        ("a", list(range(100, 106)), 0, [0, 1], True),
        ("b", [200, 201], 0, [2], False),
    ]
    assert out.num_scheduled_tokens == 8
    assert ids(sched.waiting) == ["c"]
    assert sched.update_from_output(out, {"a": 1}) == [a]

    # Running first: a's decode token, then the rest of b's prompt, then c.
    out = sched.schedule()
    assert steps(out) == [
        ("a", [1], 6, [0, 1], True),
        ("b", [202, 203, 204, 205], 2, [2, 3], True),
        ("c", [300], 0, [4], True),
    ]
    assert out.num_scheduled_tokens == 6
    assert sched.update_from_output(out, {"a": 2, "b": 3, "c": 4}) == [a, b, c]
    assert b.output_token_ids == [3]


def test_chunked_prefill_disabled_a_prompt_over_the_remaining_budget_waits():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = add(sched, "a", range(100, 106), max_tokens=4)
    b = add(sched, "b", range(200, 204), max_tokens=4)
    c = add(sched, "c", [300], max_tokens=4)

    # b needs 4 tokens with 2 left: it waits, and c waits behind it although it would fit.
    out = sched.schedule()
    assert steps(out) == [("a", list(range(100, 106)), 0, [0, 1], True)]
    assert out.num_scheduled_tokens == 6
    assert ids(sched.waiting) == ["b", "c"]
    assert b.status == c.status == RequestStatus.WAITING
    sched.update_from_output(out, {"a": 1})

    out = sched.schedule()
    assert steps(out) == [
        ("a", [1], 6, [0, 1], True),
        ("b", list(range(200, 204)), 0, [2], True),
        ("c", [300], 0, [3], True),
    ]
    assert out.num_scheduled_tokens == 6
    assert a.num_computed_tokens == 7


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    a = add(sched, "a", [100, 101, 102], max_tokens=1)
    b = add(sched, "b", [200, 201, 202], max_tokens=3)
    c = add(sched, "c", [300, 301, 302], max_tokens=3)

    out = sched.schedule()
    assert steps(out) == [
        ("a", [100, 101, 102], 0, [0], True),
        ("b", [200, 201, 202], 0, [1], True),
    ]
    assert ids(sched.running) == ["a", "b"]
    assert ids(sched.waiting) == ["c"]
    sched.update_from_output(out, {"a": 1, "b": 2})
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert b.status == RequestStatus.RUNNING

    # a's block 0 went to the free queue's tail; c gets block 2 from its front.
    out = sched.schedule()
    assert steps(out) == [
        ("b", [2], 3, [1], True),
        ("c", [300, 301, 302], 0, [2], True),
    ]
    assert out.finished_request_ids == {"a"}
    assert c.status == RequestStatus.RUNNING


# ---- preemption ------------------------------------------------------------------------


def test_preemption_frees_the_newest_request_and_recomputes_its_outputs_later():
    sched = make_scheduler(num_blocks=4, max_num_seqs=3)
    a = add(sched, "a", range(100, 104), max_tokens=2)
    b = add(sched, "b", range(200, 204), max_tokens=3)
    c = add(sched, "c", range(300, 304), max_tokens=3)
    d = add(sched, "d", range(400, 404), max_tokens=1)

    out = sched.schedule()
    assert steps(out) == [
        ("a", list(range(100, 104)), 0, [0], True),
        ("b", list(range(200, 204)), 0, [1], True),
        ("c", list(range(300, 304)), 0, [2], True),
    ]
    assert ids(sched.waiting) == ["d"]  # max_num_seqs
    sched.update_from_output(out, {"a": 1, "b": 2, "c": 3})

    # a takes the last free block; b needs one more, so c (newest) is preempted and its
    # block 2 goes to b. c goes ahead of d, and nobody is admitted in this step.
    out = sched.schedule()
    assert steps(out) == [
        ("a", [1], 4, [0, 3], True),
        ("b", [2], 4, [1, 2], True),
    ]
    assert out.preempted_request_ids == ["c"]
    assert out.num_scheduled_tokens == 2
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == [3]
    assert c.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert sched.kv_cache.block_ids("c") == []
    assert ids(sched.running) == ["a", "b"]
    assert ids(sched.waiting) == ["c", "d"]
    assert ref_cnts(sched) == [1, 1, 1, 1]
    sched.update_from_output(out, {"a": 11, "b": 12})
    assert a.status == RequestStatus.FINISHED_LENGTH  # frees blocks 3, 0 (tail first)
    assert free_queue(sched) == [3, 0]

    # c is recomputed: its prompt and its generated token, in blocks 3 and 0.
    out = sched.schedule()
    assert steps(out) == [
        ("b", [12], 5, [1, 2], True),
        ("c", [300, 301, 302, 303, 3], 0, [3, 0], True),
    ]
    assert out.num_scheduled_tokens == 6
    assert out.finished_request_ids == {"a"}
    assert ids(sched.waiting) == ["d"]  # no block left for d
    assert c.status == RequestStatus.RUNNING
    sched.update_from_output(out, {"b": 13, "c": 4})
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert free_queue(sched) == [2, 1]

    out = sched.schedule()
    assert steps(out) == [
        ("c", [4], 5, [3, 0], True),
        ("d", list(range(400, 404)), 0, [2], True),
    ]
    assert out.finished_request_ids == {"b"}
    sched.update_from_output(out, {"c": 5, "d": 6})
    assert c.output_token_ids == [3, 4, 5]
    assert c.status == d.status == RequestStatus.FINISHED_LENGTH

    out = sched.schedule()
    assert out.is_empty
    assert out.finished_request_ids == {"c", "d"}
    assert not sched.has_unfinished_requests()
    assert free_queue(sched) == [1, 0, 3, 2]
    assert ref_cnts(sched) == [0, 0, 0, 0]
    assert sched.stats().num_preemptions == 1


def test_request_that_cannot_grow_preempts_itself_and_stops_the_running_loop():
    sched = make_scheduler(num_blocks=3)
    a = add(sched, "a", range(100, 104), max_tokens=2)
    b = add(sched, "b", range(200, 204), max_tokens=2)
    c = add(sched, "c", range(300, 304), max_tokens=2)

    out = sched.schedule()
    assert [s.block_ids for s in out.scheduled] == [[0], [1], [2]]
    sched.update_from_output(out, {"a": 1, "b": 2, "c": 3})

    # a preempts c and takes block 2; b then needs a block, is itself the newest: preempted.
    out = sched.schedule()
    assert steps(out) == [("a", [1], 4, [0, 2], True)]
    assert out.preempted_request_ids == ["c", "b"]
    assert ids(sched.running) == ["a"]
    assert ids(sched.waiting) == ["b", "c"]  # arrival order kept at the front
    assert b.status == c.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == c.num_computed_tokens == 0
    assert free_queue(sched) == [1]
    assert sched.num_preemptions == 2
    sched.update_from_output(out, {"a": 11})
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert free_queue(sched) == [1, 2, 0]

    out = sched.schedule()
    assert steps(out) == [("b", [200, 201, 202, 203, 2], 0, [1, 2], True)]
    assert ids(sched.waiting) == ["c"]  # needs 2 blocks, 1 free

    # Aborting the waiting, preempted c frees nothing more and reports it once.
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert c.status == RequestStatus.FINISHED_ABORTED
    assert ids(sched.waiting) == []
    assert free_queue(sched) == [0]


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=True)
    a = add(sched, "a", range(100, 109), max_tokens=8)
    c = add(sched, "c", range(100, 108), max_tokens=8)

    # c's first block hits a's block 0 (its second could too, but its last token is left
    # to compute); its second block (3) is a duplicate of a's block 1.
    out = sched.schedule()
    assert steps(out) == [
        ("a", list(range(100, 109)), 0, [0, 1, 2], True),
        ("c", list(range(104, 108)), 4, [0, 3], True),
    ]
    assert out.num_scheduled_tokens == 13
    assert c.num_cached_tokens == 4
    assert ref_cnts(sched) == [2, 1, 1, 1]
    sched.update_from_output(out, {"a": 1, "c": 2})

    # c needs a third block: preempted. It would fit right away (hits on a's blocks 0 and 1,
    # one new block with block 3 free), but a request preempted in this step waits.
    out = sched.schedule()
    assert steps(out) == [("a", [1], 9, [0, 1, 2], True)]
    assert out.preempted_request_ids == ["c"]
    assert ids(sched.waiting) == ["c"]
    assert free_queue(sched) == [3]
    assert ref_cnts(sched) == [1, 1, 1, 0]
    sched.update_from_output(out, {"a": 11})
    assert a.output_token_ids == [1, 11]

    out = sched.schedule()
    assert steps(out) == [
        ("a", [11], 10, [0, 1, 2], True),
        ("c", [2], 8, [0, 1, 3], True),
    ]
    assert out.num_scheduled_tokens == 2
    assert ref_cnts(sched) == [2, 2, 1, 1]
    assert c.num_cached_tokens == 4  # set at first scheduling only


def test_preempted_request_is_recomputed_from_its_cached_blocks():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=True)
    a = add(sched, "a", range(100, 104), max_tokens=2)
    b = add(sched, "b", range(200, 208), max_tokens=4)

    out = sched.schedule()
    assert steps(out) == [
        ("a", list(range(100, 104)), 0, [0], True),
        ("b", list(range(200, 208)), 0, [1, 2], True),
    ]
    sched.update_from_output(out, {"a": 1, "b": 2})

    out = sched.schedule()
    assert steps(out) == [("a", [1], 4, [0, 3], True)]
    assert out.preempted_request_ids == ["b"]
    assert free_queue(sched) == [2, 1]  # b's full blocks keep their hashes
    sched.update_from_output(out, {"a": 11})
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert free_queue(sched) == [2, 1, 3, 0]

    # b hits its own blocks 1 and 2; only its generated token is computed, in block 3.
    out = sched.schedule()
    assert steps(out) == [("b", [2], 8, [1, 2, 3], True)]
    assert out.num_scheduled_tokens == 1
    assert free_queue(sched) == [0]
    for token_id in (3, 4):
        sched.update_from_output(out, {"b": token_id})
        out = sched.schedule()
    assert steps(out) == [("b", [4], 10, [1, 2, 3], True)]
    sched.update_from_output(out, {"b": 5})
    assert b.output_token_ids == [2, 3, 4, 5]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert free_queue(sched) == [0, 3, 2, 1]


def test_request_outgrowing_the_long_context_len_is_recomputed_as_long_context():
    """LongRoPE (`long_context_len=6`): a sequence of more than 6 tokens is computed with the
    long factors at every position, so a request that grows past 6 drops its KV and is
    computed again from its first token, in blocks hashed apart from short requests'."""
    sched = make_scheduler(num_blocks=8, enable_prefix_caching=True, long_context_len=6)
    a = add(sched, "a", range(100, 104), max_tokens=4)

    out = sched.schedule()
    assert steps(out) == [("a", [100, 101, 102, 103], 0, [0], True)]
    assert not out.scheduled[0].long_context
    sched.update_from_output(out, {"a": 1})

    # 5 tokens: one draft fits before the length (position 5 scored by a short sequence).
    a.spec_token_ids = [7, 8, 9]
    out = sched.schedule()
    assert steps(out) == [("a", [1, 7], 4, [0, 1], True)]
    assert out.scheduled[0].spec_token_ids == [7]
    sched.discard_rejected_drafts("a", 1)
    sched.update_from_output(out, {"a": 2})

    a.spec_token_ids = [8]  # 6 tokens: at the length, no draft fits
    out = sched.schedule()
    assert steps(out) == [("a", [2], 5, [0, 1], True)]
    assert not a.long_context
    sched.update_from_output(out, {"a": 3})

    # 7 tokens: recomputed from the start as long-context, block 0's short hash not hit.
    out = sched.schedule()
    assert steps(out) == [("a", [100, 101, 102, 103, 1, 2, 3], 0, [2, 3], True)]
    assert out.scheduled[0].long_context and a.long_context
    assert out.preempted_request_ids == [] and sched.num_preemptions == 0
    assert free_queue(sched) == [4, 5, 6, 7, 1, 0]
    sched.update_from_output(out, {"a": 4})
    assert a.status == RequestStatus.FINISHED_LENGTH

    # A short prompt hits the short block 0; a long one the long block 2, from a's recompute.
    b = add(sched, "b", [100, 101, 102, 103, 5], max_tokens=1)
    c = add(sched, "c", [100, 101, 102, 103, 6, 6, 6], max_tokens=1)
    out = sched.schedule()
    assert steps(out) == [("b", [5], 4, [0, 4], True), ("c", [6, 6, 6], 4, [2, 5], True)]
    assert [s.long_context for s in out.scheduled] == [False, True]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (4, 4)


def test_a_request_outgrowing_the_long_context_len_waits_for_its_token_in_flight():
    """Scheduled ahead (async scheduling), a request whose token in flight takes it past
    the length is not scheduled: its recompute needs that token on the host."""
    sched = make_scheduler(long_context_len=5)
    a = add(sched, "a", range(100, 105), max_tokens=3)
    first = sched.schedule()
    ahead = sched.schedule(ahead=True)
    assert ahead.is_empty and ahead.sync_next
    sched.update_from_output(first, {"a": 1})
    out = sched.schedule()
    assert steps(out) == [("a", [100, 101, 102, 103, 104, 1], 0, [2, 3], True)]
    assert a.long_context


# ---- stop conditions -------------------------------------------------------------------


def run_prefill(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    assert all(s.needs_sample for s in out.scheduled)
    return out


def test_eos_stops_the_request():
    sched = make_scheduler()
    a = add(sched, "a", [5, 6, 7], eos_token_id=2, max_tokens=10)
    out = run_prefill(sched)
    assert sched.update_from_output(out, {"a": 2}) == [a]
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.status.finish_reason == "stop"
    assert a.stop_reason is None
    assert a.output_token_ids == [2]
    assert sched.running == []
    assert sched.kv_cache.num_free_blocks == 16


def test_ignore_eos_keeps_generating_until_max_tokens():
    sched = make_scheduler()
    a = add(sched, "a", [5, 6, 7], eos_token_id=2, ignore_eos=True, max_tokens=2)
    sched.update_from_output(run_prefill(sched), {"a": 2})
    assert a.status == RequestStatus.RUNNING
    sched.update_from_output(sched.schedule(), {"a": 2})
    assert a.output_token_ids == [2, 2]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.stop_reason is None


def test_stop_token_ids_stop_and_set_stop_reason():
    sched = make_scheduler()
    a = add(sched, "a", [5, 6, 7], eos_token_id=2, stop_token_ids=[7, 9], max_tokens=10)
    sched.update_from_output(run_prefill(sched), {"a": 5})
    assert a.status == RequestStatus.RUNNING
    sched.update_from_output(sched.schedule(), {"a": 9})
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.status.finish_reason == "stop"
    assert a.stop_reason == 9
    assert a.output_token_ids == [5, 9]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    sched = make_scheduler()
    params = dict(eos_token_id=2, stop_token_ids=[7], min_tokens=2, max_tokens=5)
    a = add(sched, "a", [10, 11], **params)
    b = add(sched, "b", [20, 21], **params)

    sched.update_from_output(run_prefill(sched), {"a": 2, "b": 7})
    assert a.status == b.status == RequestStatus.RUNNING
    assert b.stop_reason is None

    # The second token reaches min_tokens=2: now both stop.
    sched.update_from_output(sched.schedule(), {"a": 7, "b": 2})
    assert a.status == b.status == RequestStatus.FINISHED_STOPPED
    assert (a.stop_reason, b.stop_reason) == (7, None)
    assert (a.output_token_ids, b.output_token_ids) == ([2, 7], [7, 2])


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    a = add(sched, "a", [5, 6, 7], eos_token_id=2, max_tokens=2)
    sched.update_from_output(run_prefill(sched), {"a": 3})
    assert a.status == RequestStatus.RUNNING
    sched.update_from_output(sched.schedule(), {"a": 4})
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.status.finish_reason == "length"
    assert a.stop_reason is None


def test_eos_on_the_last_allowed_token_reports_stop():
    # Stop conditions are checked before the length limits (as in Hugging Face and vLLM v0).
    sched = make_scheduler()
    a = add(sched, "a", [5, 6, 7], eos_token_id=2, max_tokens=1)
    sched.update_from_output(run_prefill(sched), {"a": 2})
    assert a.status == RequestStatus.FINISHED_STOPPED


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=8)
    a = add(sched, "a", range(100, 106), max_tokens=None)
    sched.update_from_output(run_prefill(sched), {"a": 1})
    assert a.num_tokens == 7
    assert a.status == RequestStatus.RUNNING
    sched.update_from_output(sched.schedule(), {"a": 2})
    assert a.num_tokens == 8
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.status.finish_reason == "length"


# ---- aborts ----------------------------------------------------------------------------


def test_finish_requests_aborts_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    a = add(sched, "a", range(100, 106))
    b = add(sched, "b", range(200, 203))
    out = sched.schedule()
    assert steps(out) == [("a", list(range(100, 106)), 0, [0, 1], True)]
    sched.update_from_output(out, {"a": 1})
    assert ids(sched.waiting) == ["b"]

    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert sched.running == []
    assert ids(sched.waiting) == []
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache.num_free_blocks == 16
    assert ref_cnts(sched) == [0] * 16
    assert free_queue(sched)[-2:] == [1, 0]

    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # already finished: no-op
    out = sched.schedule()
    assert out.is_empty
    assert out.finished_request_ids == {"a", "b"}
    assert sched.schedule().finished_request_ids == set()


def test_token_sampled_for_a_request_aborted_during_the_step_is_dropped():
    sched = make_scheduler()
    a = add(sched, "a", range(100, 106))
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, {"a": 5}) == []
    assert a.output_token_ids == []
    assert a.status == RequestStatus.FINISHED_ABORTED


# ---- a whole run -----------------------------------------------------------------------


def test_every_block_is_free_after_everything_finishes():
    """A small pool and budget with shared prefixes: chunking, hits and preemptions mix."""
    sched = make_scheduler(
        num_blocks=6, max_num_batched_tokens=10, max_num_seqs=4, enable_prefix_caching=True
    )
    shared = list(range(100, 108))
    prompts = {
        "a": shared + [1],
        "b": shared + [2, 3],
        "c": list(range(200, 209)),
        "d": shared[:5],
        "e": list(range(300, 306)),
        "f": shared + [1, 4],
    }
    max_tokens = {"a": 6, "b": 4, "c": 5, "d": 3, "e": 6, "f": 2}
    requests = {
        rid: add(sched, rid, prompt, max_tokens=max_tokens[rid]) for rid, prompt in prompts.items()
    }
    kv = sched.kv_cache
    reported: list[str] = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        reported += out.finished_request_ids
        assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled) <= 10
        assert len(sched.running) <= 4
        for s in out.scheduled:
            request = requests[s.request_id]
            end = s.start_pos + len(s.token_ids)
            assert s.token_ids == request.all_token_ids[s.start_pos : end]
            assert end == request.num_computed_tokens
            assert len(s.block_ids) == -(-end // BLOCK_SIZE)
            assert s.needs_sample == (end == request.num_tokens)
        # Each block's ref count is the number of block tables holding it.
        tables = [bid for table in kv.req_block_ids.values() for bid in table]
        assert ref_cnts(sched) == [tables.count(i) for i in range(6)]
        assert kv.num_free_blocks == 6 - len(set(tables))
        sampled = {
            s.request_id: 1000 + requests[s.request_id].num_output_tokens
            for s in out.scheduled
            if s.needs_sample
        }
        sched.update_from_output(out, sampled)
    reported += sched.schedule().finished_request_ids

    assert not sched.has_unfinished_requests()
    assert sorted(reported) == sorted(prompts)
    for rid, request in requests.items():
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == [1000 + i for i in range(max_tokens[rid])]
    assert sched.num_preemptions > 0
    assert kv.prefix_cache_hits > 0
    assert kv.num_free_blocks == 6
    assert kv.usage == 0.0
    assert ref_cnts(sched) == [0] * 6
    assert kv.req_blocks == {}


# ---- statistics ------------------------------------------------------------------------


def test_prefix_cache_stats_count_a_blocked_request_once():
    sched = make_scheduler(num_blocks=2, enable_prefix_caching=True)
    a = add(sched, "a", range(100, 104), max_tokens=2)
    b = add(sched, "b", range(200, 208), max_tokens=1)

    out = sched.schedule()  # b needs 2 blocks, 1 free
    assert steps(out) == [("a", list(range(100, 104)), 0, [0], True)]
    sched.update_from_output(out, {"a": 1})
    out = sched.schedule()  # a takes the last block; b waits again
    assert steps(out) == [("a", [1], 4, [0, 1], True)]
    sched.update_from_output(out, {"a": 2})
    assert a.status == RequestStatus.FINISHED_LENGTH

    out = sched.schedule()
    assert steps(out) == [("b", list(range(200, 208)), 0, [1, 0], True)]
    # One lookup of a (4 tokens) and one of b (8 tokens), whatever the retries.
    assert sched.kv_cache.prefix_cache_queries == 4 + b.num_tokens


@pytest.mark.parametrize(
    ("runner_type", "device", "gib", "expected"),
    [
        ("generate", "cpu", None, 8192),
        ("generate", "cuda:0", 141, 16384),
        ("generate", "cuda:0", 70, 16384),
        ("generate", "cuda:0", 48, 8192),
        ("pooling", "cuda:0", 141, 32768),
        ("pooling", "cuda:0", 48, 8192),
        ("pooling", "cpu", None, 8192),
    ],
)
def test_default_step_budget_is_larger_on_large_gpus(
    monkeypatch, runner_type, device, gib, expected
):
    import types

    import torch

    from batchlm.engine.engine_args import default_max_num_batched_tokens

    asked = []

    def properties(index):
        asked.append(index)
        return types.SimpleNamespace(total_memory=gib * 2**30)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert default_max_num_batched_tokens(runner_type, torch.device(device)) == expected
    assert asked == ([0] if device != "cpu" else [])
