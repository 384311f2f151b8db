"""A fleet: N identical engine replicas behind a router, on one SimPy clock.

Each replica is an ordinary `ReplayEngine` (its own scheduler, KV-cache manager and block
pool). The router's process routes the trace's requests in arrival order, each at its arrival
(a replica reaching a step boundary at that same instant may do it first); a busy replica takes
its requests at its next step boundary, an idle one is woken. A routing decision at arrival time
T depends only on what the router has sent and on the finishes strictly before T, so it does not
depend on the order in which SimPy resumes processes at one instant: the same trace and options
give the same fleet, byte for byte.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np
import pandas as pd
import simpy

from simkv.core.request import Request
from simkv.replay.engine import ArrivalFeed, ReplayEngine, ReplayRun, TraceRows
from simkv.replay.results import (admission_limits_summary, admission_summary, largest_admission_limit, cost_model_summary, itl_samples, kv_cache_groups_summary, latencies_and_rates, lora_summary, multimodal_summary, offload_summary,
                                  parallel_sampling_summary,
                                  request_table, spec_summary, stored_and_wasted_slots, summarize, weighted_dist)
from simkv.replay.router import Router
from simkv.replay.sessions import ReleaseWatch, earliest_release, make_pacing, mark_not_sent
from simkv.replay.step_log import SPEC_COLUMNS
from simkv.traces.lora import content_namespaces


class FleetRouting:
    """The router's side of the fleet: routes trace rows, and counts each replica's requests in flight."""

    def __init__(self, trace, router: Router, max_model_len: int, rows: TraceRows | None = None,
                 clients=None, pacing=None, autoscaler=None, failures=None) -> None:
        self.trace = trace
        self.router = router
        self.autoscaler = autoscaler  # (simkv/replay/autoscale.py: which replicas are up, decided as time passes)
        self.failures = failures  # (simkv/replay/failures.py's FailurePlan: replicas down for a while)
        self._history = autoscaler.history if autoscaler is not None else None  # (metrics read with a delay)
        self.hold: dict[int, int] = {}  # (scale to zero: rows waiting for a replica to be ready, until when)
        n = router.num_replicas
        self.rows = rows if rows is not None else TraceRows(trace)  # the replicas' feeds read the same lists
        # Sessions (simkv/replay/sessions.py): a turn is routed once its previous turn is done; or a
        # client's concurrency limit: a request is routed once fewer than that many are in flight
        self.sessions = make_pacing(trace, self.rows, pacing) if pacing is not None else None
        self.engines: list[ReplayEngine] = []  # (the replicas: the runner sets them)
        self._wake: simpy.Event | None = None  # the router's, while it sleeps (a release may wake it)
        self._sleep_until: int | None = None
        self._arrival_ticks = self.rows.arrival_ticks
        self._prompts = self.rows.prompt_tokens
        self._has_hashes = trace.hash_ids is not None
        self._namespaces = content_namespaces(trace)  # (cache_salt and LoRA adapter)
        self._by_class = bool(router.class_replicas) and getattr(trace, "request_class", None) is not None
        self._sessions = trace.session_id if getattr(router, "policy", None) == "session_affinity" else None
        self.max_model_len = max_model_len
        self.next_index = 0
        self.queues: list[deque[int]] = [deque() for _ in range(n)]  # routed, not yet delivered
        self.assignment = np.full(len(trace), -1, dtype=np.int32)  # -1: rejected (or never routed)
        self.num_rejected = 0
        self.outstanding = [0] * n
        self._finishes: list[deque[tuple[int, int]]] = [deque() for _ in range(n)]  # (tick, count)
        self.on_reject = None
        # Clients that give up and retry (simkv/replay/client_timeouts.py's FleetClients): retries
        # are routed like arrivals, at their send times, into each replica's retry queue
        self.clients = clients
        self.retry_queues: list[deque[tuple[int, int, int]]] = [deque() for _ in range(n)]  # (tick, row, attempt)

    @property
    def all_routed(self) -> bool:
        out = self.sessions.all_out if self.sessions is not None else self.next_index >= len(self._arrival_ticks)
        return out and (self.clients is None or self.clients.settled)

    def next_unrouted_ticks(self) -> int | None:
        if self.sessions is not None:
            nxt = self.sessions.next_ticks()
        else:
            i = self.next_index
            nxt = self._arrival_ticks[i] if i < len(self._arrival_ticks) else None
        if self.clients is not None and self.clients.resends:
            resend = self.clients.resends[0][0]
            nxt = resend if nxt is None or resend < nxt else nxt
        decision = self._next_decision(nxt is not None)
        return decision if decision is not None and (nxt is None or decision < nxt) else nxt

    def _next_decision(self, routing_left: bool) -> int | None:
        """An autoscaler whose scale-downs end replicas at a deadline (--shutdown-timeout), or
        whose replicas or nodes fail, decides at its own instants while there is anything to
        route or in flight: a drain's end falls then, and the requests held for a slot follow its
        restart then, not at the next arrival (None: it decides as arrivals are routed)."""
        if not self._decides(routing_left):
            return None
        return self.autoscaler.next_event()

    def _decides(self, routing_left: bool) -> bool:
        """The autoscaler decides at its own instants (_next_decision), and the replay goes on:
        anything to route, or anything in flight."""
        scaler = self.autoscaler
        if scaler is None or not scaler.eager or not self.engines:
            return False
        return routing_left or any(self.loads_at(self.engines[0].env.now))

    def resend(self, row: int, attempt: int, tick: int) -> None:
        """A client gave up on `row`'s attempt and sends attempt number `attempt` at `tick`."""
        heapq.heappush(self.clients.resends, (tick, row, attempt))
        self._wake_for(tick)

    def earliest_resend(self) -> int | None:
        """The earliest tick at which a client could send a retry it has not yet decided on."""
        best = None
        for engine in self.engines:
            t = engine.feed.earliest_resend()
            if t is not None and (best is None or t < best):
                best = t
        return best

    def wake_router(self, tick: int) -> None:
        """Something the router waits for happened at `tick` (now)."""
        self._wake_for(tick)

    def client_gave_up(self, row: int, tick: int) -> list[int]:
        """Paced requests: `row`'s client gave up on it for good at `tick`: its session's later
        turns are never sent (returned), or its concurrency slot goes to the next request."""
        dropped, due = self.sessions.give_up(row, tick)
        self.clients.abandoned += dropped
        self._wake_after_release(due, tick)
        return dropped

    def refused_for_good(self, row: int, tick: int) -> None:
        """A replica's front end refused `row` (HTTP 503) at `tick`, and its client will not
        retry: paced requests count it done, as a rejected one (its next turn, or the next request
        in a concurrency slot, becomes due)."""
        if self.sessions is not None:
            self._wake_after_release(self.sessions.release(row, tick), tick)

    def log_finished(self, feed, request, tick: int) -> None:
        """A row's request completed on `feed`'s replica: into its log."""
        feed.request_log.finish(request)

    def clients_finished(self, feed, finished, tick: int) -> None:
        """Clients that give up: these requests finished on `feed`'s replica; their clients have them."""
        feed._finished_for_good(finished, tick)

    def abort_group(self, feed, request, chunk_ends) -> bool:
        """Clients that give up: vLLM aborts `feed`'s attempt `request` (fanned out: every member)."""
        return feed.scheduler.abort_group(request, chunk_ends)

    def note_aborted(self, replica: int, tick: int) -> None:
        """The replica aborted a request at `tick`: it no longer counts there."""
        self._finishes[replica].append((tick, 1))
        if self._history is not None:
            self._history.finished(replica, tick, 1)

    #: Sessions: a request's finish here ends its turn (P/D's prefill pool: the decode side's does).
    finishes_turns = True

    def note_finished(self, replica: int, finished, tick: int) -> None:
        self._finishes[replica].append((tick, len(finished)))
        if self._history is not None:
            self._history.finished(replica, tick, len(finished))
        if self.sessions is not None and self.finishes_turns:
            self.turns_done(finished, tick)

    def turns_done(self, finished, tick: int) -> None:
        """Sessions: these requests' turns ended at `tick` (here, or P/D's decode side)."""
        self._wake_after_release(self.sessions.release_finished(finished, tick), tick)

    def _wake_after_release(self, due: int | None, tick: int) -> None:
        """A release at `tick` made a turn due at `due`, or (None) made none due: the router
        wakes then, or now if that release ended its work (a client that stopped early)."""
        self._wake_for(tick if due is None and self.all_routed else due)

    def _wake_for(self, due: int | None) -> None:
        """A turn (sessions) or a retry (clients) became due at `due`, or the router's work ended;
        the router, asleep until a later arrival, wakes."""
        if due is not None and self._wake is not None and not self._wake.triggered and (
                self._sleep_until is None or due < self._sleep_until):
            self._wake.succeed()

    def router_process(self, env, engines: list[ReplayEngine]):
        """The router in simulated time: at each arrival it routes and wakes the idle replica that
        got work (busy ones take it at their next step boundary); once all are routed it wakes the
        idle ones, which then end. Idle replicas otherwise sleep, however many arrivals pass.
        With sessions it also wakes when a finish releases a turn due before its next arrival."""
        while True:
            t = self.next_unrouted_ticks()
            if t is None:
                if self.all_routed:
                    break
                self._sleep_until, self._wake = None, env.event()  # (turns wait for replies, retries for deadlines)
                yield self._wake
                self._wake = None
                self._wake_idle(engines, env.now)  # (a replica may have routed a retry to an idle one)
                continue
            if t > env.now:
                if self.sessions is None and self.clients is None:
                    yield env.timeout(t - env.now)
                else:
                    self._sleep_until, self._wake = t, env.event()
                    yield env.timeout(t - env.now) | self._wake
                    self._wake = None
                    self._wake_idle(engines, env.now)
                    continue
            if self._decides(not self.all_routed):
                self.autoscaler.advance(env.now, self.loads_at)  # (its decisions due by now: _next_decision)
            self.route_until(env.now)
            self._wake_idle(engines, env.now)
        for engine in engines:
            if engine.idle:
                engine.wake(None)  # (the replay is over: its clock stays at the end of its last step)

    def _wake_idle(self, engines: list[ReplayEngine], now: int) -> None:
        """Wake the idle replicas that were routed work."""
        for r, engine in enumerate(engines):
            if (self.queues[r] or self.retry_queues[r]) and engine.idle:
                engine.wake(now)

    def route_until(self, now: int) -> None:
        """Route every request that arrived by tick `now`."""
        resends = self.clients.resends if self.clients is not None else None
        if self.sessions is not None:
            sessions = self.sessions
            while True:  # (turns and retries in time order; a tie in row order)
                due = sessions.peek()
                if due is not None and due[0] > now:
                    due = None
                if resends and resends[0][0] <= now and (due is None or resends[0][:2] < due):
                    self._route_retry(*heapq.heappop(resends))
                elif due is not None:
                    tick, i = sessions.pop_next()
                    self._route(i, tick)
                else:
                    return
        ticks, n = self._arrival_ticks, len(self._arrival_ticks)
        i = self.next_index
        while resends and resends[0][0] <= now:  # (retries and arrivals in time order; a tie in row order)
            if i < n and (ticks[i], i) < resends[0][:2]:
                self._route(i, ticks[i])
                i += 1
                continue
            self._route_retry(*heapq.heappop(resends))
        while i < n and ticks[i] <= now:
            self._route(i, ticks[i])
            i += 1
        self.next_index = i

    def _route(self, i: int, tick: int) -> None:
        if self._prompts[i] >= self.max_model_len:  # every replica would reject it: vLLM's engine does
            self.num_rejected += 1
            if self.clients is not None:
                self.clients.attempts[i] = 1
            if self.on_reject is not None:
                self.on_reject(1)
            if self.sessions is not None:
                self._wake_after_release(self.sessions.release(i, tick), tick)
            return
        self.queues[self.assign(i, tick)].append(i)
        if self.clients is not None:
            self.clients.routed(0)

    def _route_retry(self, tick: int, row: int, attempt: int) -> None:
        """A client's retry, due at `tick`, goes to a replica as any arrival does."""
        self.retry_queues[self.assign(row, tick)].append((tick, row, attempt))
        self.clients.routed(attempt)

    def loads_at(self, tick: int) -> list[int]:
        """Each replica's requests in flight at `tick`: sent, less the finishes strictly before it."""
        loads = self.outstanding
        last = self.autoscaler.last_finish if self.autoscaler is not None else None
        for r, finishes in enumerate(self._finishes):
            while finishes and finishes[0][0] < tick:
                done, count = finishes.popleft()
                loads[r] -= count
                if last is not None:
                    last[r] = max(last[r], done)
        return loads

    def assign(self, i: int, tick: int) -> int:
        """The replica for trace row `i` at `tick`, chosen on the finishes strictly before `tick`;
        it counts the request as outstanding there."""
        hold = None
        if self.autoscaler is not None:  # (its decisions due by `tick` first: they read earlier loads)
            self.autoscaler.advance(tick, self.loads_at)
        loads = self.loads_at(tick)
        if self.autoscaler is not None:
            up = self.autoscaler.up(tick)
            if not up:  # (scaled to zero: it waits for the first slot to be ready)
                up, hold = self.autoscaler.hold_slots(tick, self._arrival_ticks[i], loads)
            self.router.up = up
        elif self.failures is not None:  # (a failed replica takes nothing until it is back)
            self.router.up = self.failures.up(tick, self.engines, self.router)
        trace = self.trace
        hashes = trace.block_hashes(i) if self._has_hashes else None
        block_tokens = int(trace.hash_block_tokens[i]) if self._has_hashes else 0
        salt = self._namespaces[i] if self._namespaces is not None else None
        request_class = trace.request_class[i] if self._by_class else None
        session = self._sessions[i] if self._sessions is not None else None
        r = self.router.choose(loads, hashes, block_tokens, salt, request_class, session)
        self.assignment[i] = r
        loads[r] += 1
        if self._history is not None:
            self._history.routed(r, tick)
        if hold is not None:
            self.hold[i] = hold
            engine = self.engines[r]
            engine.env.process(self._wake_at(engine, hold))
        return r

    def hold_until(self, r: int, ready: int) -> None:
        """Slot `r`, which requests wait for (scale to zero, or every slot down), is now ready at
        `ready` (its pod failed, or its node, before it was up): they wait until then."""
        rows = [row_of(entry) for entry in self.queues[r]] + [entry[1] for entry in self.retry_queues[r]]
        moved = False
        for row in rows:
            if self.hold.get(row, ready) < ready:
                self.hold[row] = ready
                moved = True
        if moved:
            engine = self.engines[r]
            engine.env.process(self._wake_at(engine, ready))

    def due(self, row: int) -> int:
        """When a routed row reaches its replica: its arrival, or when the slot it waits for is ready."""
        return self.hold.get(row, self._arrival_ticks[row])

    @staticmethod
    def _wake_at(engine, tick: int):
        """Scale to zero: the replica a held request waits for takes it once it is ready."""
        yield engine.env.timeout(max(0, tick - engine.env.now))  # (a retry routed late: ready already)
        if engine.idle:
            engine.wake(tick)


