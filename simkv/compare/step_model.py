"""The simulation's cost model asked about the measured run's own steps.

A simulated and a measured replay drift apart after a few steps, so comparing them step by
step says little about the cost model. The measured run records every step's shape
(`measured_steps.parquet`: prefill chunks and tokens, query-key pairs, KV read, decodes and
their context) with its measured duration, and the simulation's cost model (calibrated,
roofline, linear or unit, rebuilt from its summary.json) can predict each of those steps. The residual then separates the two causes of a
latency error: a cost model that is wrong about steps (the residual is biased), or dynamics
that diverge although each step is predicted well (the residual is centred).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

MEASURED_STEPS = "measured_steps.parquet"
_FEATURE_COLUMNS = ("num_prefill_chunks", "num_prefill_tokens", "prefill_pairs", "prefill_kv_read",
                    "num_decodes", "decode_context_tokens", "duration_s")
#: decode-only steps are binned by batch size (lower edges)
BATCH_BINS = (1, 2, 8, 32, 128)


def load_measured_steps(run_dir: str | Path) -> pd.DataFrame | None:
    path = Path(run_dir) / MEASURED_STEPS
    if not path.is_file():
        return None
    steps = pd.read_parquet(path)
    missing = [c for c in _FEATURE_COLUMNS if c not in steps.columns]
    if missing:
        raise ValueError(f"{path} lacks columns {missing}")
    return steps


def features_of(steps: pd.DataFrame) -> np.ndarray:
    """(T, S, Pp, Kp, Kd) per step, the calibrated model's features."""
    d = steps["num_decodes"].to_numpy(np.int64)
    return np.column_stack([steps["num_prefill_tokens"].to_numpy(np.int64) + d,
                            steps["num_prefill_chunks"].to_numpy(np.int64) + d,
                            steps["prefill_pairs"].to_numpy(np.int64), steps["prefill_kv_read"].to_numpy(np.int64),
                            steps["decode_context_tokens"].to_numpy(np.int64)])


def step_family(steps: pd.DataFrame) -> np.ndarray:
    chunks = steps["num_prefill_chunks"].to_numpy() > 0
    decodes = steps["num_decodes"].to_numpy() > 0
    return np.where(chunks & decodes, "mixed", np.where(chunks, "prefill", "decode"))


def _stats(rel: np.ndarray, pred: np.ndarray, meas: np.ndarray) -> dict:
    if rel.size == 0:
        return {"steps": 0}
    return {"steps": int(rel.size), "mean_rel_error": float(rel.mean()), "median_rel_error": float(np.median(rel)),
            "p90_abs_rel_error": float(np.percentile(np.abs(rel), 90)),
            "sum_rel_error": float((pred.sum() - meas.sum()) / meas.sum()) if meas.sum() > 0 else None,
            "measured_mean_s": float(meas.mean()), "predicted_mean_s": float(pred.mean())}


def step_predictor(sim_summary: dict):
    """The simulated run's cost model as a function of step features [N, 5] -> seconds [N]
    (its `predict_features`), rebuilt from its summary.json; None if it has no such model."""
    cm = sim_summary.get("cost_model") or {}
    name = cm.get("cost_model")
    if name == "calibrated":
        from simkv.calibration.costmodel import COEFFICIENTS, CalibratedCostModel

        return CalibratedCostModel({k: cm[k] for k in COEFFICIENTS if k in cm}, cm["knee"],
                                   graph_sizes=cm.get("graph_sizes", ()),
                                   piecewise_sizes=cm.get("piecewise_sizes", ())).predict_features
    if name in ("roofline", "linear", "unit"):
        from simkv.backends.factory import make_backend
        from simkv.config import EngineConfig

        options = {k: cm[k] for k in ("step_base_s", "step_per_token_s") if k in cm}
        config = EngineConfig.from_flat(sim_summary.get("config") or {})
        return make_backend(name, config, **options).predict_features
    return None


