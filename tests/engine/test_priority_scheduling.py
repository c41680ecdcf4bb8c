"""Priority scheduling as vLLM 0.26 documents and implements it (`scheduling_policy=
"priority"`): waiting requests start by (priority, arrival), lower first; when the KV cache
cannot grow a running request, the running request with the largest (priority, arrival)
is preempted (undoing its share of the step when it was scheduled earlier in it) and
waits by the same order. Under "fcfs" the newest running request is preempted and an
all-zero priority list changes nothing; other values are refused.

The scheduler tests are exact (scheduling order, block ids, free queue), derived by hand
from those rules; the LLM tests observe the order in which requests finish one at a time.
"""

from __future__ import annotations

import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.config import SchedulerConfig
from batchlm.engine.core.kv_cache import KVCacheManager
from batchlm.engine.core.request import Request, RequestStatus
from batchlm.engine.core.request_queue import FCFSQueue, PriorityQueue
from batchlm.engine.core.scheduler import Scheduler
from batchlm.engine.errors import InvalidParamError
from batchlm.engine.sampling_params import SamplingParams as Params

BLOCK_SIZE = 4


def make_scheduler(policy: str, num_blocks: int = 16, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs, policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, False), max_model_len=64)


def add(sched: Scheduler, rid: str, prompt, priority: int = 0, **params) -> Request:
    request = Request(rid, list(prompt), Params(**params), (), sched.num_unfinished_requests)
    request.priority = priority
    sched.add_request(request)
    return request


def steps(out) -> list[tuple[str, list[int], int, list[int]]]:
    return [
        (s.request_id, list(s.token_ids), s.start_pos, list(s.block_ids)) for s in out.scheduled
    ]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def free_queue(sched: Scheduler) -> list[int]:
    return list(sched.kv_cache.pool.free_queue)


def test_priority_queue_orders_by_priority_then_arrival():
    q = PriorityQueue()
    made = {}
    for i, (rid, prio) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -1)]):
        made[rid] = Request(rid, [1], Params(), (), i)
        made[rid].priority = prio
        q.append(made[rid])
    assert ids(q) == ["e", "b", "d", "c", "a"]
    assert q[0].request_id == "e" and q[2].request_id == "d" and len(q) == 5
    q.remove(made["b"])
    q.appendleft(made["b"])  # a request back from running takes its place by its key
    assert ids(q) == ["e", "b", "d", "c", "a"]
    assert [q.popleft().request_id for _ in range(5)] == ["e", "b", "d", "c", "a"]
    assert not q
    with pytest.raises(IndexError):
        q.popleft()
    fcfs = FCFSQueue([made["a"], made["b"]])
    fcfs.appendleft(made["c"])
    assert ids(fcfs) == ["c", "a", "b"]


@pytest.mark.parametrize(
    "policy, first, second",
    [("priority", ["b", "d"], ["c", "a"]), ("fcfs", ["a", "b"], ["c", "d"])],
)
def test_waiting_requests_start_by_priority_then_arrival(policy, first, second):
    sched = make_scheduler(policy, max_num_seqs=2)
    for rid, prio in [("a", 2), ("b", 0), ("c", 1), ("d", 0)]:
        add(sched, rid, range(4), prio, max_tokens=1)
    out = sched.schedule()
    # Fresh blocks in id order: the first admitted gets block 0.
    assert steps(out) == [(first[0], [0, 1, 2, 3], 0, [0]), (first[1], [0, 1, 2, 3], 0, [1])]
    sched.update_from_output(out, {rid: 7 for rid in first})
    out = sched.schedule()
    assert steps(out) == [(second[0], [0, 1, 2, 3], 0, [2]), (second[1], [0, 1, 2, 3], 0, [3])]


def _two_running(policy: str) -> tuple[Scheduler, Request, Request]:
    """x (priority 1) runs first, alone; y (priority 0) arrives later and runs beside it.
    Three blocks: x holds 0 and 1, y holds 2, and y's next token needs a fourth."""
    sched = make_scheduler(policy, num_blocks=3)
    x = add(sched, "x", range(100, 104), 1, max_tokens=10)
    out = sched.schedule()
    assert steps(out) == [("x", [100, 101, 102, 103], 0, [0])]
    sched.update_from_output(out, {"x": 1})
    y = add(sched, "y", range(200, 204), 0, max_tokens=10)
    out = sched.schedule()
    assert steps(out) == [("x", [1], 4, [0, 1]), ("y", [200, 201, 202, 203], 0, [2])]
    sched.update_from_output(out, {"x": 2, "y": 3})
    assert ids(sched.running) == ["x", "y"]
    return sched, x, y


