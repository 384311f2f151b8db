"""`replay()`: the library entry point that the CLI and the studies call."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.backends.factory import make_backend
from simkv.capacity import compute_capacity
from simkv.config import ConfigError, EngineConfig
from simkv.replay.engine import ReplayEngine, ReplayRun
from simkv.replay.fleet import fleet_summary, fleet_tables, run_fleet
from simkv.replay.classes import classes_summary, missing_class, trace_labels, with_trace_columns
from simkv.replay.goodput import check_slo_classes, goodput_summary, judge
from simkv.replay.pipeline import pipeline_summary
from simkv.replay.results import (class_itl, frontend_latency, latencies_and_rates, request_table, summarize,
                                  token_gap_table, write_outputs)
from simkv.replay.router import Router, RouterError, RouterOptions


@dataclass(frozen=True)
class FleetSpec:
    """Replicas of the engine behind a router (`simkv replay --replicas N --router POLICY`). `router`
    None: the default, round_robin for replicas; on one engine of data-parallel ranks vLLM's own
    balancer, and a router named puts that router in front of the ranks instead."""
    num_replicas: int = 1
    router: str | None = None
    options: RouterOptions = RouterOptions()
    class_replicas: tuple = ()  # ((request class, replicas), ...): classes with replicas of their own (router.py)
    # ((replicas, ((engine option, value), ...)), ...): replicas whose engines differ from the others
    # (another GPU, TP size, batch limits: `--replica-set 2-3:gpu=H200`); the rest run the common options
    replica_sets: tuple = ()
    # AutoscaleSpec (simkv/replay/autoscale.py): num_replicas slots, as many up as the load asks for
    autoscale: object = None
    # FailureSpec (simkv/replay/failures.py): replicas that fail and come back
    failures: object = None

    def __post_init__(self) -> None:
        if self.failures is not None:
            scales = self.autoscale is not None
            if self.class_replicas:
                raise RouterError("--replica-failure is not modelled yet with --class-replicas")
            if self.num_replicas < 2 and not scales:
                raise RouterError("--replica-failure: a fleet of one replica has nowhere to send requests while it "
                                  "is down (give --replicas 2 or more)")
            self.failures.check_fleet(self.num_replicas, fixed=not scales)
        if self.autoscale is not None:
            if self.autoscale.max_replicas != self.num_replicas:
                raise RouterError(f"--autoscale {self.autoscale.min_replicas}-{self.autoscale.max_replicas}: the "
                                  f"fleet has {self.num_replicas} replicas (MAX is the fleet's size)")
            if self.class_replicas:
                raise RouterError("--autoscale: replicas of a class's own (--class-replicas) are not modelled in "
                                  "a fleet that scales")
        # (RouterError, a ValueError, names what is wrong; on one engine, class replicas number the
        # data-parallel ranks, checked where the ranks' router is made)
        Router(self.policy, self.num_replicas, self.options,
               class_replicas=self.class_replicas if self.num_replicas > 1 else ())
        seen: set[int] = set()
        for replicas, _ in self.replica_sets:
            for r in replicas:
                if not 0 <= r < self.num_replicas:
                    raise RouterError(f"--replica-set: replica {r} is not one of the fleet's 0-{self.num_replicas - 1}")
                if r in seen:
                    raise RouterError(f"--replica-set: replica {r} is in two sets")
                seen.add(r)

    @property
    def nodes_fail(self) -> bool:
        """The GPU nodes under its autoscaled replicas fail (node_mtbf_s)."""
        return self.autoscale is not None and self.autoscale.node_mtbf_s is not None

    @property
    def fails(self) -> bool:
        """Its replicas fail (--replica-failure, --replica-mtbf-s), or their nodes do."""
        return self.failures is not None or self.nodes_fail

    @property
    def loses_requests(self) -> bool:
        """Requests in flight can be lost: its replicas or nodes fail, or a scale-down ends a
        replica before it has drained (--shutdown-timeout)."""
        return self.fails or (self.autoscale is not None and self.autoscale.kill_after_s is not None)

    def replica_configs(self, base: EngineConfig) -> list[EngineConfig] | None:
        """Each replica's engine config where replica sets differ (None: every replica runs `base`);
        ConfigError naming the set whose options do not build or change what every replica
        must share (max_model_len: the router refuses a prompt for the fleet)."""
        if not self.replica_sets:
            return None
        from simkv.config import ConfigError

        configs = [base] * self.num_replicas
        for replicas, options in self.replica_sets:
            where = f"--replica-set {','.join(map(str, replicas))}"
            try:
                config = EngineConfig.from_flat(base.given_options() | dict(options))
            except (ConfigError, TypeError, ValueError) as exc:
                raise ConfigError(f"{where}: {exc}") from None
            if config.max_model_len != base.max_model_len:
                raise ConfigError(f"{where}: max_model_len {config.max_model_len} differs from the fleet's "
                                  f"{base.max_model_len}; every replica takes the same prompts (give max_model_len)")
            if config.hardware.data_parallel_size > 1:
                raise ConfigError(f"{where}: data-parallel ranks in a fleet are not modelled")
            if config.scheduler.enable_lora != base.scheduler.enable_lora:
                raise ConfigError(f"{where}: enable_lora differs from the fleet's; every replica takes the same "
                                  "requests, adapters or not")
            for r in replicas:
                configs[r] = config
        return configs

    @property
    def policy(self) -> str:
        """The replicas' router."""
        return self.router or "round_robin"

    def to_dict(self) -> dict:
        """As records (goodput.json) keep it."""
        out = {"num_replicas": self.num_replicas, "router": self.policy, "router_options": self.options.to_dict()}
        if self.class_replicas:
            out["class_replicas"] = {name: list(rs) for name, rs in self.class_replicas}
        if self.replica_sets:
            out["replica_sets"] = [{"replicas": list(rs), "options": dict(opts)} for rs, opts in self.replica_sets]
        if self.autoscale is not None:
            out["autoscale"] = self.autoscale.to_dict()
        return out


