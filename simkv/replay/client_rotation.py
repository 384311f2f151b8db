"""Clients that rotate over their own conversations (`client_rotation`): vLLM's multi-turn
benchmark's clients (benchmarks/multi_turn/benchmark_serving_multi_turn.py), each a process that
sends one request at a time.

N clients (`client_max_concurrency`) share one queue of conversations, in the order of their
first turns; each keeps k = M // N of them in progress (`client_max_active_sessions` M). A client
takes conversations from the queue until it has k, sends the next turn of one of them, waits for
the reply, pauses (`client_request_rate`), and starts over. Which one: round-robin (the newest
first; a conversation that goes on goes to the back) or, with `sampling` "random", a draw from
Python's `random` seeded `client_seed` + client + 1 over its conversations in the order it took
them (the script's `random.choice`). A conversation ends after its last turn, or when a turn is
rejected or refused for good (the client drops it); a turn given up on for good ends the client.
A client that wants a conversation when the queue is empty leaves, as does one that has sent
its share of `client_max_requests` (// N); the conversations it still had are never finished:
their later turns are not sent (status `not_sent`). With an early stop (`client_early_stop`, the
benchmark's default) the first client to leave stops every client: nothing more is sent after
that tick.

With a warm-up (`client_warmup`, the script's --warmup-step) the clients first send every
conversation's first turn alone (one conversation each, no early stop); once all are done, the
clients start over, their random states too, from the second turn of every conversation whose
first turn was answered (the script goes on with the conversations its warm-up returned).

Where M = N this is SessionPacing's shared pool of due turns (one conversation per client), turn
for turn. Client c is given conversations c k .. c k + k - 1 first (the benchmark's processes race
for them). A turn is also no earlier than its previous turn's finish plus its think time and its
own trace time (the benchmark's conversations are all ready at 0, with none).
"""

from __future__ import annotations

import heapq
import random
from collections import deque

from simkv.clock import TICKS_PER_SECOND
from simkv.replay.engine import TraceRows
from simkv.replay.sessions import SessionPacing


class _Client:
    """One client: its conversations in progress (first row -> the row it sends next, in the
    order taken), their round-robin order, and the requests it has sent."""

    def __init__(self) -> None:
        self.active: dict[int, int] = {}
        self.order: deque[int] = deque()
        self.sent = 0
        self.gone = False


