"""Data-parallel attention for a mixture of experts: vLLM's `--data-parallel-size N`.

N engine ranks, each an ordinary `ReplayEngine` (its own scheduler, KV-cache manager and block
pool, attention and dense layers replicated on its TP GPUs), share the expert layers, which
span all N x TP GPUs. Their forward passes must line up: the expert layers gather every rank's
tokens, so while any rank has work the others run dummy passes (vLLM's DP coordinator and its
"waves"). One SimPy process therefore steps all ranks together: at each step boundary every
rank takes its arrivals and schedules; the step lasts as long as the slowest rank
(`RooflineCostModel.dp_step_seconds`); then every rank that ran processes its output.

Requests go to ranks at their arrival as vLLM 0.33's front end sends them
(`DPLBAsyncMPClient.get_core_engine_for_request`): to the rank of least score, the larger of
its requests in flight and its waiting + running count in the coordinator's latest snapshot
(published every 100 ms: here at the first step boundary 100 ms after the last), plus, when
it has waiting requests, 6 x waiting x max(0, KV cache usage - 0.5); ties go to the lowest
rank, and the chosen rank's snapshot counts one more waiting request until the next snapshot.
With a router named (`-dp N --router POLICY`, vLLM's --data-parallel-external-lb: each rank
behind an API server of its own) a fleet's router (replay/router.py) picks the ranks instead.
Synchronous (`lockstep`) or async scheduling (`lockstep_async`), on the roofline cost model
only (replay/api.py refuses the others); drafters run their passes in lockstep too
(backends/drafting.py); a P/D decode pool may be one such engine (replay/disaggregated.py).
With KV offloading every rank has its CPU tier and host link (replay/offload_feed.py), and the
group sleeps until the next transfer ends when only transfers are left. Every step is stepped
(no decode runs).
"""

from __future__ import annotations

import simpy

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.core.parallel_sampling import FIRST_SEQUENCE_INDEX, fan_out
from simkv.replay.engine import ReplayEngine, ReplayError, ReplayRun
from simkv.replay.admission import queue_limits
from simkv.replay.fleet import FleetRouting, ReplicaFeed, fleet_clients, row_of

SNAPSHOT_INTERVAL_S = 0.1  # vLLM's DP coordinator publishes the ranks' counts every 100 ms


class DPBalancer:
    """The policy's description and size, as a fleet's router gives them."""

    def __init__(self, num_ranks: int) -> None:
        self.num_replicas = num_ranks
        self.class_replicas: dict = {}  # (it balances by load: no request class has ranks of its own)

    def describe(self) -> dict:
        return {"policy": "vllm_dp_load_balancer", "num_replicas": self.num_replicas,
                "snapshot_interval_s": SNAPSHOT_INTERVAL_S}