@dataclass
class ReplayResult:
    summary: dict
    requests: pd.DataFrame
    steps: dict
    run: ReplayRun  # a fleet's first replica
    fleet_runs: list[ReplayRun] | None = None  # a fleet's replicas, in order


@contextmanager
def collector_paused(pause: bool = True):
    """Pause Python's cyclic garbage collector. The engine creates no reference cycles per
    step (tests/replay/test_replay.py checks), so reference counting frees what a replay
    drops, and the collector would only walk the pool's blocks and the logs over and over."""
    collecting = pause and gc.isenabled()
    if collecting:
        gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def retries_have_use(config: EngineConfig, fleet: FleetSpec | None) -> bool:
    """Something for the clients' retries (client_max_retries) to retry: time-outs, a queue
    limit's HTTP 503s, or failing replicas or nodes."""
    return config.scheduler.has_clients or (fleet is not None and fleet.loses_requests)


def replay(trace, config: EngineConfig, cost_model: str = "roofline", cost_options: dict | None = None,
           use_decode_runs: bool = True, on_progress=None, backend=None,
           pause_collector: bool = True, goodput: dict | None = None, fleet: FleetSpec | None = None,
           disaggregation=None, encode=None) -> ReplayResult:
    """`pause_collector=False` keeps Python's cyclic collector running (a real backend, whose
    steps are not ours to vouch for, passes it; its timer pauses the collector per step).
    `goodput`: latency SLOs in ms (`simkv/replay/goodput.py`); the summary then says which
    requests met them (`summary["goodput"]`). `fleet`: replay on that many replicas behind a
    router (simkv/replay/fleet.py); one replica is the plain replay. `disaggregation`: a
    `DisaggregationSpec`, a prefill pool and a decode pool (simkv/replay/disaggregated.py).
    `encode`: an `EncodeSpec`, encode instances in front (simkv/replay/encode_pool.py).
    A trace with request classes (simkv/replay/classes.py) gets them in its request table and
    its summary's `classes`."""
    check_slo_classes(goodput, trace_labels(trace), str(getattr(trace, "source", "") or "the trace"))
    _check_class_replicas(trace, config, fleet, disaggregation, encode)
    sc = config.scheduler
    if sc.client_max_retries and not retries_have_use(config, fleet):
        raise ConfigError("client_max_retries retries requests that timed out: give client_timeout_s or "
                          "client_ttft_timeout_s too (or a queue limit, max_num_queued_reqs or "
                          "max_num_queued_tokens, whose HTTP 503s the clients retry, or --replica-failure, "
                          "--node-mtbf-s or --shutdown-timeout, whose lost requests they retry)")
    result = _replay(trace, config, cost_model, cost_options, use_decode_runs, on_progress, backend, pause_collector,
                     fleet, disaggregation, encode)
    requests = result.requests = with_trace_columns(result.requests, trace)
    duration = result.summary["duration_s"]
    judged = judge(requests, goodput) if goodput else None
    result.summary |= classes_summary(requests, duration, judged.good if judged is not None else None,
                                      class_itl(result.fleet_runs or [result.run]))
    if judged is not None:
        result.summary["goodput"] = goodput_summary(requests, goodput, duration, judged)
    return result


