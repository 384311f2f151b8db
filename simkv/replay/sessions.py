"""Session pacing: a conversation's next turn is sent once its previous reply is done.

A trace with a `session_id` column groups rows into conversations, their turns in arrival
order. A client sends turn k+1 after it has turn k's reply: the replay delivers a turn at
max(its trace arrival, the previous turn's finish + the turn's `think_time_s`), and never
sooner than one clock tick (2^-40 s) after that finish; a rejected turn counts as finished when
it is rejected. Rows without a session arrive at their trace times. Where the engine keeps up
with the trace's schedule nothing moves; where it falls behind, a conversation waits for its
replies instead of sending turns that repeat replies not yet written (and the open-loop
replay's queue of such turns does not build up).

Arrival times are no longer all known in advance: a finish may release a turn. One engine asks
its feed for the next arrival after every finish (decode runs end at finishes), so a decode run
never passes a released turn. In a fleet (simkv/replay/fleet.py) a replica's decode run also
stops by the earliest tick another replica could release a turn: that replica's committed end
plus the least think time among its requests' next turns (the tick minimum keeps every turn
released at T due after T, so no routing at T depends on the order in which SimPy resumes
processes at T).
"""

from __future__ import annotations

import heapq

import numpy as np

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.core.request import Request
from simkv.replay.engine import ArrivalFeed, TraceRows


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


class Pacing:
    """Rows handed out when due, from a heap of (tick, row); a release (a finish or a rejection)
    may make another row due. `rows`' arrival lists become the pacing's own: a held row's
    entries move to when it was sent."""

    summary_key = ""

    def __init__(self, rows: TraceRows) -> None:
        self._trace_ticks = list(rows.arrival_ticks)
        rows.arrival_ticks = list(rows.arrival_ticks)
        rows.arrival_s = list(rows.arrival_s)
        self.rows = rows
        self._ready: list[tuple[int, int]] = []
        self._num_rows = len(self._trace_ticks)
        self.num_out = 0  # rows handed out
        self.num_held = 0  # rows sent later than their trace arrival
        self.held_ticks = 0  # ... by this much in all

    @property
    def all_out(self) -> bool:
        return self.num_out >= self._num_rows

    def next_ticks(self) -> int | None:
        """When the next row is due (None: none is, until a release)."""
        return self._ready[0][0] if self._ready else None

    def pop_due(self, now: int):
        """The rows due by tick `now`, as (tick, row), in (tick, row) order."""
        ready = self._ready
        while ready and ready[0][0] <= now:
            self.num_out += 1
            yield heapq.heappop(ready)

    def peek(self) -> tuple[int, int] | None:
        """The next row due, as (tick, row), without handing it out (None: none is, until a release)."""
        return self._ready[0] if self._ready else None

    def pop_next(self) -> tuple[int, int]:
        """The next row due, as (tick, row) (there must be one)."""
        self.num_out += 1
        return heapq.heappop(self._ready)

    def _hold(self, row: int, due: int) -> int:
        """Row `row` is sent at the later of `due` and its trace time (returned)."""
        if due > self._trace_ticks[row]:
            self.num_held += 1
            self.held_ticks += due - self._trace_ticks[row]
            self.rows.arrival_ticks[row] = due
            self.rows.arrival_s[row] = due / TICKS_PER_SECOND
        return self.rows.arrival_ticks[row]

    def _send_at(self, row: int, due: int) -> int:
        """Row `row` becomes due at the later of `due` and its trace time; returns that tick."""
        tick = self._hold(row, due)
        heapq.heappush(self._ready, (tick, row))
        return tick

    def release(self, row: int, tick: int) -> int | None:
        """Row `row` finished (or was rejected) at `tick`. Returns the due tick of the row that
        makes due (None: none)."""
        raise NotImplementedError

    def give_up(self, row: int, tick: int) -> tuple[list[int], int | None]:
        """Row `row`'s client gave up on it for good at `tick` (its last attempt timed out).
        Returns the rows never sent because of it, and the due tick of a row it makes due (None:
        none)."""
        raise NotImplementedError

    def release_finished(self, finished: list[Request], tick: int) -> int | None:
        """These requests finished at `tick`: the rows they release become due. Returns the
        earliest due tick (None: none)."""
        earliest = None
        for request in finished:
            if request.index < self._num_rows:  # (not a parallel-sampling sequence of its own)
                due = self.release(request.index, tick)
                if due is not None and (earliest is None or due < earliest):
                    earliest = due
        return earliest

    def last_trace_ticks(self) -> int:
        return max(self._trace_ticks, default=0)

    @property
    def mean_hold_s(self) -> float:
        """How long a held row was held on average (0 when none was)."""
        return self.held_ticks / TICKS_PER_SECOND / self.num_held if self.num_held else 0.0