class DPRouting(FleetRouting):
    """A fleet's routing with vLLM's data-parallel load balancer instead of a router.

    With `fan_out`, a row for n sequences is n requests before it is routed, as vLLM's front end
    fans out before its client picks an engine core: each is routed on its own (so they spread
    over the ranks, and only those on one rank share the prompt), counts as one in flight there
    until it finishes, and the row completes with the last, wherever it ran. The row belongs to
    the rank of its first (`assignment`), whose feed watches its client: a client that gives up
    has every member aborted on its own rank (`abort_group`), and its retry fans out again."""

    def __init__(self, trace, num_ranks: int, max_model_len: int, rows=None, clients=None, fan_out: bool = False,
                 router=None, pacing=None) -> None:
        super().__init__(trace, router or DPBalancer(num_ranks), max_model_len, rows, clients=clients, pacing=pacing)
        # an external router (vLLM's --data-parallel-external-lb: each rank behind its own API
        # server) picks the ranks as a fleet's picks replicas; a row's samples then stay on its rank
        self.external = router is not None
        fan_out = fan_out and not self.external
        self.snapshot = [[0, 0, 0.0] for _ in range(num_ranks)]  # waiting, running, KV cache usage
        self._snapshot_tick: int | None = None
        self._interval = round(SNAPSHOT_INTERVAL_S * TICKS_PER_SECOND)
        self.fan_out = fan_out and trace.n is not None
        self._next_sequence_index = FIRST_SEQUENCE_INDEX
        self._sequences_done = [0] * num_ranks  # each rank's finished or aborted sequences, counted so far
        self.ranks_per_row: list[int] = []  # per row fanned out: the ranks its sequences went to
        self.rank_of: dict = {}  # clients that give up: a later member's rank (vLLM aborts it there)
        # vLLM's admission control: the one front end counts over all ranks (simkv/replay/admission.py)
        self.queue_limits = None

    def publish(self, ranks: list[ReplayEngine], tick: int) -> None:
        """The coordinator's snapshot of every rank, if 100 ms have passed since the last."""
        if self._snapshot_tick is not None and tick - self._snapshot_tick < self._interval:
            return
        self._snapshot_tick = tick
        for r, rank in enumerate(ranks):
            sched = rank.scheduler
            pool = sched.kv_cache_manager.block_pool
            self.snapshot[r] = [sched.num_waiting(), len(sched.running),
                                pool.get_num_used_blocks() / max(pool.num_usable_blocks, 1)]

    def _route(self, i: int, tick: int) -> None:
        if (self.queue_limits is not None and self._prompts[i] < self.max_model_len
                and not self._front_end_admits(i)):
            self.num_rejected += 1  # (HTTP 503: never routed, as a prompt too long is not)
            if self.on_reject is not None:
                self.on_reject(1)
            self.refused_for_good(i, tick)
            return
        if not self.fan_out or self.trace.n[i] <= 1 or self._prompts[i] >= self.max_model_len:
            super()._route(i, tick)
            return
        root = self.engines[0].feed.make_request(i)
        for rank, request in self._spread(root, i, tick, 0):
            self.queues[rank].append(request)
        if self.clients is not None:
            self.clients.routed(0)

    def _front_end_admits(self, i: int) -> bool:
        """vLLM's API server, in front of every rank, admits row `i`: its counts are the ranks'
        requests and those routed to them but not yet delivered."""
        from simkv.replay.admission import queued_prompt_tokens

        listed: list[list[int]] = []  # (listed once, for whichever limit asks first)

        def undelivered():
            if not listed:
                listed.append([row_of(entry) for queue in self.queues for entry in queue])
            return listed[0]

        def unfinished():
            return sum(len(e.scheduler.running) + e.scheduler.num_waiting() for e in self.engines) + len(undelivered())

        def queued_tokens():
            return (sum(queued_prompt_tokens(e.scheduler) for e in self.engines)
                    + sum(self._prompts[row] for row in undelivered()))

        n = int(self.trace.n[i]) if self.trace.n is not None else 1
        return self.queue_limits.admits_counts(unfinished, queued_tokens, n)

    def _route_retry(self, tick: int, row: int, attempt: int) -> None:
        if not self.fan_out or self.trace.n[row] <= 1:
            super()._route_retry(tick, row, attempt)
            return
        root = self.engines[0].feed.make_retry(row, attempt, tick)
        for rank, request in self._spread(root, row, tick, attempt):
            self.retry_queues[rank].append((tick, row, attempt, request))
        self.clients.routed(attempt)

    def _spread(self, root, row: int, tick: int, attempt: int) -> list:
        """Fan row `row`'s request `root` (attempt number `attempt`) out and pick each member's
        rank: [(rank, request)], the first member's rank the row's."""
        if self.clients is not None:  # (before the fan-out: the members inherit it)
            root.may_resend = attempt < self.clients.max_retries
        members = fan_out(root, self._next_sequence_index)
        self._next_sequence_index += len(members)
        ranks = [self.assign(row, tick)] + [self._least_loaded(tick) for _ in members]
        if self.clients is not None:
            self.rank_of.update(zip(members, ranks[1:]))
        if attempt == 0:
            self.ranks_per_row.append(len(set(ranks)))
        return list(zip(ranks, (root, *members)))

    def note_aborted(self, replica: int, tick: int) -> None:
        if not self.fan_out:  # (with the fan-out each rank's aborted sequences are counted: note_sequences)
            super().note_aborted(replica, tick)

    def abort_group(self, feed, request, chunk_ends) -> bool:
        """A fanned-out request's members are aborted on their own ranks."""
        if not request.members or not self.fan_out:
            return super().abort_group(feed, request, chunk_ends)
        aborted = False
        for member in (request, *request.members):
            scheduler = feed.scheduler if member is request else self.engines[self.rank_of.pop(member)].scheduler
            aborted |= scheduler.abort_request(member, chunk_ends.get(id(member)) if chunk_ends else None)
        return aborted

    def clients_finished(self, feed, finished, tick: int) -> None:
        """A fanned-out request completes on the rank of its last member; its client is watched
        from its first member's."""
        for request in finished:
            home = self.engines[self.assignment[request.index]].feed if request.members else feed
            home._finished_for_good([request], tick)
            for member in request.members:
                self.rank_of.pop(member, None)

    def note_finished(self, replica: int, finished, tick: int) -> None:
        if not self.fan_out:
            super().note_finished(replica, finished, tick)
            return
        # (with the fan-out each rank's finished sequences are counted: note_sequences)
        if self.sessions is not None:
            for engine in self.engines:  # (a row's members may have been on any rank)
                engine.feed.release_watch.finished(finished)
            self.turns_done(finished, tick)

    def note_sequences(self, rank: int, scheduler, tick: int) -> None:
        """Fan-out: the rank's sequences that finished or were aborted by `tick` are no longer in
        flight there."""
        done = scheduler.num_done_sequences
        if done != self._sequences_done[rank]:
            self._finishes[rank].append((tick, done - self._sequences_done[rank]))
            self._sequences_done[rank] = done

    def log_finished(self, feed, request, tick: int) -> None:
        """A row completed, perhaps on another rank than its first sequence's: into that rank's
        log, with the time (its steps are not that rank's)."""
        if not request.members:
            feed.request_log.finish(request)
            return
        log = self.engines[self.assignment[request.index]].requests
        request.finish_step = -1  # (a step of the rank that finished it: the log has the time instead)
        log.finish(request)
        log.finish_times_s[request.index] = tick / TICKS_PER_SECOND

    def assign(self, i: int, tick: int) -> int:
        if self.external:
            return super().assign(i, tick)
        best = self._least_loaded(tick)
        self.assignment[i] = best
        return best

    def _least_loaded(self, tick: int) -> int:
        """vLLM's choice of engine core for the next request; it counts there from now."""
        loads = self.loads_at(tick)
        best, least = 0, float("inf")
        for r, (waiting, running, usage) in enumerate(self.snapshot):
            score = max(loads[r], waiting + running)
            if waiting:
                score += waiting * 6.0 * max(0.0, usage - 0.5)
            if score < least:
                best, least = r, score
        self.snapshot[best][0] += 1
        loads[best] += 1
        return best