def _replay(trace, config: EngineConfig, cost_model, cost_options, use_decode_runs, on_progress, backend,
            pause_collector, fleet, disaggregation, encode) -> ReplayResult:
    _check_lora(trace, config, disaggregation)
    _check_client_concurrency(trace, config, encode)
    config = _multimodal_config(trace, config, backend, disaggregation)
    if encode is not None:
        return _replay_with_encode_pool(trace, config, cost_model, cost_options, use_decode_runs, on_progress,
                                        pause_collector, fleet, disaggregation, encode, backend)
    # (under P/D the front end that refuses is the prefill pool's: its config carries the limits)
    _check_queue_limits(trace, disaggregation.pool_configs(config)[0] if disaggregation is not None else config,
                        fleet)
    if backend is not None and config.hardware.pipeline_parallel_size > 1:
        raise ValueError("the GPU backend runs the model on one device: replay pipeline_parallel_size on a cost model")
    if backend is not None and config.cache.kv_offloading_size is not None:
        raise ValueError("the GPU backend does not run KV offloading's transfers; replay kv_offloading_size on a "
                         "cost model")
    if disaggregation is not None:
        if backend is not None or (fleet is not None and fleet.num_replicas > 1):
            raise ValueError("a disaggregated replay sets its pools' replicas itself, on cost models only")
        return _replay_disaggregated(trace, config, cost_model, cost_options or {}, use_decode_runs, on_progress,
                                     pause_collector, disaggregation)
    capacity = compute_capacity(config)
    if config.hardware.data_parallel_size > 1:
        if fleet is not None and fleet.num_replicas > 1:
            raise ValueError(f"data_parallel_size {config.hardware.data_parallel_size} with {fleet.num_replicas} "
                             "replicas (--replicas): DP ranks are one engine; a fleet of DP engines is not modelled "
                             "(--router picks the rank instead)")
        if backend is not None or cost_model != "roofline":
            raise ValueError("data_parallel_size > 1 replays one engine's lockstep ranks on the roofline cost model "
                             "(not another cost model or the GPU backend)")
        router = None  # (vLLM's own balancer) or the external router named in front of the ranks
        if fleet is not None and fleet.router is not None:
            router = Router(fleet.router, config.hardware.data_parallel_size, fleet.options,
                            cache_tokens_per_replica=capacity.num_gpu_blocks * config.kv_manager_block_size,
                            class_replicas=fleet.class_replicas)
        return _replay_data_parallel(trace, config, cost_options or {}, on_progress, pause_collector,
                                     capacity, router)
    if fleet is not None and fleet.num_replicas > 1:
        if backend is not None:
            raise ValueError("a fleet replays on cost models only (one backend per replica)")
        return _replay_fleet(trace, config, cost_model, cost_options or {}, use_decode_runs, on_progress,
                             pause_collector, fleet, capacity)
    if backend is None:
        backend = make_backend(cost_model, config, **(cost_options or {}))
    with collector_paused(pause_collector):
        engine = ReplayEngine(trace, config, backend, capacity.num_gpu_blocks, use_decode_runs, on_progress,
                              capacity=capacity)
        t0 = time.perf_counter()
        run = engine.run()
        wall = time.perf_counter() - t0
        requests = request_table(run, trace, frontend_latency(backend))
        summary = summarize(run, trace, config, backend, capacity, wall, requests)
        steps = run.steps.columns()
    return ReplayResult(summary, requests, steps, run)


