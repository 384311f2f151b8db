"""`simkv compare SIM_DIR MEASURED_DIR`: a simulated replay against a measured one.

Relative error is (simulated - measured) / measured; a metric whose measured value is 0 gets
an absolute difference instead (`rel_error` None). Requests are matched by request_id, steps
by step index (two replays diverge as soon as one step's duration moves an arrival to the
other side of a step boundary, so per-step errors are reported for steps whose shape, i.e.
prefill and decode token counts, is the same in both).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.compare.run_report import expand_weighted, gap_samples, load_run, load_token_gaps
from simkv.compare.step_model import cost_model_on_measured, measured_step_profile, profile_markdown_lines
from simkv.compare.step_model import to_markdown_lines as step_model_lines
from simkv.compare.svg import cdf_chart, line_chart, page, scatter_chart

SCALAR_METRICS = ("duration_s", "request_throughput_req_s", "output_throughput_tok_s", "num_steps", "peak_running",
                  "mean_running", "num_preemptions", "prefix_cache_hit_rate", "num_finished")
DIST_METRICS = ("ttft_s", "itl_s", "e2e_s", "queue_s")
STATS = ("mean", "p50", "p90", "p99")

#: Targets of the issue: metric -> max |relative error|.
TARGETS = {
    "gpu": {"duration_s": 0.03, "request_throughput_req_s": 0.03, "output_throughput_tok_s": 0.03,
            "ttft_s.p50": 0.05, "itl_s.p50": 0.05, "ttft_s.p99": 0.10, "itl_s.p99": 0.10},
    "cpu": {"duration_s": 0.15, "request_throughput_req_s": 0.15, "output_throughput_tok_s": 0.15},
}


def _rel(sim, meas):
    if sim is None or meas is None:
        return None
    if meas == 0:
        return None
    return (sim - meas) / abs(meas)


def _metric_row(metric: str, s, m) -> dict:
    return {"metric": metric, "simulated": s, "measured": m, "rel_error": _rel(s, m),
            "abs_error": None if s is None or m is None else s - m}


def metric_rows(sim: dict, meas: dict) -> list[dict]:
    rows = [_metric_row(key, sim.get(key), meas.get(key)) for key in SCALAR_METRICS]
    for key in DIST_METRICS:
        for stat in STATS:
            rows.append(_metric_row(f"{key}.{stat}", (sim.get(key) or {}).get(stat), (meas.get(key) or {}).get(stat)))
    if not any((meas.get("itl_s") or {}).values()) and meas.get("tpot_s"):  # (no token gaps measured: TPOT)
        for stat in STATS:
            rows.append(_metric_row(f"tpot_s.{stat}", (sim.get("tpot_s") or {}).get(stat), meas["tpot_s"].get(stat)))
    ls, lm = sim.get("admission_limits"), meas.get("admission_limits")
    if ls and lm:  # (two simkv replays: what held each one's waiting queue, share by share)
        rows.append(_metric_row("admission_limits.waiting_request_s", ls["waiting_request_s"], lm["waiting_request_s"]))
        for name in dict.fromkeys([*ls["by_limit"], *lm["by_limit"]]):
            rows.append(_metric_row(f"admission_limits.{name}.share", ls["by_limit"].get(name, {}).get("share", 0.0),
                                    lm["by_limit"].get(name, {}).get("share", 0.0)))
    gs, gm = sim.get("goodput"), meas.get("goodput")
    if gs and gm and gs.get("slo_ms") == gm.get("slo_ms"):  # both judged on the same SLOs (--goodput)
        for key in ("slo_attainment", "request_goodput_req_s"):
            rows.append(_metric_row(f"goodput.{key}", gs.get(key), gm.get(key)))
    cs, cm = (sim.get("classes") or {}).get("classes") or {}, (meas.get("classes") or {}).get("classes") or {}
    for name in (n for n in cs if n in cm):  # (request classes both runs have: simkv/replay/classes.py)
        a, b = cs[name], cm[name]
        rows.append(_metric_row(f"class.{name}.request_throughput_req_s", a["request_throughput_req_s"],
                                b["request_throughput_req_s"]))
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            if key not in a or key not in b:  # (token-level ITL per class: runs since 2026-12-07)
                continue
            for stat in ("p50", "p99"):
                rows.append(_metric_row(f"class.{name}.{key}.{stat}", a[key][stat], b[key][stat]))
        if "slo_attainment" in a and "slo_attainment" in b and gs and gm and gs.get("slo_ms") == gm.get("slo_ms"):
            rows.append(_metric_row(f"class.{name}.slo_attainment", a["slo_attainment"], b["slo_attainment"]))
    return rows


def request_comparison(sim_req: pd.DataFrame, meas_req: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    cols = ["request_id", "ttft_s", "e2e_s", "queue_s", "status"]
    j = sim_req[cols].merge(meas_req[cols], on="request_id", suffixes=("_sim", "_meas"))
    both = j[(j["status_sim"] == "finished") & (j["status_meas"] == "finished")]
    out = {"matched_requests": int(len(both)), "requests_sim": int(len(sim_req)), "requests_measured": int(len(meas_req))}
    for key in ("ttft_s", "e2e_s"):
        s, m = both[f"{key}_sim"].to_numpy(), both[f"{key}_meas"].to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.abs(s - m) / np.abs(m)
        rel = rel[np.isfinite(rel)]
        out[key] = {"median_abs_rel_error": float(np.median(rel)) if rel.size else None,
                    "p90_abs_rel_error": float(np.percentile(rel, 90)) if rel.size else None,
                    "correlation": float(np.corrcoef(s, m)[0, 1]) if len(s) > 2 and np.std(s) > 0 and np.std(m) > 0 else None}
    return both, out


def step_comparison(sim_steps: pd.DataFrame, meas_steps: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    cols = ["step", "duration_s", "num_prefill_tokens", "num_decode_tokens"]
    j = sim_steps[cols].merge(meas_steps[cols], on="step", suffixes=("_sim", "_meas"))
    same = j[(j["num_prefill_tokens_sim"] == j["num_prefill_tokens_meas"])
             & (j["num_decode_tokens_sim"] == j["num_decode_tokens_meas"])]
    s, m = same["duration_s_sim"].to_numpy(), same["duration_s_meas"].to_numpy()
    rel = (s - m) / np.maximum(m, 1e-12)
    out = {"steps_sim": int(len(sim_steps)), "steps_measured": int(len(meas_steps)),
           "steps_same_shape": int(len(same)),
           "same_shape_fraction": float(len(same) / max(len(meas_steps), 1)),
           "duration_mean_rel_error": float(rel.mean()) if rel.size else None,
           "duration_mean_abs_rel_error": float(np.abs(rel).mean()) if rel.size else None,
           "duration_p90_abs_rel_error": float(np.percentile(np.abs(rel), 90)) if rel.size else None,
           "sum_duration_rel_error": float((s.sum() - m.sum()) / m.sum()) if m.size and m.sum() > 0 else None}
    return same, out


def calibration_check(sim: dict, meas: dict) -> dict:
    """When the simulated run used a calib.json: was it fitted for the measured run's model/device?"""
    cm = sim.get("cost_model") or {}
    if cm.get("cost_model") != "calibrated":
        return {"used": False}
    from simkv.calibration.costmodel import CalibrationError, check_calibration

    calib = {"model": cm.get("calibrated_model"), "device": cm.get("device"), "versions": cm.get("calibration_versions"),
             "_path": cm.get("calibration_file")}
    mdev = meas.get("device_info")
    try:
        warnings = check_calibration(calib, model=(meas.get("config") or {}).get("model"), device=mdev,
                                     versions=meas.get("versions"))
        graphs_cal, graphs_meas = cm.get("cuda_graphs"), meas.get("cuda_graphs")
        if graphs_cal and graphs_meas and graphs_cal.split(":")[0] != graphs_meas.split(":")[0]:
            warnings.append(f"decode CUDA graphs differ: calibration '{graphs_cal}', measured run '{graphs_meas}'")
        ops_cal, ops_meas = cm.get("layer_ops"), meas.get("layer_ops")
        if ops_cal and ops_meas and ops_cal != ops_meas:
            warnings.append(f"kernels differ: calibration ran {ops_cal}, the measured run {ops_meas}")
        sizes_cal, sizes_meas = cm.get("graph_sizes"), meas.get("cuda_graph_sizes")
        if sizes_cal is not None and sizes_meas is not None and list(sizes_cal) != list(sizes_meas):
            warnings.append(f"the cost model pads decode steps to CUDA graph sizes {list(sizes_cal) or 'none'}, "
                            f"the measured run captured {list(sizes_meas) or 'none'}")
        pieces_cal, pieces_meas = cm.get("piecewise_sizes"), meas.get("cuda_piecewise_sizes")
        if pieces_cal is not None and (list(pieces_cal) or pieces_meas) and list(pieces_cal) != list(pieces_meas or []):
            warnings.append(f"the cost model runs steps with prefill chunks from piecewise graphs of "
                            f"{list(pieces_cal) or 'no'} token counts, the measured run captured {list(pieces_meas or []) or 'none'}")
        from simkv.calibration.coverage import cost_model_warnings

        return {"used": True, "ok": True,
                "warnings": warnings + cost_model_warnings(cm, cm.get("calibration_file") or "the calibration")}
    except CalibrationError as exc:
        return {"used": True, "ok": False, "error": str(exc)}