def run_data_parallel(trace, config, backend, num_gpu_blocks: int, capacity,
                      on_progress=None, router=None) -> tuple[list[ReplayRun], FleetRouting]:
    """Replay `trace` on config.hardware.data_parallel_size lockstep ranks of `backend` (a
    roofline built for that data parallelism); `router`: a fleet's router in front of the ranks
    (vLLM's external load balancing) instead of vLLM's own balancer."""
    dp = config.hardware.data_parallel_size
    env = simpy.Environment()
    clients = fleet_clients(trace, config)
    routing = DPRouting(trace, dp, config.max_model_len, clients=clients,
                        fan_out=config.scheduler.parallel_sampling == "fan_out", router=router, pacing=config.scheduler)
    routing.on_reject = on_progress
    if router is None:  # (one API server in front of every rank; else each rank's own, as a fleet's replicas)
        routing.queue_limits = queue_limits(config)

    def rank_feed(scheduler, log, rank):
        feed = ReplicaFeed(routing, rank, trace, scheduler, log, config.max_model_len)
        if router is None:
            feed.queue_limits = None  # (the front end's check is the routing's, over every rank)
        return feed

    def feed_of(rank):
        if clients is not None:
            from simkv.replay.client_timeouts import ReplicaClientFeed
            return lambda scheduler, log: ReplicaClientFeed(routing, rank, trace, scheduler, log, config)
        return lambda scheduler, log: rank_feed(scheduler, log, rank)

    ranks = [ReplayEngine(trace, config, backend, num_gpu_blocks, use_decode_runs=False, on_progress=on_progress,
                          capacity=capacity, env=env, make_feed=feed_of(r)) for r in range(dp)]
    routing.engines = ranks
    group = env.process(group_process(config)(env, ranks, backend, routing))
    env.process(routing.router_process(env, ranks))  # (it wakes the idle group at arrivals, as a fleet's replicas)
    env.run(until=group)
    return [rank.result() for rank in ranks], routing


