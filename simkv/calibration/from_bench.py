"""`simkv calibrate --from-bench bench.json --sim SIM_DIR`: fit the roofline to a real vLLM server.

A user with a vLLM server but no use for simkv's GPU backend measures their own engine: the
trace `simkv trace export` wrote is replayed against the server by vLLM's benchmark client, and
simulated with the server's settings (SIM_DIR, whose summary.json holds the engine options and
the trace). The client records no engine steps, only each request's times, so the fit is of the
roofline's four free numbers (simkv/backends/roofline_fit.py), chosen so that the simulation's
per-request times match the measured ones:

    loss = mean over requests finished in both of  ln((TTFT_sim + f) / TTFT_meas)^2
                                                  + ln((E2E_sim + f) / E2E_meas)^2

where f, the front end's latency (HTTP, SSE, detokenizing, network: what the client sees on top
of the engine, the same for every request), is the best constant for each parameter set
(golden-section search, no replay needed) and is recorded in the fit with the four numbers.

minimised over the parameters' logarithms within their bounds: a coarse grid around the
roofline's defaults, then Nelder-Mead from its best points, each evaluation a replay of the trace (deterministic: the same inputs give the same
fit). TTFT weighs prefill work and queueing, end-to-end latency the decode steps. What the client
adds to every request (HTTP, tokenizer) lands in the overheads. The fit transfers to other
settings of the same model on the same GPU; check it on a trace slice it was not fitted on
(`simkv replay --cost-model fit.json`, then `simkv compare`).
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.backends.factory import make_roofline
from simkv.backends.roofline_fit import BOUNDS, PARAMS, fit_document
from simkv.compare.vllm_bench import load_bench_run

DEFAULTS = {"compute_efficiency": 0.6, "memory_efficiency": 0.8, "step_overhead_s": 1.0e-3, "seq_overhead_s": 5.0e-6}


def simulated_setup(sim_dir: str | Path, trace_path: str | None = None):
    """The engine config and trace of a simulated replay's folder (one engine, no fleet)."""
    from simkv.config import EngineConfig
    from simkv.traces.schema import read_trace

    summary_path = Path(sim_dir) / "summary.json"
    if not summary_path.is_file():
        raise ValueError(f"{sim_dir}: not a replay's output folder (no summary.json)")
    summary = json.loads(summary_path.read_text())
    for key in ("fleet", "disaggregation", "data_parallel"):
        if key in summary:
            raise ValueError(f"{sim_dir}: a {key.replace('_', '-')} replay; --from-bench fits one engine's replay")
    if summary.get("backend") != "sim":
        raise ValueError(f"{sim_dir}: backend '{summary.get('backend')}': give a simulated replay's folder")
    path = trace_path or summary["trace"]
    if not Path(path).is_file():
        raise ValueError(f"{sim_dir}: its trace {path} is not here: give it with --trace")
    return summary, EngineConfig.from_flat(summary["config"]), read_trace(path)


def _paired(sim: pd.DataFrame, meas: pd.DataFrame) -> tuple[np.ndarray, ...]:
    """(simulated TTFT, measured TTFT, simulated E2E, measured E2E) of the requests finished in both."""
    ok = (sim["status"].to_numpy() == "finished") & (meas["status"].to_numpy() == "finished")
    return tuple(np.maximum(frame[key].to_numpy()[ok], 1e-6) for key in ("ttft_s", "e2e_s") for frame in (sim, meas))


def _loss_at(pairs: tuple[np.ndarray, ...], d: float) -> float:
    st, mt, se, me = pairs
    return float(np.mean(np.log((st + d) / mt) ** 2) + np.mean(np.log((se + d) / me) ** 2))


