"""The tables and summary.json of a disaggregated replay (simkv/replay/disaggregated.py).

requests.parquet: one row per request, as the client sees it (the decode replica's times: TTFT
from arrival to the decode side's first token), plus `prefill_replica`, `decode_replica`,
`prefill_end_time_s` (the prefill replica sampled its one token), `kv_pull_start_s` and
`kv_pull_end_s` (the decode replica admitted the request and started its pull; the pull ended),
and `kv_pull_bytes`.
steps.parquet: every replica's steps, with `pool` (prefill / decode) and `replica` (within it).
summary.json: the decode pool's engine statistics at the top level (the keys of a fleet's; it is
where requests run, decode and get preempted), the latencies of the whole path, and
`disaggregation`: the setup, each pool's statistics and replicas, and the KV transfers.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simkv.clock import TICKS_PER_SECOND
from simkv.replay.disaggregated import DisaggregatedRun
from simkv.replay.fleet import fleet_summary, fleet_tables
from simkv.replay.pipeline import pipeline_summary
from simkv.replay.results import admission_limits_summary, dist, multimodal_summary
from simkv.replay.sessions import mark_not_sent

_POOL_KEYS = ("duration_s", "num_steps", "peak_running", "mean_running", "peak_waiting", "num_gpu_blocks",
              "peak_blocks_used", "num_preemptions", "num_preempted_requests", "prefix_cache_queries_tokens",
              "prefix_cache_hits_tokens", "prefix_cache_hit_rate", "num_prefill_tokens", "num_decode_tokens",
              "internal_fragmentation_pct")


def _seconds(ticks: np.ndarray) -> np.ndarray:
    return np.where(ticks >= 0, ticks / TICKS_PER_SECOND, np.nan)


def pd_tables(run: DisaggregatedRun, trace, frontend_latency_s: float = 0.0):
    """(requests, steps, the prefill pool's requests, per-replica request tables of each pool);
    `frontend_latency_s` is added to the requests' TTFT and E2E (request_table)."""
    pd_ = run.routing
    requests, decode_steps, per_decode = fleet_tables(run.decode_runs, pd_.decode, trace, frontend_latency_s)
    prefill_requests, prefill_steps, per_prefill = fleet_tables(run.prefill_runs, pd_.prefill, trace)
    clients = pd_.prefill.clients
    if clients is not None:  # (a row whose last attempt timed out may never have reached the decode pool)
        timed_out = np.concatenate([r.requests.timed_out_rows for r in run.prefill_runs + run.decode_runs])
        requests.loc[timed_out, "status"] = "timed_out"
        if clients.abandoned:  # (turns never sent: their conversations ended)
            requests.loc[clients.abandoned, "status"] = "abandoned"
    mark_not_sent(requests, pd_.prefill.sessions)
    requests = requests.rename(columns={"replica": "decode_replica"})
    requests.insert(1, "prefill_replica", pd_.prefill.assignment)
    requests["queue_held_by"] = prefill_requests["queue_held_by"]  # (its first step: on the prefill pool)
    requests["prefill_end_time_s"] = _seconds(pd_.prefill_end)
    requests["kv_pull_start_s"] = _seconds(pd_.pull_start)
    requests["kv_pull_end_s"] = _seconds(pd_.pull_end)
    requests["kv_pull_bytes"] = pd_.pull_bytes
    steps = {"pool": np.concatenate([np.full(len(prefill_steps["replica"]), "prefill", dtype=object),
                                     np.full(len(decode_steps["replica"]), "decode", dtype=object)])}
    for name in decode_steps:
        steps[name] = np.concatenate([prefill_steps[name], decode_steps[name]])
    return requests, steps, prefill_requests, per_prefill, per_decode


def pd_summary(run: DisaggregatedRun, trace, spec, configs, backends, capacities, wall_time_s: float,
               requests: pd.DataFrame, prefill_requests: pd.DataFrame, per_prefill, per_decode) -> dict:
    pd_ = run.routing
    prefill_config, decode_config = configs
    decode = fleet_summary(run.decode_runs, pd_.decode, trace, decode_config, backends[1], capacities[1], wall_time_s,
                           requests, per_decode)
    prefill = fleet_summary(run.prefill_runs, pd_.prefill, trace, prefill_config, backends[0], capacities[0], 0.0,
                            prefill_requests, per_prefill)
    # (a CPU tier: per pool; images: per pool, and both pools' encodes summed)
    summary = {k: v for k, v in decode.items() if k not in ("fleet", "kv_offloading", "multimodal")}
    summary |= multimodal_summary(run.prefill_runs + run.decode_runs, trace)
    summary |= admission_limits_summary([r.steps.columns() for r in run.prefill_runs + run.decode_runs])
    for key in ("session_pacing", "client_concurrency"):  # (the prefill router paces the turns, holds the requests)
        if key in prefill:
            summary[key] = prefill[key]
    if "admission_control" in prefill:  # (the prefill pool's front ends refuse: simkv/replay/admission.py)
        summary["admission_control"] = prefill["admission_control"]
    summary["duration_s"] = max(decode["duration_s"], prefill["duration_s"])
    clients = pd_.prefill.clients
    if clients is not None:
        from simkv.replay.client_timeouts import client_section

        summary["client"] = client_section(prefill_config.scheduler, clients.attempts, requests,
                                           [r.feed for r in run.prefill_runs + run.decode_runs],
                                           pd_.prefill.sessions)
        summary["client"]["aborted_in"] = dict(pd_.transit.aborted_in)
    pulled = pd_.pull_end >= 0
    pull_s = (pd_.pull_end[pulled] - pd_.pull_start[pulled]) / TICKS_PER_SECOND
    arrival = requests["arrival_time_s"].to_numpy()
    prefill_end = requests["prefill_end_time_s"].to_numpy()
    first_token = requests["first_token_time_s"].to_numpy()
    total_bytes = pd_.total_pull_bytes
    summary["disaggregation"] = {
        **spec.to_dict(), **({"kv_abort_timeout_s": spec.kv_abort_timeout_s} if clients is not None else {}),
        "prefill": _pool(prefill, prefill_config) | _pool_pipeline(run.prefill_runs, summary["duration_s"])
        | {"prefill_s": dist(prefill_end - arrival)},
        "decode": _pool(decode, decode_config) | _pool_pipeline(run.decode_runs, summary["duration_s"])
        | {"prefill_end_to_first_token_s": dist(first_token - prefill_end)},
        "kv_transfer": {
            "num_pulls": pd_.num_pulls,
            "pulled_bytes": total_bytes,
            "pull_s": dist(pull_s),
            "handoff_to_pull_s": dist(_seconds(pd_.pull_start)[pulled] - prefill_end[pulled]),
            "mean_link_utilization": _link_utilization(total_bytes, spec, len(run.decode_runs), summary["duration_s"]),
        },
    }
    return summary


def _pool(s: dict, config) -> dict:
    return {k: s[k] for k in _POOL_KEYS} | {k: s[k] for k in ("kv_offloading", "lora", "multimodal", "admission_limits")
                                             if k in s} | {
        "config": {k: v for k, v in config.to_dict().items()
                   if k in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                            "long_prefill_token_threshold", "enable_prefix_caching", "gpu_memory_utilization",
                            "num_gpu_blocks", "block_size", "watermark", "gpu", "tensor_parallel_size",
                            "pipeline_parallel_size", "data_parallel_size")},
        "router": s["fleet"]["router"], "replicas": s["fleet"]["replicas"]}


