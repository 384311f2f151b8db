"""Turn a finished replay into summary.json, requests.parquet, steps.parquet and token_gaps.parquet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from simkv.atomic import atomic_write
from simkv.clock import TICKS_PER_SECOND
from simkv.core.admission_limits import ADMISSION_LIMITS
from simkv.replay.engine import ReplayRun
from simkv.replay.pipeline import pipeline_summary
from simkv.replay.sessions import mark_not_sent
from simkv.replay.step_log import SPEC_COLUMNS, RequestLog


def dist(values: np.ndarray) -> dict:
    """mean/p50/p90/p99 (numpy linear percentiles); NaN-free, None when empty."""
    values = values[np.isfinite(values)]
    if values.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def weighted_dist(values: np.ndarray, weights: np.ndarray) -> dict:
    """Like `dist` for samples given as (value, count) pairs (inverted-CDF quantiles)."""
    mask = weights > 0
    values, weights = values[mask], weights[mask]
    if values.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    order = np.argsort(values, kind="stable")
    values, weights = values[order], weights[order]
    cum = np.cumsum(weights)
    total = cum[-1]
    q = [float(values[np.searchsorted(cum, p * total, side="left")]) for p in (0.5, 0.9, 0.99)]
    return {"mean": float(np.dot(values, weights) / total), "p50": q[0], "p90": q[1], "p99": q[2]}


def request_table(run: ReplayRun, trace, frontend_latency_s: float = 0.0) -> pd.DataFrame:
    """One row per request. `frontend_latency_s`: what the server's API front end and the network
    add to every request's TTFT and end-to-end latency as its client sees them (a roofline fit's,
    simkv/backends/roofline_fit.py; 0 = the engine's own times)."""
    steps = run.steps.columns()
    starts, durations = steps["start_time_s"], steps["duration_s"]
    ends = starts + durations
    log: RequestLog = run.requests
    ints = log.ints
    finished = log.status == 1

    def at(step_col: np.ndarray, times: np.ndarray) -> np.ndarray:
        out = np.full(step_col.shape, np.nan)
        ok = finished & (step_col >= 0)
        out[ok] = times[step_col[ok]]
        return out

    arrival = run.feed.arrival_times_s()  # (the trace's, or as session pacing held them)
    first_sched = at(ints["first_scheduled_step"], starts)
    first_token = at(ints["first_token_step"], ends)
    finish = at(ints["finish_step"], ends)
    for row, t in log.finish_times_s.items():  # (rows fanned out over data-parallel ranks)
        finish[row] = t
    out_tokens = ints["num_output_tokens"]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_itl = np.where(out_tokens > 1, (finish - first_token) / (out_tokens - 1), np.nan)
    status = np.asarray(RequestLog.STATUS_NAMES, dtype=object)[log.status]
    attempts = getattr(run.feed, "attempts", None)  # (clients that retry: simkv/replay/client_timeouts.py)
    frame = pd.DataFrame({
        "request_id": trace.request_id.astype(str),
        "arrival_time_s": arrival,
        "first_scheduled_time_s": first_sched,
        "first_token_time_s": first_token,
        "finish_time_s": finish,
        "status": status.astype(str),
        "prompt_tokens": trace.prompt_tokens,
        "output_tokens": np.where(finished, out_tokens, 0),
        "prefix_hit_tokens": np.where(finished, ints["prefix_hit_tokens"], 0),
        "num_preemptions": np.where(finished, ints["num_preemptions"], 0),
        "queue_s": first_sched - arrival,
        "ttft_s": first_token - arrival + frontend_latency_s,
        "e2e_s": finish - arrival + frontend_latency_s,
        "mean_itl_s": mean_itl,
        "queue_held_by": queue_held_by(steps, arrival, first_sched),
    } | {c: np.where(finished, ints[c], 0) for c in SPEC_COLUMNS if c in ints})
    if attempts is not None:
        frame["attempts"] = attempts
    mark_not_sent(frame, getattr(run.feed, "pacing", None))
    return frame