def _replay_with_encode_pool(trace, config, cost_model, cost_options, use_decode_runs, on_progress, pause_collector,
                             fleet, disaggregation, encode, backend) -> ReplayResult:
    """Encoder disaggregation in two passes (simkv/replay/encode_pool.py): the encode pool on
    the requests with images, then the engines, each of those requests arriving when the proxy
    sends it on and loading its embeddings; latencies counted from the client's send."""
    from simkv.replay.encode_pool import check_encode_pool, client_view, delayed_trace, run_encode_pool

    check_encode_pool(trace, config, backend, fleet)
    t0 = time.perf_counter()
    with collector_paused(pause_collector):
        ready, section = run_encode_pool(trace, config, encode)  # (the progress bar counts the engines' requests)
    engines_trace, order = delayed_trace(trace, ready)
    result = replay(engines_trace, encode.consumer_config(config), cost_model, cost_options, use_decode_runs,
                    on_progress, None, pause_collector, None, fleet, disaggregation)
    requests = client_view(result.requests, trace, order)
    summary = result.summary
    summary["trace"] = str(trace.source)
    summary |= latencies_and_rates(requests, summary["itl_s"], summary["duration_s"], time.perf_counter() - t0)
    summary["encode_pool"] = section
    return ReplayResult(summary, requests, result.steps, result.run, result.fleet_runs)


def _check_class_replicas(trace, config: EngineConfig, fleet, disaggregation, encode) -> None:
    """Replicas of a class's own (`FleetSpec.class_replicas`) route a fleet by the trace's
    request_class, and data-parallel ranks behind an external router (their numbers then the
    ranks'), and each P/D pool (`DisaggregationSpec.prefill_class_replicas`, ...); with vLLM's
    own DP balancer they are not modelled. Behind encode instances the engines' pass routes as
    without them (the instances themselves are shared by every class)."""
    if disaggregation is not None and disaggregation.class_names:
        decode_dp = disaggregation.pool_configs(config)[1].hardware.data_parallel_size
        if disaggregation.decode_class_replicas and decode_dp > 1:
            raise ValueError("decode class_replicas: the decode pool's data-parallel ranks are behind vLLM's own "
                             "DP balancer, which picks ranks by load, not by request class")
        _check_classes_in(trace, disaggregation.class_names)
    if fleet is None or not fleet.class_replicas:
        return
    if config.hardware.data_parallel_size == 1 and fleet.num_replicas == 1:
        raise ValueError("class_replicas: one engine has no replicas to give a class (--replicas N, or "
                         "data-parallel ranks behind a router)")
    if config.hardware.data_parallel_size > 1 and fleet.router is None:
        raise ValueError("class_replicas on data-parallel ranks: vLLM's own DP balancer picks ranks by load, not by "
                         "request class; put the ranks behind an external router (--router round_robin, "
                         "least_outstanding or prefix_aware: vLLM's --data-parallel-external-lb)")
    if disaggregation is not None:
        raise ValueError("class_replicas (replicas of a request class's own) is not modelled with P/D pools as a "
                         "fleet's: give each pool's (prefill:CLASS=REPLICAS, decode:CLASS=REPLICAS)")
    _check_classes_in(trace, [name for name, _ in fleet.class_replicas])


