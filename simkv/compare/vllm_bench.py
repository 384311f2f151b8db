"""A run measured by vLLM's benchmark client, read as `simkv compare`'s measured side.

`vllm bench serve --dataset-name timed_trace --save-result --save-detailed` writes one JSON
object: the run's aggregates (``duration``, ``completed``, ``request_throughput``, ...) and, per
request in the order the dataset listed them, ``input_lens``, ``output_lens``, ``ttfts``,
``itls`` (the gaps between streamed chunks), ``latencies``, ``start_times`` and ``errors``
(``server_queue_times`` too when the server reports them). The client measures TTFT and latency
from the moment it sent the request; it records neither engine steps nor the cache, so those
metrics come from two snapshots of the server's Prometheus ``/metrics`` when given (counters
``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``, ``vllm:num_preemptions``).

Request i of the benchmark is request i of the simulated run (both replay the exported trace in
its arrival order); their prompt and output lengths must agree, or the two are not comparable.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.replay.results import dist

DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors")
COUNTERS = {"prefix_cache_queries": "vllm:prefix_cache_queries_total", "prefix_cache_hits": "vllm:prefix_cache_hits_total",
            "num_preemptions": "vllm:num_preemptions_total"}


def is_vllm_bench_result(path: str | Path) -> bool:
    return Path(path).is_file() and str(path).endswith(".json")


def read_bench_result(path: str | Path) -> dict:
    """The benchmark's JSON, checked for the per-request lists (one-line ValueError otherwise)."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); `vllm bench serve --append-result` "
                         f"files hold several runs: keep one") from None
    if not isinstance(result, dict) or "duration" not in result:
        raise ValueError(f"{path}: not a `vllm bench serve --save-result` file (no 'duration')")
    missing = [k for k in DETAILED if k not in result]
    if missing:
        raise ValueError(f"{path}: no per-request field(s) {', '.join(missing)}: run `vllm bench serve` "
                         f"with --save-detailed")
    n = len(result["ttfts"])
    for key in DETAILED:
        if len(result[key]) != n:
            raise ValueError(f"{path}: field '{key}' has {len(result[key])} entries, 'ttfts' {n}")
    return result


def read_prometheus_counters(path: str | Path) -> dict[str, float]:
    """The vLLM counters simkv compares, summed over their label sets, from a /metrics text dump."""
    wanted = {name: key for key, name in COUNTERS.items()}
    out = {key: 0.0 for key in COUNTERS}
    seen = set()
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            try:
                rest = line[line.rindex("}") + 1:] if "{" in line else line[len(name):]
                value = float(rest.split()[0])  # (a sample may carry a timestamp after its value)
            except (ValueError, IndexError):
                raise ValueError(f"{path}, line {number}: cannot read the value of '{name}'") from None
            out[wanted[name]] += value
            seen.add(wanted[name])
    if not seen:
        raise ValueError(f"{path}: none of {', '.join(COUNTERS.values())} found: is it a vLLM server's /metrics?")
    return out


def server_counters(before: str | Path, after: str | Path) -> dict:
    """What the server counted during the benchmark: the counters' differences."""
    a, b = read_prometheus_counters(before), read_prometheus_counters(after)
    diff = {key: b[key] - a[key] for key in COUNTERS}
    if any(v < 0 for v in diff.values()):
        raise ValueError(f"{after}: counters lower than in {before}: swapped, or the server restarted between them")
    return diff


def load_bench_run(path: str | Path, sim_requests: pd.DataFrame,
                   metrics: tuple[str, str] | None = None) -> tuple[dict, pd.DataFrame, np.ndarray]:
    """(summary, requests, inter-token gaps) of a benchmark run in the shape of a replay's,
    matched to the simulated run's requests by order, or by name for a trace imported from the
    result (`_in_bench_order`)."""
    result = read_bench_result(path)
    n = len(result["ttfts"])
    sim_requests = _in_bench_order(sim_requests, result, path)
    if n != len(sim_requests):
        raise ValueError(f"{path}: the benchmark sent {n:,} requests, the simulated run replayed "
                         f"{len(sim_requests):,}: give `vllm bench serve` --num-prompts {len(sim_requests)}, "
                         f"or replay the same rows")
    # (the client counts the prompt's text; the server, and simkv, its image placeholders too)
    images = (sim_requests["mm_tokens"].fillna(0).to_numpy(np.int64) if "mm_tokens" in sim_requests
              else np.zeros(n, np.int64))
    prompt = np.asarray(result["input_lens"], dtype=np.int64) + images
    differs = prompt != sim_requests["prompt_tokens"].to_numpy()
    if differs.any():
        i = int(np.argmax(differs))
        text = f" ({images[i]} of them the images')" if images[i] else ""
        raise ValueError(f"{path}: request {i} has {prompt[i] - images[i]} prompt tokens, the simulated run's "
                         f"'{sim_requests['request_id'].iloc[i]}' {sim_requests['prompt_tokens'].iloc[i]}{text}: "
                         f"not the trace the simulation replayed (simulate the .parquet `simkv trace export` wrote)")
    ok = np.array([not e for e in result["errors"]])
    ttft = np.where(ok, np.asarray(result["ttfts"], dtype=float), np.nan)
    e2e = np.where(ok, np.asarray(result["latencies"], dtype=float), np.nan)
    out_tokens = np.where(ok, np.asarray(result["output_lens"], dtype=np.int64), 0)
    start = np.asarray(result["start_times"], dtype=float)
    queue = result.get("server_queue_times")
    queue = np.array([np.nan if q is None else q for q in queue], dtype=float) if queue else np.full(n, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out_tokens > 1, (e2e - ttft) / (out_tokens - 1), np.nan)
    requests = pd.DataFrame({
        "request_id": sim_requests["request_id"].to_numpy(),
        "sent_time_s": start - start.min() if n else start,
        "status": np.where(ok, "finished", "failed"),
        "prompt_tokens": prompt, "output_tokens": out_tokens,
        "queue_s": np.where(ok, queue, np.nan), "ttft_s": ttft, "e2e_s": e2e, "mean_itl_s": tpot})
    itls = np.array([g for gaps, good in zip(result["itls"], ok) if good for g in gaps], dtype=float)
    completed = int(ok.sum())
    summary = {
        "backend": "vllm-bench", "device": result.get("model_id"),
        "config": {}, "trace": None, "num_requests": n, "num_finished": completed,
        "duration_s": float(result["duration"]),
        "request_throughput_req_s": completed / result["duration"] if result["duration"] else 0.0,
        "output_throughput_tok_s": int(out_tokens.sum()) / result["duration"] if result["duration"] else 0.0,
        "ttft_s": dist(ttft), "itl_s": dist(itls), "tpot_s": dist(tpot), "e2e_s": dist(e2e), "queue_s": dist(queue),
        "vllm_bench": {key: result.get(key) for key in ("date", "backend", "model_id", "label", "num_prompts",
                                                        "request_rate", "max_concurrency", "completed", "failed")},
        "client_send_lag_s": send_lag(start, sim_requests),
    }
    summary["vllm_aggregates"] = own_aggregates_agree(result, summary)
    if metrics:
        counted = server_counters(*metrics)
        q, h = counted["prefix_cache_queries"], counted["prefix_cache_hits"]
        summary |= {"num_preemptions": int(counted["num_preemptions"]),
                    "prefix_cache_hit_rate": h / q if q else 0.0, "server_metrics": counted}
    return summary, requests, itls