def row_of(entry) -> int:
    """The trace row of a replica queue's entry: a row, or one sequence of a row fanned out
    over data-parallel ranks (its first's row)."""
    return entry.prompt_owner if isinstance(entry, Request) else entry


class ReplicaFeed(ArrivalFeed):
    """One replica's arrivals: the requests the router sent it. Its lookahead stops at the fleet's
    next arrival too, since that request might be sent here."""

    def __init__(self, routing: FleetRouting, replica: int, trace, scheduler, request_log, max_model_len: int):
        super().__init__(trace, scheduler, request_log, max_model_len, routing.rows)
        self.routing = routing
        self.replica = replica
        self.queue = routing.queues[replica]
        self.release_watch = ReleaseWatch()  # (sessions: what it could release)

    @property
    def exhausted(self) -> bool:
        return self.routing.all_routed and not self.queue

    def next_arrival_ticks(self) -> int | None:
        routing = self.routing
        nxt = routing.due(row_of(self.queue[0])) if self.queue else routing.next_unrouted_ticks()
        if routing.sessions is not None:  # (a turn another replica may release comes to any of them)
            bound = earliest_release(routing.engines, skip=self.replica)
            if bound is not None and (nxt is None or bound < nxt):
                return bound
        return nxt

    def deliver_until(self, now: int) -> None:
        self.routing.route_until(now)
        queue, due = self.queue, self.routing.due
        sessions = self.routing.sessions
        while queue and due(row_of(queue[0])) <= now:
            row = queue.popleft()
            if isinstance(row, Request):  # (a sequence of a row fanned out over data-parallel ranks)
                self.scheduler.add_request(row)
                row = row.prompt_owner  # (sessions: the row's turn may end here)
            elif not self._deliver(row):  # (the replica's front end answered 503: simkv/replay/admission.py)
                self.routing.note_aborted(self.replica, now)
                self.routing.refused_for_good(row, due(row))  # (answered when it reached the replica)
                continue
            if sessions is not None:
                self.release_watch.delivered(sessions, row)

    def note_finished(self, finished, tick: int) -> None:
        if self.routing.sessions is not None:
            self.release_watch.finished(finished)
        self.routing.note_finished(self.replica, finished, tick)

    def log_finished(self, request, tick: int) -> None:
        self.routing.log_finished(self, request, tick)

    def arrival_times_s(self):
        if self.routing.sessions is None:
            return self.arrivals
        return np.asarray(self._arrival_list, dtype=np.float64)


