"""Session pacing: a conversation's next turn is sent once its previous reply is read.

A trace with a `session_id` column groups rows into conversations, their turns in arrival
order. A client sends turn k+1 after it has turn k's reply: the replay delivers a turn at
max(its trace arrival, the previous turn's finish + the turn's `think_time_s`), a rejected turn
counting as finished when it is rejected. Rows without a session arrive at their trace times.
Where the engine keeps up with the trace's schedule nothing moves; where it falls behind, a
conversation waits for its replies instead of sending turns that repeat replies not yet
written (and the open-loop replay's queue of such turns does not build up).

The feed's arrival times are no longer known in advance: a finish may release a turn. The
engine asks `next_arrival_ticks` after every finish (decode runs end at finishes), so a decode
run never passes a released turn's arrival.
"""

from __future__ import annotations

import heapq

import numpy as np

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.core.request import Request
from simkv.replay.engine import ArrivalFeed


def next_turns(session_id: np.ndarray) -> np.ndarray:
    """Per row, the row of its session's next turn (-1: last turn, or no session). Rows are in
    arrival order."""
    following = np.full(len(session_id), -1, np.int64)
    last: dict[str, int] = {}
    for row, session in enumerate(session_id.tolist()):
        if session is None:
            continue
        before = last.get(session)
        if before is not None:
            following[before] = row
        last[session] = row
    return following


class SessionFeed(ArrivalFeed):
    """An ArrivalFeed that holds each turn until its previous turn has finished."""

    def __init__(self, trace, scheduler, request_log, max_model_len: int, rows=None) -> None:
        super().__init__(trace, scheduler, request_log, max_model_len, rows)
        n = len(trace)
        self._trace_ticks = self._arrival_ticks
        self._arrival_ticks = list(self._arrival_ticks)  # (a held turn's arrival moves)
        self._arrival_list = list(self._arrival_list)
        self._next_turn = next_turns(trace.session_id).tolist()
        think = trace.think_time_s
        self._think_ticks = [to_ticks(t) for t in think.tolist()] if think is not None else [0] * n
        has_previous = np.zeros(n, bool)
        following = np.asarray(self._next_turn)
        has_previous[following[following >= 0]] = True
        # (first turns in arrival order: already a heap of (tick, row))
        self._ready = [(self._trace_ticks[i], i) for i in np.flatnonzero(~has_previous).tolist()]
        self._num_delivered = 0
        self.num_sessions = len({s for s in trace.session_id.tolist() if s is not None})
        self.num_held = 0  # turns delivered later than their trace arrival
        self.held_ticks = 0  # ... by this much in all

    @property
    def exhausted(self) -> bool:
        return self._num_delivered >= len(self._next_turn)

    def last_arrival_ticks(self) -> int:
        return max(self._trace_ticks) if self._trace_ticks else 0

    def next_arrival_ticks(self) -> int | None:
        return self._ready[0][0] if self._ready else None

    def deliver_until(self, now: int) -> None:
        ready = self._ready
        while ready and ready[0][0] <= now:
            tick, i = heapq.heappop(ready)
            self._num_delivered += 1
            rejected = self.num_rejected
            self._deliver(i)
            if self.num_rejected != rejected:
                self._release(i, tick)

    def note_finished(self, finished: list[Request], tick: int) -> None:
        n = len(self._next_turn)
        for request in finished:
            if request.index < n:  # (not a parallel-sampling sequence of its own)
                self._release(request.index, tick)

    def _release(self, row: int, tick: int) -> None:
        """Row `row` finished (or was rejected) at `tick`: its session's next turn may be sent."""
        nxt = self._next_turn[row]
        if nxt < 0:
            return
        due = tick + self._think_ticks[nxt]
        if due > self._trace_ticks[nxt]:
            self.num_held += 1
            self.held_ticks += due - self._trace_ticks[nxt]
            self._arrival_ticks[nxt] = due
            self._arrival_list[nxt] = due / TICKS_PER_SECOND
        heapq.heappush(self._ready, (self._arrival_ticks[nxt], nxt))

    def arrival_times_s(self) -> np.ndarray:
        return np.asarray(self._arrival_list, dtype=np.float64)

    def pacing_summary(self) -> dict:
        held_s = self.held_ticks / TICKS_PER_SECOND
        return {"sessions": self.num_sessions, "turns_held": self.num_held,
                "mean_hold_s": held_s / self.num_held if self.num_held else 0.0}