#: The client's own aggregates (milliseconds) and the summary's distributions they must equal.
AGGREGATES = {"mean_ttft_ms": ("ttft_s", "mean"), "median_ttft_ms": ("ttft_s", "p50"), "p99_ttft_ms": ("ttft_s", "p99"),
              "mean_itl_ms": ("itl_s", "mean"), "median_itl_ms": ("itl_s", "p50"), "p99_itl_ms": ("itl_s", "p99"),
              "mean_tpot_ms": ("tpot_s", "mean"), "median_tpot_ms": ("tpot_s", "p50"), "p99_tpot_ms": ("tpot_s", "p99"),
              "mean_e2el_ms": ("e2e_s", "mean"), "median_e2el_ms": ("e2e_s", "p50"), "p99_e2el_ms": ("e2e_s", "p99")}


def own_aggregates_agree(result: dict, summary: dict) -> dict:
    """Do the distributions read from the per-request lists equal the aggregates the client
    printed into the same file? (They differ if the file was edited or the format moved.)"""
    worst, checked = 0.0, 0
    for key, (metric, stat) in AGGREGATES.items():
        theirs, ours = result.get(key), (summary.get(metric) or {}).get(stat)
        if theirs is None or ours is None:
            continue
        checked += 1
        worst = max(worst, abs(1e3 * ours - theirs) / max(abs(theirs), 1e-9))
    return {"checked": checked, "max_rel_difference": worst, "agree": worst < 1e-6}


def _in_bench_order(sim_requests: pd.DataFrame, result: dict, path) -> pd.DataFrame:
    """The simulated requests in the benchmark's order. A trace imported from this result
    (`simkv trace import vllm-bench`) names request i `bench-<i>` (sorting by send time may have
    moved it, and failed requests were dropped: they are compared as failed, with no simulated
    twin); an exported trace is in the benchmark's order already."""
    from simkv.traces.importers.vllm_bench import REQUEST_ID_PREFIX

    ids = sim_requests["request_id"].astype(str)
    if not (len(ids) and ids.str.startswith(REQUEST_ID_PREFIX).all()):
        return sim_requests.reset_index(drop=True)
    n = len(result["ttfts"])
    index = {f"{REQUEST_ID_PREFIX}{i}": i for i in range(n)}
    positions = ids.map(index)
    if positions.isna().any():
        raise ValueError(f"{path}: the simulated run's request '{ids[positions.isna()].iloc[0]}' is not one of this "
                         f"benchmark's {n:,} requests: was its trace imported from another result?")
    failed = {i for i, e in enumerate(result["errors"]) if e}
    frame = sim_requests.set_index(positions.astype(int).to_numpy())
    missing = sorted(set(range(n)) - set(frame.index))
    if set(missing) - failed:
        raise ValueError(f"{path}: request {min(set(missing) - failed)} is not in the simulated run (only failed "
                         f"requests may be missing): was its trace imported from another result?")
    filler = pd.DataFrame({"request_id": [f"{REQUEST_ID_PREFIX}{i}" for i in missing],
                           "prompt_tokens": np.asarray(result["input_lens"], dtype=np.int64)[missing],
                           "status": "failed", "arrival_time_s": np.nan}, index=missing)
    return pd.concat([frame, filler]).sort_index().reset_index(drop=True)


def send_lag(start_times: np.ndarray, sim_requests: pd.DataFrame) -> dict | None:
    """How late the client sent each request against the simulated arrivals, both counted from
    the first request (the client's clock has another origin). A measured TTFT starts at the send,
    a simulated one at the arrival: a lag that grows means the client fell behind the trace."""
    if not len(start_times):
        return None
    arrival = sim_requests["arrival_time_s"].to_numpy(dtype=float)
    known = np.isfinite(arrival)
    if not known.any():
        return None
    first = int(np.argmax(known))
    lag = ((start_times - start_times[first]) - (arrival - arrival[first]))[known]
    return {"median": float(np.median(lag)), "p99": float(np.percentile(lag, 99)), "max": float(np.abs(lag).max())}