def _pool_pipeline(runs, duration_s: float) -> dict:
    """A pool's pipeline stages (simkv/replay/pipeline.py): its replicas' batches and empty
    schedule() calls summed, a stage's busy fraction averaged over them (a data-parallel
    engine's ranks share one set of stages: counted once)."""
    runs = list({id(run.pipeline): run for run in runs}.values())
    sections = [pipeline_summary(run, duration_s).get("pipeline") for run in runs]
    if not sections or sections[0] is None:
        return {}
    first = sections[0]
    return {"pipeline": {"pipeline_parallel_size": first["pipeline_parallel_size"], "link_gbs": first["link_gbs"],
                         "stage_busy_fraction": sum(p["stage_busy_fraction"] for p in sections) / len(sections),
                         "batches": sum(p["batches"] for p in sections),
                         "empty_schedule_calls": sum(p["empty_schedule_calls"] for p in sections)}}


def _link_utilization(total_bytes: int, spec, num_links: int, duration: float) -> float:
    """Bytes pulled over the decode pool's links' capacity for the replay's duration (each pull
    also occupies a prefill replica's link; a data-parallel decode engine has a link per rank)."""
    capacity = spec.kv_link_gbps * 1e9 * num_links * duration
    return total_bytes / capacity if capacity > 0 else 0.0
