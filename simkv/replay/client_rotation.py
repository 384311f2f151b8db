"""Clients that rotate over their own conversations (`client_rotation`): vLLM's multi-turn
benchmark's clients (benchmarks/multi_turn/benchmark_serving_multi_turn.py), each a process that
sends one request at a time.

N clients (`client_max_concurrency`) share one queue of conversations, in the order of their
first turns; each keeps k = M // N of them in progress (`client_max_active_sessions` M). A client
takes conversations from the queue until it has k, sends the next turn of the one it took last
or has waited longest (its round-robin: the newest first, a conversation that goes on goes to
the back), waits for the reply, pauses (`client_request_rate`), and starts over. A conversation
ends after its last turn, or when a turn is rejected or refused for good (the client drops it);
a turn given up on for good (a time-out) ends the client. A client that wants a conversation
when the queue is empty leaves, and the conversations it still had are never finished: their
later turns are not sent (status `not_sent`). With an early stop (`client_early_stop`, the
benchmark's default) the first client to leave stops every client: nothing more is sent after
that tick.

Where M = N this is SessionPacing's shared pool of due turns (one conversation per client), turn
for turn. Client c is given conversations c k .. c k + k - 1 first (the benchmark's processes race
for them). A turn is also no earlier than its previous turn's finish plus its think time and its
own trace time (the benchmark's conversations are all ready at 0, with none).
"""

from __future__ import annotations

import heapq
from collections import deque

from simkv.replay.engine import TraceRows
from simkv.replay.sessions import SessionPacing


class RotatingClients(SessionPacing):
    """`num_clients` clients of `per_client` conversations each, over `trace`'s sessions."""

    def __init__(self, trace, rows: TraceRows, num_clients: int, per_client: int, token_limit: int | None = None,
                 samples: list[int] | None = None, early_stop: bool = False, request_rate: float | None = None,
                 seed: int = 0) -> None:
        super().__init__(trace, rows, None, token_limit, samples, max_active=0, early_stop=early_stop,
                         request_rate=request_rate, seed=seed)
        self.num_clients = num_clients
        self.per_client = per_client
        self._turn_ready = list(self._trace_ticks)  # per row: no earlier than this (its trace time, or think)
        self._active: list[deque[int]] = [deque() for _ in range(num_clients)]  # each client's next rows
        self._gone = [False] * num_clients
        self.num_clients_left = 0
        self._left_behind: list[int] = []  # rows never sent: their client dropped or left their conversation
        for client in range(num_clients):
            self._client_next(client, 0)

    def _leave(self, client: int, tick: int) -> None:
        """`client` leaves at `tick`: its conversations' turns not yet sent never are."""
        self._gone[client] = True
        self.num_clients_left += 1
        for row in self._active[client]:
            while row >= 0:
                self._left_behind.append(row)
                self._out[row] = 1
                self.num_out += 1
                row = self.next_turn[row]
        self._active[client].clear()
        if self.early_stop and (self.stop_tick is None or tick < self.stop_tick):
            self.stop_tick = tick

    def _client_next(self, client: int, tick: int) -> None:
        """`client` is free at `tick`: it fills up its conversations and sends its next turn."""
        if self.stop_tick is not None and tick > self.stop_tick:
            self._gone[client] = True  # (it sees the stop before its next request)
            return
        active = self._active[client]
        while len(active) < self.per_client:
            if not self._unstarted:
                self._leave(client, tick)
                return
            first = self._unstarted.popleft()
            self._client[first] = client
            active.append(first)
        row = active.pop()
        due = max(tick, self._turn_ready[row])
        heapq.heappush(self._ready, (due, row))

    def _next_due(self, row: int, tick: int) -> None:
        """Row `row`'s reply came at `tick`: its conversation goes on at the back of its client's
        rotation (or ends), and the client sends again a tick later, after its pause."""
        client = int(self._client[row])
        nxt = self.next_turn[row]
        if nxt >= 0:
            self._client[nxt] = client
            self._turn_ready[nxt] = max(tick + self.think_ticks[nxt], self._trace_ticks[nxt])
            self._active[client].appendleft(nxt)
        self._client_next(client, tick + 1 + self._pause(row, tick))

    def release(self, row: int, tick: int) -> int | None:
        """Row `row` was rejected (or refused for good) at `tick`: its client drops the
        conversation (its later turns are never sent) and goes on."""
        later = self._drop_after(row)
        self._left_behind += later
        for nxt in later:
            self._out[nxt] = 1
        self.num_out += len(later)
        self.num_in_flight -= 1
        self._free_share(row, tick)
        self._client_next(int(self._client[row]), tick + 1 + self._pause(row, tick))
        return self.next_ticks()

    def give_up(self, row: int, tick: int) -> tuple[list[int], int | None]:
        """Row `row` timed out for good at `tick`: its conversation ends and its client leaves."""
        dropped = self._drop_after(row)
        self.num_out += len(dropped)
        for nxt in dropped:
            self._out[nxt] = 1
        self.num_in_flight -= 1
        self._free_share(row, tick)
        self._leave(int(self._client[row]), tick)
        return dropped, self.next_ticks()

    def successor_think(self, row: int) -> int | None:
        return 1  # (its client may send its next turn a tick after the reply)

    def not_sent(self) -> list[int]:
        return sorted(self._left_behind + super().not_sent())

    def summary(self) -> dict:
        section = super().summary()
        pacing = section["session_pacing"]
        for key in ("max_active_sessions", "sessions_started_late", "mean_start_delay_s"):
            pacing.pop(key, None)
        pacing |= {"clients": self.num_clients, "sessions_per_client": self.per_client,
                   "clients_left": self.num_clients_left, "turns_not_sent": len(self.not_sent())}
        return section
