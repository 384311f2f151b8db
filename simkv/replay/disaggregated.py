"""Prefill/decode disaggregation: a prefill pool and a decode pool of engines, on one SimPy clock.

As vLLM serves it with the NIXL connector in pull mode (its disaggregated-serving proxy):
1. A request arrives; the prefill router sends it to a prefill replica as a one-token request
   (max_tokens=1). That replica runs the prompt (prefix cache, chunked prefill and all), samples
   one token, finishes, and keeps the prompt's blocks (core/remote_kv.py).
2. `handoff_ms` later (the proxy passing the prefill's answer on), the decode router sends the
   request, with its whole output length, to a decode replica. There it waits in line like any
   request; when admitted it gets blocks for its whole prompt (less its local prefix hits), takes
   no tokens of the step, and the step's start starts the pull.
3. The pull reads the blocks the decode replica lacks. Every replica has a link of
   `kv_link_gbps`; a pull occupies the prefill replica's and the decode replica's links, and
   pulls queue first come, first served on both (a pull starts when both are free). The last
   byte lands `kv_link_latency_ms` after it was sent. Bytes: the pulled blocks times the KV
   bytes of a block (one GPU's share under tensor parallelism: each GPU has its own link).
4. The decode replica sees the pull's end at its first step boundary at or after it (an idle
   engine polls, so at once), computes the last prompt token again and decodes. The prefill
   replica releases the blocks at its first step boundary at or after the same moment.

The client sees the decode replica's tokens: TTFT runs from arrival to the decode replica's
first token. Both pools' routers are the fleet's (simkv/replay/router.py): the prefill router
routes at each arrival, the decode router at each handoff, each on the finishes strictly before
that moment, so the outcome does not depend on the order in which SimPy resumes processes at one
instant. A decode replica's decode runs (jumps over event-free decode steps) stop before the
earliest moment a handoff could reach it: the end of a prefill replica's step under way, plus
the handoff delay.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import simpy

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.config import ConfigError, EngineConfig
from simkv.core.request import KV_PULL, KV_SEND, Request
from simkv.replay.engine import ArrivalFeed, ReplayEngine, ReplayError, ReplayRun
from simkv.replay.fleet import FleetRouting, ReplicaFeed, fleet_clients
from simkv.replay.sessions import ReleaseWatch, earliest_release
from simkv.replay.router import ROUTERS, Router, RouterError, RouterOptions, check_class_replicas

TRANSFER_DONE, SEND_ABANDONED = 1, 0  # a transfer event's kind (SEND_ABANDONED: its client gave up)
IF_IDLE, IF_WAITING, NEVER = "if idle", "if waiting", "never"  # whom a transfer event wakes (add_event)


@dataclass(frozen=True)
class DisaggregationSpec:
    """`simkv replay --prefill-replicas P --decode-replicas D ...`: the two pools, their routers,
    the engine options each pool sets over the common ones, and the KV link."""

    num_prefill: int = 1
    num_decode: int = 1
    prefill_options: tuple = ()  # ((engine option, value), ...) for the prefill pool only
    decode_options: tuple = ()
    prefill_router: str = "least_outstanding"
    decode_router: str = "least_outstanding"
    router_options: RouterOptions = field(default_factory=RouterOptions)
    kv_link_gbps: float = 50.0  # GB/s of each GPU's link (a 400 Gb/s NIC)
    kv_link_latency_ms: float = 0.1  # from a transfer's last byte sent to the decode side knowing it
    handoff_ms: float = 1.0  # from the prefill's answer to the decode replica receiving the request
    # Clients that give up: how long a prefill replica holds a finished prompt's blocks that no
    # decode replica will read (the proxy dropped the request in its hop): NIXL's lease,
    # VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s by default)
    kv_abort_timeout_s: float = 480.0
    # Replicas of a request class's own in each pool (`--class-replicas prefill:docs=1`; router.py):
    # ((request class, replicas), ...)
    prefill_class_replicas: tuple = ()
    decode_class_replicas: tuple = ()
    # A pool that scales with its load (`--prefill-autoscale 1-4:metric=waiting`): its AutoscaleSpec
    # (simkv/replay/autoscale.py), MAX being the pool's replicas
    prefill_autoscale: object = None
    decode_autoscale: object = None

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name.replace('num_', '')} replicas must be a whole number >= 1, got {value!r}")
        for name in ("prefill_router", "decode_router"):
            if getattr(self, name) not in ROUTERS:
                raise ConfigError(f"{name} must be one of {', '.join(ROUTERS)}, got {getattr(self, name)!r}")
        if not self.kv_link_gbps > 0:
            raise ConfigError(f"kv_link_gbps must be > 0, got {self.kv_link_gbps}")
        if not self.kv_link_latency_ms >= 0:
            raise ConfigError(f"kv_link_latency_ms must be >= 0, got {self.kv_link_latency_ms}")
        if not self.handoff_ms > 0:
            raise ConfigError(f"handoff_ms must be > 0 (the proxy's hop takes time), got {self.handoff_ms}")
        if not self.kv_abort_timeout_s >= 0:
            raise ConfigError(f"kv_abort_timeout_s must be >= 0, got {self.kv_abort_timeout_s}")
        for pool, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            try:
                check_class_replicas(getattr(self, f"{pool}_class_replicas"), count)
            except RouterError as exc:
                raise ConfigError(f"{pool} pool: {exc}") from None
            scaling = getattr(self, f"{pool}_autoscale")
            if scaling is None:
                continue
            if scaling.max_replicas != count:
                raise ConfigError(f"{pool} pool: --{pool}-autoscale {scaling.min_replicas}-{scaling.max_replicas} "
                                  f"scales up to {scaling.max_replicas} replicas, the pool has {count} (give "
                                  f"--{pool}-replicas {scaling.max_replicas} or leave it out)")
            if scaling.min_replicas == 0:
                raise ConfigError(f"{pool} pool: scaling to zero (--{pool}-autoscale 0-N) is not modelled for a P/D "
                                  "pool: MIN must be >= 1")
            if getattr(self, f"{pool}_class_replicas"):
                raise ConfigError(f"{pool} pool: a class's own replicas are not modelled in a pool that scales")
            if scaling.shutdown_timeout_s is not None:
                raise ConfigError(f"{pool} pool: --shutdown-timeout is not modelled yet for a P/D pool that scales "
                                  "(its replicas drain to their last request)")
            own = "ttft_" if pool == "prefill" else "itl_"  # (the latency each pool's replicas measure alone)
            latencies = [name for name, _ in scaling.latency_targets]
            if any(not name.startswith(own) for name in latencies):
                raise ConfigError(f"{pool} pool: {', '.join(latencies)}: a P/D pool scales on the latency its own "
                                  "replicas measure: the prefill pool on its time to first token (ttft_pQ), the "
                                  "decode pool on its inter-token latency (itl_pQ)")
        scaling = [s for s in (self.prefill_autoscale, self.decode_autoscale) if s is not None]
        if any(s.node_mtbf_s is not None for s in scaling):
            raise ConfigError("--node-mtbf-s (nodes that fail) is not modelled yet under P/D pools")
        if len(scaling) == 2 and scaling[0].nodes_dict() != scaling[1].nodes_dict():
            raise ConfigError("P/D pools that scale share the cluster's nodes: give them the same node settings "
                              f"(--node-gpus and the others), got prefill {scaling[0].nodes_dict() or 'none'}, "
                              f"decode {scaling[1].nodes_dict() or 'none'}")

    @property
    def class_names(self) -> list[str]:
        """The request classes with replicas of their own in either pool."""
        return list(dict.fromkeys(c for c, _ in self.prefill_class_replicas + self.decode_class_replicas))

    def pool_configs(self, base: EngineConfig) -> tuple[EngineConfig, EngineConfig]:
        """The prefill pool's and the decode pool's engine configs: `base` with each pool's options."""
        configs = []
        limits = {"max_num_queued_reqs", "max_num_queued_tokens"} & dict(self.decode_options).keys()
        if limits:
            raise ConfigError(f"decode pool: {' / '.join(sorted(limits))} (vLLM's admission control) is modelled at "
                              "the prefill servers, where requests enter (a decode server's 503 would come after the "
                              "prefill, whose blocks then wait for NIXL's abort timeout): set it for both pools or "
                              "with --prefill-set")
        for pool, options in (("prefill", self.prefill_options), ("decode", self.decode_options)):
            try:
                config = EngineConfig.from_flat(base.given_options() | dict(options))
            except (ConfigError, TypeError, ValueError) as exc:
                raise ConfigError(f"{pool} pool: {exc}") from None
            _check_pool(pool, config)
            configs.append(config)
        if configs[1].hardware.data_parallel_size > 1 and self.decode_autoscale is not None:
            raise ConfigError("decode pool: a data-parallel engine's ranks do not scale (--decode-autoscale with "
                              "data_parallel_size > 1)")
        if configs[1].hardware.data_parallel_size > 1 and self.num_decode != 1:
            raise ConfigError(f"decode pool: with data_parallel_size > 1 the pool is one data-parallel engine "
                              f"(--decode-replicas 1), got {self.num_decode} replicas")
        prefill, decode = configs[0].to_dict(), configs[1].to_dict()
        for key in ("model", "block_size", "kv_cache_dtype", "kv_cache_dtype_skip_layers"):
            if prefill.get(key) != decode.get(key):
                raise ConfigError(f"the pools' {key} differ ({prefill.get(key)} and {decode.get(key)}): the decode side "
                                  "reads the prefill side's blocks as they are")
        for key in ("speculative_method", "num_speculative_tokens", "spec_draft_model"):
            if prefill.get(key) != decode.get(key):
                raise ConfigError(f"the pools' {key} differ ({prefill.get(key)} and {decode.get(key)}): the pools "
                                  "run one speculative config (the pulled blocks hold the draft layers' KV too)")
        for key in prefill:
            if key.startswith("client_") and prefill[key] != decode.get(key):
                raise ConfigError(f"the pools' {key} differ ({prefill[key]} and {decode.get(key)}): the clients "
                                  "are the proxy's, not a pool's (set it for both)")
        if configs[0].max_model_len != configs[1].max_model_len:
            raise ConfigError(f"the pools' max_model_len differ ({configs[0].max_model_len} and "
                              f"{configs[1].max_model_len}): a prompt either pool rejects cannot be served")
        return configs[0], configs[1]

    def to_dict(self) -> dict:
        return {"prefill_replicas": self.num_prefill, "decode_replicas": self.num_decode,
                "prefill_options": dict(self.prefill_options), "decode_options": dict(self.decode_options),
                "prefill_router": self.prefill_router, "decode_router": self.decode_router,
                "router_options": self.router_options.to_dict(), "kv_link_gbps": self.kv_link_gbps,
                "kv_link_latency_ms": self.kv_link_latency_ms, "handoff_ms": self.handoff_ms} | {
            f"{pool}_class_replicas": {name: list(rs) for name, rs in getattr(self, f"{pool}_class_replicas")}
            for pool in ("prefill", "decode") if getattr(self, f"{pool}_class_replicas")} | {
            f"{pool}_autoscale": getattr(self, f"{pool}_autoscale").to_dict()
            for pool in ("prefill", "decode") if getattr(self, f"{pool}_autoscale") is not None}