def _check_classes_in(trace, names: list[str]) -> None:
    """The trace labels its requests with every one of these classes."""
    if trace.request_class is None:
        raise ValueError(f"{trace.source}: class_replicas routes by request class, and the trace has none (no "
                         "request_class column; label it with simkv trace merge or trace transform --request-class)")
    missing = missing_class(names, trace.request_class)
    if missing is not None:
        raise ValueError(f"class_replicas: {trace.source} {missing[1]}")


def _check_lora(trace, config: EngineConfig, disaggregation) -> None:
    """A trace naming LoRA adapters needs --enable-lora (vLLM refuses such requests without it)."""
    from simkv.traces.lora import has_adapters

    if has_adapters(trace) and not config.scheduler.enable_lora:
        raise ValueError(f"{trace.source}: column 'lora_name' names LoRA adapters: give --enable-lora "
                         f"(and --max-loras, vLLM's default 1), as vLLM refuses them without it")


def _multimodal_config(trace, config: EngineConfig, backend, disaggregation) -> EngineConfig:
    """A trace with multimodal items (simkv/core/encoder_cache.py): the config with
    mm_max_tokens_per_item in force (given, else the model's, else the trace's largest item),
    which sizes vLLM's encoder budget and cache. One below an item of the trace is refused, as
    vLLM's processor never makes such an item."""
    largest = trace.max_mm_item_tokens() if getattr(trace, "mm_items", None) is not None else 0
    if not largest:
        return config
    if backend is not None:
        raise ValueError(f"{trace.source}: multimodal items (mm_* columns): the GPU backend runs a text-only model "
                         "without the vision encoder; replay them on a cost model")
    if config.hardware.language_model_only:
        raise ValueError(f"{trace.source}: multimodal items (mm_* columns): --language-model-only serves "
                         f"{config.hardware.model} as text only, and vLLM refuses a prompt with images then (each "
                         "modality's limit is 0)")
    limit = config.scheduler.limit_mm_per_prompt
    if limit is not None:
        counts = np.diff(trace.mm_item_offsets)
        if counts.max() > limit:
            row = int(np.argmax(counts > limit))
            raise ValueError(f"{trace.source}: column 'mm_lengths', request {trace.request_id[row]}: "
                             f"{int(counts[row])} images in one prompt, and vLLM's API server answers 400 past "
                             f"--limit-mm-per-prompt ({limit}): \"At most {limit} image(s) may be provided in one "
                             "prompt.\" Raise the limit or trim the trace")
    hw = config.hardware
    sc = config.scheduler
    if sc.mm_max_tokens_per_item is None:
        given = hw.model_spec().mm_max_tokens_per_item or largest
        config = dataclasses.replace(config, scheduler=dataclasses.replace(sc, mm_max_tokens_per_item=given))
        sc = config.scheduler
    pools = disaggregation.pool_configs(config) if disaggregation is not None else (config,)
    for pool in pools:  # (P/D: each pool's engines schedule the items with their own token budget)
        if pool.scheduler.disable_chunked_mm_input:
            _check_unchunked_items_fit(trace, pool, largest)
    if sc.mm_max_tokens_per_item < largest:
        k = int(np.argmax(trace.mm_items[:, 1]))
        row = int(np.searchsorted(trace.mm_item_offsets, k, side="right") - 1)
        raise ValueError(f"{trace.source}: column 'mm_lengths', request {trace.request_id[row]}: an item of "
                         f"{largest} tokens exceeds mm_max_tokens_per_item ({sc.mm_max_tokens_per_item}), the most "
                         "the model's processor makes of one item")
    return config


