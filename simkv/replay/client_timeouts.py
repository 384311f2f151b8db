"""Clients that give up: time-outs, vLLM's aborts, and retries.

A client waits `client_ttft_timeout_s` for a request's first token and `client_timeout_s` for its
last, counted from when it sent the request. When a deadline passes it abandons the request
(closes the connection), and vLLM's front end aborts it (`Scheduler.abort_request`: the request
leaves the queues and frees its blocks). vLLM 0.33's engine core takes the aborts that arrived
while a step ran just before it processes that step's output, and those that arrived between
steps before it schedules the next: a request whose deadline passes during a step is aborted
even if the step computed its first or last token (computed, never delivered). A token counts
when the step that sampled it ends, so one at the deadline itself is in time.

A client with retries left sends the same request again `client_retry_backoff_s` after it gave
up, and twice as long after each later give-up (the OpenAI client's exponential back-off, without
its jitter). The new attempt is a new request to vLLM, arriving then, and its prompt finds the
blocks the abandoned attempt left in the prefix cache. A request's latencies count from its
first send, which is what its user waits; a request whose last attempt is abandoned is
`timed_out`.

Under async scheduling (vLLM's serving default) the abort points are the same two, at step ends,
while the next step is already in flight: a token counts as delivered when its step's output is
processed, not when the step is scheduled, and an aborted request's KV is cached as far as vLLM
had cached it when it last allocated its blocks (a decoder's token in flight is not).

Modelled for one engine, without paced sessions; `check_supported` names what is not.
"""

from __future__ import annotations

import heapq

import numpy as np

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.config import EngineConfig
from simkv.core.request import Request
from simkv.core.scheduler import Scheduler
from simkv.replay.engine import ArrivalFeed
from simkv.replay.step_log import RequestLog

TTFT, E2E = 0, 1  # which deadline a client missed
_KINDS = ("ttft", "e2e")


def check_supported(trace, config: EngineConfig, *, fleet: bool = False, disaggregated: bool = False,
                    real_backend: bool = False) -> None:
    """ValueError naming the first setting that client time-outs are not modelled with yet."""
    sc = config.scheduler
    if not sc.has_client_timeouts:
        return
    why = None
    if config.speculative.enabled:
        why = "speculative decoding"
    elif disaggregated:
        why = "P/D disaggregation"
    elif fleet:
        why = "a fleet of replicas or data-parallel ranks (one engine only)"
    elif real_backend:
        why = "the gpu backend (simulated replays only)"
    elif config.cache.kv_offloading_size is not None:
        why = "KV offloading"
    elif trace.n is not None and (trace.n > 1).any():
        why = "parallel sampling (a trace column n > 1)"
    elif trace.session_id is not None and sc.session_pacing:
        why = "session pacing (give --no-session-pacing to replay the turns at the trace's times)"
    if why is not None:
        raise ValueError(f"client time-outs (client_timeout_s, client_ttft_timeout_s) are not modelled with {why} yet")