def check_pull_fits(decode_config: EngineConfig, capacity) -> None:
    """Under speculative decoding vLLM admits a pull only if the blocks of one speculative step
    (1 + K + lookahead slots) stay free besides the prompt's: a prompt near max_model_len whose
    blocks and those do not fit the pool would wait forever (vLLM 0.33 does not check it)."""
    step_blocks, bs = decode_config.spec_step_blocks, decode_config.kv_manager_block_size
    if not step_blocks:
        return
    usable = capacity.num_gpu_blocks - (1 if decode_config.cache.reserve_null_block else 0)
    longest = -(-(decode_config.max_model_len - 1) // bs)  # the longest prompt a replay admits
    if longest + step_blocks > usable:
        raise ConfigError(
            f"decode pool: a pulled prompt of max_model_len - 1 = {decode_config.max_model_len - 1} tokens needs "
            f"{longest} blocks plus {step_blocks} for its first speculative step, more than the {usable} the pool "
            "has: such a pull would never be admitted (lower max_model_len or give the pool more blocks)")


def _check_pool(pool: str, config: EngineConfig) -> None:
    sc, cc = config.scheduler, config.cache
    if pool == "prefill" and config.hardware.data_parallel_size > 1:
        raise ConfigError("prefill pool: data_parallel_size > 1 is modelled in the decode pool only")
    hw = config.hardware
    if hw.decode_context_parallel_size > 1:  # (vLLM: a NIXL side is fully replicated or fully DCP-sharded, MLA only)
        if not hw.model_spec().is_mla:
            raise ConfigError(f"{pool} pool: P/D with decode_context_parallel_size > 1 is only supported for MLA "
                              "models (vLLM)")
        if hw.decode_context_parallel_size != hw.tensor_parallel_size:
            raise ConfigError(f"{pool} pool: decode_context_parallel_size={hw.decode_context_parallel_size} must be 1 "
                              f"or equal to the NIXL transfer parallel size={hw.tensor_parallel_size} (vLLM)")
    if sc.preemption_mode != "recompute":
        raise ConfigError(f"{pool} pool: P/D disaggregation is modelled with vLLM v1's recompute preemption; "
                          f"got preemption_mode={sc.preemption_mode}")
    if cc.allocator != "paged":
        raise ConfigError(f"{pool} pool: P/D disaggregation needs the paged allocator, got {cc.allocator}")


class PrefillRouting(FleetRouting):
    """The prefill router: a fleet's, counting the requests it sent that are not yet handed off.
    With sessions it paces the turns, which the decode side finishes. With clients that give up
    it routes their retries (an attempt starts over at a prefill replica)."""

    finishes_turns = False

    def __init__(self, trace, router: Router, max_model_len: int, clients=None, pacing=None, autoscaler=None) -> None:
        super().__init__(trace, router, max_model_len, clients=clients, pacing=pacing, autoscaler=autoscaler)
        self.num_in_prefill = 0
        self.pd: PDRouting | None = None

    def _route(self, i: int, tick: int) -> None:
        super()._route(i, tick)
        if self.assignment[i] >= 0:
            self.num_in_prefill += 1

    def _route_retry(self, tick: int, row: int, attempt: int) -> None:
        super()._route_retry(tick, row, attempt)
        self.num_in_prefill += 1

    def earliest_resend(self) -> int | None:
        """The earliest send time of a retry not yet decided on: of an attempt in either pool
        (`engines` holds both) or between them."""
        best = super().earliest_resend()
        transit = self.pd.earliest_transit_resend()
        return transit if best is None or (transit is not None and transit < best) else best


class PDRouting:
    """Both routers, each a fleet's routing: the prefill side routes trace rows at their
    arrivals, the decode side finished prefills at their handoff ticks (its queues hold rows;
    a row reaches the decode pool at `handoff_tick(row)`)."""

    def __init__(self, trace, spec: DisaggregationSpec, prefill_router: Router, decode_router: Router,
                 max_model_len: int, decode_data_parallel_size: int = 1, clients=None, pacing=None) -> None:
        self.trace = trace
        self.spec = spec
        scalers = {}  # (pools that scale: simkv/replay/autoscale.py)
        for pool in ("prefill", "decode"):
            if getattr(spec, f"{pool}_autoscale") is not None:
                from simkv.replay.autoscale import Autoscaler

                scalers[pool] = Autoscaler(getattr(spec, f"{pool}_autoscale"))
        nodes = next((scaler.nodes for scaler in scalers.values()), None)
        for pool, scaler in scalers.items():  # (both pools on one cluster's nodes)
            scaler.share_nodes(nodes, pool)
        # (sessions: turns paced by the prefill router, released by the decode side's finishes)
        self.prefill = PrefillRouting(trace, prefill_router, max_model_len, clients, pacing,
                                      autoscaler=scalers.get("prefill"))
        self.prefill.pd = self
        self.rows = self.prefill.rows
        if decode_data_parallel_size > 1:  # one data-parallel decode engine: its ranks, its balancer
            from simkv.replay.data_parallel import DPRouting

            self.decode = DPRouting(trace, decode_data_parallel_size, max_model_len, self.rows)
        else:
            self.decode = FleetRouting(trace, decode_router, max_model_len, self.rows,
                                       autoscaler=scalers.get("decode"))
        self._handoffs: list[tuple[int, int]] = []  # heap of (tick, row): finished prefills on their way
        self.handoff_ticks = max(1, to_ticks(spec.handoff_ms / 1e3))
        self.prefill_engines: list[ReplayEngine] = []
        self.decode_engines: list[ReplayEngine] = []
        self.env: simpy.Environment | None = None
        # per trace row: the prefill's end, the pull's start and end (ticks), the bytes pulled
        self.prefill_end = np.full(len(trace), -1, dtype=np.int64)
        self.pull_start = np.full(len(trace), -1, dtype=np.int64)
        self.pull_end = np.full(len(trace), -1, dtype=np.int64)
        self.pull_bytes = np.zeros(len(trace), dtype=np.int64)
        self.num_pulls = self.total_pull_bytes = 0  # (every attempt's)
        self.prefill_link_free = [0] * prefill_router.num_replicas  # tick each prefill link has sent all by
        # Clients that give up (simkv/replay/disaggregated_clients.py; `prefill.clients`): the
        # attempts between the pools, row -> (sent at tick, attempt number, the prefill's request),
        # from the prefill's end until a decode replica takes the request
        self.in_transit: dict[int, tuple[int, int, Request]] = {}
        self.transit = None  # (their TransitClients)

    @property
    def all_handed_off(self) -> bool:
        return self.prefill.all_routed and self.prefill.num_in_prefill == 0 and not self._handoffs

    # ---- the handoff: prefill replica -> proxy -> decode replica -------------------------------
    def hand_off(self, row: int, tick: int) -> None:
        """A prefill finished at `tick`: its request reaches the decode router `handoff_ms` later."""
        self.prefill_end[row] = tick
        at = self.handoff_tick(row)
        heapq.heappush(self._handoffs, (at, row))
        self.env.process(self._route_at(at))

    def handoff_tick(self, row: int) -> int:
        """When a finished prefill reaches the decode router (and the replica it routes it to)."""
        return int(self.prefill_end[row]) + self.handoff_ticks

    def next_handoff_ticks(self) -> int | None:
        return self._handoffs[0][0] if self._handoffs else None

    def route_handoffs_until(self, now: int) -> None:
        handoffs = self._handoffs
        while handoffs and handoffs[0][0] <= now:
            tick, row = heapq.heappop(handoffs)
            self._route_decode(row, tick)

    def _route_decode(self, row: int, tick: int) -> None:
        self.prefill.num_in_prefill -= 1
        if self.transit is not None and self.transit.dropped(row, tick):
            return  # (its client gave up: the proxy does not pass it on)
        self.decode.queues[self.decode.assign(row, tick)].append(row)

    def earliest_transit_resend(self) -> int | None:
        return self.transit.earliest_resend() if self.transit is not None else None

    def _route_at(self, tick: int):
        env = self.env
        yield env.timeout(tick - env.now)
        self.route_handoffs_until(env.now)
        done = self.all_handed_off
        for r, engine in enumerate(self.decode_engines):
            if engine.idle and (self.decode.queues[r] or done):
                engine.wake(env.now)

    def prefill_process(self):
        """The prefill router's process (a fleet's), then: nothing more will reach the decode pool
        once every prefill has been handed off."""
        yield from self.prefill.router_process(self.env, self.prefill_engines)
        self.release_idle_decoders()

    def refused_at_prefill(self) -> None:
        """A prefill replica's front end refused an attempt (HTTP 503): it will not reach the
        decode pool, which may then have nothing more to wait for."""
        self.prefill.num_in_prefill -= 1
        self.release_idle_decoders()

    def release_idle_decoders(self) -> None:
        if self.all_handed_off:
            for engine in self.decode_engines:
                if engine.idle:
                    engine.wake(self.env.now)

    def earliest_handoff_ticks(self) -> int | None:
        """No request can reach a decode replica before this tick (None: none will): the
        handoffs under way, and prefills that could end (a replica's step under way ends then;
        an idle replica without requests must first get one; any other could end now)."""
        bound = self.next_handoff_ticks()
        now = self.env.now
        for r, engine in enumerate(self.prefill_engines):
            busy = max(engine.now, engine.busy_until)
            if busy > now:  # in a step: its end
                earliest = busy
            elif engine.idle and not engine.scheduler.has_unfinished_requests() and not self.prefill.queues[r] \
                    and not self.prefill.retry_queues[r]:
                earliest = self.prefill.next_unrouted_ticks()
                if self.prefill.clients is not None:  # (or a retry a client has yet to decide on)
                    resend = self.prefill.earliest_resend()
                    if resend is not None and (earliest is None or resend < earliest):
                        earliest = resend
                if self.prefill.sessions is not None:  # (or a turn a decode replica's finish releases)
                    release = earliest_release(self.decode_engines)
                    if release is not None and (earliest is None or release < earliest):
                        earliest = release
                if earliest is None:
                    continue
            else:
                earliest = now
            earliest += self.handoff_ticks
            if bound is None or earliest < bound:
                bound = earliest
        return bound

    def wake_at(self, engine: ReplayEngine, tick: int, waiting_only: bool = False):
        """A transfer ends at `tick`: an idle engine then polls (vLLM's engine steps while a
        connector has work), a busy one sees it at its next step boundary. `waiting_only`: only
        an engine with requests waiting (for blocks) is woken; another sees it when next woken."""
        env = self.env
        yield env.timeout(tick - env.now)
        if engine.idle and (not waiting_only or engine.scheduler.has_unfinished_requests()):
            engine.wake(env.now)


class _EventFeed(ReplicaFeed):
    """A pool replica's feed: its routed requests, and transfer events that take effect at the
    first step boundary at or after their tick."""

    def __init__(self, pd: PDRouting, replica: int, queue: deque, trace, scheduler, request_log, max_model_len: int):
        ArrivalFeed.__init__(self, trace, scheduler, request_log, max_model_len, pd.rows)
        self.release_watch = ReleaseWatch()  # (sessions, decode side: what it could release)
        self.routing = pd.prefill
        self.replica = replica
        self.queue = queue  # what the pool's router sent here, not yet delivered
        self.pd = pd
        self.engine: ReplayEngine | None = None
        self._events: list[tuple[int, int, int, int, Request]] = []  # (tick, row, kind, number, request)
        self._num_events = 0

    def add_event(self, tick: int, request: Request, kind: int = TRANSFER_DONE, wake: str = IF_IDLE) -> None:
        """`wake`: the engine is woken at `tick` if idle (IF_IDLE), only if requests wait in it
        (IF_WAITING), or not at all (NEVER: it sees the event when next woken)."""
        heapq.heappush(self._events, (tick, request.index, kind, self._num_events, request))
        self._num_events += 1
        if wake != NEVER:
            self.pd.env.process(self.pd.wake_at(self.engine, tick, waiting_only=wake == IF_WAITING))

    def next_event_ticks(self) -> int | None:
        return self._events[0][0] if self._events else None

    def _apply_events(self, now: int) -> None:
        events = self._events
        while events and events[0][0] <= now:
            _, _, kind, _, request = heapq.heappop(events)
            self.apply(request, kind)

    def apply(self, request: Request, kind: int) -> None:
        raise NotImplementedError

    def holds_pending_work(self) -> bool:
        return bool(self._events)


class PrefillFeed(_EventFeed):
    """A prefill replica: trace rows as one-token KV_SEND requests; releases their blocks when
    the decode side has read them."""

    def __init__(self, pd: PDRouting, replica: int, *args):
        super().__init__(pd, replica, pd.prefill.queues[replica], *args)
        self.held: dict[int, Request] = {}  # trace row -> its finished request, blocks held

    def make_request(self, i: int) -> Request:
        request = super().make_request(i)
        request.max_tokens = 1
        request.num_samples = request.group_remaining = 1  # the decode side samples the sequences
        request.kv_role = KV_SEND
        return request

    def deliver_until(self, now: int) -> None:
        self._apply_events(now)
        super().deliver_until(now)

    def _deliver(self, i: int) -> bool:
        if super()._deliver(i):
            return True
        self.pd.refused_at_prefill()  # (the replica's front end answered 503: simkv/replay/admission.py)
        return False

    def apply(self, request: Request, kind: int) -> None:
        if self.held.get(request.index) is request:
            del self.held[request.index]
        if kind == TRANSFER_DONE:
            self.scheduler.finished_sending(request)
        else:
            self.scheduler.abandon_send(request)

    def holds_pending_work(self) -> bool:
        return bool(self._events) or bool(self.scheduler.kv_held)

    def note_finished(self, finished, tick: int) -> None:
        super().note_finished(finished, tick)
        pd = self.pd
        for request in finished:
            pd.hand_off(request.index, tick)
            self.held[request.index] = request


class DecodeFeed(_EventFeed):
    """A decode replica: handed-off requests as KV_PULL requests with their whole output; its
    link, on which (and on the prefill replica's) their pulls queue."""

    def __init__(self, pd: PDRouting, replica: int, *args, block_bytes: int):
        super().__init__(pd, replica, pd.decode.queues[replica], *args)
        self.queue_limits = None  # (the prefill servers' front ends refuse: simkv/replay/admission.py)
        self.block_bytes = block_bytes
        spec = self.pd.spec
        self._ticks_per_byte = TICKS_PER_SECOND / (spec.kv_link_gbps * 1e9)
        self._latency_ticks = to_ticks(spec.kv_link_latency_ms / 1e3)
        self.link_free = 0  # tick at which the link has sent everything queued on it

    @property
    def exhausted(self) -> bool:
        return self.pd.all_handed_off and not self.queue and not self._events

    def next_arrival_ticks(self) -> int | None:
        pd = self.pd
        candidates = [t for t in (pd.handoff_tick(self.queue[0]) if self.queue else None, pd.earliest_handoff_ticks(),
                                  self.next_event_ticks()) if t is not None]
        return min(candidates) if candidates else None

    def deliver_until(self, now: int) -> None:
        self._apply_events(now)
        pd = self.pd
        pd.route_handoffs_until(now)
        queue = self.queue
        sessions = pd.prefill.sessions
        while queue and pd.handoff_tick(queue[0]) <= now:
            row = queue.popleft()
            self.scheduler.add_request(self.make_request(row))
            if sessions is not None:
                self.release_watch.delivered(sessions, row)

    def make_request(self, i: int) -> Request:
        request = super().make_request(i)
        request.kv_role = KV_PULL
        return request

    def apply(self, request: Request, kind: int) -> None:
        self.scheduler.finished_recving(request)

    def kv_loads_started(self, requests: list[Request], tick: int) -> None:
        pd = self.pd
        for request in requests:
            num_bytes = request.kv_pull_blocks * self.block_bytes
            row = request.index
            prefill = pd.prefill.assignment[row]
            begin = max(tick, self.link_free, pd.prefill_link_free[prefill])
            self.link_free = pd.prefill_link_free[prefill] = begin + round(num_bytes * self._ticks_per_byte)
            end = self.link_free + self._latency_ticks
            pd.pull_start[row], pd.pull_end[row], pd.pull_bytes[row] = tick, end, num_bytes
            pd.num_pulls += 1
            pd.total_pull_bytes += num_bytes
            self.add_event(end, request)
            feed = pd.prefill_engines[prefill].feed
            feed.add_event(end, feed.held[row])

    def note_finished(self, finished, tick: int) -> None:
        self.pd.decode.note_finished(self.replica, finished, tick)
        if self.pd.prefill.sessions is not None:  # (the turns end here: the prefill router paces them)
            self.release_watch.finished(finished)
            self.pd.prefill.turns_done(finished, tick)


@dataclass
class DisaggregatedRun:
    prefill_runs: list[ReplayRun]
    decode_runs: list[ReplayRun]
    routing: PDRouting


def run_disaggregated(trace, spec: DisaggregationSpec, prefill_config: EngineConfig, decode_config: EngineConfig,
                      prefill_backends: list, decode_backends: list, prefill_capacity, decode_capacity,
                      use_decode_runs: bool = True, on_progress=None) -> DisaggregatedRun:
    env = simpy.Environment()
    max_model_len = prefill_config.max_model_len
    clients = fleet_clients(trace, prefill_config)  # (clients that give up and retry, through the prefill router)
    if clients is not None:
        from simkv.replay.disaggregated_clients import DecodeClientFeed, PrefillClientFeed, TransitClients
    prefill_router = Router(spec.prefill_router, spec.num_prefill, spec.router_options,
                            cache_tokens_per_replica=prefill_capacity.kv_cache_tokens,
                            class_replicas=spec.prefill_class_replicas)
    decode_router = Router(spec.decode_router, spec.num_decode, spec.router_options,
                           cache_tokens_per_replica=decode_capacity.kv_cache_tokens,
                           class_replicas=spec.decode_class_replicas)
    decode_dp = decode_config.hardware.data_parallel_size
    pd = PDRouting(trace, spec, prefill_router, decode_router, max_model_len, decode_dp,
                   clients=clients, pacing=prefill_config.scheduler)
    pd.env = env
    if clients is not None:
        pd.transit = TransitClients(pd, prefill_config)
    pd.prefill.on_reject = on_progress
    block_bytes = decode_capacity.block_bytes  # (one block of one KV-cache group: a pull counts each group's)

    def engines(configs_backends, make_feed_of, capacity, config, progress):
        out = []
        for r, backend in enumerate(configs_backends):
            engine = ReplayEngine(trace, config, backend, capacity.num_gpu_blocks, use_decode_runs, progress,
                                  capacity=capacity, env=env, make_feed=make_feed_of(r), kv_connector=True)
            engine.arrival_feed.engine = engine  # (under a CPU tier's OffloadFeed)
            out.append(engine)
        return out

    def prefill_feed(r):
        if clients is not None:
            return lambda scheduler, log: PrefillClientFeed(pd, r, trace, scheduler, log, prefill_config)
        return lambda scheduler, log: PrefillFeed(pd, r, trace, scheduler, log, max_model_len)

    def decode_feed(r):
        if clients is not None:
            return lambda scheduler, log: DecodeClientFeed(pd, r, trace, scheduler, log, decode_config,
                                                           block_bytes=block_bytes)
        return lambda scheduler, log: DecodeFeed(pd, r, trace, scheduler, log, max_model_len, block_bytes=block_bytes)

    pd.prefill_engines = engines(prefill_backends, prefill_feed, prefill_capacity, prefill_config, None)
    if decode_dp > 1:  # the decode pool is one data-parallel engine: its ranks step in lockstep
        from simkv.replay.data_parallel import group_process

        pd.decode_engines = engines(decode_backends * decode_dp, decode_feed, decode_capacity, decode_config,
                                    on_progress)
        processes = [e.start(own_arrivals=False) for e in pd.prefill_engines]
        group = group_process(decode_config)
        processes.append(env.process(group(env, pd.decode_engines, decode_backends[0], pd.decode)))
    else:
        pd.decode_engines = engines(decode_backends, decode_feed, decode_capacity, decode_config, on_progress)
        processes = [e.start(own_arrivals=False) for e in pd.prefill_engines + pd.decode_engines]
    for routing, pool in ((pd.prefill, pd.prefill_engines), (pd.decode, pd.decode_engines)):
        if routing.autoscaler is not None:
            routing.autoscaler.watch(pool, routing.router)
    if clients is not None:
        pd.prefill.engines = pd.prefill_engines + pd.decode_engines  # (whose clients may resend: the prefill router's)
        for engine in pd.prefill_engines:
            engine.arrival_feed.on_timed_out = on_progress
    env.process(pd.prefill_process())
    try:
        env.run(until=simpy.AllOf(env, processes))
    except RuntimeError as exc:  # SimPy: nothing left to happen, some engine still waiting
        if "No scheduled events left" not in str(exc):
            raise
        raise ReplayError(_deadlock_message(pd)) from None
    return DisaggregatedRun([e.result() for e in pd.prefill_engines], [e.result() for e in pd.decode_engines], pd)


def _deadlock_message(pd: PDRouting) -> str:
    def pool(name, engines):
        return "; ".join(f"{name} {r}: {len(e.scheduler.running)} running, {e.scheduler.num_waiting()} waiting, "
                         f"{len(e.scheduler.kv_held)} holding blocks for the decode side, "
                         f"{e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()} free blocks"
                         for r, e in enumerate(engines))
    return ("the disaggregated fleet cannot make progress (a prompt may need more blocks than a decode replica "
            f"has): {pool('prefill', pd.prefill_engines)}; {pool('decode', pd.decode_engines)}")