def test_priority_preempts_the_worst_running_request_even_one_scheduled_this_step():
    sched, x, y = _two_running("priority")
    # x fits its token in block 1 and is scheduled first; y needs a block, none is free:
    # the victim is x, the largest (priority, arrival), so its share of the step is undone,
    # its blocks freed tail first (1, 0), and y takes block 1.
    out = sched.schedule()
    assert steps(out) == [("y", [3], 4, [2, 1])]
    assert out.preempted_request_ids == ["x"]
    assert out.num_scheduled_tokens == 1  # x's token went back to the budget
    assert x.status == RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    assert x.num_inflight_tokens == 0 and x.output_token_ids == [1, 2]
    assert ids(sched.running) == ["y"] and ids(sched.waiting) == ["x"]
    assert free_queue(sched) == [0]
    assert sched.kv_cache.block_ids("x") == []
    # A later, better request overtakes the preempted x in the queue.
    add(sched, "z", range(300, 302), -1, max_tokens=1)
    assert ids(sched.waiting) == ["z", "x"]
    sched.update_from_output(out, {"y": 4})
    out = sched.schedule()
    assert steps(out) == [("y", [4], 5, [2, 1]), ("z", [300, 301], 0, [0])]


def test_fcfs_preempts_the_newest_running_request():
    sched, x, y = _two_running("fcfs")
    # y, the newest, cannot grow: it preempts itself and x runs on.
    out = sched.schedule()
    assert steps(out) == [("x", [2], 5, [0, 1])]
    assert out.preempted_request_ids == ["y"]
    assert y.status == RequestStatus.PREEMPTED and x.status == RequestStatus.RUNNING
    assert ids(sched.waiting) == ["y"]
    add(sched, "z", range(300, 302), -1, max_tokens=1)
    assert ids(sched.waiting) == ["y", "z"]  # the preempted request stays in front


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPTS = ["red green blue", "one two three", "the quick brown fox", "hello there"]


def _finish_order(llm: LLM, request_ids: list[str]) -> list[str]:
    done = []
    while llm.llm_engine.has_unfinished_requests():
        done += [o.request_id for o in llm.llm_engine.step()]
    return [str(request_ids.index(rid)) for rid in done]


def test_llm_priority_orders_requests_and_fcfs_ignores_zeros(llama):
    llm = LLM(str(llama), max_model_len=64, max_num_seqs=1, scheduling_policy="priority")
    ids_ = llm.enqueue(PROMPTS, GREEDY, priority=[3, -2, 5, -2], use_tqdm=False)
    assert _finish_order(llm, ids_) == ["1", "3", "0", "2"]  # ties by arrival
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # generate and chat take priorities too; outputs come back in input order.
    outs = llm.generate(PROMPTS, GREEDY, priority=[1, 0, 1, 0], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    chat_ids = llm.enqueue_chat(chats, GREEDY, priority=[9, 0])
    assert _finish_order(llm, chat_ids) == ["1", "0"]
    assert len(llm.chat(chats, GREEDY, use_tqdm=False, priority=[1, 2])) == 2
    llm.shutdown()

    fcfs = LLM(str(llama), max_model_len=64, max_num_seqs=1)
    ids_ = fcfs.enqueue(PROMPTS, GREEDY, priority=[0, 0, 0, 0])
    assert _finish_order(fcfs, ids_) == ["0", "1", "2", "3"]
    with pytest.raises(InvalidParamError, match="Got priority 3 but Priority scheduling is not"):
        fcfs.generate(PROMPTS, GREEDY, priority=[0, 3, 0, 0])
    with pytest.raises(InvalidParamError, match=r"lengths of prompts \(4\) and priority \(2\)"):
        fcfs.generate(PROMPTS, GREEDY, priority=[0, 0])
    with pytest.raises(InvalidParamError, match=r"priority\[1\]=0.5 must be an int"):
        fcfs.enqueue(PROMPTS[:2], GREEDY, priority=[0, 0.5])
    assert not fcfs.llm_engine.has_unfinished_requests()  # nothing half-added
    with pytest.raises(InvalidParamError, match="scheduling_policy='lifo'.*'fcfs' or 'priority'"):
        LLM(str(llama), scheduling_policy="lifo")
    fcfs.shutdown()