class ClientTimeoutFeed(ArrivalFeed):
    """The trace's arrivals, sent by clients that give up and retry. Retries are arrivals, and
    deadlines events like them: `next_arrival_ticks` names the earliest, so decode runs stop at
    them (and `next_deadline_ticks` the earliest deadline: a step during which one passes runs
    alone). `expire_during_step` takes the aborts of deadlines that passed during a step, before
    its output is processed; `deliver_until` those at the step boundary, then the sends."""

    def __init__(self, trace, scheduler: Scheduler, request_log: RequestLog, config: EngineConfig,
                 rows=None) -> None:
        super().__init__(trace, scheduler, request_log, config.max_model_len, rows)
        sc = self.clients = config.scheduler  # (their client_* options)
        self.max_retries = sc.client_max_retries
        self._timeouts = (None if sc.client_ttft_timeout_s is None else to_ticks(sc.client_ttft_timeout_s),
                          None if sc.client_timeout_s is None else to_ticks(sc.client_timeout_s))
        self._live: dict[int, tuple[Request, int, int]] = {}  # row -> (its attempt in flight, sent at tick, number)
        self._deadlines: list[tuple[int, int, int, int]] = []  # (tick, row, attempt number, TTFT/E2E)
        self._resends: list[tuple[int, int, int]] = []  # (tick, row, attempt number)
        self.attempts = np.zeros(len(trace), dtype=np.int64)  # per row: attempts sent
        self.num_abandoned = [0, 0]  # attempts given up on (and aborted), by the deadline missed
        self.num_aborted_after_prefill = 0  # of them, those whose whole prompt had been computed
        self.abandoned_output_tokens = 0  # tokens the engine sampled for them (delivered or not)
        self.on_timed_out = None  # (the engine's progress callback)

    # ---- the engine's view ---------------------------------------------------------------------
    @property
    def exhausted(self) -> bool:
        return self.next_index >= len(self.arrivals) and not self._resends

    def next_arrival_ticks(self) -> int | None:
        """The next send or deadline."""
        candidates = [t for t in (super().next_arrival_ticks(), self._resends[0][0] if self._resends else None,
                                  self.next_deadline_ticks()) if t is not None]
        return min(candidates) if candidates else None

    def next_deadline_ticks(self) -> int | None:
        """The next deadline of an attempt in flight (those of attempts no longer in flight are dropped)."""
        deadlines = self._deadlines
        while deadlines and not self._is_live(deadlines[0][1], deadlines[0][2]):
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def expire_during_step(self, now: int, out) -> None:
        """A step `out` ended at tick `now`: abort the attempts whose deadlines passed while it ran,
        before its output is processed (their tokens of this step came after the deadline)."""
        deadline = self.next_deadline_ticks()
        if deadline is None or deadline >= now:
            return
        chunk_ends = None if self.scheduler.async_scheduling else {  # (async: counted when scheduled)
            id(chunk.request): chunk.num_computed_tokens + chunk.num_new_tokens for chunk in out.chunks}
        self._expire(now - 1, chunk_ends)

    def deliver_until(self, now: int) -> None:
        """Give up on the attempts whose deadlines passed by tick `now`, then send what is due:
        the trace's rows and the retries, in time order (a tie in row order)."""
        self._expire(now)
        arrivals, resends = self._arrival_ticks, self._resends
        n = len(arrivals)
        while True:
            i = self.next_index
            row_tick = arrivals[i] if i < n else None
            if resends and resends[0][0] <= now and (row_tick is None or row_tick > now
                                                     or (resends[0][0], resends[0][1]) < (row_tick, i)):
                tick, row, attempt = heapq.heappop(resends)
                self._send(self.make_retry(row, attempt, tick), row, tick, attempt)
            elif row_tick is not None and row_tick <= now:
                self._deliver(i)
                self.next_index = i + 1
            else:
                return

    def make_retry(self, row: int, attempt: int, tick: int) -> Request:
        """The row's request sent again: a new request to vLLM, arriving at `tick`."""
        request = self.make_request(row)
        request.request_id = f"{request.request_id}/retry{attempt}"
        request.arrival_time = tick / TICKS_PER_SECOND
        request.has_own_cached_blocks = True  # (its prompt's unique blocks may be cached: an earlier attempt's)
        return request

    def _deliver(self, i: int) -> None:
        self.attempts[i] = 1
        if self._prompt_list[i] >= self.max_model_len:
            super()._deliver(i)  # (rejected, as vLLM's front end refuses it)
            return
        self._send(self.make_request(i), i, self._arrival_ticks[i], 0)

    def note_finished(self, finished: list[Request], tick: int) -> None:
        """Finished by tick `tick`, so by every deadline not yet passed: their clients have them."""
        for request in finished:
            del self._live[request.index]

    # ---- clients ---------------------------------------------------------------------------------
    def _send(self, request: Request, row: int, tick: int, attempt: int) -> None:
        request.may_resend = attempt < self.max_retries
        self._live[row] = (request, tick, attempt)
        self.attempts[row] = attempt + 1
        for kind, timeout in enumerate(self._timeouts):
            if timeout is not None:
                heapq.heappush(self._deadlines, (tick + timeout, row, attempt, kind))
        self.scheduler.add_request(request)

    def _is_live(self, row: int, attempt: int) -> bool:
        live = self._live.get(row)
        return live is not None and live[2] == attempt

    def _expire(self, upto: int, chunk_ends: dict[int, int] | None = None) -> None:
        """Give up on the attempts whose deadlines are at or before tick `upto` and that lack what
        the deadline asks for; vLLM aborts them. `chunk_ends`: during a step, whose tokens all come
        after these deadlines (where each request's chunk in it ends, by the request's id)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= upto:
            deadline, row, attempt, kind = heapq.heappop(deadlines)
            if not self._is_live(row, attempt):
                continue
            request = self._live[row][0]
            if kind == TTFT and self.scheduler.token_delivered(request.first_token_step):
                continue  # (a step whose output was processed before the deadline sampled it)
            del self._live[row]
            aborted = self.scheduler.abort_request(request, chunk_ends.get(id(request)) if chunk_ends else None)
            assert aborted, f"{request} was in flight but not in the engine"
            self._give_up(row, request, attempt, deadline, kind)

    def _give_up(self, row: int, request: Request, attempt: int, at: int, kind: int) -> None:
        self.num_abandoned[kind] += 1
        computed, prompt = request.num_computed_tokens, request.num_prompt_tokens
        if computed >= prompt:  # (its prompt's KV was all there: work that reached nobody)
            self.num_aborted_after_prefill += 1
        self.abandoned_output_tokens += max(request.num_output_tokens, computed - prompt + 1)
        if attempt < self.max_retries:
            heapq.heappush(self._resends, (at + to_ticks(self.clients.client_retry_backoff_s * 2 ** attempt),
                                           row, attempt + 1))
            return
        self.request_log.time_out(row)
        if self.on_timed_out is not None:
            self.on_timed_out(1)

    # ---- results ---------------------------------------------------------------------------------
    def client_summary(self, requests) -> dict:
        """summary.json's `client` section."""
        status = requests["status"].to_numpy()
        sent = self.attempts
        sc = self.clients
        return {
            "ttft_timeout_s": sc.client_ttft_timeout_s, "timeout_s": sc.client_timeout_s,
            "max_retries": sc.client_max_retries, "retry_backoff_s": sc.client_retry_backoff_s,
            "attempts": int(sent.sum()), "retries": int(np.maximum(sent - 1, 0).sum()),
            "aborted": sum(self.num_abandoned), "aborted_by_deadline": dict(zip(_KINDS, self.num_abandoned)),
            "aborted_after_prefill": self.num_aborted_after_prefill,
            "abandoned_output_tokens": int(self.abandoned_output_tokens),
            "timed_out_requests": int((status == "timed_out").sum()),
            "finished_after_retries": int(((status == "finished") & (sent > 1)).sum()),
        }


def client_row(section: dict) -> tuple[str, str]:
    """The report row of summary.json's `client` section (the terminal table and report.html)."""
    limits = [f"{label} {section[key]:g} s" for label, key in (("TTFT", "ttft_timeout_s"), ("E2E", "timeout_s"))
              if section[key] is not None]
    return ("client time-outs", f"{section['timed_out_requests']:,} requests timed out ({', '.join(limits)}, "
                                f"{section['max_retries']} retries); vLLM aborted {section['aborted']:,} attempts; "
                                f"{section['retries']:,} retries, {section['finished_after_retries']:,} requests "
                                f"finished on one")