def fleet_clients(trace, config, failures=None):
    """The clients of a fleet or of data-parallel ranks, if they give up or retry, or lose their
    requests with a replica that fails (None if not)."""
    if not config.scheduler.has_clients and failures is None:
        return None
    from simkv.replay.client_timeouts import FleetClients

    return FleetClients(len(trace), config.scheduler.client_max_retries)


def run_fleet(trace, config, backends: list, num_gpu_blocks: int, router: Router, capacity,
              use_decode_runs: bool = True, on_progress=None, prepare=None,
              replicas: tuple[list, list] | None = None, autoscaler=None,
              failures=None) -> tuple[list[ReplayRun], FleetRouting]:
    """Replay `trace` on len(backends) replicas (one backend each) behind `router`; `prepare`:
    called with each engine before the run (an encode pool's shared store); `replicas`: each
    replica's (engine config, capacity) where they differ (FleetSpec.replica_sets); `autoscaler`:
    which replicas are up as time passes (simkv/replay/autoscale.py); `failures`: replicas that
    fail and come back (simkv/replay/failures.py's FailurePlan)."""
    env = simpy.Environment()
    clients = fleet_clients(trace, config, failures)
    routing = FleetRouting(trace, router, config.max_model_len, clients=clients, pacing=config.scheduler,
                           autoscaler=autoscaler, failures=failures)
    routing.on_reject = on_progress

    def feed_of(replica):
        if clients is not None:
            from simkv.replay.client_timeouts import ReplicaClientFeed
            return lambda scheduler, log: ReplicaClientFeed(routing, replica, trace, scheduler, log, config)
        return lambda scheduler, log: ReplicaFeed(routing, replica, trace, scheduler, log, config.max_model_len)

    configs, capacities = replicas or ([config] * len(backends), [capacity] * len(backends))
    engines = [ReplayEngine(trace, configs[r], backend, capacities[r].num_gpu_blocks if replicas else num_gpu_blocks,
                            use_decode_runs, on_progress, capacity=capacities[r], env=env, make_feed=feed_of(r))
               for r, backend in enumerate(backends)]
    routing.engines = engines
    if autoscaler is not None:
        autoscaler.watch(engines, router, routing.hold)
        autoscaler.on_ready_moved = routing.hold_until
    for engine in engines if prepare is not None else ():
        prepare(engine)
    processes = [engine.start(own_arrivals=False) for engine in engines]
    env.process(routing.router_process(env, engines))
    env.run(until=simpy.AllOf(env, processes))
    return [engine.result() for engine in engines], routing