def _check_unchunked_items_fit(trace, config: EngineConfig, largest: int) -> None:
    """disable_chunked_mm_input: a chunk must hold a whole item and, under speculative decoding,
    the drafter's read-ahead before it (vLLM rolls a chunk back to that many tokens before the
    item). vLLM 0.33 accepts an item larger than a request's share of a step, but never schedules
    its request (or, over the long-prefill threshold, never while other requests are around): refused."""
    sc = config.scheduler
    shift = config.num_prefill_lookahead
    slots = config.speculative.draft_slots if config.speculative.enabled else 0
    per_request = min(sc.max_num_scheduled_tokens or sc.max_num_batched_tokens, sc.max_num_batched_tokens - slots)
    limits = [(per_request, f"a request's share of a step ({per_request})")]
    if sc.long_prefill_token_threshold > 0:
        limits.append((sc.long_prefill_token_threshold,
                       f"long_prefill_token_threshold ({sc.long_prefill_token_threshold}) while other requests are "
                       "around"))
    for limit, what in limits:
        if largest + shift > limit:
            ahead = f" and the drafter's read-ahead of {shift}" if shift else ""
            raise ValueError(f"{trace.source}: disable_chunked_mm_input with an item of {largest} tokens{ahead}: a "
                             f"chunk must hold them whole, more than {what}; vLLM 0.33 accepts it but rolls every "
                             "chunk that reaches the item back before it and never schedules that request; raise the "
                             "budget or the threshold")


def _check_client_concurrency(trace, config: EngineConfig, encode) -> None:
    """A client's concurrency limit (vllm bench serve's --max-concurrency) is modelled in front
    of one engine, a fleet, data-parallel ranks or a P/D pair, with clients that give up or retry,
    with vLLM's admission control and with sessions paced on their replies; a limit on the
    conversations in progress needs a trace with sessions."""
    sc = config.scheduler
    if sc.client_max_active_sessions is not None and trace.session_id is None:
        raise ValueError(f"{trace.source}: client_max_active_sessions limits the conversations in progress, and the "
                         "trace has none (no session_id column)")
    if sc.client_request_rate is not None and trace.session_id is None:
        raise ValueError(f"{trace.source}: client_request_rate paces the clients of conversations, and the trace "
                         "has none (no session_id column)")
    if sc.client_early_stop and trace.session_id is None:
        raise ValueError(f"{trace.source}: client_early_stop stops a client when its conversations run out, and the "
                         "trace has none (no session_id column)")
    if encode is not None and (sc.client_max_concurrency is not None or sc.client_max_inflight_tokens is not None):
        raise ValueError("client_max_concurrency / client_max_inflight_tokens (a client's limits on what is in "
                         "flight) are not modelled with encode instances yet")


def _check_queue_limits(trace, config: EngineConfig, fleet) -> None:
    """vLLM's API-server admission control (simkv/replay/admission.py) is modelled for one
    engine, a fleet (its clients may retry: the router routes the retry), data-parallel ranks
    whose clients do not retry and a P/D prefill pool (`config` is then the pool's). A request
    refused for good is done with, as a rejected one: paced on replies or on a concurrency
    limit, it releases the next."""
    sc = config.scheduler
    if sc.max_num_queued_reqs is None and sc.max_num_queued_tokens is None:
        return
    unsupported = [(config.hardware.data_parallel_size > 1 and sc.has_clients,
                    "data-parallel ranks whose clients retry")]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"max_num_queued_reqs / max_num_queued_tokens (vLLM's admission control) are not "
                             f"modelled with {what} yet")