class SessionPacing(Pacing):
    """The rows of a trace with sessions: first turns at their trace times, a next turn once its
    previous turn is released (finished or rejected), after its think time."""

    summary_key = "session_pacing"

    def __init__(self, trace, rows: TraceRows) -> None:
        super().__init__(rows)
        n = self._num_rows
        self.next_turn = next_turns(trace.session_id).tolist()
        think = trace.think_time_s
        # (at least a tick after the finish that releases it)
        self.think_ticks = [max(1, to_ticks(t)) for t in think.tolist()] if think is not None else [1] * n
        has_previous = np.zeros(n, bool)
        following = np.asarray(self.next_turn)
        has_previous[following[following >= 0]] = True
        # (first turns in arrival order: already a heap of (tick, row))
        self._ready = [(self._trace_ticks[i], i) for i in np.flatnonzero(~has_previous).tolist()]
        self.num_sessions = len({s for s in trace.session_id.tolist() if s is not None})

    def give_up(self, row: int, tick: int) -> tuple[list[int], int | None]:
        """The conversation ends: its later turns are never sent."""
        dropped = []
        nxt = self.next_turn[row]
        while nxt >= 0:
            dropped.append(nxt)
            nxt = self.next_turn[nxt]
        self.num_out += len(dropped)
        return dropped, None

    def successor_think(self, row: int) -> int | None:
        """The think ticks of `row`'s next turn (None: it has none)."""
        nxt = self.next_turn[row]
        return self.think_ticks[nxt] if nxt >= 0 else None

    def release(self, row: int, tick: int) -> int | None:
        """Row `row` finished (or was rejected) at `tick`: its session's next turn becomes due.
        Returns that turn's due tick (None: no next turn)."""
        nxt = self.next_turn[row]
        return None if nxt < 0 else self._send_at(nxt, tick + self.think_ticks[nxt])

    def summary(self) -> dict:
        return {"sessions": self.num_sessions, "turns_held": self.num_held, "mean_hold_s": self.mean_hold_s}


class ConcurrencyPacing(Pacing):
    """A client that keeps at most `limit` requests in flight (vllm bench serve's
    --max-concurrency, a semaphore its requests queue on in order): the first `limit` rows go at
    their trace times; each release (a finish or a rejection) frees a slot a tick later, and the
    next row in arrival order takes the earliest free slot, at the later of that tick and its
    trace time. A request whose client gives up and retries keeps its slot through the back-off;
    one given up on for good frees it at its last deadline, one refused for good (HTTP 503) when
    it is refused.

    Slots are taken when rows are handed out, not when they free: engines may report releases
    out of time order (a step's finishes before a refusal during that step, taken at its end),
    and the earliest free slot still goes to the next row."""

    summary_key = "client_concurrency"

    def __init__(self, rows: TraceRows, limit: int) -> None:
        super().__init__(rows)
        self.limit = limit
        first = min(limit, self._num_rows)
        self._ready = [(self._trace_ticks[i], i) for i in range(first)]  # (in arrival order: a heap)
        self._next_row = first
        self._free: list[int] = []  # ticks at which slots free, not yet taken (a heap)

    def _freed(self) -> tuple[int, int] | None:
        """The next row as the earliest free slot would send it, as (tick, row) (None: no row
        waits for a slot, or no slot is free)."""
        if not self._free or self._next_row >= self._num_rows:
            return None
        row = self._next_row
        return max(self._free[0], self._trace_ticks[row]), row

    def peek(self) -> tuple[int, int] | None:
        freed, ready = self._freed(), self._ready[0] if self._ready else None
        return ready if freed is None else freed if ready is None else min(freed, ready)

    def next_ticks(self) -> int | None:
        nxt = self.peek()
        return None if nxt is None else nxt[0]

    def pop_next(self) -> tuple[int, int]:
        freed = self._freed()
        self.num_out += 1
        if freed is None or (self._ready and self._ready[0] < freed):
            return heapq.heappop(self._ready)
        heapq.heappop(self._free)
        self._next_row += 1
        return self._hold(freed[1], freed[0]), freed[1]

    def pop_due(self, now: int):
        while (nxt := self.peek()) is not None and nxt[0] <= now:
            yield self.pop_next()

    def successor_think(self, row: int) -> int | None:
        """A tick: any finish, refusal or give-up may send the next row (None once every row is
        sent). Behind a router, other engines' decode runs stop a tick after an engine's step
        ends (ReleaseWatch), where it learns of them."""
        return 1 if self._next_row < self._num_rows else None

    def release(self, row: int, tick: int) -> int | None:
        if self._next_row >= self._num_rows:
            return None
        heapq.heappush(self._free, tick + 1)
        return max(tick + 1, self._trace_ticks[self._next_row])  # (when the next row could go, at the soonest)

    def give_up(self, row: int, tick: int) -> tuple[list[int], int | None]:
        """The client's slot is free again: the next row is sent."""
        return [], self.release(row, tick)

    def summary(self) -> dict:
        return {"max_concurrency": self.limit, "requests_held": self.num_held, "mean_hold_s": self.mean_hold_s}


