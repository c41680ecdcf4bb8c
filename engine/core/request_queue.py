"""The scheduler's queue of waiting requests, one per scheduling policy.

Both offer what the scheduler does with its waiting requests: `append` (a new request),
`appendleft` (a preempted or rolled-back one), `popleft` / `[0]` (the next to start),
`remove`, `len` and iteration (in the order they would start).

- `FCFSQueue`: first come, first served; a preempted request goes back to the front.
- `PriorityQueue`: lowest `(priority, arrival_index)` first, as vLLM's priority policy
  orders its requests (lower priority values first, ties by arrival); a preempted request
  takes its place by the same order, not the front.

Pure Python: no tensors.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from .request import Request


class FCFSQueue(deque):
    """Waiting requests in order of arrival (a preempted one back at the front)."""

    policy = "fcfs"


class PriorityQueue:
    """Waiting requests by `(priority, arrival_index)`, lowest first (a binary heap)."""

    policy = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    @staticmethod
    def _key(request: Request) -> tuple[int, int, Request]:
        return (request.priority, request.arrival_index, request)

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, self._key(request))

    def appendleft(self, request: Request) -> None:
        """A request back from running: it waits by its priority and arrival, like any other."""
        self.append(request)

    def popleft(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __getitem__(self, index: int) -> Request:
        """The request `index`-th in line (0: the next to start)."""
        if index == 0 and self._heap:
            return self._heap[0][2]
        return sorted(self._heap)[index][2]

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap))


def create_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The waiting queue of `policy` (`fcfs` or `priority`)."""
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"scheduling policy {policy!r} is unknown; use 'fcfs' or 'priority'")