def _replay_fleet(trace, config, cost_model, cost_options, use_decode_runs, on_progress, pause_collector,
                  fleet: FleetSpec, capacity) -> ReplayResult:
    configs = fleet.replica_configs(config) or [config] * fleet.num_replicas
    capacities = [capacity if c is config else compute_capacity(c) for c in configs]
    router = Router(fleet.policy, fleet.num_replicas, fleet.options,
                    cache_tokens_per_replica=[cap.num_gpu_blocks * c.kv_manager_block_size
                                              for c, cap in zip(configs, capacities)],
                    class_replicas=fleet.class_replicas)
    seed = cost_options.get("noise_seed", 0)  # replicas' step noise: independent draws
    backends = [make_backend(cost_model, configs[r], **(cost_options | {"noise_seed": seed + r}))
                for r in range(fleet.num_replicas)]
    replicas = (configs, capacities) if fleet.replica_sets else None
    autoscaler = None
    if fleet.autoscale is not None:
        from simkv.replay.autoscale import Autoscaler

        autoscaler = Autoscaler(fleet.autoscale)
    failures = None
    if fleet.loses_requests:  # (lost requests' clients: FailurePlan counts what failures lose)
        from simkv.replay.failures import FailurePlan, FailureSpec

        arrivals = np.asarray(trace.arrival_time_s, dtype=np.float64)
        span = float(arrivals.max()) if len(arrivals) else 0.0  # (random failures over the arrivals)
        given = fleet.failures if fleet.failures is not None else FailureSpec(())  # (nodes' failures, or none)
        failures = FailurePlan(given, given.drawn(fleet.num_replicas, span, autoscaler is None))
        if autoscaler is not None:  # (its slots restart in place)
            autoscaler.schedule_failures(failures)
    with collector_paused(pause_collector):
        t0 = time.perf_counter()
        runs, routing = run_fleet(trace, config, backends, capacity.num_gpu_blocks, router, capacity,
                                  use_decode_runs, on_progress, replicas=replicas, autoscaler=autoscaler,
                                  failures=failures)
        wall = time.perf_counter() - t0
        requests, steps, per_replica = fleet_tables(runs, routing, trace, frontend_latency(backends[0]))
        summary = fleet_summary(runs, routing, trace, config, backends, capacity, wall, requests, per_replica,
                                replicas=replicas)
    if fleet.replica_sets:
        summary["fleet"]["replica_sets"] = fleet.to_dict()["replica_sets"]
    if fleet.failures is not None:
        summary["fleet"]["failures"] = failures.section()
    if autoscaler is not None:
        from simkv.replay.autoscale import autoscaling_section

        summary["fleet"]["autoscaling"] = autoscaling_section(autoscaler, summary["duration_s"], routing.loads_at,
                                                              configs, summary["fleet"]["replicas"])
        if fleet.nodes_fail:  # (what the nodes that failed took with them)
            summary["fleet"]["autoscaling"]["nodes"] |= {"requests_lost": failures.node_aborted,
                                                         "requests_failed": failures.node_failed}
    return ReplayResult(summary, requests, steps, runs[0], runs)


def _replay_data_parallel(trace, config, cost_options, on_progress, pause_collector,
                          capacity, router=None) -> ReplayResult:
    from simkv.replay.data_parallel import run_data_parallel

    backend = make_backend("roofline", config, **cost_options)
    with collector_paused(pause_collector):
        t0 = time.perf_counter()
        runs, routing = run_data_parallel(trace, config, backend, capacity.num_gpu_blocks, capacity, on_progress,
                                          router)
        wall = time.perf_counter() - t0
        requests, steps, per_rank = fleet_tables(runs, routing, trace)
        summary = fleet_summary(runs, routing, trace, config, [backend] * len(runs), capacity, wall, requests,
                                per_rank)
        fleet_part = summary.pop("fleet")
        summary["data_parallel"] = {"data_parallel_size": fleet_part["num_replicas"], "router": fleet_part["router"],
                                    "ranks": fleet_part["replicas"]}
        cadence = getattr(routing, "cadence", None)  # (the waves' tails: passes with no rank's requests)
        if cadence is not None:
            summary["data_parallel"] |= {"dp_sync_interval": cadence.sync_interval,
                                         "wave_tail_dummy_passes": cadence.num_dummy_passes}
        summary |= pipeline_summary(runs[0], summary["duration_s"])  # (the group's stages: one set of clocks)
    return ReplayResult(summary, requests, steps, runs[0], runs)


