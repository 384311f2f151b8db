"""The SimPy model: an engine process runs steps; an arrival process wakes it when it idles.

Time follows the engine: a step starts when the previous one ends or, when nothing is
runnable, at the next arrival. A request arriving during a step (or exactly when it ends)
joins at the next step. A request's first token exists at the end of the step that sampled
it. Time is counted in integer ticks (simkv/clock.py), SimPy's included: a run of pure-decode
steps, whose durations are affine in the step index, ends at a closed-form time that equals
stepping through it, and costs the same whatever its length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import simpy

from simkv.backends.base import StepBackend
from simkv.backends.lora_adapters import adapter_residency
from simkv.backends.vision_encoder import vision_encoder_cost
from simkv.clock import MAX_TICKS, TICKS_PER_SECOND, line_ticks, run_shape, run_ticks, steps_to_reach, to_ticks
from simkv.config import EngineConfig
from simkv.core.request import Request
from simkv.core.scheduler import LivelockError, Scheduler
from simkv.replay.admission import queue_limits
from simkv.replay.step_log import RequestLog, StepLog
from simkv.traces.lora import content_namespaces, lora_ids


class ReplayError(RuntimeError):
    """The replay cannot make progress (reported with its cause)."""


class TraceRows:
    """A trace's per-row values that every delivery reads, as Python numbers: scalar access to
    numpy arrays costs more than the rest of a delivery. Built once per replay (a fleet's
    replicas and router share one)."""

    def __init__(self, trace) -> None:
        self.arrival_s = trace.arrival_time_s.tolist()
        self.arrival_ticks = [to_ticks(a) for a in self.arrival_s]
        self.prompt_tokens = trace.prompt_tokens.tolist()
        self.output_tokens = trace.output_tokens.tolist()
        self.class_names, self.class_codes = _class_codes(trace)


def _class_codes(trace) -> tuple[tuple[str, ...], list[int] | None]:
    """The trace's request classes (simkv/replay/classes.py; priorities where it has none), in
    name order, and each row's number among them; ((), None) without classes."""
    from simkv.replay.classes import trace_labels

    found = trace_labels(trace)
    if found is None:
        return (), None
    names, codes = np.unique(found[1].astype(str), return_inverse=True)
    return tuple(names.tolist()), codes.tolist()


class ArrivalFeed:
    """Turns trace rows into Requests, in arrival order, when the clock reaches them."""

    def __init__(self, trace, scheduler: Scheduler, request_log: RequestLog, max_model_len: int,
                 rows: TraceRows | None = None) -> None:
        self.trace = trace
        self.arrivals = trace.arrival_time_s
        rows = rows if rows is not None else TraceRows(trace)
        self._arrival_list = rows.arrival_s
        self._arrival_ticks = rows.arrival_ticks
        self._prompt_list = rows.prompt_tokens
        self._output_list = rows.output_tokens
        self.scheduler = scheduler
        self.request_log = request_log
        self.max_model_len = max_model_len
        self.next_index = 0
        self.num_rejected = 0
        self._ids = trace.request_id
        self._salt = content_namespaces(trace)  # (cache_salt and LoRA adapter: what blocks are shared within)
        self._lora_ids = lora_ids(trace)
        self._priority = trace.priority
        self._has_hashes = trace.hash_ids is not None
        self.class_names, self._class_codes = rows.class_names, rows.class_codes
        # vLLM's API-server admission control (None: no limit; simkv/replay/admission.py)
        self.queue_limits = queue_limits(scheduler.config)

    @property
    def exhausted(self) -> bool:
        return self.next_index >= len(self.arrivals)

    def last_arrival_ticks(self) -> int:
        return self._arrival_ticks[-1] if self._arrival_ticks else 0

    def next_arrival_ticks(self) -> int | None:
        i = self.next_index
        return self._arrival_ticks[i] if i < len(self._arrival_ticks) else None

    def deliver_until(self, now: int) -> None:
        """Deliver the requests that arrived by tick `now`."""
        arrivals = self._arrival_ticks
        n = len(arrivals)
        i = self.next_index
        while i < n and arrivals[i] <= now:
            self._deliver(i)
            i += 1
        self.next_index = i

    def note_finished(self, finished: list[Request], tick: int) -> None:
        """The engine finished these requests at `tick` (a fleet's router counts them)."""

    def log_finished(self, request: Request, tick: int) -> None:
        """A row's request completed at `tick`: into the request log (data-parallel ranks: the
        log of the rank its first sequence ran on)."""
        self.request_log.finish(request)

    def arrival_times_s(self):
        """Per trace row, when it arrived (the trace's times; session pacing moves some)."""
        return self.arrivals

    def kv_loads_started(self, requests: list[Request], tick: int) -> None:
        """P/D: a step starting at `tick` admitted these requests to pull their KV."""
        raise ReplayError("a request pulls its KV outside a disaggregated fleet")

    def holds_pending_work(self) -> bool:
        """P/D: the engine's scheduler waits for a transfer to end (a step may then run nothing)."""
        return False

    def _deliver(self, i: int) -> bool:
        """Send row `i` to the engine; False if it was rejected (a prompt of max_model_len tokens
        or more, or vLLM's admission control: HTTP 503)."""
        prompt = self._prompt_list[i]
        if prompt >= self.max_model_len or (
                self.queue_limits is not None
                and not self.queue_limits.admits(self.scheduler, int(self.trace.n[i]) if self.trace.n is not None else 1)):
            self.num_rejected += 1
            self.request_log.reject(i)
            return False
        self.scheduler.add_request(self.make_request(i))
        return True

    def make_request(self, i: int) -> Request:
        trace = self.trace
        hashes = trace.block_hashes(i) if self._has_hashes else None
        request = Request(
            str(self._ids[i]), i, self._arrival_list[i], self._prompt_list[i], self._output_list[i],
            priority=int(self._priority[i]) if self._priority is not None else 0,
            cache_salt=self._salt[i] if self._salt is not None else None,
            shared_hash_ids=hashes,
            hash_block_tokens=int(trace.hash_block_tokens[i]) if self._has_hashes else 0,
            num_samples=int(trace.n[i]) if trace.n is not None else 1,
            lora_id=int(self._lora_ids[i]) if self._lora_ids is not None else 0)
        if trace.mm_items is not None:
            request.mm_items = trace.multimodal_items(i)
        if self._class_codes is not None:
            request.class_code = self._class_codes[i]
        return request


