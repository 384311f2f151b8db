"""The highest request rate one engine sustains within latency SLOs, found by replaying a trace
at scaled arrival rates (``simkv goodput``).

Each probe replays the whole trace with its arrival times divided by a factor (the request mix,
the burstiness and the order stay the trace's own) and counts the requests that met every SLO
(``simkv/replay/goodput.py``). The search doubles or halves the factor until one probe meets
the target attainment and another misses it, then bisects between them geometrically until
they are within ``tolerance`` of each other. The answer is the last rate that met the target.
Attainment need not fall monotonically with the rate on a finite trace; every probe is reported
so that a user can see where it did not. ``check_replicas`` then replays the trace at a target
rate on fleets of replicas behind a router (``simkv/replay/fleet.py``), from the count an even
spread would need upwards.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

MAX_FACTOR = 2.0 ** 12  # 4096x the trace's rate, and 1/4096 of it: the search's bounds


class GoodputSearchError(ValueError):
    """A search that cannot start (the message says why)."""


@dataclass(frozen=True)
class Probe:
    factor: float  # arrival rate / the trace's own
    rate_req_s: float
    slo_attainment: float  # (SLOs given per request class: the lowest class's)
    request_goodput_req_s: float
    met: bool
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    e2e_p99_s: float | None
    num_preemptions: int
    peak_running: int
    num_rejected: int = 0  # (prompts at or past max_model_len: they meet no SLO at any rate)
    waiting_held_by: str | None = None  # the limit that held the waiting queue longest, with its share
    clients: int | None = None  # a closed loop's clients (search_max_clients; rate_req_s is then what they sent)
    attainment_by_class: dict | None = None  # a trace with request classes: each class's (simkv/replay/classes.py)
    duration_s: float | None = None  # an autoscaled fleet (simkv/replay/autoscale.py): the replay's length,
    gpu_hours_by_gpu: dict | None = None  # and the GPU-hours it paid for, per GPU kind


def trace_rate(trace) -> float:
    """Requests per second of a trace: its requests over the span of its arrivals."""
    arrivals = np.asarray(trace.arrival_time_s, dtype=np.float64)
    span = float(arrivals.max() - arrivals.min()) if len(arrivals) else 0.0
    if len(arrivals) < 2 or span <= 0:
        raise GoodputSearchError("every request of the trace arrives at the same instant: there is no rate to scale "
                                 "(re-time it first, e.g. simkv trace transform --rate R)")
    return len(arrivals) / span


def probe(trace, config, factor: float, slo_ms: dict, target: float, cost_model: str, cost_options: dict | None,
          fleet=None, disaggregation=None, encode=None) -> Probe:
    from simkv.replay.api import replay

    scaled = replace(trace, arrival_time_s=np.asarray(trace.arrival_time_s, dtype=np.float64) / factor)
    if trace.think_time_s is not None:  # (sessions' users think faster too)
        scaled = replace(scaled, think_time_s=np.asarray(trace.think_time_s, dtype=np.float64) / factor)
    s = replay(scaled, config, cost_model, cost_options, goodput=slo_ms, fleet=fleet,
               disaggregation=disaggregation, encode=encode).summary
    return _probe_of(s, factor, trace_rate(scaled), target)


def _probe_of(s: dict, factor: float, rate: float, target: float, clients: int | None = None) -> Probe:
    """A probe's record from its replay's summary `s` (with its goodput section)."""
    from simkv.replay.results import largest_admission_limit

    g = s["goodput"]
    attained = g.get("lowest_class_attainment", g["slo_attainment"])  # (SLOs per class: every class held to it)
    scaling = (s.get("fleet") or {}).get("autoscaling")
    return Probe(factor, rate, attained, g["request_goodput_req_s"], attained >= target, s["ttft_s"]["p99"],
                 s["tpot_s"]["p99"], s["e2e_s"]["p99"], int(s["num_preemptions"]), int(s["peak_running"]),
                 int(s.get("num_rejected", 0)), largest_admission_limit(s), clients, g.get("attainment_by_class"),
                 s["duration_s"] if scaling else None, scaling["gpu_hours_by_gpu"] if scaling else None)


def lowest_factor(trace) -> float:
    """The search's lowest rate factor: 1 / MAX_FACTOR, or higher where the trace slowed that far
    would outlast simkv's clock (48.5 days of simulated time), with room for the replay itself."""
    from simkv.clock import MAX_TICKS, TICKS_PER_SECOND

    arrivals = np.asarray(trace.arrival_time_s, dtype=np.float64)
    span = float(arrivals.max()) if len(arrivals) else 0.0
    limit = MAX_TICKS / TICKS_PER_SECOND / 2
    return max(1 / MAX_FACTOR, span / limit)