def queue_held_by(steps: dict, arrival: np.ndarray, first_scheduled: np.ndarray) -> pd.Categorical:
    """Per request, the limit that held it longest before its first step (`admission_limit`): of
    the steps that started after it arrived and before it was first scheduled, the limit whose
    steps lasted longest; "none" where no such step left requests waiting (or it never ran).
    The step running when it arrived is left out (it was scheduled before the request came)."""
    n = len(arrival)
    codes = np.zeros(n, dtype=np.int8)
    limits = steps["admission_limit"]
    held = steps["num_waiting"] > 0
    present = [int(k) for k in np.unique(limits[held]) if k]
    ran = np.isfinite(first_scheduled)
    if present and ran.any():
        starts = steps["start_time_s"]
        lo = np.searchsorted(starts, arrival[ran], side="left")
        hi = np.searchsorted(starts, first_scheduled[ran], side="left")
        waited = np.empty((len(present), int(ran.sum())))
        for j, k in enumerate(present):
            cum = np.concatenate(([0.0], np.cumsum(np.where(held & (limits == k), steps["duration_s"], 0.0))))
            waited[j] = cum[hi] - cum[np.minimum(lo, hi)]
        best = waited.argmax(axis=0)
        codes[ran] = np.where(waited.max(axis=0) > 0, np.asarray(present, dtype=np.int8)[best], 0)
    return pd.Categorical.from_codes(codes, ADMISSION_LIMITS)


def frontend_latency(backend) -> float:
    """The client-side latency a cost model adds to every request (a roofline fit's; else 0)."""
    return float(getattr(backend, "frontend_latency_s", 0.0))