def _replay_disaggregated(trace, config, cost_model, cost_options, use_decode_runs, on_progress, pause_collector,
                          spec) -> ReplayResult:
    from simkv.replay.disaggregated import check_pull_fits, run_disaggregated
    from simkv.replay.disaggregated_results import pd_summary, pd_tables

    configs = spec.pool_configs(config)
    capacities = [compute_capacity(c) for c in configs]
    check_pull_fits(configs[1], capacities[1])
    seed = cost_options.get("noise_seed", 0)
    backends, k = [], 0
    for pool_config, n in zip(configs, (spec.num_prefill, spec.num_decode)):
        backends.append([make_backend(cost_model, pool_config, **(cost_options | {"noise_seed": seed + k + r}))
                         for r in range(n)])
        k += n
    with collector_paused(pause_collector):
        t0 = time.perf_counter()
        run = run_disaggregated(trace, spec, configs[0], configs[1], backends[0], backends[1], capacities[0],
                                capacities[1], use_decode_runs, on_progress)
        wall = time.perf_counter() - t0
        backends[1] = backends[1] * (len(run.decode_runs) // len(backends[1]))  # (a data-parallel pool: one per rank)
        requests, steps, prefill_requests, per_prefill, per_decode = pd_tables(run, trace,
                                                                               frontend_latency(backends[1][0]))
        summary = pd_summary(run, trace, spec, configs, backends, capacities, wall, requests, prefill_requests,
                             per_prefill, per_decode)
    if spec.prefill_autoscale is not None or spec.decode_autoscale is not None:
        _pools_autoscaling(summary, run.routing, configs)
    return ReplayResult(summary, requests, steps, run.decode_runs[0], run.decode_runs)


def _pools_autoscaling(summary: dict, routing, configs) -> None:
    """P/D pools that scale (simkv/replay/autoscale.py): each one's section, and the GPU-hours
    both pools paid (a pool that does not scale: its replicas the whole replay)."""
    from simkv.replay.autoscale import autoscaling_section
    from simkv.studies.serving_cost import engine_gpus

    duration = summary["duration_s"]
    gpu_hours = replicas_up = 0.0
    nodes = None  # (the nodes under the pools that scale, shared: paid once)
    by_gpu: Counter = Counter()  # (GPU-hours per kind)
    for pool, pool_routing, pool_config in (("prefill", routing.prefill, configs[0]),
                                            ("decode", routing.decode, configs[1])):
        section = summary["disaggregation"][pool]
        n = len(section["replicas"])
        if pool_routing.autoscaler is None:
            hours = n * engine_gpus(pool_config) * duration / 3600.0
            gpu_hours += hours
            by_gpu[pool_config.hardware.gpu] += hours
            replicas_up += n
            continue
        scaling = section["autoscaling"] = autoscaling_section(pool_routing.autoscaler, duration,
                                                               pool_routing.loads_at, [pool_config] * n,
                                                               section["replicas"], nodes=False)
        nodes = pool_routing.autoscaler.nodes or nodes
        if nodes is None:
            gpu_hours += scaling["gpu_hours"]
            by_gpu.update(scaling["gpu_hours_by_gpu"])
        replicas_up += scaling["mean_ready"]
    paid_nodes = None  # (the replicas' GPU-hours in each pool's section; the nodes' paid here)
    if nodes is not None:
        from simkv.clock import to_ticks

        paid_nodes = nodes.section(to_ticks(duration))
        gpu_hours += paid_nodes["gpu_hours"]
        by_gpu.update(paid_nodes["gpu_hours_by_gpu"])
    totals = {"gpu_hours": gpu_hours, "mean_replicas_up": replicas_up, "gpu_hours_by_gpu": dict(by_gpu)}
    summary["disaggregation"]["autoscaling"] = totals | ({"nodes": paid_nodes} if paid_nodes is not None else {})


def save(result: ReplayResult, out_dir: str | Path) -> None:
    write_outputs(Path(out_dir), result.summary, result.requests, result.steps,
                  token_gap_table(result.fleet_runs or [result.run]))
