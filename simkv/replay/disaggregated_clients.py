"""Clients that give up, under P/D disaggregation (simkv/replay/client_timeouts.py has the
deadlines, aborts and retries themselves; simkv/replay/disaggregated.py the pools).

An attempt lives in three places in turn, and its client's give-up is taken where it is then:
- **At a prefill replica** (routed there, waiting or running its prompt): that replica aborts
  it, as one engine does (the proxy cancels its request). Its one token goes to the proxy, not
  to the client: the step that samples it finishes the attempt there (it is handed off).
- **Between the pools** (the prefill's answer on its way through the proxy, `handoff_ms`): the
  proxy does not pass it on. No decode replica will read the prompt's blocks, and the prefill
  replica holds them until the connector's hold on them expires, `kv_abort_timeout_s` after the
  prefill ended (NIXL's lease, vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: 480 s by default).
- **At a decode replica** (from the handoff on): that replica aborts it. If its pull has not
  started, the decode side's connector tells the prefill replica to free the blocks (NIXL
  notifies the prefill side of a request aborted before it read them); if it has, both keep
  their blocks until the read ends (core/remote_kv.py).

A retry starts over at the prefill router, which routes it at its send time like any arrival.
The prefill replica's blocks that an abandoned attempt left held leave its block table at once
(`Scheduler.abandon_send`), so a retry of the same row there is a request of its own. With
paced conversations a turn given up on for good, wherever, ends its conversation (the prefill
router paces the turns); a data-parallel decode pool's ranks abort in lockstep, as one engine's.
"""

from __future__ import annotations

from simkv.clock import to_ticks
from simkv.config import EngineConfig
from simkv.core.request import Request
from simkv.replay.client_timeouts import (ClientDeadlines, ReplicaClientFeed, RoutedClients, backoff_ticks,
                                          timeout_ticks)
from simkv.replay.disaggregated import (IF_WAITING, NEVER, SEND_ABANDONED, TRANSFER_DONE, DecodeFeed, PDRouting,
                                       PrefillFeed)

#: Where attempts were aborted (summary.json's client.aborted_in): at a prefill replica, in the
#: proxy's hop, at a decode replica before its pull started, at a decode replica after.
STAGES = ("prefill", "handoff", "decode_queue", "decode")


def _end_conversation(feed, row: int, at: int) -> None:
    """Paced requests: `row`'s client gave up on it for good at tick `at`, in `feed`'s pool; its
    conversation's later turns are never sent, or its concurrency slot goes to the next request."""
    prefill = feed.pd.prefill
    if prefill.sessions is not None:
        dropped = prefill.client_gave_up(row, at)
        if feed.on_timed_out is not None and dropped:
            feed.on_timed_out(len(dropped))  # (done with, for the progress bar)


class TransitClients:
    """The clients of the attempts between the pools (`PDRouting.in_transit`: from the prefill's
    end until a decode replica takes the request), and where attempts were aborted."""

    def __init__(self, pd: PDRouting, config: EngineConfig) -> None:
        self.pd = pd
        self.clients = config.scheduler
        self.max_retries = self.clients.client_max_retries
        self._timeouts = timeout_ticks(self.clients)
        self.lease_ticks = to_ticks(pd.spec.kv_abort_timeout_s)
        self.aborted_in = dict.fromkeys(STAGES, 0)

    def dropped(self, row: int, tick: int) -> bool:
        """The proxy would pass `row`'s attempt on at `tick`: False, or True if its client gave up
        by then (the earliest deadline missed counts), which is then taken."""
        sent, attempt, send = self.pd.in_transit[row]
        missed = [(sent + t, kind) for kind, t in enumerate(self._timeouts) if t is not None and sent + t <= tick]
        if not missed:
            return False
        del self.pd.in_transit[row]
        deadline, kind = min(missed)
        self.aborted_in["handoff"] += 1
        self.pd.prefill_engines[self.pd.prefill.assignment[row]].feed.give_up_in_transit(
            row, send, attempt, deadline, kind, tick)
        return True

    def earliest_resend(self) -> int | None:
        """The earliest send time of a retry of an attempt between the pools."""
        best = None
        for row, (sent, attempt, _) in self.pd.in_transit.items():
            if attempt >= self.max_retries:
                continue
            for t in self._timeouts:
                if t is not None:
                    bound = sent + t + backoff_ticks(self.clients, row, attempt)
                    if best is None or bound < best:
                        best = bound
        return best


class _WakesAtDeadlines:
    """Mixed into a pool replica's client feed: an engine idle with requests in it (waiting for a
    pull or for blocks a send holds) is woken at their deadlines, as vLLM's engine, polling
    while its connector has work, takes an abort at once."""

    def _send(self, request: Request, row: int, tick: int, attempt: int, reached: int | None = None) -> None:
        super()._send(request, row, tick, attempt, reached)
        pd = self.pd
        for timeout in self._timeouts:
            if timeout is not None and tick + timeout > pd.env.now:
                pd.env.process(pd.wake_at(self.engine, tick + timeout, waiting_only=True))