def pacing_rows(summary: dict) -> list[tuple[str, str]]:
    """The report's rows on the client's pacing: sessions paced on their replies, or a
    concurrency limit, and the requests each held back."""
    rows = []
    if summary.get("session_pacing"):
        sp = summary["session_pacing"]
        rows.append(("sessions (paced on replies)", f"{sp['sessions']:,}; {sp['turns_held']:,} turns sent later than "
                                                    f"the trace's times, by {sp['mean_hold_s']:,.2f} s on average"))
    if summary.get("client_concurrency"):
        cc = summary["client_concurrency"]
        rows.append(("client concurrency limit", f"{cc['max_concurrency']:,} in flight; {cc['requests_held']:,} requests "
                                                 f"sent later than the trace's times, by {cc['mean_hold_s']:,.2f} s on "
                                                 "average"))
    return rows


class ReleaseWatch:
    """What one engine could release (fleets, P/D): (think ticks of the next turn, row) of the
    rows it was given that have a next turn, in a heap; rows since finished are dropped when
    they reach the top."""

    def __init__(self) -> None:
        self._thinks: list[tuple[int, int]] = []
        self._done: set[int] = set()

    def delivered(self, pacing: SessionPacing, row: int) -> None:
        think = pacing.successor_think(row)
        if think is not None:
            heapq.heappush(self._thinks, (think, row))

    def finished(self, finished: list[Request]) -> None:
        self._done.update(request.index for request in finished)

    def earliest(self, engine) -> int | None:
        """The earliest tick at which `engine` (whose rows these are) could end a turn that has a
        next one: its next finish at the soonest, plus the least think time of those turns."""
        thinks, done = self._thinks, self._done
        while thinks and thinks[0][1] in done:
            done.discard(heapq.heappop(thinks)[1])
        if not thinks:
            return None
        finish = engine.next_finish_bound()
        return None if finish is None else finish + thinks[0][0]


def earliest_release(engines: list, skip: int = -1) -> int | None:
    """The earliest tick at which one of `engines` (but the one at index `skip`) could release
    a turn (None: none could)."""
    best = None
    for r, engine in enumerate(engines):
        if r != skip:
            t = engine.feed.release_watch.earliest(engine)
            if t is not None and (best is None or t < best):
                best = t
    return best


class SessionFeed(ArrivalFeed):
    """One engine's ArrivalFeed that holds each turn until its previous turn has finished (or,
    with `max_concurrency`, each request until fewer than that many are in flight)."""

    def __init__(self, trace, scheduler, request_log, max_model_len: int, max_concurrency: int | None = None) -> None:
        rows = TraceRows(trace)
        self.pacing = (SessionPacing(trace, rows) if max_concurrency is None
                       else ConcurrencyPacing(rows, max_concurrency))
        super().__init__(trace, scheduler, request_log, max_model_len, rows)

    @property
    def exhausted(self) -> bool:
        return self.pacing.all_out

    def last_arrival_ticks(self) -> int:
        return self.pacing.last_trace_ticks()

    def next_arrival_ticks(self) -> int | None:
        return self.pacing.next_ticks()

    def deliver_until(self, now: int) -> None:
        for tick, i in self.pacing.pop_due(now):
            rejected = self.num_rejected
            self._deliver(i)
            if self.num_rejected != rejected:
                self.pacing.release(i, tick)

    def note_finished(self, finished: list[Request], tick: int) -> None:
        self.pacing.release_finished(finished, tick)

    def arrival_times_s(self) -> np.ndarray:
        return np.asarray(self._arrival_list, dtype=np.float64)

    def pacing_summary(self) -> dict:
        return self.pacing.summary()
