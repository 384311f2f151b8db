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
up, and twice as long after each later give-up (the OpenAI client's exponential back-off;
`client_retry_max_backoff_s` caps it and `client_retry_jitter` shortens each wait by a draw of
up to that fraction, as that client does). The new attempt is a new request to vLLM, arriving
then, and its prompt finds the blocks the abandoned attempt left in the prefix cache. A request's latencies count from its
first send, which is what its user waits; a request whose last attempt is abandoned is
`timed_out`. With a queue limit (simkv/replay/admission.py) the clients retry the front end's
HTTP 503s the same way, as the OpenAI client does, even without time-outs (one engine, or a
fleet: the router routes the retry).

Under async scheduling (vLLM's serving default) the abort points are the same two, at step ends,
while the next step is already in flight: a token counts as delivered when its step's output is
processed, not when the step is scheduled, and an aborted request's KV is cached as far as vLLM
had cached it when it last allocated its blocks (a decoder's token in flight is not).

In a fleet (`ReplicaClientFeed`) each replica aborts as one engine does, and the router routes
the retries; data-parallel ranks likewise, their retries routed by vLLM's load balancer. With
session pacing (`SessionClientFeed`; on several engines, their router's pacing) a conversation
whose turn timed out for good ends: its later turns are never sent. Under speculative decoding
an aborted request's drafts go with it; with a CPU tier (KV offloading) it is finished for the
connector too, and one aborted while its prompt loads keeps its blocks until the load ends;
under P/D disaggregation the pool that holds an attempt aborts it (simkv/replay/
disaggregated_clients.py); a request fanned out for parallel sampling is aborted whole
(`Scheduler.abort_group`). docs/semantics.md has the rules; `check_supported` names what is not
modelled yet.
"""

from __future__ import annotations

import heapq

import numpy as np

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.config import EngineConfig
from simkv.core.request import Request
from simkv.core.scheduler import Scheduler
from simkv.core.spec_decode import mix64
from simkv.replay.engine import ArrivalFeed
from simkv.replay.fleet import ReplicaFeed, row_of
from simkv.replay.sessions import SessionFeed, SessionPacing
from simkv.replay.step_log import RequestLog

# which deadline a client missed (FAILURE: its replica failed, simkv/replay/failures.py; SHUTDOWN:
# a scale-down ended its replica, simkv/replay/autoscale.py's --shutdown-timeout)
TTFT, E2E, FAILURE, SHUTDOWN = 0, 1, 2, 3
_KINDS = ("ttft", "e2e", "failure", "shutdown")
_LOST = (FAILURE, SHUTDOWN)  # (lost with their replica: "failed" unless retried)


def check_supported(trace, config: EngineConfig) -> None:
    """ValueError naming the first setting that client time-outs are not modelled with yet (P/D's:
    simkv/replay/disaggregated_clients.py)."""
    sc = config.scheduler
    if not sc.has_clients:
        return
    why = None
    if trace.n is not None and (trace.n > 1).any() and sc.parallel_sampling == "fork":
        why = "vLLM v0's forked parallel sampling (--parallel-sampling fork; vLLM v1's fan_out is)"
    if why is not None:
        raise ValueError(f"client time-outs (client_timeout_s, client_ttft_timeout_s) are not modelled with {why} yet")


def timeout_ticks(sc) -> tuple[int | None, int | None]:
    """The clients' (first-token, whole-request) time-outs in ticks, indexed by TTFT and E2E
    (None: no such deadline)."""
    return tuple(None if t is None else to_ticks(t) for t in (sc.client_ttft_timeout_s, sc.client_timeout_s))


def backoff_ticks(sc, row: int, attempt: int) -> int:
    """How long `row`'s client waits after giving up on attempt number `attempt` (0: the first):
    the back-off doubled per attempt, at most the cap, less its jitter (a draw hashed from the
    row and the attempt, so the same in every replay and every order)."""
    delay = sc.client_retry_backoff_s * 2 ** attempt
    if sc.client_retry_max_backoff_s is not None:
        delay = min(delay, sc.client_retry_max_backoff_s)
    if sc.client_retry_jitter:
        delay *= 1.0 - sc.client_retry_jitter * (mix64((row << 16) | attempt) >> 11) / (1 << 53)
    return to_ticks(delay)


class ClientDeadlines:
    """Mixed into an engine's feed: the attempts in flight on that engine, their clients'
    deadlines, and vLLM's aborts. A give-up with retries left calls `_resend`; the feed sends
    the retry (one engine) or its router routes it (a fleet)."""

    def _init_clients(self, config: EngineConfig, attempts: np.ndarray) -> None:
        sc = self.clients = config.scheduler  # (their client_* options)
        self.max_retries = sc.client_max_retries
        self._timeouts = timeout_ticks(sc)
        self._live: dict[int, tuple[Request, int, int]] = {}  # row -> (its attempt in flight, sent at tick, number)
        self._deadlines: list[tuple[int, int, int, int]] = []  # (tick, row, attempt number, TTFT/E2E)
        self.attempts = attempts  # per row: attempts sent (a fleet's replicas share one array)
        self.num_abandoned = [0, 0, 0, 0]  # attempts given up on (and aborted), by the deadline missed
        self.num_aborted_after_prefill = 0  # of them, those whose whole prompt had been computed
        self.abandoned_output_tokens = 0  # tokens the engine sampled for them (delivered or not)
        self.on_timed_out = None  # (the engine's progress callback)

    def next_deadline_ticks(self) -> int | None:
        """The next deadline that could still make a client give up. Those of attempts no longer in
        flight are dropped, and so are first-token deadlines met (a delivered token stays
        delivered): decode runs need not stop at them."""
        deadlines, live, delivered = self._deadlines, self._live, self.scheduler.token_delivered
        while deadlines:
            _, row, attempt, kind = deadlines[0]
            entry = live.get(row)
            if entry is not None and entry[2] == attempt and not (kind == TTFT and delivered(entry[0].first_token_step)):
                return deadlines[0][0]
            heapq.heappop(deadlines)
        return None

    def expire_during_step(self, now: int, steps: list) -> None:
        """`steps` (the engine's step; data-parallel ranks' with a fanned-out row's members on any
        rank, every rank's) ended at tick `now`: abort the attempts whose deadlines passed while
        they ran, before their output is processed (their tokens of them came after the deadline)."""
        deadline = self.next_deadline_ticks()
        if deadline is None or deadline >= now:
            return
        chunk_ends = None if self.scheduler.overlapped else {  # (async, PP: counted when scheduled)
            id(chunk.request): chunk.num_computed_tokens + chunk.num_new_tokens
            for step in steps for chunk in step.chunks}
        self._expire(now - 1, now, chunk_ends)

    def expire_until(self, now: int) -> None:
        """Give up on the attempts whose deadlines passed by tick `now` (a step boundary)."""
        self._expire(now, now)

    def make_retry(self, row: int, attempt: int, tick: int) -> Request:
        """The row's request sent again: a new request to vLLM, arriving at `tick`."""
        request = self.make_request(row)
        request.request_id = f"{request.request_id}/retry{attempt}"
        request.arrival_time = tick / TICKS_PER_SECOND
        request.has_own_cached_blocks = True  # (its prompt's unique blocks may be cached: an earlier attempt's)
        return request

    def note_finished(self, finished: list[Request], tick: int) -> None:
        """Finished by tick `tick`, so by every deadline not yet passed: their clients have them."""
        for request in finished:
            del self._live[request.index]

    def _send(self, request: Request, row: int, tick: int, attempt: int, reached: int | None = None) -> None:
        """Send attempt number `attempt` of `row` at `tick`, reaching the replica at `reached` (a
        request held for a replica to be ready: then; None: at once), unless the front end
        refuses it."""
        limits = self.queue_limits
        if limits is not None and not limits.admits(self.scheduler, request.num_samples):
            self._refused(row, attempt, tick)
            return
        request.may_resend = attempt < self.max_retries
        self._live[row] = (request, tick, attempt)
        self.attempts[row] = attempt + 1
        self._watch(self._ends(tick, tick if reached is None else reached), row, attempt, request.may_resend)
        self.scheduler.add_request(request)

    def _watch(self, ends: list[tuple[int, int]], row: int, attempt: int, may_resend: bool) -> None:
        """The attempt's client gives up, or loses it, at each of `ends` ((tick, kind)) it has not
        finished by."""
        for end, kind in ends:
            heapq.heappush(self._deadlines, (end, row, attempt, kind))

    def _ends(self, tick: int, reached: int) -> list[tuple[int, int]]:
        """(tick, kind) of each end an attempt sent at `tick` may meet: its client's time-outs, the
        next failure of its replica from when it reaches it, its replica's end after a scale-down
        (lost then)."""
        ends = [(tick + timeout, kind) for kind, timeout in enumerate(self._timeouts) if timeout is not None]
        failure = self.next_failure(reached)
        if failure is not None:
            ends.append((failure, FAILURE))
        if self.shutdown_at is not None:
            ends.append((self.shutdown_at, SHUTDOWN))
        return ends

    failure_ticks: tuple[int, ...] = ()  # (a fleet's replica that fails: when; simkv/replay/failures.py)
    shutdown_at: int | None = None  # (a fleet replica's end after a scale-down: simkv/replay/autoscale.py)

    def next_failure(self, tick: int) -> int | None:
        """This engine's next failure at or after `tick` (None: none)."""
        return next((f for f in self.failure_ticks if f >= tick), None)

    def _refused(self, row: int, attempt: int, tick: int) -> None:
        """vLLM's front end answered HTTP 503 (simkv/replay/admission.py): the client retries it
        after its back-off, as after a time-out, or the request is rejected."""
        self.attempts[row] = attempt + 1
        if attempt < self.max_retries:
            self._resend(row, attempt + 1, tick + self.backoff_ticks(row, attempt), tick)
            return
        self.num_rejected += 1
        self.request_log.reject(row)

    def _is_live(self, row: int, attempt: int) -> bool:
        live = self._live.get(row)
        return live is not None and live[2] == attempt

    def _expire(self, upto: int, now: int, chunk_ends: dict[int, int] | None = None) -> None:
        """At tick `now`, give up on the attempts whose deadlines are at or before tick `upto`
        and that lack what the deadline asks for; vLLM aborts them. `chunk_ends`: during a step,
        whose tokens all come after these deadlines (where each request's chunk in it ends, by
        the request's id)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= upto:
            deadline, row, attempt, kind = heapq.heappop(deadlines)
            if not self._is_live(row, attempt):
                continue
            request = self._live[row][0]
            if kind == TTFT and self.scheduler.token_delivered(request.first_token_step):
                continue  # (a step whose output was processed before the deadline sampled it)
            del self._live[row]
            aborted = self._abort_group(request, chunk_ends)
            assert aborted, f"{request} was in flight but not in the engine"
            self._give_up(row, request, attempt, deadline, kind, now)

    def _abort_group(self, request: Request, chunk_ends: dict[int, int] | None) -> bool:
        """vLLM aborts the attempt (fanned out: each member); False if none was in the engine."""
        return self.scheduler.abort_group(request, chunk_ends)

    prompt_computed_elsewhere = False  # (P/D's decode side: a prefill replica computed every prompt)

    def _give_up(self, row: int, request: Request, attempt: int, at: int, kind: int, now: int) -> None:
        self.num_abandoned[kind] += 1
        self.request_log.last_abort_s = max(self.request_log.last_abort_s, now / TICKS_PER_SECOND)
        computed, prompt = request.num_computed_tokens, request.num_prompt_tokens
        if computed >= prompt or self.prompt_computed_elsewhere:  # (its prompt's KV was all there: work that reached nobody)
            self.num_aborted_after_prefill += 1
        for sequence in (request, *request.members):  # (fanned out: every member's tokens)
            self.abandoned_output_tokens += max(sequence.num_output_tokens,
                                                sequence.num_computed_tokens - sequence.num_prompt_tokens + 1)
        if attempt < self.max_retries:
            self._resend(row, attempt + 1, at + self.backoff_ticks(row, attempt), now)
            return
        if kind in _LOST:
            self.request_log.fail(row)
        else:
            self.request_log.time_out(row)
        if self.on_timed_out is not None:
            self.on_timed_out(1)

    def backoff_ticks(self, row: int, attempt: int) -> int:
        return backoff_ticks(self.clients, row, attempt)

    def _resend(self, row: int, attempt: int, tick: int, now: int) -> None:
        raise NotImplementedError


class OneEngineClients(ClientDeadlines):
    """Mixed into one engine's feed: its clients' retries wait here until their send times.
    Retries are arrivals, and deadlines events like them: `next_arrival_ticks` names the
    earliest, so decode runs stop at them (and `next_deadline_ticks` the earliest deadline: a
    step during which one passes runs alone). `expire_during_step` takes the aborts of deadlines
    that passed during a step, before its output is processed; `deliver_until` those at the step
    boundary, then the sends: first attempts (`_peek_first`, `_send_first`) and retries, in time
    order (a tie in row order)."""

    def _init_one_engine(self, config: EngineConfig, num_rows: int) -> None:
        self._init_clients(config, np.zeros(num_rows, dtype=np.int64))
        self._resends: list[tuple[int, int, int]] = []  # (tick, row, attempt number)

    @property
    def exhausted(self) -> bool:
        return self._all_first_sent() and not self._resends

    def next_arrival_ticks(self) -> int | None:
        """The next send or deadline."""
        first = self._peek_first()
        candidates = [t for t in (first[0] if first is not None else None,
                                  self._resends[0][0] if self._resends else None,
                                  self.next_deadline_ticks()) if t is not None]
        return min(candidates) if candidates else None

    def deliver_until(self, now: int) -> None:
        self._expire(now, now)
        resends = self._resends
        while True:
            due = self._peek_first()
            if due is not None and due[0] > now:
                due = None
            if resends and resends[0][0] <= now and (due is None or resends[0][:2] < due):
                tick, row, attempt = heapq.heappop(resends)
                self._send(self.make_retry(row, attempt, tick), row, tick, attempt)
            elif due is not None:
                self._send_first(*due)
            else:
                return

    def _send_or_reject(self, row: int, tick: int) -> bool:
        """The row's first attempt: sent at `tick`, or (False) rejected, as vLLM's front end
        refuses a prompt of max_model_len tokens or more."""
        self.attempts[row] = 1
        if self._prompt_list[row] >= self.max_model_len:
            ArrivalFeed._deliver(self, row)
            return False
        self._send(self.make_request(row), row, tick, 0)
        return True

    def _resend(self, row: int, attempt: int, tick: int, now: int) -> None:
        heapq.heappush(self._resends, (tick, row, attempt))

    def client_summary(self, requests) -> dict:
        """summary.json's `client` section."""
        return client_section(self.clients, self.attempts, requests, [self], getattr(self, "pacing", None))

    # (the feed's first attempts)
    def _peek_first(self) -> tuple[int, int] | None:
        """The next first attempt, as (tick, row) (None: none is due, for now or at all)."""
        raise NotImplementedError

    def _send_first(self, tick: int, row: int) -> None:
        raise NotImplementedError

    def _all_first_sent(self) -> bool:
        raise NotImplementedError


class ClientTimeoutFeed(OneEngineClients, ArrivalFeed):
    """The trace's arrivals, sent to one engine by clients that give up and retry."""

    def __init__(self, trace, scheduler: Scheduler, request_log: RequestLog, config: EngineConfig,
                 rows=None) -> None:
        super().__init__(trace, scheduler, request_log, config.max_model_len, rows)
        self._init_one_engine(config, len(trace))

    def _peek_first(self) -> tuple[int, int] | None:
        i = self.next_index
        return (self._arrival_ticks[i], i) if i < len(self._arrival_ticks) else None

    def _send_first(self, tick: int, row: int) -> None:
        self.next_index = row + 1
        self._send_or_reject(row, tick)

    def _all_first_sent(self) -> bool:
        return self.next_index >= len(self._arrival_ticks)


class SessionClientFeed(OneEngineClients, SessionFeed):
    """One engine's paced requests (conversations, or a client's concurrency limit), sent by
    clients that give up and retry. A request's retries are sent as one engine's clients send
    them; one that finishes (or is rejected, for good) releases the next, as without time-outs; a
    turn whose client gave up for good ends its conversation: the later turns are never sent
    (status `abandoned`), while a concurrency limit's slot goes to the next request."""

    def __init__(self, trace, scheduler: Scheduler, request_log: RequestLog, config: EngineConfig) -> None:
        super().__init__(trace, scheduler, request_log, config.max_model_len, config.scheduler)
        self._init_one_engine(config, len(trace))

    def _peek_first(self) -> tuple[int, int] | None:
        return self.pacing.peek()

    def _send_first(self, tick: int, row: int) -> None:
        self.pacing.pop_next()
        if not self._send_or_reject(row, tick):
            self.pacing.release(row, tick)  # (a rejected turn is done with at once)

    def _all_first_sent(self) -> bool:
        return self.pacing.all_out

    def note_finished(self, finished: list[Request], tick: int) -> None:
        ClientDeadlines.note_finished(self, finished, tick)
        SessionFeed.note_finished(self, finished, tick)

    def _give_up(self, row: int, request: Request, attempt: int, at: int, kind: int, now: int) -> None:
        super()._give_up(row, request, attempt, at, kind, now)
        if attempt >= self.max_retries:  # (for good: the conversation ends, or the slot frees)
            dropped, _ = self.pacing.give_up(row, at)
            for later in dropped:
                self.request_log.abandon(later)
            if self.on_timed_out is not None and dropped:
                self.on_timed_out(len(dropped))  # (done with, for the progress bar)

    def _refused(self, row: int, attempt: int, tick: int) -> None:
        super()._refused(row, attempt, tick)
        if attempt >= self.max_retries:  # (refused for good: done with, as a rejected request is)
            self.pacing.release(row, tick)


class FleetClients:
    """A fleet's clients, beside its router (simkv/replay/fleet.py): the attempts sent per row,
    the retries waiting for their send time, and how many attempts routed and not yet done may
    still be resent (the router is done only when none is)."""

    def __init__(self, num_rows: int, max_retries: int) -> None:
        self.attempts = np.zeros(num_rows, dtype=np.int64)
        self.resends: list[tuple[int, int, int]] = []  # (tick, row, attempt number)
        self.max_retries = max_retries
        self.num_resendable = 0
        self.abandoned: list[int] = []  # paced sessions: turns never sent (an earlier turn timed out)

    @property
    def settled(self) -> bool:
        return not self.resends and not self.num_resendable

    def routed(self, attempt: int) -> None:
        """Attempt number `attempt` of a row was routed to a replica (it is sent there at its
        next step boundary)."""
        if attempt < self.max_retries:
            self.num_resendable += 1


class RoutedClients(ClientDeadlines):
    """Mixed into the feed of an engine behind a router whose clients retry through that router
    (`routing`, a FleetRouting with FleetClients): the send-time bounds of the retries its
    attempts in flight could cause, and the router's count of attempts that may still be resent."""

    def _init_routed(self, routing, config: EngineConfig) -> None:
        self.fleet_clients = routing.clients
        self._init_clients(config, self.fleet_clients.attempts)
        self._resend_bounds: list[tuple[int, int, int, int]] = []  # (deadline + back-off, row, attempt, kind)

    def earliest_resend(self) -> int | None:
        """The earliest send time of a retry of an attempt in flight here (None: none can be)."""
        bounds = self._resend_bounds
        while bounds:
            _, row, attempt, kind = bounds[0]
            live = self._live.get(row)
            if live is not None and live[2] == attempt and not (
                    kind == TTFT and self.scheduler.token_delivered(live[0].first_token_step)):
                return bounds[0][0]
            heapq.heappop(bounds)
        return None

    def _watch(self, ends: list[tuple[int, int]], row: int, attempt: int, may_resend: bool) -> None:
        """As one engine's clients; and a retry the attempt's client may send after each end bounds
        the other replicas' decode runs (counted as resendable when it was routed)."""
        super()._watch(ends, row, attempt, may_resend)
        if may_resend:
            backoff = self.backoff_ticks(row, attempt)
            for end, kind in ends:
                heapq.heappush(self._resend_bounds, (end + backoff, row, attempt, kind))

    def shutdown(self, at: int) -> None:
        """A scale-down ends this replica at tick `at` (the drain that vLLM's --shutdown-timeout and
        the pod's grace period allow): the attempts still in flight then are lost, as at a failure."""
        self.shutdown_at = at
        for row, (request, _, attempt) in self._live.items():
            self._watch([(at, SHUTDOWN)], row, attempt, request.may_resend)

    def reopen(self) -> None:
        """A new pod in its slot takes requests: none is lost at the old one's end."""
        self.shutdown_at = None

    def _finished_for_good(self, finished: list[Request], tick: int) -> None:
        """These attempts finished: their clients have them, and will not resend them."""
        resendable = sum(request.may_resend for request in finished)
        ClientDeadlines.note_finished(self, finished, tick)
        if resendable:
            self._no_longer_resendable(resendable, tick)

    def _no_longer_resendable(self, count: int, tick: int) -> None:
        self.fleet_clients.num_resendable -= count
        if self.routing.all_routed:  # (the last retry that could come will not: the router is done)
            self.routing.wake_router(tick)

    def _resend(self, row: int, attempt: int, tick: int, now: int) -> None:
        self.routing.resend(row, attempt, tick)

    def _abort_group(self, request: Request, chunk_ends: dict[int, int] | None) -> bool:
        return self.routing.abort_group(self, request, chunk_ends)


class ReplicaClientFeed(RoutedClients, ReplicaFeed):
    """One replica's arrivals, sent by clients that give up and retry. A replica aborts what its
    clients gave up on (as one engine does); a retry goes back to the router, which routes it at
    its send time, like any arrival, to any replica. The router learns of a give-up when the
    replica takes the abort, at the end of the step during which the deadline passed: a retry
    whose back-off ends before that is routed then (a back-off shorter than the rest of a step).
    Decode runs stop before the earliest send time of a retry that any replica's clients could
    still make, since it could be routed here."""

    _nodes_fail = False  # (nodes that fail under its replica: simkv/replay/autoscale_nodes.py)

    def __init__(self, routing, replica: int, trace, scheduler, request_log, config: EngineConfig) -> None:
        super().__init__(routing, replica, trace, scheduler, request_log, config.max_model_len)
        self._init_routed(routing, config)
        self.retry_queue = routing.retry_queues[replica]
        if routing.failures is not None:
            self.failure_ticks = tuple(routing.failures.failure_ticks(replica))
        scaler = routing.autoscaler  # (nodes that fail under an autoscaled fleet: simkv/replay/autoscale_nodes.py)
        self._nodes_fail = scaler is not None and scaler.nodes is not None and bool(scaler.nodes.mtbf_s)

    def next_failure(self, tick: int) -> int | None:
        """This replica's next failure at or after `tick`, its own or its node's."""
        own = ClientDeadlines.next_failure(self, tick)
        node = self.routing.autoscaler.node_failure_after(self.replica, tick) if self._nodes_fail else None
        return own if node is None else node if own is None else min(own, node)

    @property
    def exhausted(self) -> bool:
        return super().exhausted and not self.retry_queue

    def next_arrival_ticks(self) -> int | None:
        """The next send here, the next deadline here, or the next retry any replica's clients
        could send."""
        candidates = [t for t in (super().next_arrival_ticks(), self._retry_due(self.retry_queue[0]) if self.retry_queue
                                  else None,
                                  self.next_deadline_ticks(), self.routing.earliest_resend()) if t is not None]
        return min(candidates) if candidates else None

    def deliver_until(self, now: int) -> None:
        """Give up on the attempts whose deadlines passed by tick `now`, route what is due, then
        send what the router gave this replica, in time order (a tie in row order)."""
        self._expire(now, now)
        self.routing.route_until(now)
        queue, retries, ticks, due = self.queue, self.retry_queue, self._arrival_ticks, self.routing.due
        sessions = self.routing.sessions
        while True:
            head = row_of(queue[0]) if queue else -1
            row_due = queue and due(head) <= now  # (its arrival, or when the slot it waits for is ready)
            reached = self._retry_due(retries[0]) if retries else None
            if reached is not None and reached <= now and (not row_due or (retries[0][0], retries[0][1])
                                                           < (ticks[head], head)):
                tick, row, attempt, *made = retries.popleft()
                if made:  # (a row fanned out over data-parallel ranks: its first member, or another)
                    self._send_sequence(made[0], row, tick, attempt)
                else:
                    self._send(self.make_retry(row, attempt, tick), row, tick, attempt, reached)
            elif row_due:
                entry = queue.popleft()
                if isinstance(entry, Request):
                    row = entry.prompt_owner
                    self._send_sequence(entry, row, ticks[row], 0)
                else:
                    row = entry
                    self._send(self.make_request(row), row, ticks[row], 0, due(row))
            else:
                if self.failure_ticks or self._nodes_fail or self.shutdown_at is not None or self.routing.hold:
                    self._expire(now, now)  # (sent before a failure and reaching it after: lost; held for a
                    # cold start past its client's deadline: given up on before vLLM schedules it)
                return
            if sessions is not None:  # (this replica could now release the row's next turn)
                self.release_watch.delivered(sessions, row)

    def _retry_due(self, entry) -> int:
        """When a routed retry reaches this replica: its send time, or when the slot it waits for
        is ready (every slot down: FleetRouting.hold)."""
        return max(entry[0], self.routing.hold.get(entry[1], entry[0]))

    def _send_sequence(self, request: Request, row: int, tick: int, attempt: int) -> None:
        """A sequence of a row that data-parallel ranks' router fanned out: its first member is the
        attempt its client watches (sent here), the others join their ranks' schedulers."""
        if request.parent is None:
            self._send(request, row, tick, attempt)
        else:
            self.scheduler.add_request(request)

    def note_finished(self, finished: list[Request], tick: int) -> None:
        ReplicaFeed.note_finished(self, finished, tick)
        self.routing.clients_finished(self, finished, tick)

    def _refused(self, row: int, attempt: int, tick: int) -> None:
        """The replica's front end answered 503: the attempt no longer counts here, and its retry
        (if any) goes back to the router, which may send it to another replica; refused for good,
        it is done with, as a rejected request is (paced requests: it releases the next)."""
        self.routing.note_aborted(self.replica, tick)
        super()._refused(row, attempt, tick)
        if attempt < self.max_retries:  # (counted as resendable when it was routed)
            self._no_longer_resendable(1, tick)
        else:
            self.routing.refused_for_good(row, tick)

    def _give_up(self, row: int, request: Request, attempt: int, at: int, kind: int, now: int) -> None:
        routing = self.routing
        routing.note_aborted(self.replica, now)
        if kind == FAILURE:
            routing.failures.note_abort(self.replica, at, for_good=not request.may_resend)
        elif kind == SHUTDOWN:
            routing.autoscaler.note_shutdown_abort(for_good=not request.may_resend)
        if routing.sessions is not None:
            self.release_watch.finished([request])  # (it releases nothing here now)
        super()._give_up(row, request, attempt, at, kind, now)  # (a retry: first in the router's queue)
        if request.may_resend:
            self._no_longer_resendable(1, now)
        elif routing.sessions is not None:  # (for good: the conversation ends, or the slot frees)
            dropped = routing.client_gave_up(row, at)
            if self.on_timed_out is not None and dropped:
                self.on_timed_out(len(dropped))  # (done with, for the progress bar)


def client_section(sc, attempts: np.ndarray, requests, feeds: list[ClientDeadlines], pacing=None) -> dict:
    """summary.json's `client` section, over the engines whose `feeds` these are (`pacing`, if
    any: paced conversations end at a time-out, and the turns they never sent are counted)."""
    paced = isinstance(pacing, SessionPacing)
    status = requests["status"].to_numpy()
    abandoned = [sum(f.num_abandoned[k] for f in feeds) for k in (TTFT, E2E, FAILURE, SHUTDOWN)]
    return {
        "ttft_timeout_s": sc.client_ttft_timeout_s, "timeout_s": sc.client_timeout_s,
        "max_retries": sc.client_max_retries, "retry_backoff_s": sc.client_retry_backoff_s,
        **({"retry_max_backoff_s": sc.client_retry_max_backoff_s, "retry_jitter": sc.client_retry_jitter}
           if sc.client_retry_max_backoff_s is not None or sc.client_retry_jitter else {}),
        "attempts": int(attempts.sum()), "retries": int(np.maximum(attempts - 1, 0).sum()),
        "aborted": sum(abandoned),  # (by failures too, where a replica failed: simkv/replay/failures.py)
        "aborted_by_deadline": {kind: n for k, (kind, n) in enumerate(zip(_KINDS, abandoned))
                                if k not in _LOST or n},
        "aborted_after_prefill": sum(f.num_aborted_after_prefill for f in feeds),
        "abandoned_output_tokens": int(sum(f.abandoned_output_tokens for f in feeds)),
        "timed_out_requests": int((status == "timed_out").sum()),
        **({"failed_requests": int((status == "failed").sum())} if any(abandoned[k] for k in _LOST) else {}),
        "finished_after_retries": int(((status == "finished") & (attempts > 1)).sum()),
    } | ({"abandoned_turns": int((status == "abandoned").sum())} if paced else {})


def client_row(section: dict) -> tuple[str, str] | None:
    """The report row of summary.json's `client` section (the terminal table and report.html);
    None when it says nothing (clients that neither give up nor retry, and lost nothing)."""
    limits = [f"{label} {section[key]:g} s" for label, key in (("TTFT", "ttft_timeout_s"), ("E2E", "timeout_s"))
              if section[key] is not None]
    where = section.get("aborted_in")  # (P/D: simkv/replay/disaggregated_clients.py)
    places = (f" ({where['prefill']:,} at a prefill replica, {where['handoff']:,} in the proxy's hop, "
              f"{where['decode_queue']:,} before their pull, {where['decode']:,} after it)" if where else "")
    if not limits:  # (no deadline: the clients retry the front end's 503s, or what a failed replica lost)
        if not section["max_retries"] and "failed_requests" not in section:
            return None
        failed = (f"; {section['failed_requests']:,} requests failed with their replica"
                  if "failed_requests" in section else "")
        return ("clients", f"{section['retries']:,} retries (at most {section['max_retries']} a request), "
                           f"{section['finished_after_retries']:,} requests finished on one{failed}")
    return ("client time-outs", f"{section['timed_out_requests']:,} requests timed out ({', '.join(limits)}, "
                                f"{section['max_retries']} retries); vLLM aborted {section['aborted']:,} attempts{places}; "
                                f"{section['retries']:,} retries, {section['finished_after_retries']:,} requests "
                                f"finished on one" + (f"; {section['abandoned_turns']:,} later turns of their "
                                                      "conversations never sent" if "abandoned_turns" in section
                                                      else ""))