def _check_search(slo_ms: dict, target: float, tolerance: float) -> None:
    if not slo_ms:
        raise GoodputSearchError("give at least one SLO (--goodput ttft:MS, tpot:MS or e2el:MS)")
    if not 0 < target <= 1:
        raise GoodputSearchError(f"--attainment must be in (0, 1], got {target}")
    if not 0 < tolerance < 1:
        raise GoodputSearchError(f"--tolerance must be in (0, 1), got {tolerance}")


def search_max_rate(trace, config, slo_ms: dict, *, target: float = 0.99, tolerance: float = 0.02,
                    cost_model: str = "roofline", cost_options: dict | None = None, max_probes: int = 40,
                    on_probe=None, fleet=None, disaggregation=None, encode=None) -> dict:
    """`fleet` (simkv.replay.api.FleetSpec): the rate of that many replicas behind its router;
    `disaggregation` (simkv.replay.disaggregated.DisaggregationSpec): of that prefill and decode pool;
    `encode` (simkv.replay.encode_pool.EncodeSpec): with that encode pool in front.
    The search's record: ``status`` ('found', 'unbounded': met even at MAX_FACTOR x the trace's rate,
    'unattainable': missed even at 1 / MAX_FACTOR of it (or as slow as simkv's clock allows), or at
    once where the requests the engine rejects already leave fewer than the target's share:
    ``reason`` says so), ``max_rate_req_s`` (None unless found or unbounded), the bracket and every
    probe in the order run."""
    _check_search(slo_ms, target, tolerance)
    base_rate = trace_rate(trace)
    probes: list[Probe] = []

    def run(factor: float) -> bool:
        p = probe(trace, config, factor, slo_ms, target, cost_model, cost_options, fleet, disaggregation, encode)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return p.met

    lo = hi = None  # factors that met / missed the target
    factor = 1.0
    first_met = run(factor)
    capped = _rejection_cap(probes[0], len(trace.arrival_time_s), target)
    if capped is not None:  # (rejected requests meet no SLO: no rate can reach the target)
        return _record("unattainable", slo_ms, target, tolerance, base_rate, None, factor, probes) | capped
    if first_met:
        lo = factor
        while hi is None and factor < MAX_FACTOR:
            factor *= 2
            if run(factor):
                lo = factor
            else:
                hi = factor
    else:
        hi = factor
        floor = lowest_factor(trace)
        while lo is None and factor / 2 >= floor:
            factor /= 2
            if run(factor):
                lo = factor
            else:
                hi = factor
    if lo is not None and hi is not None:
        while hi / lo > 1 + tolerance and len(probes) < max_probes:
            mid = math.sqrt(lo * hi)
            if run(mid):
                lo = mid
            else:
                hi = mid
    status = "found" if lo is not None and hi is not None else ("unbounded" if hi is None else "unattainable")
    return _record(status, slo_ms, target, tolerance, base_rate, lo, hi, probes)


def _rejection_cap(first: Probe, num_requests: int, target: float) -> dict | None:
    """Where the requests the engine rejects (prompts at or past max_model_len) leave fewer than
    the target's share to meet the SLOs, at any rate: the record's reason; else None."""
    if not first.num_rejected or (num_requests - first.num_rejected) / num_requests >= target:
        return None
    return {"num_rejected": first.num_rejected,
            "reason": f"{first.num_rejected} of {num_requests} requests are rejected (prompt at or past "
                      f"max_model_len) and meet no SLO: at most {100 * (1 - first.num_rejected / num_requests):.1f} % "
                      f"can, below the target {100 * target:g} % (raise --max-model-len, lower --attainment, or "
                      "drop those rows: simkv trace transform)"}