def group_process(config):
    """The ranks' process for `config`: lockstep steps, async scheduling's two-deep queue, or
    under pipeline parallelism the group's batch queue (replay/data_parallel_pipeline.py)."""
    if config.hardware.pipeline_parallel_size > 1:
        from simkv.replay.data_parallel_pipeline import lockstep_pipelined

        return lockstep_pipelined
    return lockstep_async if config.scheduler.async_scheduling else lockstep


class PrefillCadence:
    """vLLM's DP engine core's count of the group's steps in a wave (its step_counter, the same
    on every rank; dummy passes count) and what hangs on it. Prefill balancing
    (`--prefill-schedule-interval N` on data-parallel ranks): prefill is throttled on every step
    whose count is not a multiple of N; each rank's scheduler then holds prefill back unless it
    is capacity-bound or runs no decode (core/scheduler.py). The wave's end: the ranks agree
    whether any has requests after the wave's first step and every `dp_sync_interval` steps
    (16); a wave whose requests all finished goes on in dummy passes on every rank until such a
    step, and only then ends (the count starts again at 0, so prefill goes at once after idle).
    A request that arrives meanwhile waits for the dummy pass under way and joins the wave."""

    def __init__(self, ranks: list[ReplayEngine]) -> None:
        self.schedulers = [rank.scheduler for rank in ranks]
        self.interval = ranks[0].config.scheduler.prefill_schedule_interval
        self.sync_interval = ranks[0].config.hardware.dp_sync_interval
        self.count = 0
        self.num_dummy_passes = 0  # (the waves' tails: passes every rank ran with no rank's requests)

    def wave_goes_on(self) -> bool:
        """Checked when no rank has requests, before the arrivals since the last step: whether the
        wave goes on (its last step was not a sync step). At a sync step it ends (count 0)."""
        if self.count == 0:
            return False
        if self.count == 1 or self.count % self.sync_interval == 0:
            self.count = 0
            return False
        return True

    def before_schedule(self) -> None:
        if self.interval > 1:
            throttle = self.count % self.interval != 0
            for scheduler in self.schedulers:
                scheduler.throttle_prefills = throttle


def lockstep(env: simpy.Environment, ranks: list[ReplayEngine], backend, routing: DPRouting):
    """The ranks' process. Idle, it sleeps on one event that every rank holds as its own idle
    event, so whoever wakes an idle engine (the router at an arrival; under P/D a handoff or a
    transfer's end) wakes the group."""
    now = 0
    cadence = routing.cadence = PrefillCadence(ranks)
    while True:
        waves_on = not _has_requests(ranks) and cadence.wave_goes_on()
        _take_arrivals(ranks, routing, now)
        if not _has_requests(ranks):
            if _retire_offloaded(ranks):
                continue
            if all(rank.feed.exhausted for rank in ranks):
                return
            if waves_on:
                now = yield from _dummy_pass(env, ranks, backend, cadence, now)
                continue
            now = yield from _sleep(env, ranks, now)
            continue
        cadence.before_schedule()
        outs, ran = _schedule_all(ranks)
        if not ran:
            for rank, out in zip(ranks, outs):
                if out is not None:
                    rank.scheduler.current_step = out.step  # nothing ran: not a step
            _start_transfers(ranks, outs, now, now)
            if _retry_or_stuck(ranks, outs):
                continue
            now = yield from _sleep(env, ranks, now)  # P/D or KV offloading: a transfer's end wakes the group
            continue
        duration = (to_ticks(backend.dp_step_seconds(ran, len(ranks) - len(ran)) + _lora_load_s(ran))
                    + encoder_ticks(ranks, outs))
        _start_transfers(ranks, outs, now, now + duration)
        cadence.count += 1
        yield env.timeout(duration)
        now = _process_outputs(ranks, outs, now, duration, True, routing)