_MERGED_COLUMNS = ("first_scheduled_time_s", "first_token_time_s", "finish_time_s", "status", "output_tokens",
                   "prefix_hit_tokens", "num_preemptions", "queue_s", "ttft_s", "e2e_s", "mean_itl_s", "queue_held_by")


def fleet_tables(runs: list[ReplayRun], routing: FleetRouting, trace,
                 frontend_latency_s: float = 0.0) -> tuple[pd.DataFrame, dict, list[pd.DataFrame]]:
    """The fleet's requests (each row from the replica that served it, plus a `replica` column)
    and steps (every replica's, replica by replica), and each replica's own request table."""
    assignment = routing.assignment
    per_replica = [request_table(run, trace, frontend_latency_s) for run in runs]
    merged = per_replica[0].copy()
    for column in _MERGED_COLUMNS + tuple(c for c in SPEC_COLUMNS if c in merged):
        values = merged[column].to_numpy().copy()
        for r, frame in enumerate(per_replica[1:], start=1):
            rows = assignment == r
            values[rows] = frame[column].to_numpy()[rows]
        merged[column] = pd.Categorical(values, merged[column].cat.categories) if column == "queue_held_by" else values
    rejected = assignment < 0
    merged.loc[rejected, "status"] = "rejected"
    if routing.clients is not None and routing.clients.abandoned:  # (turns never sent: their sessions ended)
        merged.loc[routing.clients.abandoned, "status"] = "abandoned"
    mark_not_sent(merged, routing.sessions)
    merged.insert(1, "replica", assignment)
    steps: dict[str, list] = {}
    for r, run in enumerate(runs):
        columns = run.steps.columns()
        steps.setdefault("replica", []).append(np.full(run.steps.num_steps, r, dtype=np.int32))
        for name, values in columns.items():
            steps.setdefault(name, []).append(values)
    return merged, {k: np.concatenate(v) for k, v in steps.items()}, per_replica