def _record(status: str, slo_ms: dict, target: float, tolerance: float, base_rate: float, lo, hi,
            probes: list[Probe]) -> dict:
    """The search's record: `lo` and `hi`, the factors that met and missed the target (None: none)."""
    return {
        "status": status,
        "slo_ms": dict(slo_ms),
        "target_attainment": target,
        "tolerance": tolerance,
        "trace_rate_req_s": base_rate,
        "max_rate_req_s": base_rate * lo if lo is not None else None,
        "bracket_factors": [lo, hi],
        "probes": [asdict(p) for p in probes],
    }


def _per_client(config) -> tuple[int, int | None]:
    """Rotating clients (vLLM's multi-turn benchmark's): the conversations each keeps in progress
    and the requests each sends at most, as `config` gives them to its clients; (1, None) else."""
    sc = config.scheduler
    if not sc.client_rotation:
        return 1, None
    clients = sc.client_max_concurrency
    share = None if sc.client_max_requests is None else sc.client_max_requests // clients
    return (sc.client_max_active_sessions or clients) // clients, share


def client_options(trace, config, clients: int):
    """`config` with `clients` clients in a closed loop: at most that many requests in flight
    (client_max_concurrency) and, where the trace's sessions are paced on their replies, one
    conversation in progress each (client_max_active_sessions: vLLM's multi-turn benchmark's
    default, one active conversation per client), or as many as each of `config`'s rotating
    clients keeps (and the same share of a cap on requests)."""
    paced = trace.session_id is not None and config.scheduler.session_pacing
    per_client, share = _per_client(config)
    sc = replace(config.scheduler, client_max_concurrency=clients,
                 **({"client_max_active_sessions": clients * per_client} if paced else {}),
                 **({"client_max_requests": clients * share} if share is not None else {}))
    return replace(config, scheduler=sc)