@dataclass
class ReplayRun:
    scheduler: Scheduler
    steps: StepLog
    requests: RequestLog
    feed: ArrivalFeed
    duration_s: float  # the end of the last step
    adapters: object = None  # LoRA: the worker's adapter caches (simkv/backends/lora_adapters.py)
    pipeline: object = None  # pipeline parallelism: the stages' clocks (simkv/replay/pipeline.py)
    encoder: tuple = (None, 0.0, 0.0)  # images: the encoder's cost (None: not priced), its seconds, store reads


def _first_sampled_row(trace) -> int | None:
    """The first trace row asking for n > 1 sequences (parallel sampling), or None."""
    if trace.n is None:
        return None
    many = trace.n > 1
    return int(many.argmax()) if many.any() else None


def _check_parallel_sampling(trace, row: int, config: EngineConfig, kv_connector: bool) -> None:
    """ValueError naming `row` (the first with n > 1) where parallel sampling is not modelled."""
    fork = config.scheduler.parallel_sampling == "fork"
    if fork and (config.speculative.enabled or config.has_sliding_window or config.has_linear_attention):
        without = ("with speculative decoding" if config.speculative.enabled
                   else f"for models with {'sliding-window' if config.has_sliding_window else 'linear-attention'} "
                   f"layers ({config.hardware.model})")
        raise ValueError(f"{trace.source}: row {row}: n = {int(trace.n[row])} (parallel sampling) forked as vLLM v0 "
                         f"did is not modelled {without}; --parallel-sampling fan_out (vLLM v1's) is")
    paced = config.scheduler.session_pacing and trace.session_id is not None
    dp_paced_clients = config.hardware.data_parallel_size > 1 and config.scheduler.has_client_timeouts and paced
    if config.scheduler.parallel_sampling == "fan_out" and (kv_connector or dp_paced_clients):
        where = ("with P/D disaggregation (--parallel-sampling fork samples the sequences on the decode side)"
                 if kv_connector else "on data-parallel ranks with clients that give up on paced sessions "
                 "(--no-session-pacing sends the turns at their trace times)")
        raise ValueError(f"{trace.source}: row {row}: n = {int(trace.n[row])} (parallel sampling), fanned out as "
                         f"vLLM v1 does, is not modelled {where}")