def fleet_summary(runs: list[ReplayRun], routing: FleetRouting, trace, config, backends, capacity, wall_time_s: float,
                  requests: pd.DataFrame, per_replica: list[pd.DataFrame], replicas: tuple[list, list] | None = None) -> dict:
    """summary.json of a fleet: the same keys as one engine's, over the whole fleet (latencies over
    all requests, counts summed, ratios pooled; per-engine peaks and `num_gpu_blocks` are per
    replica, the largest over the replicas; `mean_running` is the mean over all replicas' steps),
    plus `fleet`: the router and one row per replica."""
    configs, capacities = replicas or ([config] * len(runs), [capacity] * len(runs))
    differ = replicas is not None
    replicas = []
    for r, (run, frame) in enumerate(zip(runs, per_replica)):
        s = summarize(run, trace, configs[r], backends[r], capacities[r], 0.0, frame)
        s["num_requests"] = int((routing.assignment == r).sum())
        s["num_rejected"] = 0
        replicas.append(s)
    status = requests["status"].to_numpy()
    finished = status == "finished"
    duration = max((s["duration_s"] for s in replicas), default=0.0)
    stored = wasted = 0
    for run, frame, replica_config in zip(runs, per_replica, configs):
        a, b = stored_and_wasted_slots(run, replica_config, frame["status"].to_numpy() == "finished")
        stored, wasted = stored + a, wasted + b
    samples = [itl_samples(run) for run in runs]
    queries = sum(s["prefix_cache_queries_tokens"] for s in replicas)
    hits = sum(s["prefix_cache_hits_tokens"] for s in replicas)

    def total(key):
        return sum(s[key] for s in replicas)

    def largest(key):
        return max(s[key] for s in replicas)

    allocator = dict(replicas[0]["allocator_stats"])
    for key, value in allocator.items():  # peaks: the largest over the replicas
        if isinstance(value, (int, float)):
            allocator[key] = max(s["allocator_stats"][key] for s in replicas)
    if "reservation_waste_pct" in allocator:  # a ratio: pooled over the replicas
        managers = [run.scheduler.kv_cache_manager for run in runs]
        reserved = sum(m.reserved_slots for m in managers)
        allocator["reservation_waste_pct"] = (100.0 * sum(m.reserved_unwritten_slots for m in managers) / reserved
                                              if reserved else 0.0)
    summary = {
        "backend": "sim",
        "cost_model": cost_model_summary(backends[0], [run.steps.columns() for run in runs]),
        "config": replicas[0]["config"],
        "trace": str(trace.source),
        "num_requests": int(len(trace)),
        "num_finished": int(finished.sum()),
        "num_rejected": int((status == "rejected").sum()),
        "duration_s": duration,
        "num_steps": total("num_steps"),
        "peak_running": largest("peak_running"),
        "mean_running": float(sum(s["mean_running"] * s["num_steps"] for s in replicas) / max(total("num_steps"), 1)),
        "peak_waiting": largest("peak_waiting"),
        "num_gpu_blocks": largest("num_gpu_blocks"),
        "peak_blocks_used": largest("peak_blocks_used"),
        "num_preemptions": total("num_preemptions"),
        "num_preempted_requests": total("num_preempted_requests"),
        "prefix_cache_queries_tokens": queries,
        "prefix_cache_hits_tokens": hits,
        "prefix_cache_hit_rate": float(hits / queries) if queries else 0.0,
        "prefix_cache": {k: sum(s["prefix_cache"][k] for s in replicas) for k in replicas[0]["prefix_cache"]},
        "num_evictions": total("num_evictions"),
        "num_cow_copies": total("num_cow_copies"),
        "num_swap_outs": total("num_swap_outs"),
        "peak_requests_swapped": largest("peak_requests_swapped"),
        "swap_out_bytes": total("swap_out_bytes"),
        "swap_in_bytes": total("swap_in_bytes"),
        "false_prefix_hits": total("false_prefix_hits"),
        "internal_fragmentation_pct": 100.0 * wasted / stored if stored else 0.0,
        "allocator_stats": allocator,
        "num_prefill_tokens": total("num_prefill_tokens"),
        "num_decode_tokens": total("num_decode_tokens"),
    } | parallel_sampling_summary(config, trace, [run.requests for run in runs], getattr(routing, "ranks_per_row", None)) | lora_summary(config, runs, trace, capacities, backends[0], configs) | multimodal_summary(runs, trace) | offload_summary(runs, capacities, queries) | kv_cache_groups_summary(config, capacity) | spec_summary(
        config, [run.scheduler for run in runs], backends, duration)
    itl = weighted_dist(np.concatenate([v for v, _ in samples]), np.concatenate([w for _, w in samples]))
    summary |= latencies_and_rates(requests, itl, duration, wall_time_s)
    summary |= admission_summary(runs, routing) | admission_limits_summary([run.steps.columns() for run in runs])
    if routing.sessions is not None:
        summary |= routing.sessions.summary()
    if routing.clients is not None:
        from simkv.replay.client_timeouts import client_section
        summary["client"] = client_section(config.scheduler, routing.clients.attempts, requests,
                                           [run.feed for run in runs], routing.sessions)
    summary["fleet"] = {"num_replicas": len(runs), "router": routing.router.describe(),
                        "replicas": [_replica_row(r, s) | (_engine_of(s) if differ else {})
                                     for r, s in enumerate(replicas)]}
    return summary