def max_clients_bound(trace, config) -> int:
    """More clients than this change nothing: one per request, or per conversation where the
    trace's sessions are paced (per so many conversations for rotating clients that keep
    several)."""
    if trace.session_id is not None and config.scheduler.session_pacing:
        from simkv.replay.sessions import next_turns

        conversations = int(len(trace.session_id) - np.count_nonzero(next_turns(trace.session_id) >= 0))
        return max(1, conversations // _per_client(config)[0])
    return len(trace.arrival_time_s)


def probe_clients(trace, config, clients: int, slo_ms: dict, target: float, cost_model: str,
                  cost_options: dict | None, fleet=None, disaggregation=None) -> Probe:
    from simkv.replay.api import replay

    s = replay(trace, client_options(trace, config, clients), cost_model, cost_options, goodput=slo_ms, fleet=fleet,
               disaggregation=disaggregation).summary
    return _probe_of(s, 1.0, s["request_throughput_req_s"], target, clients)


def search_max_clients(trace, config, slo_ms: dict, *, target: float = 0.99, tolerance: float = 0.02,
                       cost_model: str = "roofline", cost_options: dict | None = None, max_probes: int = 40,
                       on_probe=None, fleet=None, disaggregation=None) -> dict:
    """The most clients of a closed loop (`client_options`: each keeps one request in flight,
    and one conversation in progress where the trace's sessions are paced, or as many as each of
    `config`'s rotating clients keeps) for which the target
    share of the trace's requests meets every SLO. The trace's times still bound when a request
    may go (all at once: a pure closed loop). The search doubles the clients from 1 until a
    probe misses the target, then bisects (whole clients) until the bracket is within
    ``tolerance`` (at least one client). The record: ``status`` ('found'; 'unbounded': met even
    with a client per request or conversation, ``max_clients_bound``; 'unattainable': missed with
    one client, or rejected requests alone make the target unreachable: ``reason``),
    ``max_clients``, the bracket and every probe."""
    _check_search(slo_ms, target, tolerance)
    bound = max_clients_bound(trace, config)
    probes: list[Probe] = []

    def run(clients: int) -> bool:
        p = probe_clients(trace, config, clients, slo_ms, target, cost_model, cost_options, fleet, disaggregation)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return p.met

    def record(status: str, lo: int | None, hi: int | None) -> dict:
        return {"status": status, "slo_ms": dict(slo_ms), "target_attainment": target, "tolerance": tolerance,
                "max_clients": lo, "bracket_clients": [lo, hi], "max_clients_bound": bound,
                "conversations_per_client": _per_client(config)[0],
                "probes": [asdict(p) for p in probes]}

    if not run(1):
        return record("unattainable", None, 1) | (_rejection_cap(probes[0], len(trace.arrival_time_s), target) or {})
    lo, hi = 1, None
    while hi is None and lo < bound:
        n = min(2 * lo, bound)
        if run(n):
            lo = n
        else:
            hi = n
    if hi is None:
        return record("unbounded", lo, None)
    while hi - lo > max(1, int(tolerance * lo)) and len(probes) < max_probes:
        mid = (lo + hi) // 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return record("found", lo, hi)


def replicas_for(target_rate: float, max_rate: float) -> int:
    """Replicas for ``target_rate`` if each takes ``max_rate`` and requests spread evenly."""
    return max(1, math.ceil(target_rate / max_rate - 1e-9))


def check_replicas(trace, config, slo_ms: dict, target_rate: float, start: int, *, target: float = 0.99,
                   router: str = "round_robin", router_options=None, cost_model: str = "roofline",
                   cost_options: dict | None = None, max_replicas: int | None = None, on_probe=None) -> dict:
    """The fewest replicas behind ``router`` that meet the target attainment at ``target_rate``,
    by replaying the trace on fleets: from ``start`` (an even spread's count) upwards until one
    meets it (at most ``max_replicas``, by default 2 * start + 4), or downwards while they do.
    An even spread is the best case for a router, but a finite trace's bursts can go either way."""
    from simkv.replay.api import FleetSpec
    from simkv.replay.router import RouterOptions

    factor = target_rate / trace_rate(trace)
    start = max(start, 1)
    limit = max_replicas if max_replicas is not None else 2 * start + 4
    probes, met = [], {}

    def run(n: int) -> bool:
        p = probe(trace, config, factor, slo_ms, target, cost_model, cost_options,
                  FleetSpec(n, router, router_options or RouterOptions()))
        probes.append({"replicas": n} | asdict(p))
        if on_probe is not None:
            on_probe(n, p)
        met[n] = p.met
        return p.met

    n = start
    if run(n):
        while n > 1 and run(n - 1):
            n -= 1
    else:
        while n < limit and not run(n + 1):
            n += 1
        n = n + 1 if met.get(n + 1) else None
    return {"router": router, "router_options": (router_options or RouterOptions()).to_dict(),
            "target_rate_req_s": target_rate, "even_spread_replicas": start, "replicas": n,
            "max_replicas_tried": max(met), "probes": probes}


def _search_cell(task: dict) -> dict:
    """One combination of a grid search (runs in a worker process; never raises)."""
    from simkv.config import EngineConfig
    from simkv.traces.schema import read_trace

    from simkv.sweep.worker import pool_specs

    out = {"cell_id": task["cell_id"], "index": task["index"], "swept": task["swept"],
           "num_replicas": (task.get("fleet") or {}).get("replicas", 1)}
    try:
        fleet, pd = pool_specs(task.get("fleet"))
        if pd is not None:
            out["num_replicas"] = pd.num_prefill + pd.num_decode
        config = EngineConfig.from_flat(task["options"])
        from simkv.studies.serving_cost import SetupGPUs

        gpus = SetupGPUs.of(config, fleet, pd)
        out |= {"gpu": gpus.gpu, "gpus": gpus.count}  # (for --gpu-price)
        if gpus.mixed:  # (P/D pools on different GPUs)
            out["gpu_kinds"] = [list(kind) for kind in gpus.mixed]
        record = search_max_rate(read_trace(task["trace"]), config, task["slo_ms"],
                                 target=task["target"], tolerance=task["tolerance"], cost_model=task["cost_model"],
                                 cost_options=task["cost_options"], fleet=fleet, disaggregation=pd)
    except ValueError as exc:  # ConfigError, GoodputSearchError, TraceError: this cell's, not the grid's
        return out | {"status": "failed", "error": str(exc).splitlines()[0]}
    from simkv.sweep.grid import requested_block_size

    # the block size the engine ran with and the one asked for (they differ on hybrid models)
    asked = requested_block_size(task["options"])
    return out | {"status": record["status"], "max_rate_req_s": record["max_rate_req_s"],
                  "at_max": _probe_at_max(record), "num_probes": len(record["probes"]),
                  "engine_block_size": config.cache.block_size, "asked_block_size": asked}


def _probe_at_max(record: dict) -> dict | None:
    """A search's probe at the highest rate that met the target (None: none met it)."""
    best = [p for p in record["probes"] if p["factor"] == record["bracket_factors"][0]]
    return best[0] if best else None


def search_grid(trace_path: str, base_options: dict, grid: dict[str, list], slo_ms: dict, *, target: float = 0.99,
                tolerance: float = 0.02, cost_model: str = "roofline", cost_options: dict | None = None,
                workers: int = 1, on_cell=None, fleet=None) -> dict:
    """``search_max_rate`` for every combination of ``grid`` (engine options, ``cost_model``, the
    linear model's ``step_base_s`` / ``step_per_token_s``) over ``base_options``, the combinations
    made and run as `simkv sweep` makes and runs its cells; cells in grid order (the last key
    fastest) and the combination that sustains the highest rate."""
    from simkv.sweep.grid import make_cells

    cells = _search_cells(make_cells([trace_path], grid, base_options, cost_model), slo_ms, target, tolerance,
                          cost_options, workers, on_cell, fleet)
    return {"slo_ms": dict(slo_ms), "target_attainment": target, "tolerance": tolerance, "grid": grid,
            "cells": cells, "best_index": _best_index(cells)}


def search_layouts(trace_path: str, base_options: dict, layouts: list, slo_ms: dict, *, target: float = 0.99,
                   tolerance: float = 0.02, cost_model: str = "roofline", cost_options: dict | None = None,
                   workers: int = 1, on_cell=None, router: str = "least_outstanding", router_options=None) -> dict:
    """``search_max_rate`` for every layout of a number of GPUs (simkv.studies.layouts.Layout): the
    engine options of one engine of it over ``base_options`` (dual batch overlap's only for
    layouts of data-parallel ranks), and its copies as replicas behind ``router``; run as
    `search_grid`'s combinations are, a "layout" column for their key."""
    import os

    from simkv.sweep.grid import Cell

    cells = []
    for index, layout in enumerate(layouts):
        fleet = {"replicas": layout.copies, "router": router} if layout.copies > 1 else {}
        if fleet and router_options is not None and router_options != type(router_options)():
            fleet["router_options"] = router_options.to_dict()
        options = base_options | layout.options()
        if layout.data_parallel_size == 1:  # (dual batch overlap splits data-parallel ranks' steps)
            options = {k: v for k, v in options.items() if not k.startswith(("enable_dbo", "dbo_", "ubatch_"))}
        cells.append(Cell(index, os.path.normpath(trace_path), (("layout", layout.name),),
                          tuple(sorted(options.items())), cost_model, (), (), tuple(sorted(fleet.items()))))
    done = _search_cells(cells, slo_ms, target, tolerance, cost_options, workers, on_cell, None)
    return {"slo_ms": dict(slo_ms), "target_attainment": target, "tolerance": tolerance,
            "grid": {"layout": [layout.name for layout in layouts]}, "cells": done, "best_index": _best_index(done)}


def _best_index(cells: list[dict]) -> int | None:
    """The cell that sustains the highest rate (the first of equals), None if none met the target."""
    found = [c for c in cells if c["status"] in ("found", "unbounded")]
    return max(found, key=lambda c: (c["max_rate_req_s"], -c["index"]))["index"] if found else None


def _search_cells(cells: list, slo_ms: dict, target: float, tolerance: float, cost_options: dict | None,
                  workers: int, on_cell, fleet) -> list[dict]:
    """Search every cell (`_search_cell`, in `workers` processes), under the command's ``fleet``
    where a cell names none; the cells' results in their order."""
    from simkv.sweep.executors import run_local

    tasks = {}
    for cell in cells:
        task = cell.task()
        task.update(index=cell.index, swept=dict(cell.swept), slo_ms=dict(slo_ms), target=target, tolerance=tolerance,
                    cost_options=dict(cost_options or {}) | task["cost_options"])
        # the command's fleet, under the cell's own `replicas` / `router` (grid or fixed keys)
        cell_fleet = task.pop("fleet", {})
        if fleet is not None:
            named = {"router": fleet.router} if fleet.router is not None else {}  # (None: each engine's default)
            cell_fleet = {"replicas": fleet.num_replicas} | named | cell_fleet
            if fleet.options != type(fleet.options)():
                cell_fleet["router_options"] = fleet.options.to_dict()
        if cell_fleet:
            task["fleet"] = cell_fleet
        tasks[task["cell_id"]] = task
    runs = (run_local(list(tasks.values()), workers, _search_cell) if workers > 1 and len(tasks) > 1
            else map(_search_cell, tasks.values()))
    cells: list[dict] = []
    for out in runs:
        task = tasks[out["cell_id"]]
        cell = {"index": task["index"], "swept": task["swept"]}
        cell |= ({k: v for k, v in out.items() if k != "cell_id"} if "index" in out  # else: the worker died
                 else {"status": "failed", "error": out["error"]})
        cells.append(cell)
        if on_cell is not None:
            on_cell(cell)
    cells.sort(key=lambda c: c["index"])
    return cells


def search_splits(trace, config, slo_ms: dict, num_gpus: int, *, spec=None, router: str = "least_outstanding",
                  router_options=None, target: float = 0.99, tolerance: float = 0.02, cost_model: str = "roofline",
                  cost_options: dict | None = None, on_setup=None) -> dict:
    """The highest rate within the SLOs of every way to run `num_gpus` engines: all colocated
    behind `router`, and each split into P prefill and num_gpus - P decode replicas
    (`spec`: the other P/D settings, simkv.replay.disaggregated.DisaggregationSpec)."""
    from simkv.replay.api import FleetSpec
    from simkv.replay.disaggregated import DisaggregationSpec
    from simkv.replay.router import RouterOptions

    if num_gpus < 2:
        raise GoodputSearchError(f"--pd-splits needs at least 2 engines to split, got {num_gpus}")
    spec = spec or DisaggregationSpec()
    options = router_options or RouterOptions()
    setups = [("colocated", 0, 0, FleetSpec(num_gpus, router, options), None)]
    setups += [(f"{p} prefill + {num_gpus - p} decode", p, num_gpus - p, None,
                replace(spec, num_prefill=p, num_decode=num_gpus - p)) for p in range(1, num_gpus)]
    rows = []
    for name, p, d, fleet, pd in setups:
        record = search_max_rate(trace, config, slo_ms, target=target, tolerance=tolerance, cost_model=cost_model,
                                 cost_options=cost_options, fleet=fleet, disaggregation=pd)
        row = {"setup": name, "prefill_replicas": p, "decode_replicas": d, "status": record["status"],
               "max_rate_req_s": record["max_rate_req_s"], "at_max": _probe_at_max(record),
               "num_probes": len(record["probes"])}
        rows.append(row)
        if on_setup is not None:
            on_setup(row)
    found = [r for r in rows if r["max_rate_req_s"] is not None]
    return {"num_gpus": num_gpus, "slo_ms": dict(slo_ms), "target_attainment": target, "tolerance": tolerance,
            "trace_rate_req_s": trace_rate(trace), "colocated_router": router,
            "disaggregation": spec.to_dict() | {"prefill_replicas": None, "decode_replicas": None},
            "setups": rows, "best": max(found, key=lambda r: r["max_rate_req_s"])["setup"] if found else None}
