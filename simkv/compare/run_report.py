"""report.html for one replay: KV usage, running/waiting over time, preemptions, prefix hits,
TTFT/ITL CDFs. Reads only the replay's output folder (summary.json, requests/steps.parquet,
token_gaps.parquet)."""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.compare.svg import cdf_chart, line_chart, page
from simkv.replay.classes import request_labels
from simkv.replay.results import TOKEN_GAPS, kv_cache_groups_rows, largest_admission_limit


def load_run(run_dir: str | Path) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    run_dir = Path(run_dir)
    missing = [f for f in ("summary.json", "requests.parquet", "steps.parquet") if not (run_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a replay output folder (missing {', '.join(missing)})")
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, pd.read_parquet(run_dir / "requests.parquet"), pd.read_parquet(run_dir / "steps.parquet")


def token_itl(steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Inter-token gaps as (value, weight) from the steps alone: each step's duration counts once
    per decode token in it (a folder without token_gaps.parquet; it misses the gaps of preempted,
    stalled and pipelined requests, which span several steps)."""
    w = steps["num_decode_tokens"].to_numpy()
    return steps["duration_s"].to_numpy(), w


def load_token_gaps(run_dir: str | Path, steps: pd.DataFrame) -> pd.DataFrame:
    """The run's inter-token gaps (`itl_s`, `tokens`, per `class` where it has classes): its
    token_gaps.parquet, the samples of summary.json's `itl_s`; for a folder written before that
    file existed, approximated from its steps (`token_itl`)."""
    path = Path(run_dir) / TOKEN_GAPS
    if path.is_file():
        return pd.read_parquet(path)
    values, weights = token_itl(steps)
    return pd.DataFrame({"itl_s": values, "tokens": weights})


def gap_samples(gaps: pd.DataFrame, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(values, counts) of `load_token_gaps`'s table: all of them, or one class's."""
    if name is not None:
        gaps = gaps[gaps["class"] == name]
    return gaps["itl_s"].to_numpy(), gaps["tokens"].to_numpy()


def expand_weighted(values: np.ndarray, weights: np.ndarray, limit: int = 20000) -> np.ndarray:
    """Samples of a weighted distribution (for CDF plots), at most `limit` of them."""
    weights = np.asarray(weights, dtype=np.int64)
    total = int(weights.sum())
    if total == 0:
        return np.zeros(0)
    if total <= limit:
        return np.repeat(values, weights)
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    q = (np.arange(limit) + 0.5) / limit * total
    return values[order][np.searchsorted(cum, q, side="right").clip(max=len(order) - 1)]


def _summary_table(summary: dict) -> str:
    rows = [("backend", summary.get("backend")), ("cost model", (summary.get("cost_model") or {}).get("cost_model")),
            ("device", summary.get("device_name") or summary.get("device") or "-"),
            ("scheduling", "async" if (summary.get("config") or {}).get("async_scheduling") else "synchronous"),
            ("requests finished", summary.get("num_finished")), ("duration (s)", summary.get("duration_s")),
            ("steps", summary.get("num_steps")), ("throughput (req/s)", summary.get("request_throughput_req_s")),
            ("output throughput (tok/s)", summary.get("output_throughput_tok_s")),
            ("peak running", summary.get("peak_running")), ("preemptions", summary.get("num_preemptions")),
            ("prefix cache hit rate", summary.get("prefix_cache_hit_rate"))]
    limits = summary.get("admission_limits")
    if limits and limits["waiting_request_s"]:
        rows.append(("waiting held by (time share)", ", ".join(
            f"{name} {100 * v['share']:.1f} %" for name, v in limits["by_limit"].items())))
    groups = summary.get("kv_cache_groups")
    if groups:
        rows.insert(1, ("model", (summary.get("config") or {}).get("model")))
        rows += kv_cache_groups_rows(groups)
    if summary.get("cost"):  # (simkv replay --gpu-price)
        from simkv.studies.serving_cost import describe_replay_cost

        rows.append(("cost", describe_replay_cost(summary["cost"])))
    from simkv.replay.sessions import pacing_rows

    rows += pacing_rows(summary)
    if summary.get("client"):
        from simkv.replay.client_timeouts import client_row

        rows += filter(None, [client_row(summary["client"])])
    if summary.get("parallel_sampling"):
        from simkv.replay.results import parallel_sampling_row

        rows.append(parallel_sampling_row(summary["parallel_sampling"]))
    if summary.get("pipeline"):
        from simkv.replay.pipeline import pipeline_row

        rows.append(pipeline_row(summary["pipeline"]))
    lora = summary.get("lora")
    if lora:
        memory = (f", slots {lora['slots_gib_per_gpu']:.2f} GiB a GPU" if lora.get("slots_gib_per_gpu") is not None
                  else "")
        rows.append(("LoRA adapters", f"{lora['adapters']} named, max_loras {lora['max_loras']} (rank "
                                      f"{lora['max_lora_rank']}{memory}); {lora['deferrals']:,} request-steps "
                                      f"waited for a slot"))
    spec = summary.get("speculative_decoding")
    if spec:
        rows.append(("speculative decoding", f"{spec['method']}, K={spec['num_speculative_tokens']}: "
                                             f"{spec['mean_acceptance_length']:.2f} tokens per verifying step, "
                                             f"drafter {100 * spec['drafter_time_share']:.1f} % of the time"))
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "queue_s") if spec else ("ttft_s", "itl_s", "e2e_s", "queue_s"):
        d = summary.get(key) or {}
        if d.get("mean") is not None:
            rows.append((f"{key[:-2]} mean / p50 / p99 (ms)",
                         f"{1e3 * d['mean']:.2f} / {1e3 * d['p50']:.2f} / {1e3 * d['p99']:.2f}"))
    goodput = summary.get("goodput")
    if goodput:
        from simkv.replay.goodput import describe_slo

        rows.append((f"goodput ({describe_slo(goodput['slo_ms'])})",
                     f"{goodput['request_goodput_req_s']:,.3f} req/s, {100 * goodput['slo_attainment']:.1f} % of requests"))

    def fmt(v):
        return f"{v:,.4g}" if isinstance(v, float) else html.escape(str(v))

    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{fmt(v)}</td></tr>" for k, v in rows) + "</table>"


MAX_REPLICA_SERIES = 8


def _per_replica(steps: pd.DataFrame, label: str, values) -> list[tuple]:
    """Chart series: one per replica of a fleet (the first MAX_REPLICA_SERIES), or one."""
    t = (steps["start_time_s"] + steps["duration_s"]).to_numpy()
    y = np.asarray(values)
    if "replica" not in steps:
        return [(label, t, y)]
    replica = steps["replica"].to_numpy()
    if "pool" in steps:  # P/D: each pool's replicas
        names = steps["pool"].to_numpy().astype(str) + " " + replica.astype(str)
        return [(f"{label}, {name}", t[names == name], y[names == name])
                for name in list(dict.fromkeys(names))[:MAX_REPLICA_SERIES]]
    return [(f"{label}, replica {r}", t[replica == r], y[replica == r])
            for r in np.unique(replica)[:MAX_REPLICA_SERIES]]


def run_report_html(run_dir: str | Path) -> str:
    summary, requests, steps = load_run(run_dir)
    blocks = max(int(summary.get("num_gpu_blocks") or 1) - 1, 1)
    if "pool" in steps and summary.get("disaggregation"):  # P/D: each pool's own pool of blocks
        pools = summary["disaggregation"]
        blocks = steps["pool"].map({name: max(int(pools[name]["num_gpu_blocks"]) - 1, 1)
                                    for name in ("prefill", "decode")}).to_numpy()
    kv = 100.0 * steps["num_blocks_used"].to_numpy() / blocks
    by_time = steps.sort_values(["start_time_s", "duration_s"], kind="stable") if "replica" in steps else steps
    t = (by_time["start_time_s"] + by_time["duration_s"]).to_numpy()
    charts = [
        line_chart(_per_replica(steps, "KV blocks used %", kv), "KV cache usage", "time (s)", "% of blocks", step=True),
        line_chart(_per_replica(steps, "running", steps["num_running"]) + _per_replica(steps, "waiting", steps["num_waiting"]),
                   "Running and waiting requests", "time (s)", "requests", step=True),
        line_chart([("preemptions", t, np.cumsum(by_time["num_preemptions"].to_numpy()))],
                   "Preemptions (cumulative)", "time (s)", "preemptions", step=True),
        line_chart([("prefix hit tokens", t, np.cumsum(by_time["prefix_hit_tokens"].to_numpy())),
                    ("prefix query tokens", t, np.cumsum(by_time["prefix_query_tokens"].to_numpy()))],
                   "Prefix cache (cumulative tokens)", "time (s)", "tokens", step=True),
    ]
    if "admission_limit" in by_time:
        charts.append(_held_by_chart(by_time, t))
    pools = summary.get("disaggregation") or {}
    for title, scaling in (("Autoscaled replicas", (summary.get("fleet") or {}).get("autoscaling")),
                           ("Autoscaled prefill replicas", (pools.get("prefill") or {}).get("autoscaling")),
                           ("Autoscaled decode replicas", (pools.get("decode") or {}).get("autoscaling"))):
        if scaling:  # (an autoscaled fleet or P/D pool: its replicas up and starting over time)
            points = scaling["timeline"] + [scaling["timeline"][-1] | {"time_s": summary.get("duration_s") or 0.0}]
            times = np.array([p["time_s"] for p in points])
            charts.append(line_chart([("up", times, np.array([p["ready"] for p in points])),
                                      ("starting", times, np.array([p["starting"] for p in points]))],
                                     title, "time (s)", "replicas", step=True))
            if (scaling.get("decisions") or {}).get("time_s"):  # (a replay shorter than a decision interval has none)
                charts.append(_autoscaler_readings(scaling, title))
    nodes = ((summary.get("fleet") or {}).get("autoscaling") or pools.get("autoscaling") or {}).get("nodes")
    if nodes and nodes["timeline"]:  # (the GPU nodes under the replicas: what was paid)
        points = nodes["timeline"] + [nodes["timeline"][-1] | {"time_s": summary.get("duration_s") or 0.0}]
        charts.append(line_chart([("nodes", np.array([p["time_s"] for p in points]),
                                   np.array([p["nodes"] for p in points]))],
                                 f"GPU nodes ({nodes['gpus_per_node']} GPU{'s' if nodes['gpus_per_node'] != 1 else ''} "
                                 "each)", "time (s)", "nodes", step=True))
    fin = requests[requests["status"] == "finished"]
    gaps = load_token_gaps(run_dir, steps)
    classes = summary.get("classes")
    found = request_labels(requests) if classes else None
    label = found[1][(requests["status"] == "finished").to_numpy()] if found is not None else None
    if label is not None:  # (one TTFT line per request class)
        ttft = [(name, 1e3 * fin["ttft_s"].to_numpy()[label == name]) for name in classes["classes"]
                if (label == name).any()][:MAX_REPLICA_SERIES]
    else:
        ttft = [("TTFT", 1e3 * fin["ttft_s"].to_numpy())]
    if "class" in gaps:  # (one ITL line per request class)
        itl = [(name, 1e3 * expand_weighted(*gap_samples(gaps, name))) for name in classes["classes"]
               if gaps.loc[gaps["class"] == name, "tokens"].sum() > 0][:MAX_REPLICA_SERIES]
    else:
        itl = [("ITL", 1e3 * expand_weighted(*gap_samples(gaps)))]
    charts.append(_ttft_over_time(fin, label, list(classes["classes"]) if label is not None else []))
    charts += [cdf_chart(ttft, "TTFT CDF", "TTFT (ms)"),
               cdf_chart(itl, "Inter-token latency CDF", "ITL (ms)"),
               line_chart(_per_replica(steps, "step duration", 1e3 * steps["duration_s"].to_numpy()),
                          "Step durations", "time (s)", "ms")]
    body = [f"<p>trace: {html.escape(str(summary.get('trace')))}</p>", _summary_table(summary)]
    if summary.get("fleet"):
        body.append(_replica_table(summary["fleet"]))
    if summary.get("disaggregation"):
        body.append(_pool_table(summary["disaggregation"]))
    if classes:
        body.append(_class_table(classes))
    body.append("<div class='charts'>" + "".join(charts) + "</div>")
    return page(f"simkv replay report ({summary.get('backend')})", body)


def _autoscaler_readings(scaling: dict, title: str) -> str:
    """Each metric as the autoscaler read it at its decisions, over what it aims at (1: on
    target; a summed gauge over its target times the replicas it had, a latency over its own),
    beside the replicas its metrics asked for."""
    from simkv.replay.autoscale import METRICS, section_targets

    decisions = scaling["decisions"]
    times = np.asarray(decisions["time_s"], dtype=float)
    have = np.asarray(decisions["replicas"], dtype=float)
    targets = section_targets(scaling)
    series = []
    for name, target in targets:
        values = np.array([np.nan if v is None else v for v in decisions.get(name, [])], dtype=float)
        summed = name in METRICS or scaling.get("latency_target_type") == "AverageValue"  # (read as a sum)
        aim = target * have if summed else np.full(len(values), target)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = values / aim
        ok = np.isfinite(ratio)
        series.append((f"{name} / target", times[ok], ratio[ok]))
    series.append(("on target", times[[0, -1]], np.ones(2)))
    readings = line_chart(series, f"{title}: metrics at each decision", "time (s)", "reading / target", step=True)
    wanted = line_chart([("asked for", times, np.asarray(decisions["wanted"], dtype=float)), ("had", times, have)],
                        f"{title}: replicas asked for at each decision", "time (s)", "replicas", step=True)
    return readings + wanted


TTFT_WINDOWS = 60  # the TTFT-over-time chart's windows of arrival time


def _ttft_over_time(fin: pd.DataFrame, labels: np.ndarray | None, classes: list[str]) -> str:
    """TTFT p50 and p99 of the finished requests by arrival window (the run's span in
    TTFT_WINDOWS), per request class where the trace has classes (the first few): when in the
    trace the latencies broke, which a whole-run distribution hides."""
    arrival, ttft = fin["arrival_time_s"].to_numpy(), 1e3 * fin["ttft_s"].to_numpy()
    if not len(arrival):
        return line_chart([], "TTFT over time", "arrival (s)", "ms")
    width = max(float(arrival.max() - arrival.min()), 1e-9) / TTFT_WINDOWS
    window = np.minimum(((arrival - arrival.min()) // width).astype(np.int64), TTFT_WINDOWS - 1)
    groups = [("", np.ones(len(fin), dtype=bool))] if labels is None else \
        [(f"{name} ", labels == name) for name in classes[:4]]
    series = []
    for name, rows in groups:
        for q in (50, 99):
            x, y = [], []
            for w in np.unique(window[rows]):
                values = ttft[rows & (window == w)]
                x.append(arrival.min() + (w + 0.5) * width)
                y.append(np.percentile(values, q))
            series.append((f"{name}p{q}", np.array(x), np.array(y)))
    return line_chart(series, "TTFT over time (by arrival)", "arrival (s)", "ms")


def _held_by_chart(by_time: pd.DataFrame, t: np.ndarray) -> str:
    """Cumulative request-seconds spent waiting, one line per limit that held the queue (steps
    in time order; a fleet's replicas summed)."""
    limit = by_time["admission_limit"].astype(str).to_numpy()
    weight = by_time["duration_s"].to_numpy() * by_time["num_waiting"].to_numpy()
    names = [n for n in dict.fromkeys(limit) if n != "none" and weight[limit == n].sum() > 0]
    names.sort(key=lambda n: -weight[limit == n].sum())
    series = [(n, t, np.cumsum(np.where(limit == n, weight, 0.0))) for n in names]
    return line_chart(series, "Waiting, by what held it (cumulative)", "time (s)", "request-seconds", step=True)


def _replica_table(fleet: dict) -> str:
    router = fleet["router"]
    head = (f"<p>{fleet['num_replicas']} replicas behind a {html.escape(router['policy'])} router "
            f"(decisions: {html.escape(', '.join(f'{k} {v}' for k, v in router['decisions'].items()))}); "
            f"charts of values per replica show the first {MAX_REPLICA_SERIES}.</p>")
    cols = ("replica", "requests", "peak running", "mean running", "preemptions", "prefix hit %", "TTFT p50 / p99 (ms)",
            "busy until (s)", "waiting held by")

    def ms(d):
        return "-" if d["p50"] is None else f"{1e3 * d['p50']:.1f} / {1e3 * d['p99']:.1f}"

    rows = "".join(
        "<tr>" + "".join(f"<td>{v}</td>" for v in (
            r["replica"], r["num_requests"], r["peak_running"], f"{r['mean_running']:.1f}", r["num_preemptions"],
            f"{100 * r['prefix_cache_hit_rate']:.1f}", ms(r["ttft_s"]), f"{r['duration_s']:.1f}",
            html.escape(r.get("waiting_held_by") or "-"))) + "</tr>"
        for r in fleet["replicas"])
    return head + "<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + rows + "</table>"


def _class_table(section: dict) -> str:
    """Per request class (simkv/replay/classes.py): what each kind of traffic got."""
    classes = section["classes"]
    slo = any("slo_attainment" in c for c in classes.values())
    cols = ("priority" if section["by"] == "priority" else "class", "requests", "finished", "prefix hit %",
            "preemptions", "queue p50 / p99 (ms)", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "ITL p50 / p99 (ms)", "E2E p50 / p99 (s)",
            "req/s", "output tok/s", "waited most on (requests)", *(["SLOs met %"] if slo else []))

    def pair(d, scale=1e3):
        return "-" if d is None or d["p50"] is None else f"{scale * d['p50']:,.1f} / {scale * d['p99']:,.1f}"

    rows = "".join(
        "<tr>" + "".join(f"<td>{v}</td>" for v in (
            html.escape(name), f"{c['num_requests']:,}", f"{c['num_finished']:,}",
            f"{100 * c['prefix_hit_share']:.1f}", f"{c['num_preemptions']:,}", pair(c["queue_s"]), pair(c["ttft_s"]),
            pair(c["tpot_s"]), pair(c.get("itl_s")), pair(c["e2e_s"], 1.0), f"{c['request_throughput_req_s']:,.2f}",
            f"{c['output_throughput_tok_s']:,.0f}", _held(c.get("queue_held_by")),
            *([f"{100 * c['slo_attainment']:.1f}"] if slo else []))) + "</tr>"
        for name, c in classes.items())
    head = "<p>Per request class (the trace's request_class column, or its priorities).</p>"
    return head + "<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + rows + "</table>"


def _held(counts: dict | None) -> str:
    """The limits that held a class's requests waiting longest, with how many each."""
    if not counts:
        return "-"
    return html.escape(", ".join(f"{name} {n:,}" for name, n in list(counts.items())[:3]))


def _pool_table(pd: dict) -> str:
    """P/D: the two pools and the KV pulls (the summary above is the decode pool's, latencies the whole path's)."""
    kv = pd["kv_transfer"]

    def ms(d):
        return "-" if d["p50"] is None else f"{1e3 * d['p50']:.1f} / {1e3 * d['p99']:.1f}"

    head = (f"<p>P/D disaggregation: {pd['prefill_replicas']} prefill replicas ({html.escape(pd['prefill_router'])} "
            f"router) and {pd['decode_replicas']} decode replicas ({html.escape(pd['decode_router'])}); KV link "
            f"{pd['kv_link_gbps']:g} GB/s, {pd['kv_link_latency_ms']:g} ms; handoff {pd['handoff_ms']:g} ms. The table "
            f"above is the decode pool's. {kv['num_pulls']:,} pulls, {kv['pulled_bytes'] / 1e9:,.2f} GB; pull p50 / p99 "
            f"{ms(kv['pull_s'])} ms; handoff to pull start p50 / p99 {ms(kv['handoff_to_pull_s'])} ms; link use "
            f"{100 * kv['mean_link_utilization']:.2f} %.</p>")
    cols = ("pool", "replicas", "steps", "peak running", "mean running", "peak blocks / total", "preemptions",
            "prefix hit %", "waiting held by")
    rows = "".join(
        "<tr>" + "".join(f"<td>{v}</td>" for v in (
            name, len(p["replicas"]), f"{p['num_steps']:,}", p["peak_running"], f"{p['mean_running']:.1f}",
            f"{p['peak_blocks_used']:,} / {p['num_gpu_blocks']:,}", p["num_preemptions"],
            f"{100 * p['prefix_cache_hit_rate']:.1f}", html.escape(largest_admission_limit(p) or "-"))) + "</tr>"
        for name, p in (("prefill", pd["prefill"]), ("decode", pd["decode"])))
    from simkv.replay.autoscale import describe

    head += "".join(f"<p>{name} pool autoscaling: {html.escape(describe(pd[name]['autoscaling']))}</p>"
                    for name in ("prefill", "decode") if pd[name].get("autoscaling"))
    if (pd.get("autoscaling") or {}).get("nodes"):
        from simkv.replay.autoscale_nodes import describe_nodes

        head += f"<p>{html.escape(describe_nodes(pd['autoscaling']['nodes']))}</p>"
    return head + "<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + rows + "</table>"


def write_run_report(run_dir: str | Path) -> Path:
    from simkv.atomic import atomic_write

    path = Path(run_dir) / "report.html"
    text = run_report_html(run_dir)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def write_run_report_safely(run_dir: str | Path) -> Path | None:
    """For `simkv replay`: a report failure must not fail the replay whose outputs are saved."""
    try:
        return write_run_report(run_dir)
    except Exception as exc:  # noqa: BLE001
        print(f"warning: report.html not written: {exc}", file=sys.stderr)
        return None