def _engine_of(s: dict) -> dict:
    """Where replicas differ (replica sets): a replica's GPU, parallelism and KV cache."""
    config = s["config"]
    return {"gpu": config["gpu"], "tensor_parallel_size": config["tensor_parallel_size"],
            "pipeline_parallel_size": config["pipeline_parallel_size"], "num_gpu_blocks": s["num_gpu_blocks"],
            "max_num_seqs": config["max_num_seqs"], "max_num_batched_tokens": config["max_num_batched_tokens"]} | (
                {"cpu_tier_gib": s["kv_offloading"]["cpu_tier_gib"]} if "kv_offloading" in s else {}) | (
                {"max_loras": s["lora"]["max_loras"], "lora_slots_gib_per_gpu": s["lora"].get("slots_gib_per_gpu")}
                if "lora" in s else {})


def _replica_row(replica: int, s: dict) -> dict:
    return {"replica": replica, "num_requests": s["num_requests"], "num_finished": s["num_finished"],
            "duration_s": s["duration_s"], "num_steps": s["num_steps"], "peak_running": s["peak_running"],
            "mean_running": s["mean_running"], "peak_waiting": s["peak_waiting"],
            "peak_blocks_used": s["peak_blocks_used"], "num_preemptions": s["num_preemptions"],
            "prefix_cache_hit_rate": s["prefix_cache_hit_rate"], "ttft_s": s["ttft_s"], "itl_s": s["itl_s"],
            "e2e_s": s["e2e_s"], "request_throughput_req_s": s["request_throughput_req_s"],
            "waiting_held_by": largest_admission_limit(s)} | (
                {"kv_offloading_loaded_tokens": s["kv_offloading"]["loaded_tokens"]} if "kv_offloading" in s else {})