def class_itl_samples(runs: list[ReplayRun]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per request class (the runs' engines tracked them: simkv/replay/classes.py), the token
    gaps of its requests over all `runs` as (value, count) pairs; {} without classes."""
    names = runs[0].steps.class_names if runs else ()
    out = {}
    for code, name in enumerate(names):
        samples = [itl_samples(run, code) for run in runs]
        out[name] = (np.concatenate([v for v, _ in samples]), np.concatenate([w for _, w in samples]))
    return out


def class_itl(runs: list[ReplayRun]) -> dict[str, dict]:
    """Per request class, its tokens' inter-token latency distribution (`dist`'s keys)."""
    return {name: weighted_dist(*samples) for name, samples in class_itl_samples(runs).items()}


def itl_distribution(run: ReplayRun) -> dict:
    """Inter-token latency over every token gap: a decode token's gap is its step's duration;
    a recomputed request's first new token counts from its last token before preemption."""
    return weighted_dist(*itl_samples(run))


def itl_samples(run: ReplayRun, class_code: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The token gaps of `itl_distribution` as (value, count) pairs; with `class_code`, those of
    one request class's tokens (numbered as `run.steps.class_names`)."""
    steps = run.steps.columns()
    durations = steps["duration_s"]
    sched = run.scheduler
    gaps = sched.irregular_gaps
    counted = sched.pipeline_gaps  # (pipeline parallelism: every gap, counted by its pair of steps;
    resumed = sched.resumed_steps  # (steady decoders the budget left out of steps: their gaps are irregular)
    if class_code is None:
        weights = steps["num_decode_tokens"].astype(np.float64)
    else:
        weights = run.steps.class_decode_tokens()[:, class_code].astype(np.float64)
        gaps = [gap for gap, code in zip(gaps, sched.irregular_gap_classes) if code == class_code]
        resumed = [s for s, code in zip(resumed, sched.resumed_classes) if code == class_code]
        if counted is not None:
            counted = {gap[:2]: n for gap, n in sched.pipeline_gaps_by_class.items() if gap[2] == class_code}
    if resumed:  # (gap pairs, as these, are step numbers: the rows of `steps`)
        weights = weights.copy()
        np.subtract.at(weights, resumed, 1.0)
    if counted is not None:  # a step's duration, from its first stage's start, is no gap)
        weights = np.zeros_like(weights)
    if gaps or counted:
        ends = steps["start_time_s"] + durations
        pairs = np.asarray(gaps + list(counted or ()), dtype=np.int64)
        extra = ends[pairs[:, 1]] - np.where(pairs[:, 0] >= 0, ends[np.maximum(pairs[:, 0], 0)], 0.0)
        durations = np.concatenate([durations, extra])
        counts = np.fromiter(counted.values(), dtype=np.float64, count=len(counted)) if counted else []
        weights = np.concatenate([weights, np.ones(len(gaps)), counts])
    return durations, weights


TOKEN_GAPS = "token_gaps.parquet"


def token_gap_table(runs: list[ReplayRun]) -> pd.DataFrame:
    """token_gaps.parquet: every inter-token gap of the run, the samples of summary.json's `itl_s`
    (and, with request classes, of each class's), as distinct values (`itl_s`) with how many gaps
    took each (`tokens`); per class (`class`) when the engine tracked classes."""
    names = runs[0].steps.class_names if runs else ()
    parts = [(name, [itl_samples(run, code) for run in runs]) for code, name in enumerate(names)] if names else \
        [(None, [itl_samples(run) for run in runs])]
    frames = []
    for name, samples in parts:
        values = np.concatenate([v for v, _ in samples]) if samples else np.zeros(0)
        weights = np.rint(np.concatenate([w for _, w in samples])).astype(np.int64) if samples else np.zeros(0, np.int64)
        keep = weights > 0
        distinct, index = np.unique(values[keep], return_inverse=True)
        frame = pd.DataFrame({"itl_s": distinct, "tokens": np.bincount(index, weights[keep]).astype(np.int64)
                              if distinct.size else np.zeros(0, np.int64)})
        if name is not None:
            frame.insert(0, "class", name)
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    if names:
        table["class"] = pd.Categorical(table["class"], categories=list(names))
    return table


def stored_and_wasted_slots(run: ReplayRun, config, finished: np.ndarray) -> tuple[int, int]:
    """Token slots the engine held for the finished requests at their end (lookahead included),
    and the slots of their last blocks left empty (internal fragmentation). Under the hybrid
    KV-cache manager, over all its groups (its own count: a window group holds only its window)."""
    slots = getattr(run.scheduler.kv_cache_manager, "finished_slots", None)
    if slots is not None:
        return int(slots[0]), int(slots[1])
    bs = config.kv_manager_block_size
    stored = np.minimum(run.requests.ints["num_computed_tokens"][finished] + config.num_lookahead_tokens,
                        config.max_model_len)
    held = -(-stored // bs)
    return int(stored.sum()), int((held * bs - stored).sum())


def summarize(run: ReplayRun, trace, config, backend, capacity, wall_time_s: float,
              requests: pd.DataFrame) -> dict:
    num_gpu_blocks = capacity if isinstance(capacity, int) else capacity.num_gpu_blocks
    block_bytes = 0 if isinstance(capacity, int) else capacity.kv_bytes_per_token * config.kv_manager_block_size
    steps = run.steps.columns()
    sched = run.scheduler
    kv = sched.kv_cache_manager
    finished = requests["status"].to_numpy() == "finished"
    stored, wasted = stored_and_wasted_slots(run, config, finished)
    frag = 100.0 * wasted / stored if stored else 0.0
    duration = float(steps["start_time_s"][-1] + steps["duration_s"][-1]) if run.steps.num_steps else 0.0
    duration = max(duration, run.requests.last_abort_s)  # (P/D: a replica stuck waiting may abort after its last step)
    stats = kv.prefix_cache_stats
    return {
        "backend": "sim",
        "cost_model": cost_model_summary(backend, [steps]),
        "config": config.to_dict() | {"num_gpu_blocks": num_gpu_blocks},
        "trace": str(trace.source),
        "num_requests": int(len(trace)),
        "num_finished": int(finished.sum()),
        "num_rejected": int((requests["status"].to_numpy() == "rejected").sum()),
        "duration_s": duration,
        "num_steps": int(run.steps.num_steps),
        "peak_running": int(steps["num_running"].max(initial=0)),
        "mean_running": float(steps["num_running"].mean()) if run.steps.num_steps else 0.0,
        "peak_waiting": int(steps["num_waiting"].max(initial=0)),
        "num_gpu_blocks": int(num_gpu_blocks),
        "peak_blocks_used": int(steps["num_blocks_used"].max(initial=0)),
        "num_preemptions": int(sched.num_preemptions),
        "num_preempted_requests": int(sched.num_preempted_requests),
        "prefix_cache_queries_tokens": int(stats.queries),
        "prefix_cache_hits_tokens": int(stats.hits),
        "prefix_cache_hit_rate": float(stats.hits / stats.queries) if stats.queries else 0.0,
        "prefix_cache": {"queries_new": stats.queries_new, "hits_new": stats.hits_new,
                         "queries_preempted": stats.queries_preempted, "hits_preempted": stats.hits_preempted},
        "num_evictions": int(kv.block_pool.num_evictions),
        "num_cow_copies": int(getattr(kv, "num_cow_copies", 0)),
        "num_swap_outs": int(sched.num_swap_outs),
        "peak_requests_swapped": int(steps["num_swapped"].max(initial=0)),
        "swap_out_bytes": int(sched.total_swap_out_blocks * block_bytes),
        "swap_in_bytes": int(sched.total_swap_in_blocks * block_bytes),
        "false_prefix_hits": int(getattr(kv, "num_false_prefix_hits", 0)),
        "internal_fragmentation_pct": frag,
        "allocator_stats": kv.allocator_stats(),
        "num_prefill_tokens": int(steps["num_prefill_tokens"].sum()),
        "num_decode_tokens": int(steps["num_decode_tokens"].sum()),
    } | pipeline_summary(run, duration) | session_summary(run) | client_summary(run, requests) | admission_summary([run]) | admission_limits_summary([steps]) | parallel_sampling_summary(config, trace, [run.requests]) | lora_summary(config, [run], trace, capacity, backend) | multimodal_summary([run], trace) | offload_summary(run, capacity, stats.queries) | kv_cache_groups_summary(config, capacity) | spec_summary(
        config, [sched], [backend], duration) | latencies_and_rates(
        requests, itl_distribution(run), duration, wall_time_s)


def cost_model_summary(backend, step_columns: list[dict]) -> dict:
    """The backend's description; for a calibrated cost model, with the replay's steps (of every
    engine in `step_columns`) that lie beyond the calibrated range (`calibrated_range`)."""
    out = backend.describe()
    fitted = getattr(backend, "fitted_range", None)
    if fitted is not None:
        from simkv.calibration.coverage import range_coverage

        merged = {k: np.concatenate([np.asarray(c[k]) for c in step_columns])
                  for k in ("num_prefill_tokens", "num_decode_tokens", "decode_context_tokens", "duration_s")}
        out["calibrated_range"] = range_coverage(fitted, merged)
    return out


def parallel_sampling_summary(config, trace, logs, ranks_per_row=None) -> dict:
    """Parallel sampling (a trace's `n` column): how many requests asked for more than one
    sequence, the sequences in all, and under the fan-out the prompt tokens their later members
    hit (their own group's prompt: what the prefix-cache hit rate gains from it, not reuse across
    requests); on data-parallel ranks, how many ranks a request's sequences ran on, on average."""
    if trace.n is None or not (trace.n > 1).any():
        return {}
    sampled = trace.n > 1
    out = {"mode": config.scheduler.parallel_sampling, "sampled_requests": int(sampled.sum()),
           "sequences": int(trace.n.sum())}
    if out["mode"] == "fan_out":
        out["later_members_prefix_hit_tokens"] = int(sum(log.member_hit_tokens for log in logs))
    if ranks_per_row:
        out["mean_ranks_per_sampled_request"] = float(np.mean(ranks_per_row))
    return {"parallel_sampling": out}


def parallel_sampling_row(section: dict) -> tuple[str, str]:
    """The report row of summary.json's `parallel_sampling` section (terminal table and report.html)."""
    text = (f"{section['sampled_requests']:,} requests for n > 1, {section['sequences']:,} sequences in all, "
            + ("fanned out (vLLM v1)" if section["mode"] == "fan_out" else "forked (vLLM v0)"))
    if "later_members_prefix_hit_tokens" in section:
        text += f"; later members hit {section['later_members_prefix_hit_tokens']:,} tokens of their group's prompt"
    if "mean_ranks_per_sampled_request" in section:
        text += f"; a request's sequences ran on {section['mean_ranks_per_sampled_request']:.2f} ranks on average"
    return "parallel sampling", text


def admission_summary(runs: list[ReplayRun], routing=None) -> dict:
    """vLLM's API-server admission control: summary.json's `admission_control` (the limits and
    the requests refused by each, summed over the front ends: every engine's, or data-parallel
    ranks' one, the routing's), only where a limit is set."""
    from simkv.replay.admission import merged_summary

    shared = getattr(routing, "queue_limits", None)
    front_ends = [shared] if shared is not None else [
        run.feed.queue_limits for run in runs if getattr(run.feed, "queue_limits", None) is not None]
    return {"admission_control": merged_summary(front_ends)} if front_ends else {}


def admission_limits_summary(step_columns: list[dict]) -> dict:
    """summary.json's `admission_limits`, over the steps of every engine in `step_columns`: the
    request-seconds requests spent waiting while steps ran (each step's duration times the
    requests it left waiting), and their share held by each limit that ended a step's
    admissions (simkv/core/admission_limits.py), largest first; also the steps each held."""
    waiting = np.concatenate([c["num_waiting"] for c in step_columns]) if step_columns else np.zeros(0)
    if not waiting.any():
        return {"admission_limits": {"waiting_request_s": 0.0, "steps_with_waiting": 0, "by_limit": {}}}
    codes = np.concatenate([c["admission_limit"] for c in step_columns])
    weight = np.concatenate([c["duration_s"] for c in step_columns]) * waiting
    held = waiting > 0
    request_s = np.bincount(codes[held], weights=weight[held], minlength=len(ADMISSION_LIMITS))
    steps = np.bincount(codes[held], minlength=len(ADMISSION_LIMITS))
    total = float(request_s.sum())
    order = sorted(np.flatnonzero(steps), key=lambda k: (-request_s[k], k))
    return {"admission_limits": {
        "waiting_request_s": total, "steps_with_waiting": int(held.sum()),
        "by_limit": {ADMISSION_LIMITS[k]: {"share": float(request_s[k] / total) if total else 0.0,
                                           "waiting_request_s": float(request_s[k]), "steps": int(steps[k])}
                     for k in order}}}


def largest_admission_limit(summary: dict) -> str | None:
    """'kv_cache 86 %': the first of a summary's `admission_limits` (the largest share of the
    waiting time); '' when nothing waited, None for a summary without the breakdown."""
    limits = summary.get("admission_limits")
    if limits is None:
        return None
    for name, v in limits["by_limit"].items():
        return f"{name} {100 * v['share']:.0f} %"
    return ""


def multimodal_summary(runs: list[ReplayRun], trace) -> dict:
    """Multimodal items (simkv/core/encoder_cache.py), over the runs (a fleet's replicas): the
    trace's items, those the encoder ran (an item runs again after a preemption or an eviction
    from the encoder cache; an item found in the encoder cache or under a prefix hit does not),
    vLLM's encoder budget and cache (each engine's), how often a prefill chunk stopped before an
    item, and the encoder's time."""
    caches = [run.scheduler.encoder_cache for run in runs]
    if caches[0] is None or getattr(trace, "mm_items", None) is None:
        return {}
    encoder = runs[0].encoder[0]
    return {"multimodal": {
        "items": int(len(trace.mm_items)), "item_tokens": int(trace.mm_items[:, 1].sum()),
        "items_encoded": sum(run.scheduler.num_encoded_items for run in runs),
        "embeds_encoded": sum(run.scheduler.num_encoded_embeds for run in runs),
        "encoder_budget_per_step": runs[0].scheduler.encoder_budget, "encoder_cache_size": caches[0].cache_size,
        "encoder_cache_evictions": sum(cache.num_evicted_entries for cache in caches),
        "chunks_stopped_before_item": sum(run.scheduler.num_encoder_stops for run in runs),
        "encoder_seconds": sum(run.encoder[1] for run in runs),
        "encoder_cost": encoder.describe() if encoder is not None else
        "not priced (the unit cost model, or a model spec without a vision encoder)"}
        | ({"items_loaded_from_store": sum(run.scheduler.num_loaded_items for run in runs),
            "store_read_seconds": sum(run.encoder[2] for run in runs)}
           if runs[0].scheduler.ec_store is not None else {})}


def lora_summary(config, runs, trace, capacity=None, backend=None, configs=None) -> dict:
    """LoRA (--enable-lora): the adapters the trace names, max_loras (the largest of `configs`,
    a fleet's replicas, where replica sets make it differ), how often a waiting
    request was passed over for want of an adapter slot (once per request and step), the
    worker's adapter loads (from disk into its max_cpu_loras host cache, into a GPU slot) and the
    seconds they held up steps, over every engine, the GPU memory the slots take from the KV
    cache (None: not modelled for this architecture), and whether the cost model prices the
    adapters' kernels (the roofline does, for dense decoders)."""
    if not config.scheduler.enable_lora:
        return {}
    from simkv.traces.lora import named_adapters

    sc = config.scheduler
    loads = [run.adapters.summary() for run in runs if run.adapters is not None]
    out = {"adapters": len(set(named_adapters(trace))),
           "max_loras": max(c.scheduler.max_loras for c in configs or [config]),
           "max_cpu_loras": sc.cpu_loras, "max_lora_rank": sc.max_lora_rank,
           "deferrals": int(sum(run.scheduler.num_lora_deferrals for run in runs)),
           "disk_loads": sum(x["disk_loads"] for x in loads), "slot_loads": sum(x["slot_loads"] for x in loads),
           "load_seconds": float(sum(x["load_seconds"] for x in loads)), "lora_load_gbs": sc.lora_load_gbs}
    if capacity is not None and not isinstance(capacity, int):  # (a fleet's replicas: the largest)
        capacities = capacity if isinstance(capacity, (list, tuple)) else [capacity]
        sizes = [cap.lora_bytes for cap in capacities]
        out["slots_gib_per_gpu"] = None if None in sizes else max(sizes) / (1 << 30)
    if backend is not None:
        from simkv.backends.lora_adapters import lora_priced

        out["compute_modelled"] = lora_priced(backend)
    return {"lora": out}


def client_summary(run: ReplayRun, requests: pd.DataFrame) -> dict:
    """Clients that give up and retry (simkv/replay/client_timeouts.py): summary.json's `client`."""
    summary = getattr(run.feed, "client_summary", None)
    return {"client": summary(requests)} if summary is not None else {}


def session_summary(run: ReplayRun) -> dict:
    """Session pacing (simkv/replay/sessions.py): sessions, and the turns held for their previous
    replies (how many, and by how long on average); or a client's concurrency limit and the
    requests it held."""
    pacing = getattr(run.feed, "pacing_summary", None)
    return pacing() if pacing is not None else {}


def offload_summary(runs, capacity, prefix_queries: int) -> dict:
    """KV offloading (core/kv_offload.py): the CPU tier's use, its hits and the host link's bytes,
    of one engine or summed over a fleet's replicas (each has its own tier: `cpu_chunks`,
    `cpu_tier_gib` and `chunk_tokens` are one replica's, the largest where replica sets make
    them differ; `cpu_chunks_used` the largest). `capacity`: the engine's, or one per replica."""
    if not isinstance(runs, (list, tuple)):
        runs = [runs]
    if runs[0].scheduler.offload is None:
        return {}
    capacities = capacity if isinstance(capacity, (list, tuple)) else [capacity] * len(runs)
    per_run = [run.scheduler.offload.stats() for run in runs]
    stats = {key: sum(s[key] for s in per_run) for key in per_run[0]}
    for key in ("cpu_chunks", "chunk_tokens", "cpu_chunks_used", "store_threshold"):
        if key in stats:
            stats[key] = max(s[key] for s in per_run)
    feeds = [run.feed for run in runs]
    loads = stats["loads"]
    load_ticks = sum(feed.load_ticks for feed in feeds)
    return {"kv_offloading": stats | {
        "cpu_tier_gib": max(cap.num_offload_chunks * feed.chunk_bytes for cap, feed in zip(capacities, feeds))
        / (1 << 30),
        "hit_rate": stats["loaded_tokens"] / prefix_queries if prefix_queries else 0.0,
        "load_bytes": int(sum(feed.load_bytes for feed in feeds)),
        "store_bytes": int(sum(feed.store_bytes for feed in feeds)),
        "mean_load_s": load_ticks / loads / TICKS_PER_SECOND if loads else 0.0}}


def kv_cache_groups_summary(config, capacity=None) -> dict:
    """summary.json's `kv_cache_groups` section, for models with sliding-window or linear-attention
    layers only (`block_bytes`: one block on one GPU, to compare pools whose blocks hold different
    layers)."""
    if not (config.has_sliding_window or config.has_linear_attention):
        return {}
    groups = config.kv_cache_groups
    section = groups.describe() | {"summary": groups.summary(), "hybrid_kv_cache_manager": groups.is_hybrid}
    block_bytes = getattr(capacity, "block_bytes", 0)
    if block_bytes:
        section["block_bytes"] = block_bytes
    if config.has_linear_attention:  # (a state per layer and request, padded to an attention layer's page)
        linear = section["linear_attention"] = {
            "kind": config.hardware.model_spec().linear_attention, "state_bytes_per_layer": config.linear_state_bytes,
            "state_blocks_per_request": config.state_blocks_per_request,
            "mamba_cache_mode": "align" if config.mamba_align else "none"}
        if config.mamba_align:  # (whether the prefill kernels export states from inside a chunk)
            linear["prefill_checkpoints"] = config.mamba_prefill_checkpoints
        if block_bytes:
            linear["page_bytes_per_layer"] = block_bytes // groups.layers_per_block
    return {"kv_cache_groups": section}


def kv_cache_groups_rows(section: dict) -> list[tuple[str, str]]:
    """The report rows of summary.json's `kv_cache_groups` section (kv_cache_groups_summary)."""
    rows = [("KV-cache groups", f"{section['summary']}, {section['layers_per_block']} layers per block"
             if section["hybrid_kv_cache_manager"] else "one (hybrid KV-cache manager disabled)")]
    linear = section.get("linear_attention")
    if linear:
        rows.append(("linear-attention state", f"{linear['kind']}: {linear['state_bytes_per_layer']:,} B a layer, "
                                               f"{linear['state_blocks_per_request']} blocks a request"))
        if linear.get("mamba_cache_mode") == "align":
            rows.append(("linear-attention prefix caching",
                         "states cached at block boundaries (vLLM's mamba_cache_mode 'align'), "
                         + ("prefill checkpoints inside chunks" if linear["prefill_checkpoints"]
                            else "no checkpoints inside prefill chunks")))
    return rows


def spec_summary(config, schedulers, backends, duration: float) -> dict:
    """summary.json's `speculative_decoding` section (nothing without it), over all engines.
    vLLM's figures: mean acceptance length = 1 + accepted / drafts (tokens a verifying step
    keeps), per-position rate = drafts accepted at position i / drafts."""
    spec = config.speculative
    if not spec.enabled:
        return {}
    k = spec.num_speculative_tokens
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_padded": 0}
    per_position = [0] * k
    for sched in schedulers:
        for key in total:
            total[key] += sched.spec_stats[key]
        per_position = [a + b for a, b in zip(per_position, sched.spec_stats["accepted_per_position"])]
    drafts, tokens = total["num_drafts"], total["num_draft_tokens"]
    draft_s = sum(getattr(b, "draft_seconds", 0.0) for b in backends)
    return {"speculative_decoding": {
        "method": spec.speculative_method, "num_speculative_tokens": k,
        "model_runner": config.model_runner_in_force,  # (vLLM's: where an n-gram lookup runs)
        "acceptance_rates_configured": [round(r, 6) for r in spec.conditional_acceptance_rates],
        **total,
        "draft_acceptance_rate": total["num_accepted_tokens"] / tokens if tokens else 0.0,
        "mean_acceptance_length": 1.0 + total["num_accepted_tokens"] / drafts if drafts else 1.0,
        "per_position_acceptance_rate": [a / drafts if drafts else 0.0 for a in per_position],
        "drafter_time_s": draft_s,
        "drafter_time_share": draft_s / (duration * len(schedulers)) if duration > 0 else 0.0,
    }}


def latencies_and_rates(requests: pd.DataFrame, itl: dict, duration: float, wall_time_s: float) -> dict:
    """The summary's latency distributions (ITL given), throughputs over `duration`, and wall time."""
    finished = requests["status"].to_numpy() == "finished"
    out_tokens = int(requests["output_tokens"].to_numpy()[finished].sum())
    return {
        "ttft_s": dist(requests["ttft_s"].to_numpy()),
        "itl_s": itl,
        "tpot_s": dist(requests["mean_itl_s"].to_numpy()),
        "e2e_s": dist(requests["e2e_s"].to_numpy()),
        "queue_s": dist(requests["queue_s"].to_numpy()),
        "output_throughput_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "request_throughput_req_s": float(finished.sum()) / duration if duration > 0 else 0.0,
        "wall_time_s": wall_time_s,
    }


def _write_parquet(frame: pd.DataFrame, path: Path) -> None:
    table = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)
    atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def steps_frame(steps: dict) -> pd.DataFrame:
    """steps.parquet's table: the step log's columns, each step's admission limit by name."""
    frame = pd.DataFrame(steps)
    if "admission_limit" in frame and frame["admission_limit"].dtype.kind in "iu":
        frame["admission_limit"] = pd.Categorical.from_codes(frame["admission_limit"].to_numpy(), ADMISSION_LIMITS)
    return frame


def write_outputs(out_dir: Path, summary: dict, requests: pd.DataFrame, steps: dict,
                  token_gaps: pd.DataFrame | None = None) -> None:
    """All the files, each written to a temporary name and renamed into place (summary.json last)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_parquet(requests, out_dir / "requests.parquet")
    _write_parquet(steps_frame(steps), out_dir / "steps.parquet")
    if token_gaps is not None:
        _write_parquet(token_gaps, out_dir / TOKEN_GAPS)
    text = json.dumps(summary, indent=2, sort_keys=False) + "\n"
    atomic_write(out_dir / "summary.json", lambda tmp: Path(tmp).write_text(text))