class ReplayEngine:
    def __init__(self, trace, config: EngineConfig, backend: StepBackend, num_gpu_blocks: int,
                 use_decode_runs: bool = True, on_progress: Callable[[int], None] | None = None,
                 capacity=None, env: simpy.Environment | None = None, make_feed=None,
                 kv_connector: bool = False) -> None:
        """`env` and `make_feed(scheduler, request_log)`: a fleet (simkv/replay/fleet.py) runs several
        engines on one environment, each fed by the router; by default the engine owns both."""
        self.config = config
        self.backend = backend
        sampled = _first_sampled_row(trace)
        if sampled is not None:
            _check_parallel_sampling(trace, sampled, config, kv_connector)
        num_cpu_blocks = capacity.num_cpu_blocks if capacity is not None else 0
        num_offload_chunks = capacity.num_offload_chunks if capacity is not None else 0
        if num_offload_chunks and sampled is not None and config.scheduler.parallel_sampling == "fork":
            raise ValueError("KV offloading (kv_offloading_size) is modelled without vLLM v0's forked parallel "
                             "sampling yet")
        self.scheduler = Scheduler(config.for_kv_manager(), num_gpu_blocks, detail=backend.needs_request_detail,
                                   num_cpu_blocks=num_cpu_blocks, kv_connector=kv_connector or bool(num_offload_chunks),
                                   num_offload_chunks=num_offload_chunks)
        # Swapping delays the step by its bytes over PCIe (not under the step-counting unit model).
        block_bytes = capacity.kv_bytes_per_token * config.kv_manager_block_size if capacity is not None else 0
        self.swap_seconds_per_block = (0.0 if backend.name == "unit" else
                                       block_bytes / (config.cache.pcie_bandwidth_gbs * 1e9))
        # Pure-decode steps are timed by the backend's decode line (runs and single steps alike).
        self._decode_line = backend.decode_step_line if backend.supports_decode_runs else None
        # (sparse attention: the line's ticks per token attended, beside its ticks per token scored)
        self._capped_slopes = getattr(backend, "capped_line_slopes", None) if self._decode_line is not None else None
        self._lora_seconds = getattr(backend, "lora_seconds", None) if config.scheduler.enable_lora else None
        # Multimodal items: the vision encoder's time, added to the steps that encode (not under the
        # step-counting unit model; None where the model's spec has no encoder: it is not priced)
        self.vision_encoder = (vision_encoder_cost(config) if config.scheduler.mm_max_tokens_per_item
                               and backend.name != "unit" else None)
        self.encoder_seconds = 0.0
        # Encoder disaggregation: seconds per embedding written to (an encode instance) or read from
        # (an engine behind one) the embedding store (simkv/replay/encode_pool.py)
        self._store_seconds_per_embed = 0.0
        if config.scheduler.ec_role is not None and backend.name != "unit":
            self._store_seconds_per_embed = (config.hardware.model_spec().vision_embed_bytes
                                             / (config.scheduler.ec_store_gbs * 1e9))
        self.store_seconds = 0.0
        # LoRA: the worker's adapter caches; a step whose adapters are not all in GPU slots loads them first
        self.adapters = adapter_residency(config, backend)
        # Async scheduling overlaps the host's share of a step with the device's work.
        self._host_seconds = getattr(backend, "host_seconds", None) if config.scheduler.async_scheduling else None
        self.steps = StepLog(config.speculative.enabled, multimodal=config.scheduler.mm_max_tokens_per_item is not None)
        self.requests = RequestLog(len(trace), config.speculative.enabled)
        self._client = None  # clients that give up and retry (simkv/replay/client_timeouts.py)
        from simkv.replay.sessions import paces
        if config.scheduler.has_clients:
            from simkv.replay.client_timeouts import ClientTimeoutFeed, SessionClientFeed, check_supported

            check_supported(trace, config)
            if make_feed is not None:  # (a fleet's replica)
                self.feed = self._client = make_feed(self.scheduler, self.requests)
            elif paces(trace, config.scheduler):  # (simkv/replay/sessions.py)
                self.feed = self._client = SessionClientFeed(trace, self.scheduler, self.requests, config)
            else:
                self.feed = self._client = ClientTimeoutFeed(trace, self.scheduler, self.requests, config)
            self._client.on_timed_out = on_progress
        elif make_feed is not None:
            self.feed = make_feed(self.scheduler, self.requests)
        elif paces(trace, config.scheduler):  # (simkv/replay/sessions.py)
            from simkv.replay.sessions import SessionFeed

            self.feed = SessionFeed(trace, self.scheduler, self.requests, config.max_model_len, config.scheduler)
        else:
            self.feed = ArrivalFeed(trace, self.scheduler, self.requests, config.max_model_len)
        self.arrival_feed = self.feed  # (the feed that makes its requests: a fleet replica's, P/D's)
        names = self.arrival_feed.class_names
        if names:  # (each class's token gaps: its inter-token latencies)
            self.scheduler.track_classes(len(names))
            self.steps.track_classes(names)
        if num_offload_chunks:  # (its transfers on the host link: simkv/replay/offload_feed.py)
            from simkv.capacity import offload_copies
            from simkv.replay.offload_feed import OffloadFeed
            # (each copy moves over its own GPU's link: a job takes one copy's bytes at one link's rate)
            self.feed = OffloadFeed(self.feed, self.scheduler, capacity.offload_chunk_bytes,
                                    config.cache.pcie_bandwidth_gbs, self.scheduler.config.cache.offload_blocks_per_chunk,
                                    offload_copies(config))
        self.use_decode_runs = use_decode_runs and backend.supports_decode_runs
        self.on_progress = on_progress
        self.now = 0  # ticks
        self.env = env if env is not None else simpy.Environment()  # in ticks too
        self._idle: simpy.Event | None = None
        self._engine_idle: simpy.Event | None = None
        self._num_done = 0
        self._num_rejected_reported = 0
        self._unlogged_preemptions = 0  # made by schedule() calls that ran nothing (the next step to run counts them)
        # the tick at which the engine's current step (or decode run) ends: `now` under
        # synchronous scheduling, set before the wait; async scheduling advances `now` after it
        self.busy_until = 0
        self.pipeline = None  # pipeline parallelism: the stages' clocks, set by run_batch_queue
        self.latency_watch = None  # an autoscaler's latency metrics: the first tokens and finishes they observe

    def start_anew(self) -> bool:
        """This replica's slot starts a new pod (an autoscaler's): its GPU prefix cache, CPU
        tier, encoder cache and LoRA adapter caches empty. Only once it holds nothing (no
        request, no block in use, no transfer in flight); False, with nothing changed, before."""
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        offload, encoder = sched.offload, sched.encoder_cache
        if sched.has_unfinished_requests() or pool.get_num_used_blocks() or (
                encoder is not None and encoder.request_inputs) or (offload is not None and not offload.reset_tier()):
            return False
        if encoder is not None:
            encoder.reset()
        if self.adapters is not None:
            self.adapters.reset()
        return pool.reset_prefix_cache()

    def run(self) -> ReplayRun:
        engine = self.start()
        self.env.run(until=engine)
        return self.result()

    def start(self, own_arrivals: bool = True) -> simpy.Process:
        """Register the engine's processes on the environment; the engine process ends with the replay.
        `own_arrivals=False`: no arrival process of its own; whoever feeds the engine wakes it when
        idle (`wake`), as a fleet's router does."""
        last_arrival = self.feed.last_arrival_ticks()
        if last_arrival >= MAX_TICKS:
            raise ReplayError(f"the trace spans {last_arrival / TICKS_PER_SECOND / 86400:.0f} days; simkv's "
                              f"clock covers {MAX_TICKS / TICKS_PER_SECOND / 86400:.0f} days of simulated time")
        if own_arrivals:
            self.env.process(self._arrivals())
        elif hasattr(self.feed, "next_transfer_ticks"):  # (a fleet replica with KV offloading)
            self.env.process(self._transfer_wakes())
        if self.config.hardware.pipeline_parallel_size > 1:
            from simkv.replay.pipeline import run_batch_queue

            return self.env.process(run_batch_queue(self))
        if self.config.scheduler.async_scheduling:
            return self.env.process(self._engine_async())
        return self.env.process(self._engine())

    def next_finish_bound(self) -> int | None:
        """The earliest tick at which this engine could finish a request it has not yet reported
        finished (None: it runs none): the end of the step or run it is in (fleets' session
        pacing bounds other replicas' decode runs by it)."""
        if not self.scheduler.has_unfinished_requests():
            return None
        return self.busy_until if self.scheduler.overlapped else self.now

    @property
    def idle(self) -> bool:
        """Waiting for work (`wake` resumes it)."""
        return self._idle is not None and not self._idle.triggered

    def wake(self, tick: int | None) -> None:
        """Resume an idle engine at `tick` (now): requests for it have arrived; None: the replay ended."""
        self._idle.succeed(tick)

    def result(self) -> ReplayRun:
        if self.now >= MAX_TICKS:
            raise ReplayError(f"the replay ran {self.now / TICKS_PER_SECOND / 86400:.0f} days of simulated time; "
                              f"simkv's clock covers {MAX_TICKS / TICKS_PER_SECOND / 86400:.0f} days")
        return ReplayRun(self.scheduler, self.steps, self.requests, self.feed, self.now / TICKS_PER_SECOND,
                         self.adapters, self.pipeline, (self.vision_encoder, self.encoder_seconds, self.store_seconds))

    def _arrivals(self):
        """The arrival process. A busy engine takes the requests that arrived from the feed at
        each step boundary; when it runs out of work it says so, and this process sleeps until
        the next request arrives and wakes it."""
        env = self.env
        while True:
            self._engine_idle = env.event()
            yield self._engine_idle
            t = self.feed.next_arrival_ticks()
            if t is None:
                return
            if t > env.now:
                yield env.timeout(t - env.now)
            self._idle.succeed(t)

    def _transfer_wakes(self):
        """A fleet replica's own wake-ups (its router wakes it for arrivals): an engine idle while
        a KV-offloading transfer is in flight is woken when it ends, unless woken before."""
        env = self.env
        while True:
            self._engine_idle = env.event()
            yield self._engine_idle
            self._engine_idle = None  # (an engine idle again meanwhile is woken below)
            t = self.feed.next_transfer_ticks()
            if t is None:
                continue  # (its router wakes it)
            if t > env.now:
                yield env.timeout(t - env.now)
            if self.idle:
                self._idle.succeed(max(t, env.now))

    def _engine(self):
        sched = self.scheduler
        feed = self.feed
        env = self.env
        while True:
            feed.deliver_until(self.now)
            if feed.num_rejected != self._num_rejected_reported:
                self._report_rejected()
            if not sched.has_unfinished_requests():
                if self._retire_offloaded():
                    continue
                if feed.exhausted:
                    return
                yield from self._wait_for_arrival()
                continue
            if self.use_decode_runs:
                run = self._decode_run()
                if run is not None:
                    # Decode runs back to back (split only by finishing requests) pass as one
                    # timeout: in between, nothing arrives and the loop would only start the next.
                    start = self.now
                    while run is not None:
                        self.now, finished = run
                        if finished:
                            self._record_finished(finished)
                        nxt = feed.next_arrival_ticks()
                        if (nxt is not None and nxt <= self.now) or not sched.has_unfinished_requests():
                            break
                        run = self._decode_run()
                    yield env.timeout(self.now - start)
                    continue
            out = self._schedule()
            if out.is_empty:
                sched.current_step = out.step  # nothing ran: not a step
                if out.offload_jobs:  # (loads admitted by a schedule() that ran nothing start now)
                    feed.offload_jobs_started(out.offload_jobs, self.now, self.now)
                if out.preempted:  # the last running request preempted itself: schedule again
                    continue
                if not feed.holds_pending_work():
                    raise ReplayError(self._stuck_message(out.step))
                yield from self._wait_for_arrival()  # P/D: a transfer's end wakes the engine
                continue
            start = self.now
            duration = self._duration(out)
            self.now = start + duration
            if out.offload_jobs:
                feed.offload_jobs_started(out.offload_jobs, start, self.now)
            yield env.timeout(duration)
            self._step_ended(out, start, duration)

    def _step_ended(self, out, start: int, duration: int) -> None:
        """Step `out`, from tick `start`, ended now (`duration` ticks later): the aborts that
        arrived while it ran first (vLLM takes them before its output), then its output, logged."""
        if self._client is not None:
            self._client.expire_during_step(self.now, [out])
        finished = self.scheduler.update_from_output(out)
        self.steps.add_step(out, start, duration)
        if self.latency_watch is not None:
            self.latency_watch.first_tokens(out, self.now)
        if finished:
            self._record_finished(finished)

    def _retire_offloaded(self) -> bool:
        """KV offloading: requests finished and none left: vLLM's engine schedules once more at
        once (its finished requests count as requests), and the connector stores what they left
        and retires them from the tier's recency then, not at the next arrival. True if it did."""
        offload = self.scheduler.offload
        if offload is None or not offload.has_finished_requests:
            return False
        out = self._schedule()
        self.scheduler.current_step = out.step  # (nothing ran: not a step)
        if out.offload_jobs:
            self.feed.offload_jobs_started(out.offload_jobs, self.now, self.now)
        return True

    def _carry_preemptions(self, work) -> None:
        """Preemptions of schedule() calls that ran nothing count on the next step that runs (or
        the first step of the next decode run), however late it is logged (async scheduling logs
        a step after scheduling the next)."""
        work.earlier_preemptions = self._unlogged_preemptions
        self._unlogged_preemptions = 0

    def _wait_for_arrival(self):
        """Sleep until the arrival process (or a fleet's router) wakes the engine; `now` moves to then."""
        self._idle = self.env.event()
        if self._engine_idle is not None:
            self._engine_idle.succeed()
        arrival = yield self._idle
        self._idle = None
        if arrival is not None:  # (None: woken to end)
            self.now = max(self.now, arrival)

    def _schedule(self, start: int | None = None):
        """schedule() the next step, which starts at tick `start` (now by default): the pulls it
        admits start then (async scheduling: when the step in flight ends)."""
        sched = self.scheduler
        try:
            out = sched.schedule()
        except LivelockError as exc:
            raise ReplayError(f"the engine cannot make progress at step {sched.current_step}: {exc}") from None
        if out.lora_adapters and self.adapters is not None:
            out.lora_load_s = self.adapters.activate(out.lora_adapters)
        if out.kv_loads is not None:
            self.feed.kv_loads_started(out.kv_loads, self.now if start is None else start)
        if out.is_empty:
            if out.preempted:  # (a request preempted itself and nothing ran)
                self._unlogged_preemptions += len(out.preempted)
        elif self._unlogged_preemptions:
            self._carry_preemptions(out)
        return out

    def _duration(self, out) -> int:
        """The step's duration in ticks. Under async scheduling with a backend that tells the
        host's share, max(device, host): the device's is the rest of the step."""
        host = self._host_seconds(len(out.chunks) + out.num_decode_reqs) if self._host_seconds is not None else 0.0
        if self._decode_line is not None and not out.chunks:
            host_ticks = to_ticks(host) if host else 0
            line = self._device_line(out.num_decode_reqs, host_ticks, (out.num_lora_tokens, out.lora_adapters))
            if self._capped_slopes is not None:
                line = self._with_capped(line, out.decode_capped_context_tokens)
            duration = max(line_ticks(line, out.decode_context_tokens), host_ticks)
        elif host:
            total = self.backend.execute(out)
            duration = to_ticks(max(total - host, host))
        else:
            duration = to_ticks(self.backend.execute(out))
        if out.num_swap_out_blocks or out.num_swap_in_blocks:
            duration += to_ticks((out.num_swap_out_blocks + out.num_swap_in_blocks) * self.swap_seconds_per_block)
        if out.lora_load_s:  # (the worker loads the step's adapters before its forward pass)
            duration += to_ticks(out.lora_load_s)
        return duration + self.encoder_ticks(out)

    def encoder_ticks(self, out) -> int:
        """The vision encoder's ticks in `out`'s step (run before the decoder's forward pass, on
        the first pipeline stage), counted in `encoder_seconds`, and under encoder disaggregation
        the embedding store's writes (an encode instance) or reads (counted in `store_seconds`);
        0 where nothing is encoded or loaded, or the encoder is not priced."""
        seconds = 0.0
        if out.encoder_item_embeds and self.vision_encoder is not None:
            seconds = self.vision_encoder.seconds(out.encoder_item_embeds)
            self.encoder_seconds += seconds
            if self.scheduler.ec_producer:
                seconds += sum(out.encoder_item_embeds) * self._store_seconds_per_embed
        if out.encoder_loaded_embeds and self._store_seconds_per_embed:
            loads = sum(out.encoder_loaded_embeds) * self._store_seconds_per_embed
            self.store_seconds += loads
            seconds += loads
        return to_ticks(seconds) if seconds else 0

    def _device_line(self, num_decodes: int, host_ticks: int = 0,
                     lora_load: tuple[int, tuple] = (0, ())) -> tuple[int, int, int, int]:
        """The decode line, plus the LoRA kernels of `lora_load` (tokens with an adapter, their
        distinct adapters) and less the host's share (async scheduling overlaps it), in ticks."""
        a0, a1, b0, b1 = self._decode_line(num_decodes)
        extra = -host_ticks
        if lora_load[0] and self._lora_seconds is not None:
            extra += to_ticks(self._lora_seconds(lora_load[0], len(lora_load[1])))
        return a0 + extra, a1, b0 + extra, b1

    def _run_adapters(self) -> tuple[int, tuple[int, ...]] | None:
        """LoRA: a decode run's (decoders with an adapter, their adapters), or None when some of
        the adapters are not in a GPU slot (the run's first step would load them: stepped alone)."""
        load = self.scheduler.lora_decode_load()
        if load[1] and self.adapters is not None and not self.adapters.all_active(load[1]):
            return None
        return load

    def _with_capped(self, line: tuple[int, int, int, int], capped: int) -> tuple[int, int, int, int]:
        """Sparse attention: `line` with the step's attended (capped) tokens in its intercepts."""
        a0, a1, b0, b1 = line
        c_a, c_b = self._capped_slopes
        return a0 + c_a * capped, a1, b0 + c_b * capped, b1

    def _run_shape(self, line: tuple[int, int, int, int], ctx: int, per_step: int,
                   capped: tuple[int, int] | None = None):
        """A decode run's per-step durations: `line` for its decodes attending `ctx` tokens in
        its first step, and `per_step` more in each next one (sparse attention, `capped`: and
        the tokens their queries attend, capped at top-k, first and more per step, the
        scheduler's `decode_run_capped`)."""
        a0, a1, b0, b1 = line
        if capped is None:
            return run_shape(a0 + a1 * ctx, a1 * per_step, b0 + b1 * ctx, b1 * per_step)
        (c_a, c_b), (first, capped_step) = self._capped_slopes, capped
        return run_shape(a0 + a1 * ctx + c_a * first, a1 * per_step + c_a * capped_step,
                         b0 + b1 * ctx + c_b * first, b1 * per_step + c_b * capped_step)

    def _run_capped(self) -> tuple[int, int] | None:
        """Sparse attention: the run's attended tokens (`_run_shape`'s `capped`); None otherwise."""
        return self.scheduler.decode_run_capped() if self._capped_slopes is not None else None

    def _plan_async_run(self, in_flight) -> tuple[int, int, tuple] | None:
        """A decode run for async scheduling: (its first step's start, its steps, its shape) or
        None. It starts when the step in flight ends, with nothing pending (no request waiting
        for a step's output to finish); its steps are plain decode steps, the last of which
        may sample some requests' last tokens. It ends before the next arrival: the step after
        it is scheduled at the run's end, as it would have been at the start of the run's last
        step, only if nothing arrived in between."""
        sched = self.scheduler
        limit = sched.decode_run_limit()  # (0 while a request waits for a step's output to finish)
        if limit < 2:
            return None
        start = self.now if in_flight is None else in_flight[1] + in_flight[2]
        adapters = self._run_adapters()
        if adapters is None:
            return None
        n, ctx, per_step = sched.decode_run_shape()
        host = to_ticks(self._host_seconds(n)) if self._host_seconds is not None else 0
        line = self._device_line(n, host, adapters)
        capped = self._run_capped()
        first = line if capped is None else self._with_capped(line, capped[0])
        if line_ticks(first, ctx) < host:
            return None  # host-bound: the steps last the host's time (stepped one by one)
        shape = self._run_shape(line, ctx, per_step, capped)
        next_arrival = self.feed.next_arrival_ticks()
        if next_arrival is not None:
            gap = next_arrival - start
            if gap <= 0:
                return None
            steps = steps_to_reach(shape, gap, limit)
            if run_ticks(shape, steps) >= gap:
                steps -= 1
            limit = steps
            if limit < 2:
                return None
        return start, limit, shape, adapters[1]

    def _close_async_run(self, run, start: int, shape):
        """After a decode run (the clock at its end): its last step's output is processed after
        the next step has been scheduled, as the batch queue orders them. Nothing arrived
        since the last step started, so scheduling the next one now is the same. Returns the
        step now in flight (or None) and logs the run."""
        sched = self.scheduler
        last = run.start_step + run.num_steps - 1
        if not sched.finish_due(last):
            self.steps.add_run(run, start, shape)
            return None  # nothing to process: the loop goes on as after any step
        out = self._schedule()
        queued = None if out.is_empty else (out, self.now, self._duration(out))
        if out.offload_jobs:  # (KV offloading: this step's transfers)
            self.feed.offload_jobs_started(out.offload_jobs, self.now, self.now + (queued[2] if queued else 0))
        finished, run.last_num_blocks_used_end = sched.step_output_processed(last)
        run.finished = finished
        self.steps.add_run(run, start, shape)
        if finished:
            self._record_finished(finished)
        return queued

    def _engine_async(self):
        """vLLM's async scheduling (EngineCore.step_with_batch_queue, two batches deep): the
        next step is scheduled as soon as the one before it is launched, so a step sees the
        requests that arrived by the start of the step before it, and the output of that step
        is processed (tokens delivered, finished requests freed) only after. The device runs
        the steps back to back; a backend that tells the host's share of a step
        (`host_seconds`) has it overlapped: the step lasts max(device time, host time)."""
        sched = self.scheduler
        feed = self.feed
        env = self.env
        in_flight = None  # (output, start tick, duration): the step on the device
        while True:
            feed.deliver_until(self.now)
            if feed.num_rejected != self._num_rejected_reported:
                self._report_rejected()
            if self.use_decode_runs and (in_flight is not None or sched.has_unfinished_requests()):
                plan = self._plan_async_run(in_flight)
                if plan is not None:
                    start, num_steps, shape, adapters = plan
                    after_in_flight = in_flight is not None
                    if after_in_flight:  # its output changes nothing: nobody finishes in it
                        yield from self._complete(in_flight)
                        in_flight = None
                    run = sched.advance_decode_run(num_steps, finish=False, after_in_flight=after_in_flight)
                    if run is not None and adapters:
                        self.adapters.activate(adapters)  # (all in slots: their steps only touch them)
                    if run is not None and self._unlogged_preemptions:
                        self._carry_preemptions(run)
                    if run is not None:
                        end = start + run_ticks(shape, run.num_steps)
                        self.busy_until = end
                        yield env.timeout(end - self.now)
                        self.now = end
                        in_flight = self._close_async_run(run, start, shape)
                        continue
                    # (no step of it fits the pool: the step is scheduled normally, and preempts)
            queued = None
            if sched.has_unfinished_requests():
                start = self.now if in_flight is None else in_flight[1] + in_flight[2]
                out = self._schedule(start)
                duration = self._duration(out) if not out.is_empty else 0
                if out.offload_jobs:
                    feed.offload_jobs_started(out.offload_jobs, start, start + duration)
                if not out.is_empty:
                    queued = (out, start, duration)
                    if in_flight is None:
                        in_flight = queued
                        continue  # the queue has room: schedule the next step at once
                elif in_flight is None:
                    if out.preempted:  # the last running request preempted itself: schedule again
                        continue
                    if sched.settle_run_step():  # (a decode run's last step: its output changes nothing)
                        continue
                    if not feed.holds_pending_work():
                        raise ReplayError(self._stuck_message(out.step))
                    yield from self._wait_for_arrival()  # P/D: a transfer's end wakes the engine
                    continue
            elif in_flight is None:
                if self._retire_offloaded():
                    continue
                if feed.exhausted:
                    return
                yield from self._wait_for_arrival()
                continue
            yield from self._complete(in_flight)
            in_flight = queued

    def _complete(self, in_flight):
        """Wait for the step on the device to end, then process its output and log it."""
        out, start, duration = in_flight
        end = start + duration
        self.busy_until = end
        yield self.env.timeout(end - self.now)
        self.now = end
        self._step_ended(out, start, duration)

    def _decode_run(self) -> tuple[int, list[Request]] | None:
        """Jump over the decode run ahead, if any: (its end tick, the requests it finished).
        The run stops after the step during which (or at whose end) the next request arrives."""
        sched = self.scheduler
        limit = sched.decode_run_limit()
        if limit < 2:
            return None
        adapters = self._run_adapters()
        if adapters is None:
            return None
        n, ctx, per_step = sched.decode_run_shape()
        shape = self._run_shape(self._device_line(n, 0, adapters), ctx, per_step, self._run_capped())
        next_arrival = self.feed.next_arrival_ticks()
        if next_arrival is not None:
            limit = steps_to_reach(shape, next_arrival - self.now, limit)
            if limit < 2:
                return None
        if self._client is not None:  # a step during which a client gives up runs alone (its aborts come before its output)
            deadline = self._client.next_deadline_ticks()
            if deadline is not None and run_ticks(shape, limit) > deadline - self.now:
                limit -= 1
                if limit < 2:
                    return None
        run = sched.advance_decode_run(limit)
        if run is None:
            return None
        if adapters[1]:
            self.adapters.activate(adapters[1])  # (all in slots: their steps only touch them)
        if self._unlogged_preemptions:
            self._carry_preemptions(run)
        self.steps.add_run(run, self.now, shape)
        return self.now + run_ticks(shape, run.num_steps), run.finished

    def _record_finished(self, finished: list[Request]) -> None:
        for request in finished:
            self.feed.log_finished(request, self.now)
        if finished:
            self.feed.note_finished(finished, self.now)
            if self.latency_watch is not None:
                self.latency_watch.finished(finished, self.now)
            self._num_done += len(finished)
            if self.on_progress is not None:
                self.on_progress(len(finished))

    def _report_rejected(self) -> None:
        new = self.feed.num_rejected - self._num_rejected_reported
        if new and self.on_progress is not None:
            self.on_progress(new)
        self._num_rejected_reported = self.feed.num_rejected

    def _stuck_message(self, step: int) -> str:
        sched = self.scheduler
        head = sched.waiting.peek_request() if sched.num_waiting() else None
        why = ""
        slots = sched.spec_draft_slots
        left = head.num_tokens - head.num_computed_tokens if head is not None else 0
        if head is not None and not sched.enable_chunked_prefill and left + slots > sched.max_num_batched_tokens:
            why = (f"; without chunked prefill its {left:,} tokens"
                   + (f" and {slots} drafting slot{'s' * (slots > 1)}" if slots else "")
                   + f" never fit max_num_batched_tokens = {sched.max_num_batched_tokens:,} (vLLM would wait "
                   "forever): raise it or enable chunked prefill")
        elif head is not None and not sched.enable_chunked_prefill and left > sched.max_num_scheduled_tokens:
            why = (f"; without chunked prefill its {left:,} tokens never fit max_num_scheduled_tokens = "
                   f"{sched.max_num_scheduled_tokens:,} (vLLM would wait forever): raise it or enable chunked prefill")
        return (f"the engine cannot make progress at step {step}: {len(sched.running)} running, "
                f"{sched.num_waiting()} waiting (head: {head}), "
                f"{sched.kv_cache_manager.block_pool.get_num_free_blocks()} free blocks{why}")