class PrefillClientFeed(_WakesAtDeadlines, ReplicaClientFeed, PrefillFeed):
    """A prefill replica's attempts: aborted here while their prompts wait or run; handed to the
    proxy when they finish (their deadlines go with them)."""

    def __init__(self, pd: PDRouting, replica: int, trace, scheduler, request_log, config: EngineConfig) -> None:
        PrefillFeed.__init__(self, pd, replica, trace, scheduler, request_log, config.max_model_len)
        self._init_routed(pd.prefill, config)
        self.retry_queue = pd.prefill.retry_queues[replica]

    def deliver_until(self, now: int) -> None:
        self._apply_events(now)
        ReplicaClientFeed.deliver_until(self, now)

    def note_finished(self, finished: list[Request], tick: int) -> None:
        in_transit = self.pd.in_transit
        for request in finished:
            _, sent, attempt = self._live.pop(request.index)
            in_transit[request.index] = (sent, attempt, request)
        PrefillFeed.note_finished(self, finished, tick)

    def _refused(self, row: int, attempt: int, tick: int) -> None:
        ReplicaClientFeed._refused(self, row, attempt, tick)  # (its retry, if any, is routed again)
        self.pd.refused_at_prefill()

    def _give_up(self, row: int, request: Request, attempt: int, at: int, kind: int, now: int) -> None:
        pd = self.pd
        pd.prefill.num_in_prefill -= 1
        pd.transit.aborted_in["prefill"] += 1
        super()._give_up(row, request, attempt, at, kind, now)
        pd.release_idle_decoders()

    def give_up_in_transit(self, row: int, send: Request, attempt: int, deadline: int, kind: int, now: int) -> None:
        """The proxy dropped `send`'s attempt, finished here at pd.prefill_end[row], at `now`: its
        blocks leave the table now and go back to the pool when the lease expires."""
        expiry = int(self.pd.prefill_end[row]) + self.pd.transit.lease_ticks
        self.add_event(now, send, SEND_ABANDONED, wake=NEVER)
        self.add_event(max(now, expiry), send, TRANSFER_DONE, wake=IF_WAITING)
        ClientDeadlines._give_up(self, row, send, attempt, deadline, kind, now)
        if send.may_resend:
            self._no_longer_resendable(1, now)
        else:
            _end_conversation(self, row, deadline)


class DecodeClientFeed(_WakesAtDeadlines, RoutedClients, DecodeFeed):
    """A decode replica's attempts, from the handoff on: aborted here; the prefill replica that
    holds an aborted attempt's blocks frees them now (its pull had not started) or when the
    pull ends."""

    def __init__(self, pd: PDRouting, replica: int, trace, scheduler, request_log, config: EngineConfig,
                 block_bytes: int) -> None:
        DecodeFeed.__init__(self, pd, replica, trace, scheduler, request_log, config.max_model_len,
                            block_bytes=block_bytes)
        self._init_routed(pd.prefill, config)
        self.prompt_computed_elsewhere = True
        self._sends: dict[int, Request] = {}  # row -> the prefill's request of the attempt here

    def next_arrival_ticks(self) -> int | None:
        nxt, deadline = DecodeFeed.next_arrival_ticks(self), self.next_deadline_ticks()
        return deadline if nxt is None or (deadline is not None and deadline < nxt) else nxt

    def deliver_until(self, now: int) -> None:
        """Take the handoffs due by `now` (the proxy drops those whose clients gave up), then give
        up on the attempts here whose deadlines passed by `now`, those just taken included."""
        self._apply_events(now)
        pd = self.pd
        pd.route_handoffs_until(now)
        queue, sessions = self.queue, pd.prefill.sessions
        while queue and pd.handoff_tick(queue[0]) <= now:
            row = queue.popleft()
            if sessions is not None:
                self.release_watch.delivered(sessions, row)
            sent, attempt, send = pd.in_transit.pop(row)
            request = self.make_retry(row, attempt, sent) if attempt else self.make_request(row)
            pd.pull_start[row] = pd.pull_end[row] = -1
            pd.pull_bytes[row] = 0
            self._sends[row] = send
            self._send(request, row, sent, attempt)
        self._expire(now, now)

    def note_finished(self, finished: list[Request], tick: int) -> None:
        for request in finished:
            del self._sends[request.index]
        DecodeFeed.note_finished(self, finished, tick)
        self._finished_for_good(finished, tick)

    def _give_up(self, row: int, request: Request, attempt: int, at: int, kind: int, now: int) -> None:
        pd = self.pd
        pd.decode.note_aborted(self.replica, now)
        send = self._sends.pop(row)
        pulling = pd.pull_start[row] >= 0
        prefill = pd.prefill_engines[pd.prefill.assignment[row]].feed
        if prefill.held.get(row) is send:  # (the prefill replica still holds its blocks)
            if pulling:  # (they go when the pull ends; out of the table now)
                prefill.add_event(now, send, SEND_ABANDONED, wake=NEVER)
            else:  # (the connector tells the prefill side to free them)
                prefill.add_event(now, send, TRANSFER_DONE, wake=IF_WAITING)
        pd.transit.aborted_in["decode" if pulling else "decode_queue"] += 1
        if pd.prefill.sessions is not None:
            self.release_watch.finished([request])  # (it releases nothing here now)
        super()._give_up(row, request, attempt, at, kind, now)
        if request.may_resend:
            self._no_longer_resendable(1, now)
        else:
            _end_conversation(self, row, at)