def lockstep_async(env: simpy.Environment, ranks: list[ReplayEngine], backend, routing: DPRouting):
    """The ranks' process under async scheduling: `ReplayEngine._engine_async` (vLLM's batch
    queue, two steps deep) for the group. The next lockstep step is scheduled on every rank as
    soon as the one before it is launched, and the outputs of a step are processed only after;
    a rank whose schedule is empty runs a dummy pass in that step. Each rank's step lasts
    max(device time, host time), and the group's as long as the slowest rank's."""
    now = 0
    in_flight = None  # (each rank's output or None, start tick, duration): the step on the devices
    cadence = routing.cadence = PrefillCadence(ranks)
    while True:
        waves_on = in_flight is None and not _has_requests(ranks) and cadence.wave_goes_on()
        _take_arrivals(ranks, routing, now)
        queued = None
        if _has_requests(ranks):
            start = now if in_flight is None else in_flight[1] + in_flight[2]
            cadence.before_schedule()
            outs, ran = _schedule_all(ranks, start)
            duration = (to_ticks(backend.dp_step_seconds(ran, len(ranks) - len(ran), overlap_host=True)
                                 + _lora_load_s(ran)) + encoder_ticks(ranks, outs)) if ran else 0
            _start_transfers(ranks, outs, start, start + duration)
            if ran:
                cadence.count += 1
                queued = (outs, start, duration)
                if in_flight is None:
                    in_flight = queued
                    continue  # the queue has room: schedule the next step at once
            elif in_flight is None:
                if not _retry_or_stuck(ranks, outs):
                    now = yield from _sleep(env, ranks, now)  # P/D: a transfer's end wakes the group
                continue
        elif in_flight is None:
            if _retire_offloaded(ranks):
                continue
            if all(rank.feed.exhausted for rank in ranks):
                return
            if waves_on:
                now = yield from _dummy_pass(env, ranks, backend, cadence, now)
                continue
            now = yield from _sleep(env, ranks, now)
            continue
        outs, start, duration = in_flight
        yield env.timeout(start + duration - now)
        now = _process_outputs(ranks, outs, start, duration, False, routing)
        in_flight = queued


def encoder_ticks(ranks: list[ReplayEngine], outs: list) -> int:
    """Images: the ranks' vision encoders, each run by its rank before its forward pass, so the
    slowest holds up the group's first expert collective (and so the lockstep step)."""
    return max((rank.encoder_ticks(out) for rank, out in zip(ranks, outs) if out is not None and not out.is_empty),
               default=0)


def _lora_load_s(ran: list) -> float:
    """LoRA: the ranks' adapter loads, made before the step's forward pass (the slowest rank's
    holds up the group)."""
    return max(out.lora_load_s for out in ran)


def _take_arrivals(ranks: list[ReplayEngine], routing: DPRouting, now: int) -> None:
    """A step boundary: every rank takes what arrived (routed on the snapshot before it), then
    the coordinator's snapshot may be taken."""
    for rank in ranks:
        if rank._client is not None:  # (every rank's aborts first: a retry may be due at once, to any rank)
            rank._client.expire_until(now)
    for rank in ranks:
        rank.now = now
        rank.feed.deliver_until(now)
        if rank.feed.num_rejected != rank._num_rejected_reported:
            rank._report_rejected()
    if routing.fan_out:  # (sequences aborted by now are no longer in flight)
        for r, rank in enumerate(ranks):
            routing.note_sequences(r, rank.scheduler, now)
    routing.publish(ranks, now)


def _schedule_all(ranks: list[ReplayEngine], start: int | None = None) -> tuple[list, list]:
    """Every rank's output (None for a rank without requests: its scheduler has nothing to look
    at, and it runs a dummy pass), and the outputs that run something. A rank without requests
    whose requests finished with a CPU tier schedules once, as alone (`_retire_offloaded`)."""
    outs = [rank._schedule(start) if rank.scheduler.has_unfinished_requests() else _retire_alone(rank)
            for rank in ranks]
    return outs, [out for out in outs if out is not None and not out.is_empty]