class RotatingClients(SessionPacing):
    """`num_clients` clients of `per_client` conversations each, over `trace`'s sessions."""

    def __init__(self, trace, rows: TraceRows, num_clients: int, per_client: int, token_limit: int | None = None,
                 samples: list[int] | None = None, early_stop: bool = False, request_rate: float | None = None,
                 seed: int = 0, sampling: str = "round_robin", max_requests: int | None = None,
                 warmup: bool = False) -> None:
        super().__init__(trace, rows, None, token_limit, samples, max_active=0, early_stop=early_stop,
                         request_rate=request_rate, seed=seed)
        self.num_clients = num_clients
        self.per_client = per_client
        self.sampling = sampling
        self.max_requests = None if max_requests is None else max_requests // num_clients  # (each client's share)
        self._first_rows = list(self._unstarted)  # the conversations, in queue order
        self._conversation = [-1] * self._num_rows  # per row: its conversation's first row
        for first in self._first_rows:
            row = first
            while row >= 0:
                self._conversation[row] = first
                row = self.next_turn[row]
        self._turn_ready = list(self._trace_ticks)  # per row: no earlier than this (its trace time, or think)
        self._left_behind: list[int] = []  # rows never sent: their client dropped or left their conversation
        self.num_clients_left = 0
        self.warmup = warmup
        self.warmup_end_tick: int | None = None  # when the clients started over after the warm-up
        self._warmup_leave = 0  # the last client's leaving of the warm-up (after its pause)
        self._warmed: set[int] = set()  # the conversations whose first turn the warm-up had answered
        self._start_clients(0)

    @property
    def _warming_up(self) -> bool:
        return self.warmup and self.warmup_end_tick is None

    def _start_clients(self, tick: int) -> None:
        """Fresh clients (and random states) on the queue of conversations, from `tick`."""
        if self._warming_up:
            self._unstarted = deque(self._first_rows)
        else:
            # (after a warm-up: from the second turn, of the conversations whose first turn was answered)
            rows = ([self.next_turn[first] for first in self._first_rows if first in self._warmed] if self.warmup
                    else self._first_rows)
            self._unstarted = deque(row for row in rows if row >= 0)
        self._clients = [_Client() for _ in range(self.num_clients)]
        self._num_gone = 0  # (clients that left, or saw the stop)
        self._client_rngs = {}
        self._choosers: dict[int, random.Random] = {}
        for client in range(self.num_clients):
            self._client_next(client, tick)

    def _go(self, state: _Client) -> None:
        if not state.gone:
            state.gone = True
            self._num_gone += 1

    def _leave(self, client: int, tick: int) -> None:
        """`client` leaves at `tick`: its conversations' turns not yet sent never are."""
        state = self._clients[client]
        self._go(state)
        if self._warming_up:  # (with none in progress: the benchmark proper starts once every client left)
            self._warmup_leave = max(self._warmup_leave, tick)
            return
        self.num_clients_left += 1
        for row in state.active.values():
            while row >= 0:
                self._left_behind.append(row)
                self._out[row] = 1
                self.num_out += 1
                row = self.next_turn[row]
        state.active.clear()
        if self.early_stop and (self.stop_tick is None or tick < self.stop_tick):
            self.stop_tick = tick

    def _choose(self, client: int, state: _Client) -> int:
        if self.sampling == "random":
            chooser = self._choosers.get(client)
            if chooser is None:
                chooser = self._choosers[client] = random.Random(self._seed + client + 1)
            return chooser.choice(list(state.active))
        return state.order.pop()

    def _client_next(self, client: int, tick: int) -> None:
        """`client` is free at `tick`: it fills up its conversations and sends its next turn."""
        state = self._clients[client]
        if self.max_requests is not None and state.sent >= self.max_requests:
            self._leave(client, tick)
            return
        if self.stop_tick is not None and tick > self.stop_tick:
            self._go(state)  # (it sees the stop before its next request)
            return
        per_client = 1 if self._warming_up else self.per_client
        while len(state.active) < per_client:
            if not self._unstarted:
                self._leave(client, tick)
                return
            row = self._unstarted.popleft()
            state.active[self._conversation[row]] = row
            if self.sampling != "random":
                state.order.append(self._conversation[row])
        row = state.active[self._choose(client, state)]
        self._client[row] = client
        state.sent += 1
        heapq.heappush(self._ready, (max(tick, self._turn_ready[row]), row))

    def _after_reply(self, row: int, tick: int, goes_on: bool) -> None:
        """Row `row`'s client has its answer at `tick`: the conversation goes on (at the back of
        the rotation) or ends, and the client sends again a tick later, after its pause."""
        client = int(self._client[row])
        state = self._clients[client]
        first, nxt = self._conversation[row], self.next_turn[row]
        if goes_on and self._warming_up:
            self._warmed.add(first)
        if goes_on and nxt >= 0 and not self._warming_up:
            self._turn_ready[nxt] = max(tick + self.think_ticks[nxt], self._trace_ticks[nxt])
            state.active[first] = nxt
            if self.sampling != "random":
                state.order.appendleft(first)
        else:
            del state.active[first]
        self._client_next(client, tick + 1 + self._pause(row, tick))
        self._end_warmup(tick)

    def _end_warmup(self, tick: int) -> None:
        """The warm-up is over once every client left and every answer came: the clients start
        over a tick later."""
        if self._warming_up and self.num_in_flight == 0 and self._num_gone == self.num_clients:
            self.warmup_end_tick = max(tick + 1, self._warmup_leave)
            self._start_clients(self.warmup_end_tick)

    def _next_due(self, row: int, tick: int) -> None:
        self._after_reply(row, tick, goes_on=True)

    def release(self, row: int, tick: int) -> int | None:
        """Row `row` was rejected (or refused for good) at `tick`: its client drops the
        conversation (its later turns are never sent; after a warm-up's failure too: the benchmark
        proper skips it) and goes on."""
        self._left_behind += self._drop_with(row, tick)
        self._after_reply(row, tick, goes_on=False)
        return self.next_ticks()

    def give_up(self, row: int, tick: int) -> tuple[list[int], int | None]:
        """Row `row` timed out for good at `tick`: its conversation ends and its client leaves."""
        dropped = self._drop_with(row, tick)
        client = int(self._client[row])
        del self._clients[client].active[self._conversation[row]]
        self._leave(client, tick)
        self._end_warmup(tick)
        return dropped, self.next_ticks()

    @property
    def all_out(self) -> bool:
        """As SessionPacing's, or every client left and none can send again (the conversations
        still in the queue are never sent: the script discards them)."""
        return super().all_out or (self._num_gone == self.num_clients and self.num_in_flight == 0
                                   and self.peek() is None)

    def successor_think(self, row: int) -> int | None:
        return 1  # (its client may send its next turn a tick after the reply)

    def not_sent(self) -> list[int]:
        """Once the replay is over: the rows its clients never sent (left behind, or never reached)."""
        return self._never_out() + self._left_behind

    def summary(self) -> dict:
        section = super().summary()
        pacing = section["session_pacing"]
        for key in ("max_active_sessions", "sessions_started_late", "mean_start_delay_s"):
            pacing.pop(key, None)
        pacing |= {"clients": self.num_clients, "sessions_per_client": self.per_client,
                   "clients_left": self.num_clients_left, "turns_not_sent": len(self.not_sent())}
        if self.warmup:
            pacing["warmup_end_s"] = (None if self.warmup_end_tick is None
                                      else self.warmup_end_tick / TICKS_PER_SECOND)
        return section