def cost_model_on_measured(sim_summary: dict, meas_dir: str | Path, slowest: int = 8) -> dict:
    """Residual of the simulation's cost model on every measured step (see module doc)."""
    predict = step_predictor(sim_summary)
    if predict is None:
        return {"available": False, "reason": "the simulated run's cost model is not known to compare"}
    steps = load_measured_steps(meas_dir)
    if steps is None:
        return {"available": False, "reason": f"the measured run has no {MEASURED_STEPS}"}
    pred = predict(features_of(steps))
    meas = steps["duration_s"].to_numpy(np.float64)
    rel = (pred - meas) / np.maximum(meas, 1e-12)
    fam = step_family(steps)
    out = {"available": True, "cost_model": (sim_summary.get("cost_model") or {}).get("cost_model"),
           "all": _stats(rel, pred, meas), "by_family": {}, "decode_by_batch": []}
    for name in ("decode", "prefill", "mixed"):
        m = fam == name
        out["by_family"][name] = _stats(rel[m], pred[m], meas[m])
    if "graph_batch" in steps.columns:  # decode steps replayed from CUDA graphs against eager ones
        graph = steps["graph_batch"].to_numpy() > 0
        pieces = (steps["graph_tokens"].to_numpy() > 0) if "graph_tokens" in steps.columns else np.zeros_like(graph)
        eager_decode = ~graph & ~pieces & (fam == "decode")
        out["by_path"] = {"decode from a CUDA graph": _stats(rel[graph], pred[graph], meas[graph]),
                          "decode, eager": _stats(rel[eager_decode], pred[eager_decode], meas[eager_decode])}
        if pieces.any():
            eager_rest = ~graph & ~pieces & (fam != "decode")
            out["by_path"]["from piecewise graphs"] = _stats(rel[pieces], pred[pieces], meas[pieces])
            out["by_path"]["prefill or mixed, eager"] = _stats(rel[eager_rest], pred[eager_rest], meas[eager_rest])
    batch = steps["num_decodes"].to_numpy()
    edges = list(BATCH_BINS) + [np.iinfo(np.int64).max]
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (fam == "decode") & (batch >= lo) & (batch < hi)
        if m.any():
            label = f"{lo}-{hi - 1}" if hi != edges[-1] else f">={lo}"
            out["decode_by_batch"].append({"batch": label, **_stats(rel[m], pred[m], meas[m])})
    # the steps the model under-predicts most (compilations, collector pauses, host stalls show here)
    order = np.argsort(meas - pred, kind="stable")[::-1][:slowest]
    out["largest_excess"] = [
        {"step": int(steps["step"].iloc[i]) if "step" in steps.columns else int(i), "family": str(fam[i]),
         "num_decodes": int(batch[i]), "num_prefill_tokens": int(steps["num_prefill_tokens"].iloc[i]),
         "measured_s": float(meas[i]), "predicted_s": float(pred[i])} for i in order]
    return out


def measured_step_profile(meas_dir: str | Path) -> dict:
    """Where the measured run's step time went on the host, and which steps compiled kernels
    (columns written by the GPU backend; older runs lack them)."""
    steps = load_measured_steps(meas_dir)
    if steps is None or "host_forward_s" not in steps.columns:
        return {"available": False}
    dur = steps["duration_s"].to_numpy(np.float64)
    prep = steps["host_prepare_s"].to_numpy(np.float64)
    fwd = steps["host_forward_s"].to_numpy(np.float64)
    host = prep + fwd
    out = {"available": True, "steps": int(len(dur)), "duration_sum_s": float(dur.sum()),
           "host_prepare_share": float(prep.sum() / max(dur.sum(), 1e-12)),
           "host_forward_share": float(fwd.sum() / max(dur.sum(), 1e-12)),
           "host_bound_steps": int((host >= 0.9 * dur).sum())}
    if "jit_compiles" in steps.columns:
        c = steps["jit_compiles"].to_numpy()
        m = c > 0
        out["compiling_steps"] = int(m.sum())
        out["compiling_steps_duration_s"] = float(dur[m].sum())
        out["compiling_steps_list"] = [int(x) for x in steps["step"].to_numpy()[m][:20]] if "step" in steps.columns else []
    return out


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:+.1f} %"


def profile_markdown_lines(prof: dict) -> list[str]:
    if not prof.get("available"):
        return []
    lines = ["", "## Measured steps on the host", "",
             f"- {prof['steps']} steps, {prof['duration_sum_s']:.3f} s in all: input preparation "
             f"{100 * prof['host_prepare_share']:.1f} %, forward call on the host {100 * prof['host_forward_share']:.1f} % "
             f"(on CUDA the forward call only enqueues kernels: near 100 % means host-bound)",
             f"- steps whose host time is at least 90 % of their duration: {prof['host_bound_steps']}"]
    if "compiling_steps" in prof:
        lines.append(f"- steps that compiled a kernel variant: {prof['compiling_steps']} "
                     f"({prof['compiling_steps_duration_s']:.3f} s); first: {prof['compiling_steps_list']}")
    return lines


def to_markdown_lines(check: dict) -> list[str]:
    lines = ["", "## Cost model on the measured steps", ""]
    if not check.get("available"):
        return lines + [f"Not available: {check.get('reason')}."]
    lines += [f"The simulation's cost model ({check.get('cost_model')}) applied to each step the measured run "
              "executed (error = (predicted - measured) / measured):", "",
              "| steps | count | mean error | median error | p90 abs error | error of the sum | measured mean ms |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    rows = [("all", check["all"])] + [(k, v) for k, v in check["by_family"].items()]
    rows += list(check.get("by_path", {}).items())
    rows += [(f"decode, batch {r['batch']}", r) for r in check["decode_by_batch"]]
    for name, s in rows:
        if not s.get("steps"):
            continue
        lines.append(f"| {name} | {s['steps']} | {_pct(s['mean_rel_error'])} | {_pct(s['median_rel_error'])} | "
                     f"{_pct(s['p90_abs_rel_error'])} | {_pct(s['sum_rel_error'])} | {1e3 * s['measured_mean_s']:.2f} |")
    lines += ["", "Largest excess of measured over predicted:", "",
              "| step | family | decodes | prefill tokens | measured ms | predicted ms |", "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['family']} | {r['num_decodes']} | {r['num_prefill_tokens']} | "
              f"{1e3 * r['measured_s']:.2f} | {1e3 * r['predicted_s']:.2f} |" for r in check["largest_excess"]]
    return lines