def _retire_alone(rank: ReplayEngine) -> None:
    rank._retire_offloaded()


def _retire_offloaded(ranks: list[ReplayEngine]) -> bool:
    """KV offloading: every rank whose requests finished, none left, schedules once more, as an
    engine alone does (`ReplayEngine._retire_offloaded`); True if any did."""
    return sum(rank._retire_offloaded() for rank in ranks) > 0


def _start_transfers(ranks: list[ReplayEngine], outs: list, start: int, end: int) -> None:
    """KV offloading: each rank's jobs go on its own host link: loads as the group's step starts
    at `start`, stores as it ends at `end` (a rank whose schedule ran nothing: at `start`)."""
    for rank, out in zip(ranks, outs):
        if out is not None and out.offload_jobs:
            rank.feed.offload_jobs_started(out.offload_jobs, start, start if out.is_empty else end)


def _retry_or_stuck(ranks: list[ReplayEngine], outs: list) -> bool:
    """Nothing ran: True to schedule again at once (a request preempted itself), False to sleep
    until a transfer ends (P/D); otherwise the group cannot make progress."""
    if any(out is not None and out.preempted for out in outs):
        return True
    if any(rank.feed.holds_pending_work() for rank in ranks):
        return False
    stuck = next(r for r, out in enumerate(outs) if out is not None)
    raise ReplayError(ranks[stuck]._stuck_message(outs[stuck].step))


def _process_outputs(ranks: list[ReplayEngine], outs: list, start: int, duration: int, sync: bool,
                     routing: DPRouting) -> int:
    """The step from `start` has ended: every rank that ran processes its output and logs the
    step; returns the end tick. (Synchronously an empty schedule is no step: its number is
    given back, as the single engine does.)"""
    end = start + duration
    fan_out = routing.fan_out
    if fan_out and ranks[0]._client is not None:  # (a row's members may be on any rank: every rank's
        # clients give up, on every rank's steps, before any output is processed)
        ran = [out for out in outs if out is not None and not out.is_empty]
        for rank in ranks:
            rank.now = end
            rank._client.expire_during_step(end, ran)
    for r, (rank, out) in enumerate(zip(ranks, outs)):
        rank.now = end
        if out is None:
            continue
        if out.is_empty:
            if sync:
                rank.scheduler.current_step = out.step
            continue
        if rank._client is not None and not fan_out:  # (the aborts that arrived while it ran come before its output)
            rank._client.expire_during_step(end, [out])
        finished = rank.scheduler.update_from_output(out)
        if fan_out:
            routing.note_sequences(r, rank.scheduler, end)
        rank.steps.add_step(out, start, duration)
        if finished:
            rank._record_finished(finished)
    return end


def _has_requests(ranks: list[ReplayEngine]) -> bool:
    return any(rank.scheduler.has_unfinished_requests() for rank in ranks)


def _dummy_pass(env: simpy.Environment, ranks: list[ReplayEngine], backend, cadence: PrefillCadence, now: int):
    """A pass every rank runs in a wave that no rank has requests for (vLLM's execute_dummy_batch);
    the tick it ends at. It counts as a step of the wave."""
    duration = to_ticks(backend.dp_step_seconds([], len(ranks)))
    cadence.count += 1
    cadence.num_dummy_passes += 1
    yield env.timeout(duration)
    return now + duration


def _sleep(env: simpy.Environment, ranks: list[ReplayEngine], now: int):
    """Wait until something wakes one of the ranks, or a rank's KV-offloading transfer ends;
    the tick it happened at (or `now`)."""
    event = env.event()
    for rank in ranks:
        rank._idle = event
    ends = [t for rank in ranks if hasattr(rank.feed, "next_transfer_ticks")
            and (t := rank.feed.next_transfer_ticks()) is not None]
    if ends:
        env.process(_wake_at(env, event, max(min(ends), now)))
    woken = yield event
    for rank in ranks:
        rank._idle = None
    return now if woken is None else max(now, woken)  # (None: woken to end)


def _wake_at(env: simpy.Environment, event: simpy.Event, tick: int):
    yield env.timeout(tick - env.now)
    if not event.triggered:
        event.succeed(tick)
