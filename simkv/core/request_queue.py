"""Waiting queues: FCFS (a deque) and priority (a heap on priority, then arrival)."""

from __future__ import annotations

import heapq
from collections import deque

from simkv.core.request import Request


class FCFSRequestQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest (priority, arrival time) first; equal arrival times in trace order (vLLM stamps
    arrivals with wall-clock time, so ties do not occur there). Preempted requests re-enter by
    their key, as in vLLM."""

    def __init__(self) -> None:
        self._heap: list[tuple] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.index, request))

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (entry[-1] for entry in self._heap)
