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

import bisect
import heapq
from collections import deque

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


class Budget:
    """What a client's limit lets out at once: rows take their share of it when sent and give it
    back a tick after they are released. What is free is kept by the tick from which it is free,
    so a release reported late still counts from when it came, and a row takes what freed
    earliest."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[list[int]] = [[0, capacity]]  # [tick, amount] free from then, in tick order

    def ready_at(self, need: int) -> int | None:
        """The earliest tick from which `need` (at most the capacity: a row larger than the whole
        budget goes alone) is free (None: not until more is released)."""
        need = min(need, self.capacity)
        have = 0
        for tick, amount in self._free:
            have += amount
            if have >= need:
                return tick
        return None

    def take(self, need: int) -> None:
        """A row sent takes `need` from what freed earliest (`ready_at` said it is there)."""
        need = min(need, self.capacity)
        free = self._free
        while need:
            if free[0][1] > need:
                free[0][1] -= need
                return
            need -= free.pop(0)[1]

    def give(self, need: int, tick: int) -> None:
        """A row released at `tick` gives back what it took, from the next tick."""
        bisect.insort(self._free, [tick + 1, min(need, self.capacity)])


class Pacing:
    """Rows handed out when due, from a heap of (tick, row) of the rows due by the pacing's own
    rule; a release (a finish, a rejection, a give-up) may make another row due. With a `limit`
    (a client's concurrency limit: vllm bench serve's --max-concurrency, a semaphore its requests
    queue on) a due row also waits for a free slot: at most `limit` rows are out and not yet
    released, and the earliest due row takes the earliest free slot, at the later of the two
    ticks. With a `token_limit` likewise for tokens: the rows out hold their prompt and output
    tokens (n outputs for n samples), at most `token_limit` in all (a gateway that admits by a
    request's KV footprint, its output as the trace gives it, the client's max_tokens; a row
    larger than the whole budget goes alone); the earliest due row waits, and those behind it
    too. A release frees its share a tick later. A request whose client gives up and retries
    keeps its share through its back-offs; one given up on for good frees it at its last
    deadline, one refused for good (HTTP 503) when it is refused.

    Shares are taken when rows are handed out, not when they free: engines may report releases
    out of time order (a step's finishes before a refusal during that step, taken at its end),
    and what freed earliest still goes to the earliest due row. `rows`' arrival lists become the
    pacing's own: a held row's entries move to when it was sent."""

    def __init__(self, rows: TraceRows, limit: int | None = None, token_limit: int | None = None,
                 samples: list[int] | None = None) -> None:
        self._trace_ticks = list(rows.arrival_ticks)
        rows.arrival_ticks = list(rows.arrival_ticks)
        rows.arrival_s = list(rows.arrival_s)
        self.rows = rows
        self._ready: list[tuple[int, int]] = []
        self._num_rows = len(self._trace_ticks)
        self.limit = limit
        self.token_limit = token_limit
        self._gates: list[tuple[Budget, list[int] | None]] = []  # (budget, each row's share; None: one)
        if limit is not None:
            self._gates.append((Budget(limit), None))
        if token_limit is not None:
            n = samples or [1] * self._num_rows
            self._gates.append((Budget(token_limit), [p + k * o for p, o, k in
                                                      zip(rows.prompt_tokens, rows.output_tokens, n)]))
        self.num_out = 0  # rows handed out (or dropped: never to be sent)
        self.num_in_flight = 0  # rows handed out and not yet released (or given up on for good)
        self._out = bytearray(self._num_rows)  # per row: handed out or dropped
        self.holds = [[0, 0], [0, 0]]  # (rows held, ticks in all): by the pacing's rule, for the client's limits

    @property
    def all_out(self) -> bool:
        return self.num_out >= self._num_rows

    def _never_out(self) -> list[int]:
        """The rows neither handed out nor dropped (so far)."""
        return np.flatnonzero(np.frombuffer(bytes(self._out), dtype=np.uint8) == 0).tolist()

    def peek(self) -> tuple[int, int] | None:
        """The next row due, as (tick, row), without handing it out (None: none is, until a release)."""
        if not self._ready:
            return None
        tick, row = self._ready[0]
        for budget, shares in self._gates:
            ready = budget.ready_at(1 if shares is None else shares[row])
            if ready is None:
                return None
            tick = max(tick, ready)
        return tick, row

    def next_ticks(self) -> int | None:
        """When the next row is due (None: none is, until a release)."""
        nxt = self.peek()
        return None if nxt is None else nxt[0]

    def pop_next(self) -> tuple[int, int]:
        """The next row due, as (tick, row) (there must be one)."""
        sent, row = self.peek()
        due, _ = heapq.heappop(self._ready)
        for budget, shares in self._gates:
            budget.take(1 if shares is None else shares[row])
        self.num_out += 1
        self.num_in_flight += 1
        self._out[row] = 1
        trace_tick = self._trace_ticks[row]
        for hold, (start, end) in zip(self.holds, ((trace_tick, due), (due, sent))):
            if end > start:
                hold[0] += 1
                hold[1] += end - start
        if sent > trace_tick:
            self.rows.arrival_ticks[row] = sent
            self.rows.arrival_s[row] = sent / TICKS_PER_SECOND
        return sent, row

    def pop_due(self, now: int):
        """The rows due by tick `now`, as (tick, row), in (tick, row) order."""
        while (nxt := self.peek()) is not None and nxt[0] <= now:
            yield self.pop_next()

    def _free_share(self, row: int, tick: int) -> None:
        if self.num_out < self._num_rows:
            for budget, shares in self._gates:
                budget.give(1 if shares is None else shares[row], tick)

    def _next_due(self, row: int, tick: int) -> None:
        """Row `row` was released at `tick`: the rows that makes due by the pacing's rule."""

    def _release(self, row: int, tick: int) -> None:
        self.num_in_flight -= 1
        self._free_share(row, tick)
        self._next_due(row, tick)

    def release(self, row: int, tick: int) -> int | None:
        """Row `row` finished (or was rejected) at `tick`. Returns when the next row is due (None:
        none is, until another release)."""
        self._release(row, tick)
        return self.next_ticks()

    def _drop_after(self, row: int) -> list[int]:
        """Row `row` was given up on for good: the rows never sent because of it."""
        return []

    def give_up(self, row: int, tick: int) -> tuple[list[int], int | None]:
        """Row `row`'s client gave up on it for good at `tick` (its last attempt timed out).
        Returns the rows never sent because of it, and when the next row is due (None: none is,
        until another release)."""
        dropped = self._drop_with(row, tick)
        return dropped, self.next_ticks()

    def _drop_with(self, row: int, tick: int) -> list[int]:
        """Row `row` is done with at `tick` and the rows `_drop_after` names with it (never to be
        sent): its share frees; returns those rows."""
        dropped = self._drop_after(row)
        self.num_out += len(dropped)
        self.num_in_flight -= 1
        for later in dropped:
            self._out[later] = 1
        self._free_share(row, tick)
        return dropped

    def release_finished(self, finished: list[Request], tick: int) -> int | None:
        """These requests finished at `tick`: the rows they release become due. Returns when the
        next row is due (None: none is, until another release)."""
        for request in finished:
            if request.index < self._num_rows:  # (not a parallel-sampling sequence of its own)
                self._release(request.index, tick)
        return self.next_ticks()

    def successor_think(self, row: int) -> int | None:
        """How soon after `row` is released another row could be due (None: none could): under a
        limit a tick, while rows wait to be sent (behind a router, other engines' decode runs then
        stop a tick after an engine's step ends, where it learns of its releases: ReleaseWatch)."""
        return 1 if self._gates and not self.all_out else None

    def last_trace_ticks(self) -> int:
        return max(self._trace_ticks, default=0)

    def _hold_summary(self, which: int) -> tuple[int, float]:
        rows, ticks = self.holds[which]
        return rows, ticks / TICKS_PER_SECOND / rows if rows else 0.0

    def summary(self) -> dict:
        """summary.json's sections on the pacing."""
        if not self._gates:
            return {}
        held, mean = self._hold_summary(1)
        limits = ({"max_concurrency": self.limit} if self.limit is not None else {}) | (
            {"max_inflight_tokens": self.token_limit} if self.token_limit is not None else {})
        return {"client_concurrency": limits | {"requests_held": held, "mean_hold_s": mean}}


def paces(trace, sc) -> bool:
    """The replay of `trace` holds rows back: sessions paced on their replies (SchedulerConfig
    `sc`'s session_pacing and a trace with sessions), or a client's limit on what is in flight."""
    return (sc.session_pacing and trace.session_id is not None or sc.client_max_concurrency is not None
            or sc.client_max_inflight_tokens is not None)


def make_pacing(trace, rows: TraceRows, sc) -> Pacing | None:
    """The pacing of `trace`'s rows under SchedulerConfig `sc`: sessions paced on their replies
    (at most `client_max_active_sessions` in progress), a client's limits on requests and tokens
    in flight, both, or None (the trace's times)."""
    if not paces(trace, sc):
        return None
    limits = (sc.client_max_concurrency, sc.client_max_inflight_tokens,
              trace.n.tolist() if trace.n is not None else None)
    if sc.session_pacing and trace.session_id is not None and sc.client_rotation:
        from simkv.replay.client_rotation import RotatingClients

        clients = sc.client_max_concurrency
        per_client = (sc.client_max_active_sessions or clients) // clients
        return RotatingClients(trace, rows, clients, per_client, *limits[1:], early_stop=sc.client_early_stop,
                               request_rate=sc.client_request_rate, seed=sc.client_seed,
                               sampling=sc.client_conversation_sampling, max_requests=sc.client_max_requests,
                               warmup=sc.client_warmup)
    if sc.session_pacing and trace.session_id is not None:
        return SessionPacing(trace, rows, *limits, max_active=sc.client_max_active_sessions,
                             early_stop=sc.client_early_stop, request_rate=sc.client_request_rate,
                             seed=sc.client_seed)
    return ClientLimits(rows, *limits)


class ClientLimits(Pacing):
    """A client's limits alone: every row is due at its trace time, and waits until it fits (the
    next row in arrival order takes what freed earliest)."""

    def __init__(self, rows: TraceRows, limit: int | None, token_limit: int | None = None,
                 samples: list[int] | None = None) -> None:
        super().__init__(rows, limit, token_limit, samples)
        self._ready = [(tick, i) for i, tick in enumerate(self._trace_ticks)]  # (in arrival order: a heap)


class SessionPacing(Pacing):
    """The rows of a trace with sessions: first turns at their trace times, a next turn once its
    previous turn is released (finished or rejected), after its think time; a conversation whose
    turn was given up on for good ends. With a `limit`, a due turn also waits for a slot: at
    most `limit` requests of all conversations in flight (vLLM's multi-turn benchmark's
    --num-clients, clients that each send one turn at a time). With `max_active`, at most that
    many conversations are in progress (its --max-active-conversations): the next conversation,
    in the order of their first turns, starts a tick after one ends, or at its trace time if
    later. A row without a session is a conversation of one turn.

    With `early_stop` (the multi-turn benchmark's default) the client stops sending once a
    conversation ends and none is left to start: a row is sent only if it goes out by the tick
    of that end; every later one is never sent (`not_sent`), while those in flight finish.

    With a `request_rate` (its --request-rate, per client) each client pauses after every
    request: a request that took d seconds is followed by a pause drawn from an exponential of
    mean 1 / rate - d (none if that is not positive), from the client's own numpy state seeded
    `seed` + client + 1, as the script's client processes draw it. A client is a chain of
    conversations: each of the first ones in progress is a client of its own, and the next
    conversation goes to the client whose conversation ended (and after its pause); an early
    stop comes after that pause too."""

    def __init__(self, trace, rows: TraceRows, limit: int | None = None, token_limit: int | None = None,
                 samples: list[int] | None = None, max_active: int | None = None, early_stop: bool = False,
                 request_rate: float | None = None, seed: int = 0) -> None:
        super().__init__(rows, limit, token_limit, samples)
        n = self._num_rows
        self.next_turn = next_turns(trace.session_id).tolist()
        think = trace.think_time_s
        # (at least a tick after the finish that releases it)
        self.think_ticks = [max(1, to_ticks(t)) for t in think.tolist()] if think is not None else [1] * n
        has_previous = np.zeros(n, bool)
        following = np.asarray(self.next_turn)
        has_previous[following[following >= 0]] = True
        first_turns = np.flatnonzero(~has_previous).tolist()  # (in arrival order)
        self.num_sessions = len({s for s in trace.session_id.tolist() if s is not None})
        self.max_active = max_active
        start = len(first_turns) if max_active is None else min(max_active, len(first_turns))
        self._ready = [(self._trace_ticks[i], i) for i in first_turns[:start]]  # (already a heap)
        self._unstarted = deque(first_turns[start:])  # conversations waiting to start
        self.num_started_late = 0  # conversations started later than their first turn's trace time
        self.start_ticks = 0  # ... by this much in all
        self.early_stop = early_stop
        self.stop_tick: int | None = None  # when the client stopped sending (early stop)
        self.request_rate = request_rate
        self._seed = seed
        self._client = np.full(n, -1, np.int64)  # per row: its client (with a request rate)
        self._client[first_turns[:start]] = np.arange(start)
        self._client_rngs: dict[int, np.random.RandomState] = {}
        self.num_clients = start
        self.pauses = [0, 0]  # (requests released, ticks paused after them in all)

    @property
    def all_out(self) -> bool:
        """Every row handed out, or the client stopped: nothing is due by its stop, and nothing in
        flight could still make a row due (a stop after a pause is ahead of its end)."""
        return self.num_out >= self._num_rows or (
            self.stop_tick is not None and self.num_in_flight == 0 and self.peek() is None)

    def _pause(self, row: int, tick: int) -> int:
        """The ticks `row`'s client pauses after it, released at `tick` (its request rate)."""
        if not self.request_rate:
            return 0
        self.pauses[0] += 1
        mean = 1.0 / self.request_rate - (tick - self.rows.arrival_ticks[row]) / TICKS_PER_SECOND
        if mean <= 0:
            return 0
        client = int(self._client[row])
        rng = self._client_rngs.get(client)
        if rng is None:
            rng = self._client_rngs[client] = np.random.RandomState(self._seed + client + 1)
        pause = to_ticks(float(rng.exponential(mean)))
        self.pauses[1] += pause
        return pause

    def peek(self) -> tuple[int, int] | None:
        nxt = super().peek()
        if nxt is not None and self.stop_tick is not None and nxt[0] > self.stop_tick:
            return None  # (stopped: it is never sent)
        return nxt

    def not_sent(self) -> list[int]:
        """The rows never sent because the client stopped (early stop), once the replay is over."""
        return [] if self.stop_tick is None else self._never_out()

    def _start_next(self, row: int, tick: int) -> None:
        """Row `row`'s conversation ended at `tick`: the next waiting one starts a tick later (after
        its client's pause); with none left, an early stop stops the client then."""
        pause = self._pause(row, tick)
        if self._unstarted:
            first = self._unstarted.popleft()
            self._client[first] = self._client[row]
            due = max(tick + 1 + pause, self._trace_ticks[first])
            if due > self._trace_ticks[first]:
                self.num_started_late += 1
                self.start_ticks += due - self._trace_ticks[first]
            heapq.heappush(self._ready, (due, first))
        elif self.early_stop and (self.stop_tick is None or tick + pause < self.stop_tick):
            self.stop_tick = tick + pause

    def _drop_after(self, row: int) -> list[int]:
        """The conversation ends: its later turns are never sent."""
        dropped = []
        nxt = self.next_turn[row]
        while nxt >= 0:
            dropped.append(nxt)
            nxt = self.next_turn[nxt]
        return dropped

    def give_up(self, row: int, tick: int) -> tuple[list[int], int | None]:
        dropped, _ = super().give_up(row, tick)
        self._start_next(row, tick)
        return dropped, self.next_ticks()

    def successor_think(self, row: int) -> int | None:
        """The think ticks of `row`'s next turn (None: it has none); a tick under a limit, or if
        `row` ends its conversation and another waits to start."""
        nxt = self.next_turn[row]
        if super().successor_think(row) is not None or (nxt < 0 and self._unstarted):
            return 1
        return self.think_ticks[nxt] if nxt >= 0 else None

    def _next_due(self, row: int, tick: int) -> None:
        """Row `row`'s session's next turn becomes due at `tick` plus its think time, or at its
        trace time if later; a conversation that ends lets the next one start."""
        nxt = self.next_turn[row]
        if nxt >= 0:
            self._client[nxt] = self._client[row]
            # (the client's pause and the turn's think time run together)
            due = tick + max(self.think_ticks[nxt], 1 + self._pause(row, tick))
            heapq.heappush(self._ready, (max(due, self._trace_ticks[nxt]), nxt))
        else:
            self._start_next(row, tick)

    def summary(self) -> dict:
        held, mean = self._hold_summary(0)
        section = {"sessions": self.num_sessions, "turns_held": held, "mean_hold_s": mean}
        if self.max_active is not None:
            late = self.num_started_late
            section |= {"max_active_sessions": self.max_active, "sessions_started_late": late,
                        "mean_start_delay_s": self.start_ticks / TICKS_PER_SECOND / late if late else 0.0}
        if self.request_rate:
            section |= {"request_rate": self.request_rate, "clients": self.num_clients,
                        "mean_pause_s": self.pauses[1] / TICKS_PER_SECOND / max(1, self.pauses[0])}
        if self.early_stop:
            section |= {"early_stop_s": None if self.stop_tick is None else self.stop_tick / TICKS_PER_SECOND,
                        "turns_not_sent": len(self.not_sent())}
        return {"session_pacing": section} | super().summary()


def mark_not_sent(requests, pacing) -> None:
    """The rows of `requests` (requests.parquet's table) that `pacing`'s clients never sent
    (they stopped early, or left): status not_sent."""
    rows = pacing.not_sent() if isinstance(pacing, SessionPacing) else []
    if rows:
        requests.loc[rows, "status"] = "not_sent"


def pacing_rows(summary: dict) -> list[tuple[str, str]]:
    """The report's rows on the client's pacing: sessions paced on their replies, or a
    concurrency limit, and the requests each held back."""
    rows = []
    if summary.get("session_pacing"):
        sp = summary["session_pacing"]
        rows.append(("sessions (paced on replies)", f"{sp['sessions']:,}; {sp['turns_held']:,} turns sent later than "
                                                    f"the trace's times, by {sp['mean_hold_s']:,.2f} s on average"))
        if "max_active_sessions" in sp:
            rows.append(("active sessions limit", f"{sp['max_active_sessions']:,} in progress; "
                                                  f"{sp['sessions_started_late']:,} started later than their first "
                                                  f"turn's time, by {sp['mean_start_delay_s']:,.2f} s on average"))
        if "sessions_per_client" in sp:
            rows.append(("clients (rotating)", f"{sp['clients']:,} of {sp['sessions_per_client']:,} conversations each; "
                                               f"{sp['clients_left']:,} left early (none to take, their share of "
                                               "requests sent, or a request failed)"))
        if "request_rate" in sp:
            rows.append(("client request rate", f"{sp['request_rate']:g} req/s per client ({sp['clients']:,} "
                                                f"clients): {sp['mean_pause_s']:,.2f} s paused after a request "
                                                "on average"))
        if "early_stop_s" in sp:
            stop = sp["early_stop_s"]
            rows.append(("early stop", "never" if stop is None
                         else f"at {stop:,.3f} s; {sp['turns_not_sent']:,} turns not sent"))
    if summary.get("client_concurrency"):
        cc = summary["client_concurrency"]
        limits = [f"{cc[key]:,} {what}" for key, what in (("max_concurrency", "requests"),
                                                         ("max_inflight_tokens", "tokens")) if key in cc]
        rows.append(("client concurrency limit", f"{' and '.join(limits)} in flight; {cc['requests_held']:,} "
                                                 f"requests sent later than the trace's times, by "
                                                 f"{cc['mean_hold_s']:,.2f} s on average"))
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
    """One engine's ArrivalFeed that paces its rows as `pacing` (the SchedulerConfig) says
    (`make_pacing`)."""

    def __init__(self, trace, scheduler, request_log, max_model_len: int, pacing) -> None:
        rows = TraceRows(trace)
        self.pacing = make_pacing(trace, rows, pacing)
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
