"""Waiting queues: FCFS (a deque) and priority (a heap on priority, then arrival)."""

from __future__ import annotations

import heapq
from collections import deque

from simkv.core.request import Request


class FCFSRequestQueue(deque):
    """Arrival order; preempted requests go back to the front. A deque itself, so that `len`
    (asked several times per step) costs no Python call."""

    add_request = deque.append
    prepend_request = deque.appendleft
    pop_request = deque.popleft
    remove_request = deque.remove

    def peek_request(self) -> Request:
        return self[0]


class PriorityRequestQueue:
    """Lowest (priority, arrival time) first; equal arrival times in trace order (vLLM stamps
    arrivals with wall-clock time, so ties do not occur there), except a fanned-out request's
    members: they share their arrival time in vLLM too, which then orders them by request id,
    a string (`Request.tie_rank`: "10_id" before "1_id"). Preempted requests re-enter by their key, as in vLLM."""

    def __init__(self) -> None:
        self._heap: list[tuple] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.prompt_owner, request.tie_rank,
                                    request.index, request))

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove_request(self, request: Request) -> None:
        """Take out a request that is not at the head (rare: a rebuild)."""
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (entry[-1] for entry in self._heap)