def best_frontend_latency(pairs: tuple[np.ndarray, ...], iterations: int = 60) -> tuple[float, float]:
    """The constant the front end adds to every request (0 up to the shortest measured TTFT) that
    minimises the loss, by golden-section search; (latency, loss)."""
    if not pairs[0].size:
        return 0.0, math.inf
    lo, hi = 0.0, float(pairs[1].min())
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = _loss_at(pairs, a), _loss_at(pairs, b)
    for _ in range(iterations):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = _loss_at(pairs, a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = _loss_at(pairs, b)
    d = (lo + hi) / 2
    at_zero = _loss_at(pairs, 0.0)
    return (0.0, at_zero) if at_zero <= _loss_at(pairs, d) else (d, _loss_at(pairs, d))


class BenchFit:
    """The loss of a parameter set: a replay of the trace with the roofline at those values."""

    def __init__(self, config, trace, measured: pd.DataFrame) -> None:
        self.config, self.trace, self.measured = config, trace, measured
        self.evaluations = 0

    def replay(self, params: dict):
        from simkv.replay.api import replay

        self.evaluations += 1
        return replay(self.trace, self.config, backend=make_roofline(self.config, params))

    def loss(self, params: dict) -> float:
        """The loss of `params` with the best front-end latency for them."""
        return best_frontend_latency(_paired(self.replay(params).requests, self.measured))[1]


def _to_params(x: np.ndarray) -> dict:
    return {name: float(np.clip(math.exp(v), *BOUNDS[name])) for name, v in zip(PARAMS, x)}


def nelder_mead(f, x0: np.ndarray, step: float, max_evals: int, tol: float = 1e-7, on_eval=None):
    """Minimise f from x0 (the standard reflection / expansion / contraction / shrink rules)
    in at most max_evals evaluations; returns (best x, best value, evaluations)."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    evals = n + 1
    while evals + 2 <= max_evals:  # (a pass costs up to 2 evaluations, a shrink n more)
        order = np.argsort(values, kind="stable")
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if on_eval:
            on_eval(evals, values[0])
        if abs(values[-1] - values[0]) <= tol * (abs(values[0]) + tol):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        evals += 1
        if fr < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(expanded)
            evals += 1
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            inside = fr >= values[-1]
            contracted = centroid + (0.5 * (simplex[-1] - centroid) if inside else 0.5 * (reflected - centroid))
            fc = f(contracted)
            evals += 1
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            elif evals + n > max_evals:
                break
            else:  # shrink towards the best
                for i in range(1, n + 1):
                    simplex[i] = simplex[0] + 0.5 * (simplex[i] - simplex[0])
                    values[i] = f(simplex[i])
                evals += n
    best = int(np.argmin(values))
    return simplex[best], values[best], evals


#: The starting design: each parameter at these multiples of its default (3^4 = 81 replays).
START_MULTIPLES = (0.5, 1.0, 2.0)


def multistart_nelder_mead(f, x0: np.ndarray, max_evals: int, starts: int = 3, on_eval=None):
    """A replay's loss is rugged (a step boundary moves or not, a request is admitted a step
    earlier or not), so one simplex stops in a local minimum. Evaluate a coarse grid around x0
    (each parameter at START_MULTIPLES of its value), then run Nelder-Mead from the best
    `starts` grid points, sharing the evaluations left; keep the best."""
    grid = [x0 + np.log(m) for m in itertools.product(START_MULTIPLES, repeat=len(x0))]
    values = []
    for i, x in enumerate(grid):
        values.append(f(x))
        if on_eval:
            on_eval(i + 1, min(values))
    evals = len(grid)
    order = np.argsort(values, kind="stable")[:starts]
    best_x, best_v = grid[order[0]], values[order[0]]
    for k, i in enumerate(order):
        budget = (max_evals - evals) // (starts - k)
        if budget <= len(x0) + 1:
            break
        x, v, used = nelder_mead(f, grid[i], 0.25, budget,
                                 on_eval=None if on_eval is None else lambda n, v, e=evals: on_eval(e + n, v))
        evals += used
        if v < best_v:
            best_x, best_v = x, v
    return best_x, best_v, evals


def _agreement(result, measured: pd.DataFrame, meas_summary: dict, frontend_s: float) -> dict:
    """How a replay (plus the front end's latency) agrees with the measurement: per request, and
    on the summary's figures (relative errors)."""
    st, mt, se, me = _paired(result.requests, measured)
    out = {"ttft_median_abs_rel_error": float(np.median(np.abs((st + frontend_s) / mt - 1))) if st.size else None,
           "e2e_median_abs_rel_error": float(np.median(np.abs((se + frontend_s) / me - 1))) if se.size else None}
    sim_ttft, sim_e2e = st + frontend_s, se + frontend_s
    pairs = {"duration_s": (result.summary["duration_s"], meas_summary["duration_s"]),
             "ttft_s.p50": (np.percentile(sim_ttft, 50), meas_summary["ttft_s"]["p50"]),
             "ttft_s.p99": (np.percentile(sim_ttft, 99), meas_summary["ttft_s"]["p99"]),
             "itl_s.p50": (result.summary["itl_s"]["p50"], meas_summary["itl_s"]["p50"]),
             "itl_s.p99": (result.summary["itl_s"]["p99"], meas_summary["itl_s"]["p99"]),
             "e2e_s.p50": (np.percentile(sim_e2e, 50), meas_summary["e2e_s"]["p50"])}
    for key, (sim_value, meas_value) in pairs.items():
        out[key] = None if sim_value is None or not meas_value else float((sim_value - meas_value) / meas_value)
    return out


def fit_from_bench(bench_path: str | Path, sim_dir: str | Path, trace_path: str | None = None,
                   max_evals: int = 400, on_progress=None) -> dict:
    """The roofline-fit document (simkv/backends/roofline_fit.py) for the server that produced
    `bench_path`, with the fit's agreement before (defaults) and after. Deterministic: the same
    files give the same document, byte for byte once written."""
    summary, config, trace = simulated_setup(sim_dir, trace_path)
    sim_requests = pd.read_parquet(Path(sim_dir) / "requests.parquet")
    meas_summary, measured, _ = load_bench_run(bench_path, sim_requests)
    # the measured requests in the replay's order (a trace imported from the result is sorted by send time)
    measured = measured.set_index("request_id").loc[sim_requests["request_id"].astype(str)].reset_index()
    if meas_summary["num_finished"] < 5:
        raise ValueError(f"{bench_path}: {meas_summary['num_finished']} requests finished; a fit needs more")
    grid = len(START_MULTIPLES) ** len(PARAMS)
    if max_evals < grid + 2 * len(PARAMS) + 2:
        raise ValueError(f"--max-evals {max_evals}: the search needs at least {grid + 2 * len(PARAMS) + 2} replays "
                         f"(a {grid}-point grid, then a simplex)")
    problem = BenchFit(config, trace, measured)
    x, loss, evals = multistart_nelder_mead(lambda v: problem.loss(_to_params(v)),
                                            np.log([DEFAULTS[p] for p in PARAMS]), max_evals, on_eval=on_progress)
    params = _to_params(x)
    before, after = problem.replay(DEFAULTS), problem.replay(params)
    frontend_s, _ = best_frontend_latency(_paired(after.requests, measured))
    hw = config.hardware
    fit = {"loss": loss, "loss_at_defaults": _loss_at(_paired(before.requests, measured), 0.0), "evaluations": evals,
           "requests": int(len(measured)),
           "at_defaults": _agreement(before, measured, meas_summary, 0.0),
           "fitted": _agreement(after, measured, meas_summary, frontend_s),
           "at_bounds": [p for p in PARAMS if params[p] in BOUNDS[p]]}
    source = {"bench": str(bench_path), "sim_dir": str(sim_dir), "trace": str(trace_path or summary["trace"]),
              "engine_config": summary["config"], "vllm_bench": meas_summary["vllm_bench"]}
    return fit_document(hw.model, hw.gpu, hw.tensor_parallel_size, params, frontend_s, fit, source)
