"""One cell's replay, run in a worker process (local pool or Ray task). Never raises: a failure
comes back as the cell's error text, so one bad cell does not stop the others."""

from __future__ import annotations

import os
import tempfile
import traceback

EXPECTED_ERRORS = (ValueError, TypeError, OSError)  # ConfigError and TraceError are ValueErrors


def _read(trace_path: str, trace_bytes: bytes | None):
    """Read the trace from its path, or from its bytes shipped to a remote worker."""
    from simkv.traces.schema import read_trace

    if trace_bytes is None:
        return read_trace(trace_path)
    suffix = ".csv.gz" if trace_path.endswith(".csv.gz") else os.path.splitext(trace_path)[1]
    fd, tmp = tempfile.mkstemp(suffix=suffix, prefix="simkv-sweep-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(trace_bytes)
        try:
            return read_trace(tmp)
        except ValueError as exc:
            raise type(exc)(str(exc).replace(tmp, trace_path)) from None
    finally:
        os.unlink(tmp)


def run_cell(task: dict, trace_bytes: bytes | None = None) -> dict:
    """Replay one cell; returns {'cell_id', 'status': 'ok', 'summary'} or {'cell_id', 'status': 'failed', 'error'}."""
    try:
        from simkv.replay.api import replay

        config, encode, fleet, disaggregation = cell_specs(task["options"], task.get("fleet"))
        trace = _read(task["trace"], trace_bytes)
        config = without_idle_retries(config, fleet)
        result = replay(trace, config, task["cost_model"], task["cost_options"], goodput=task.get("goodput"),
                        fleet=fleet, disaggregation=disaggregation, encode=encode)
        summary = dict(result.summary)
        summary["trace"] = task["trace"]
        summary["sweep_cell"] = {k: task[k] for k in ("cell_id", "trace", "options", "cost_model", "cost_options", "fleet")
                                 if k in task}
        return {"cell_id": task["cell_id"], "status": "ok", "summary": summary}
    except EXPECTED_ERRORS as exc:
        return {"cell_id": task["cell_id"], "status": "failed", "error": _one_line(exc), "detail": ""}
    except Exception as exc:  # noqa: BLE001 - any bug in one cell must not lose the others
        return {"cell_id": task["cell_id"], "status": "failed", "error": _one_line(exc),
                "detail": traceback.format_exc()}


def cell_specs(options: dict, fleet: dict | None):
    """A cell's engine config (its `options`), and its encode pool, fleet and P/D pools (from its
    `fleet` keys): (EngineConfig, EncodeSpec | None, FleetSpec | None, DisaggregationSpec | None)."""
    from simkv.config import EngineConfig

    config = EngineConfig.from_flat(dict(options))
    keys = dict(fleet or {})
    encode = encode_spec(keys, config)  # (its keys taken out of the rest)
    return (config, encode, *pool_specs(keys))


def without_idle_retries(config, fleet):
    """`config` without its clients' retries (client_max_retries) where the cell has nothing to
    retry: a grid's baseline cell (client_timeout_s=none, replica_failures=none) beside cells
    whose retries matter. They would change nothing there; a replay alone refuses them as a
    likely slip (simkv/replay/api.py), and the sweep refuses them when no cell has a use for
    them (simkv/cli/sweep_cmd.py)."""
    import dataclasses

    from simkv.replay.api import retries_have_use

    sc = config.scheduler
    if not sc.client_max_retries or retries_have_use(config, fleet):
        return config
    return dataclasses.replace(config, scheduler=dataclasses.replace(sc, client_max_retries=0))


ROUTER_OPTION_KEYS = ("cache_threshold", "balance_abs", "balance_rel")  # grid keys: prefix_aware's thresholds


def fleet_spec(fleet: dict | None):
    """A cell's `replicas`, `router` (and `router_options`, or the thresholds as keys of their
    own) as a FleetSpec (None: one engine)."""
    from simkv.replay.api import FleetSpec
    from simkv.replay.router import RouterError, RouterOptions, parse_class_replicas, parse_replica_sets

    if not fleet:
        return None
    router = fleet.get("router")  # (None: round_robin for replicas, vLLM's balancer for DP ranks)
    options = dict(fleet.get("router_options") or {})
    thresholds = {k: fleet[k] for k in ROUTER_OPTION_KEYS if k in fleet}
    if thresholds and router != "prefix_aware":
        raise RouterError(f"{', '.join(thresholds)}: thresholds of the prefix_aware router; this cell's router "
                          f"is {router or 'round_robin'} (set router=prefix_aware)")
    options.update(thresholds)
    classes, sets = fleet.get("class_replicas"), fleet.get("replica_sets")
    autoscale = autoscale_spec(fleet)
    replicas = fleet.get("replicas", autoscale.max_replicas if autoscale is not None else 1)
    # (FleetSpec builds the Router, which checks the replicas and the router's name)
    return FleetSpec(replicas, router, RouterOptions.parse([f"{k}={v}" for k, v in options.items()]),
                     parse_class_replicas(classes.split(";")) if classes else (),
                     parse_replica_sets(sets.split(";")) if sets else (), autoscale, failure_spec(fleet, replicas))


def failure_spec(fleet: dict, replicas: int):
    """A cell's failing replicas (`replica_failures` "T:R;T:R", `restart_s`, `replica_mtbf_s`,
    `failure_seed`) as a FailureSpec (None without failures given or drawn)."""
    from simkv.replay.failures import FailureSpec

    items = [item for item in str(fleet.get("replica_failures") or "").split(";") if item.strip()]
    mtbf, restart, seed = fleet.get("replica_mtbf_s"), fleet.get("restart_s"), fleet.get("failure_seed")
    if not items and mtbf is None:  # (a grid's replica_failures=none cell: no failures, whatever the rest)
        return None
    return FailureSpec.parse(items, None if restart is None else float(restart), replicas,
                             None if mtbf is None else float(mtbf), None if seed is None else int(seed))


def autoscale_spec(fleet: dict):
    """A cell's `autoscale` ("MIN-MAX") and its settings as an AutoscaleSpec (None without: a
    grid's `autoscale=none` cells then run the fixed fleet, whatever the settings swept beside)."""
    from simkv.replay.autoscale import SETTINGS, AutoscaleSpec

    if fleet.get("autoscale") is None:
        return None
    return AutoscaleSpec.of(fleet["autoscale"], {k: fleet.get(k) for k in SETTINGS})


def encode_spec(cell: dict, config):
    """A cell's encode pool (`encode_replicas`, `encode_router`, `encode_hop_ms`, taken out of
    `cell`) as an EncodeSpec, its store's bandwidth the engine option ec_store_gbs; None without
    encode_replicas (or with 0)."""
    from simkv.replay.encode_pool import EncodeSpec
    from simkv.sweep.grid import ENCODE_KEYS

    keys = {k: cell.pop(k) for k in ENCODE_KEYS if k in cell}
    if not keys.get("encode_replicas"):
        if set(keys) - {"encode_replicas"}:
            raise ValueError(f"{', '.join(sorted(set(keys) - {'encode_replicas'}))}: set encode_replicas too")
        return None
    return EncodeSpec(keys["encode_replicas"], keys.get("encode_router", "least_outstanding"),
                      ec_store_gbs=config.scheduler.ec_store_gbs, hop_ms=float(keys.get("encode_hop_ms", 1.0)))


def pool_specs(fleet: dict | None):
    """A cell's engines: (FleetSpec or None, DisaggregationSpec or None). A cell with any P/D key
    (`prefill_replicas`, `decode_replicas`, the pools' routers, the link) has two pools; prefix_aware's
    thresholds then apply to whichever pool routes with it."""
    from simkv.replay.disaggregated import DisaggregationSpec
    from simkv.replay.router import RouterError, RouterOptions, split_pool_class_replicas
    from simkv.sweep.grid import PD_KEYS

    fleet = dict(fleet or {})
    pd = {k: fleet.pop(k) for k in PD_KEYS if k in fleet}
    if not pd:
        return fleet_spec(fleet), None
    if fleet.get("autoscale") is not None:
        raise RouterError("autoscale: a cell with P/D keys (prefill_replicas, decode_replicas, ...) has two pools, not "
                          "one fleet that scales; scale them with prefill_autoscale / decode_autoscale")
    classes = fleet.pop("class_replicas", None)  # (each pool's: prefill:docs=1;decode:docs=0)
    prefill_classes, decode_classes = split_pool_class_replicas(classes.split(";")) if classes else ((), ())
    if fleet.get("replica_sets"):
        raise RouterError("replica_sets: a cell with P/D keys (prefill_replicas, decode_replicas, ...) has two "
                          "pools, not one fleet (`simkv replay --prefill-set/--decode-set` gives a pool other "
                          "engines); drop replica_sets")
    if fleet.get("replicas", 1) != 1:
        raise RouterError("replicas: a cell with P/D keys (prefill_replicas, decode_replicas, ...) sets its pools "
                          "itself; drop replicas")
    options = dict(fleet.get("router_options") or {}) | {k: fleet[k] for k in ROUTER_OPTION_KEYS if k in fleet}
    for pool in ("prefill", "decode"):  # (a pool that scales: its settings over the cell's autoscale_* keys)
        text = pd.pop(f"{pool}_autoscale", None)
        if text is not None:
            from simkv.replay.autoscale import parse_pool

            pd[f"{pool}_autoscale"] = scaling = parse_pool(str(text), fleet, f"{pool}_autoscale")
            pd.setdefault(f"{pool}_replicas", scaling.max_replicas)
    return None, DisaggregationSpec(
        num_prefill=pd.pop("prefill_replicas", 1), num_decode=pd.pop("decode_replicas", 1),
        router_options=RouterOptions.parse([f"{k}={v}" for k, v in options.items()]),
        prefill_class_replicas=prefill_classes, decode_class_replicas=decode_classes, **pd)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