def config_differences(sim: dict, meas: dict) -> dict:
    a, b = sim.get("config") or {}, meas.get("config") or {}
    return {k: {"simulated": a.get(k), "measured": b.get(k)} for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k != "gpu"}


def evaluate_targets(rows: list[dict], which: str | None) -> dict | None:
    if not which:
        return None
    by = {r["metric"]: r for r in rows}
    out = {}
    for metric, limit in TARGETS[which].items():
        r = by.get(metric) or {}
        err = r.get("rel_error")
        out[metric] = {"limit": limit, "rel_error": err, "pass": err is not None and abs(err) <= limit}
    return {"set": which, "all_pass": all(v["pass"] for v in out.values()), "metrics": out}


def _diagnostic(fn, *args) -> dict:
    """A diagnostic section: its failure (an older run's files, say) is reported, not raised."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}


def load_pair(sim_dir, measured, metrics: tuple[str, str] | None = None) -> tuple[tuple, tuple]:
    """The simulated run and the measured one: a replay's folder (`--backend gpu`), or a result
    file of vLLM's own benchmark client (simkv/compare/vllm_bench.py) or of its multi-turn
    benchmark (simkv/compare/vllm_multi_turn.py; no steps). Each as (summary, requests, steps or
    None, inter-token gaps as (values, weights))."""
    from simkv.compare.vllm_bench import is_vllm_bench_result, load_bench_run
    from simkv.compare.vllm_multi_turn import load_multi_turn_run, multi_turn_records

    sim, sim_req, sim_steps = load_run(sim_dir)
    sim_run = (sim, sim_req, sim_steps, gap_samples(load_token_gaps(sim_dir, sim_steps)))
    records = multi_turn_records(measured)
    if records is not None:  # (per request: no token gaps; both sides over its requests)
        if metrics:
            raise ValueError("--server-metrics goes with a `vllm bench serve` result")
        sim, sim_req, meas, meas_req = load_multi_turn_run(measured, records, sim, sim_req)
        none = (np.array([]), np.array([], np.int64))
        return (sim, sim_req, sim_steps, none), (meas, meas_req, None, none)
    if is_vllm_bench_result(measured):
        meas, meas_req, itls = load_bench_run(measured, sim_req, metrics)
        return sim_run, (meas, meas_req, None, (itls, np.ones(len(itls), np.int64)))
    if metrics:
        raise ValueError("--server-metrics goes with a `vllm bench serve` result, not a replay's folder")
    meas, meas_req, meas_steps = load_run(measured)
    if sim.get("trace") != meas.get("trace"):
        raise ValueError(f"the two runs replayed different traces: {sim.get('trace')} vs {meas.get('trace')}")
    return sim_run, (meas, meas_req, meas_steps, gap_samples(load_token_gaps(measured, meas_steps)))


NO_STEPS = {"available": False, "reason": "vLLM's benchmark client records no engine steps"}


def compare_runs(sim_dir: str | Path, meas_dir: str | Path, targets: str | None = None,
                 metrics: tuple[str, str] | None = None, pair: tuple | None = None) -> dict:
    """compare.json's record of the two runs (`pair`: `load_pair`'s, when already loaded)."""
    (sim, sim_req, sim_steps, _), (meas, meas_req, meas_steps, _) = pair or load_pair(sim_dir, meas_dir, metrics)
    rows = metric_rows(sim, meas)
    _, req = request_comparison(sim_req, meas_req)
    stepped = meas_steps is not None
    st = step_comparison(sim_steps, meas_steps)[1] if stepped else NO_STEPS
    result = {"simulated_dir": str(sim_dir), "measured_dir": str(meas_dir), "trace": sim.get("trace"),
              "simulated_backend": sim.get("backend"), "measured_backend": meas.get("backend"),
              "simulated_cost_model": (sim.get("cost_model") or {}).get("cost_model"),
              "measured_device": meas.get("device_name") or meas.get("device"),
              "metrics": rows, "requests": req, "steps": st, "calibration_check": calibration_check(sim, meas),
              "cost_model_on_measured_steps": _diagnostic(cost_model_on_measured, sim, meas_dir) if stepped else NO_STEPS,
              "measured_step_profile": _diagnostic(measured_step_profile, meas_dir) if stepped else NO_STEPS,
              "config_differences": config_differences(sim, meas) if stepped else {},
              "targets": evaluate_targets(rows, targets)}
    if not stepped:
        result["vllm_bench"] = meas["vllm_bench"] | {key: meas.get(key) for key in (
            "client_send_lag_s", "vllm_aggregates", "server_metrics")}
    return result


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:+.2f} %"


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def to_markdown(result: dict) -> str:
    lines = ["# simkv compare", "", f"- trace: `{result['trace']}`",
             f"- simulated: `{result['simulated_dir']}` (cost model: {result['simulated_cost_model']})",
             f"- measured: `{result['measured_dir']}` (backend {result['measured_backend']}, device {result['measured_device']})", ""]
    cc = result["calibration_check"]
    if cc.get("used"):
        lines.append(f"- calibration check: {'ok' if cc.get('ok') else 'REFUSED: ' + cc.get('error', '')}")
        lines += [f"  - warning: {w}" for w in cc.get("warnings", [])]
    if result["config_differences"]:
        lines.append(f"- WARNING, engine settings differ: {result['config_differences']}")
    lines += ["", "| metric | simulated | measured | relative error |", "|---|---:|---:|---:|"]
    lines += [f"| {r['metric']} | {_num(r['simulated'])} | {_num(r['measured'])} | {_pct(r['rel_error'])} |"
              for r in result["metrics"]]
    rq, st = result["requests"], result["steps"]
    lines += ["", "## Per request", "", f"{rq['matched_requests']} requests finished in both runs.", ""]
    for key in ("ttft_s", "e2e_s"):
        d = rq[key]
        lines.append(f"- {key}: median |rel error| {_pct(d['median_abs_rel_error'])}, p90 {_pct(d['p90_abs_rel_error'])}, "
                     f"correlation {_num(d['correlation'])}")
    lines += ["", "## Per step", ""]
    if st.get("available") is False:
        lines.append(f"- not compared: {st['reason']}")
    else:
        lines += [f"- {st['steps_same_shape']} of {st['steps_measured']} measured steps have the same shape in the "
                  f"simulation ({100 * st['same_shape_fraction']:.1f} %)",
                  f"- duration error on those: mean {_pct(st['duration_mean_rel_error'])}, mean |.| "
                  f"{_pct(st['duration_mean_abs_rel_error'])}, p90 |.| {_pct(st['duration_p90_abs_rel_error'])}; "
                  f"sum {_pct(st['sum_duration_rel_error'])}"]
        if "cost_model_on_measured_steps" in result:
            lines += step_model_lines(result["cost_model_on_measured_steps"])
        if "measured_step_profile" in result:
            lines += profile_markdown_lines(result["measured_step_profile"])
    if "vllm_bench" in result:
        lines += _bench_lines(result["vllm_bench"])
    t = result.get("targets")
    if t:
        lines += ["", f"## Targets ({t['set']}): {'all pass' if t['all_pass'] else 'NOT all pass'}", ""]
        lines += [f"- {m}: {_pct(v['rel_error'])} (limit {100 * v['limit']:.0f} %) {'pass' if v['pass'] else 'FAIL'}"
                  for m, v in t["metrics"].items()]
    return "\n".join(lines) + "\n"


def _bench_lines(bench: dict) -> list[str]:
    """compare.md's section on a run measured by vLLM's benchmark client."""
    first = (f"- {bench['completed']} requests counted (from {bench['clients']} clients); the simulated figures are "
             "recomputed over the same requests" if "tool" in bench else
             f"- model {bench.get('model_id')}, {bench.get('completed')} requests completed, {bench.get('failed') or 0} "
             f"failed, run of {bench.get('date')}")
    lines = ["", f"## Measured by {bench.get('tool', '`vllm bench serve`')}", "", first,
             "- measured TTFT and E2E count from the client's send and include the HTTP server, tokenizer and "
             "detokenizer; the simulation counts from the arrival at the engine"]
    own = bench.get("vllm_aggregates") or {}
    if own.get("checked") and not own.get("agree"):
        lines.append(f"- WARNING: the per-request lists do not give the client's own aggregates (off by up to "
                     f"{100 * own['max_rel_difference']:.2g} %): an edited file, or a format simkv does not know")
    lag = bench.get("client_send_lag_s")
    if lag:
        lines.append(f"- the client sent requests {1e3 * lag['median']:+.1f} ms (median) / {1e3 * lag['p99']:+.1f} ms "
                     f"(p99) off the trace's schedule, {1e3 * lag['max']:.1f} ms at most")
    counted = bench.get("server_metrics")
    if counted:
        lines.append(f"- server counters over the run (/metrics before and after): "
                     f"{int(counted['prefix_cache_hits']):,} of {int(counted['prefix_cache_queries']):,} prompt tokens "
                     f"hit the prefix cache, {int(counted['num_preemptions']):,} preemptions")
    else:
        lines.append("- no server counters given (--server-metrics BEFORE AFTER): prefix hits and preemptions "
                     "not measured")
    return lines


def to_html(result: dict, sim_dir, meas_dir, metrics: tuple[str, str] | None = None, pair: tuple | None = None) -> str:
    (sim, sim_req, sim_steps, (si_v, si_w)), (_, meas_req, meas_steps, (me_v, me_w)) = (
        pair or load_pair(sim_dir, meas_dir, metrics))
    both, _ = request_comparison(sim_req, meas_req)
    rows = "".join(
        f"<tr><td>{html.escape(r['metric'])}</td><td>{_num(r['simulated'])}</td><td>{_num(r['measured'])}</td>"
        f"<td class='{'bad' if r['rel_error'] is not None and abs(r['rel_error']) > 0.15 else 'ok'}'>{_pct(r['rel_error'])}</td></tr>"
        for r in result["metrics"])
    table = f"<table><tr><th>metric</th><th>simulated</th><th>measured</th><th>rel. error</th></tr>{rows}</table>"
    sf, mf = sim_req[sim_req["status"] == "finished"], meas_req[meas_req["status"] == "finished"]
    charts = [
        scatter_chart(1e3 * both["ttft_s_meas"].to_numpy(), 1e3 * both["ttft_s_sim"].to_numpy(),
                      "TTFT per request", "measured (ms)", "simulated (ms)"),
        scatter_chart(both["e2e_s_meas"].to_numpy(), both["e2e_s_sim"].to_numpy(),
                      "E2E per request", "measured (s)", "simulated (s)"),
        cdf_chart([("measured", 1e3 * mf["ttft_s"].to_numpy()), ("simulated", 1e3 * sf["ttft_s"].to_numpy())],
                  "TTFT CDF", "TTFT (ms)"),
        cdf_chart([("measured", 1e3 * expand_weighted(me_v, me_w)), ("simulated", 1e3 * expand_weighted(si_v, si_w))],
                  "ITL CDF", "ITL (ms)"),
        cdf_chart([("measured", mf["e2e_s"].to_numpy()), ("simulated", sf["e2e_s"].to_numpy())], "E2E CDF", "E2E (s)"),
    ]
    if meas_steps is not None:
        same, _ = step_comparison(sim_steps, meas_steps)
        rel = 100 * (same["duration_s_sim"] - same["duration_s_meas"]) / same["duration_s_meas"].clip(lower=1e-12)
        charts += [
            scatter_chart(1e3 * same["duration_s_meas"].to_numpy(), 1e3 * same["duration_s_sim"].to_numpy(),
                          "Step duration (same-shape steps)", "measured (ms)", "simulated (ms)"),
            line_chart([("step duration error %", same["step"].to_numpy(), rel.to_numpy())],
                       "Per-step duration error", "step", "% (sim - measured) / measured"),
            *_cost_model_charts(sim, meas_dir),
            line_chart([("measured", (meas_steps["start_time_s"] + meas_steps["duration_s"]).to_numpy(),
                         meas_steps["num_running"].to_numpy()),
                        ("simulated", (sim_steps["start_time_s"] + sim_steps["duration_s"]).to_numpy(),
                         sim_steps["num_running"].to_numpy())],
                       "Running requests", "time (s)", "requests", step=True),
        ]
    md = html.escape(to_markdown(result))
    body = [table, "<div class='charts'>" + "".join(charts) + "</div>", f"<details><summary>compare.md</summary><pre>{md}</pre></details>"]
    return page("simkv compare: simulated vs measured", body)


def _cost_model_charts(sim: dict, meas_dir) -> list[str]:
    """Predicted against measured duration of every measured step (when both are known)."""
    from simkv.compare.step_model import features_of, load_measured_steps, step_predictor

    try:
        predict = step_predictor(sim)
        steps = load_measured_steps(meas_dir)
    except Exception:  # noqa: BLE001 - reported in compare.md; the chart is left out
        return []
    if predict is None or steps is None or not len(steps):
        return []
    measured = 1e3 * steps["duration_s"].to_numpy()
    return [scatter_chart(measured, 1e3 * predict(features_of(steps)), "Cost model on every measured step",
                          "measured (ms)", "predicted (ms)")]


def write_comparison(sim_dir, meas_dir, out_dir, targets: str | None = None,
                     metrics: tuple[str, str] | None = None) -> dict:
    out = Path(out_dir)
    pair = load_pair(sim_dir, meas_dir, metrics)  # (read once, for the record and the page)
    result = compare_runs(sim_dir, meas_dir, targets, metrics, pair)
    texts = {"compare.json": json.dumps(result, indent=2) + "\n", "compare.md": to_markdown(result),
             "report.html": to_html(result, sim_dir, meas_dir, metrics, pair)}  # all made before any is written
    out.mkdir(parents=True, exist_ok=True)
    from simkv.atomic import atomic_write

    for name, text in texts.items():
        atomic_write(out / name, lambda tmp, text=text: Path(tmp).write_text(text))
    return result
