"""What one `Scheduler.schedule()` call has handed out so far."""

from __future__ import annotations

from simkv.core.outputs import ScheduledChunk
from simkv.core.request import Request


class StepPlan:
    """What one schedule() call has handed out so far."""

    __slots__ = ("budget", "threshold", "chunks", "preempted", "scheduled_now", "query", "hit", "first_new_seq",
                 "swap_out_blocks", "swap_in_blocks", "moved_ahead", "kv_loads")

    def __init__(self, budget: int, threshold: int) -> None:
        self.budget = budget
        self.threshold = threshold
        self.chunks: list[ScheduledChunk] = []
        self.preempted: list[Request] = []
        self.scheduled_now: dict[int, int] = {}  # seq -> tokens scheduled this step (explicitly)
        self.query = 0
        self.hit = 0
        self.first_new_seq = -1
        self.swap_out_blocks = 0
        self.swap_in_blocks = 0
        self.moved_ahead = False  # a victim ahead of the current request left the running list
        self.kv_loads: list[Request] = []  # P/D: requests whose KV pull this step starts

    def schedule(self, request: Request, num_new: int) -> None:
        self.budget -= num_new
        self.scheduled_now[request.seq] = num_new

    def unschedule(self, victim: Request, implicit: bool) -> int:
        """A victim scheduled earlier in this step gives its tokens back (`implicit`: a steady
        decoder counted in bulk, one token). Returns those tokens."""
        tokens = self.scheduled_now.pop(victim.seq, None)
        if tokens is None:
            if not implicit:
                return 0
            tokens = 1
        self.budget += tokens
        self.chunks = [c for c in self.chunks if c.request is not victim]
        return tokens
