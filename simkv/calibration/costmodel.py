"""The calibrated cost model: one formula, fitted on measured steps, used as a replay backend.

A step is described by five counts (`step_features`):
  T   tokens computed        = prefill tokens + decodes
  S   sequences in the batch = prefill chunks + decodes
  Pp  prefill attention query-key pairs (a chunk of n new after c cached: n*c + n*(n+1)/2)
  Kp  prefill KV tokens read (c + n per chunk)
  Kd  decode context tokens attended (cached + the new one, summed over decodes)
and its duration is

  t = c0 + cE*E + cW*W + cT*T + cH*max(T - knee, 0) + cS*S + cP*Pp + cKp*Kp + cKd*Kd

with every coefficient >= 0. The hinge at `knee` tokens is the roofline's bend: below it a
step is bound by reading the weights (cost nearly flat in T), above it by matmul FLOPs
(steeper). cS carries per-sequence host work (input preparation, the per-sequence attention
launch or loop).

CUDA graphs. When the measured backend replays decode-only steps from CUDA graphs captured
for a ladder of batch sizes (`graph_sizes`, as vLLM does), a step of n decodes (n no larger
than the largest size) runs as the next captured size b >= n: T and S count b rows, and each
pad row attends one slot (Kd grows by b - n). Every other step runs eagerly, launching its
kernels one by one from the host: E = 1 marks it, and cE is what the launches cost on top.
Without graphs every step is eager and E is left out (cE = 0): c0 is the eager intercept.

Piecewise graphs (vLLM's FULL_AND_PIECEWISE mode; `piecewise_sizes`, a ladder of token
counts). A step that is not served by a decode graph and has at most the largest piecewise
size of tokens runs its layers from graphs captured for the next size p >= T, attention eager
between them: T counts p rows (the matmuls compute the pad rows; S and the attention terms
count only real work), E = 0 and W = 1, with cW the cost of its replays and attention launches.
Without piecewise graphs W is left out (cW = 0).

The formula is written once in `_time`, so Python integers and numpy arrays give the same
floats. The replay times pure-decode steps with `decode_step_line`, the same formula in
clock ticks.

Step-time variation (`step_noise="empirical"`). The formula gives a step's typical time; a real
engine's steps scatter around it, and queues grow with that scatter, so a deterministic replay
predicts latencies too short. With the option, each simulated step's time is the formula's
times a ratio drawn (seeded) from the calibration's own repeats: every grid point's samples
divided by that point's median, pooled. Decode runs are then off (each step draws its own
ratio), and `predict_features` stays the formula.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from pathlib import Path

import numpy as np

from simkv.backends.base import prefill_work
from simkv.core.outputs import SchedulerOutput
from simkv.clock import per_token_ticks, to_ticks

FORMAT = "simkv-calibration"
FORMAT_VERSION = 1
COEFFICIENTS = ("c0", "cE", "cW", "cT", "cH", "cS", "cP", "cKp", "cKd")
#: coefficients a calibration written before CUDA graphs were modelled lacks (read as 0)
OPTIONAL_COEFFICIENTS = ("cE", "cW")
FORM = ("t = c0 + cE*E + cW*W + cT*T + cH*max(T - knee, 0) + cS*S + cP*Pp + cKp*Kp + cKd*Kd  (all c >= 0; "
        "E = 1 for a step run eagerly, 0 for a decode-only step run from a CUDA graph, whose T and S "
        "count the padded batch; W = 1 for a step run from piecewise graphs, whose T counts the padded "
        "token count)")


class CalibrationError(ValueError):
    """A calibration file that cannot be used here (reported with the reason and the fix)."""


def step_features(output: SchedulerOutput) -> tuple[int, int, int, int, int]:
    p_tokens, p_pairs, p_read = prefill_work(output)
    n = output.num_decode_reqs
    return p_tokens + n, len(output.chunks) + n, p_pairs, p_read, output.decode_context_tokens


def shape_features(prefills: list[tuple[int, int]], decodes: list[int]) -> tuple[int, int, int, int, int]:
    """The same counts for a step given as (cached, new) chunks and decode contexts (cached tokens)."""
    tokens = sum(n for _, n in prefills) + len(decodes)
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in prefills)
    read = sum(c + n for c, n in prefills)
    ctx = sum(c + 1 for c in decodes)
    return tokens, len(prefills) + len(decodes), pairs, read, ctx


def normalise_graph_sizes(graph_sizes) -> tuple[int, ...]:
    sizes = tuple(sorted(int(b) for b in (graph_sizes or ())))
    if sizes and sizes[0] < 1:
        raise CalibrationError(f"CUDA graph sizes must be positive, got {list(sizes)}")
    return sizes


def padded_size(sizes, n: int) -> int:
    """The smallest of the ascending captured `sizes` that holds n rows (0: none does, or n < 1)."""
    i = bisect_left(sizes, n)
    return sizes[i] if n >= 1 and i < len(sizes) else 0


def effective_features(features: np.ndarray, graph_sizes=(), piecewise_sizes=()) -> tuple[np.ndarray, ...]:
    """(E, W, T, S, Pp, Kp, Kd) as the formula reads them for an [N, 5] array of (T, S, Pp, Kp, Kd):
    decode-only steps that fit a captured graph are padded to its size and have E = 0; other
    steps that fit a piecewise size have T padded to it, E = 0 and W = 1."""
    f = np.asarray(features, dtype=np.int64).reshape(-1, 5)
    t, s, pp, kp, kd = (f[:, i].copy() for i in range(5))
    sizes = normalise_graph_sizes(graph_sizes)
    pieces = normalise_graph_sizes(piecewise_sizes)
    eager = np.ones(len(f), dtype=np.int64)
    piecewise = np.zeros(len(f), dtype=np.int64)
    graph = np.zeros(len(f), dtype=bool)
    if sizes:
        graph = (kp == 0) & (t >= 1) & (t <= sizes[-1])  # decode-only (a prefill chunk reads Kp >= 1)
        ladder = np.asarray(sizes, dtype=np.int64)
        padded = ladder[np.searchsorted(ladder, np.where(graph, t, 1))]
        kd = np.where(graph, kd + padded - t, kd)
        s = np.where(graph, padded, s)
        t = np.where(graph, padded, t)
        eager = (~graph).astype(np.int64)
    if pieces:
        fits = ~graph & (t >= 1) & (t <= pieces[-1])
        ladder = np.asarray(pieces, dtype=np.int64)
        t = np.where(fits, ladder[np.searchsorted(ladder, np.where(fits, t, 1))], t)
        eager = np.where(fits, 0, eager)
        piecewise = fits.astype(np.int64)
    return eager, piecewise, t, s, pp, kp, kd


def design_matrix(features: np.ndarray, knee: float, graph_sizes=(), piecewise_sizes=()) -> np.ndarray:
    """Columns in COEFFICIENTS order for an [N, 5] array of (T, S, Pp, Kp, Kd). Without graphs
    of any kind the E column is zero (every step is eager; c0 is their intercept)."""
    e, w, t, s, pp, kp, kd = (a.astype(np.float64)
                              for a in effective_features(features, graph_sizes, piecewise_sizes))
    if not (normalise_graph_sizes(graph_sizes) or normalise_graph_sizes(piecewise_sizes)):
        e = np.zeros_like(e)
    return np.column_stack([np.ones(len(t)), e, w, t, np.maximum(t - knee, 0.0), s, pp, kp, kd])


class CalibratedCostModel:
    """A StepBackend whose durations come from a fitted `calib.json`."""

    name = "calibrated"
    supports_decode_runs = True
    needs_request_detail = False

    def __init__(self, coefficients: dict, knee: float, info: dict | None = None, graph_sizes=(),
                 noise_log_ratios=None, noise_seed: int = 0, piecewise_sizes=(), fitted_range: dict | None = None) -> None:
        missing = [k for k in COEFFICIENTS if k not in coefficients and k not in OPTIONAL_COEFFICIENTS]
        if missing:
            raise CalibrationError(f"calibration fit lacks coefficients {missing}")
        c = {k: float(coefficients.get(k, 0.0)) for k in COEFFICIENTS}
        if any(not np.isfinite(v) for v in c.values()) or not np.isfinite(knee):
            raise CalibrationError("calibration fit has non-finite coefficients")
        self.c0, self.cE, self.cW, self.cT, self.cH = c["c0"], c["cE"], c["cW"], c["cT"], c["cH"]
        self.cS, self.cP, self.cKp, self.cKd = c["cS"], c["cP"], c["cKp"], c["cKd"]
        self.knee = float(knee)
        self.graph_sizes = normalise_graph_sizes(graph_sizes)
        self.piecewise_sizes = normalise_graph_sizes(piecewise_sizes)
        if not (self.graph_sizes or self.piecewise_sizes):
            self.cE = c["cE"] = 0.0  # every step is eager: the intercept is c0's
        if not self.piecewise_sizes:
            self.cW = c["cW"] = 0.0
        self.coefficients = c
        self.info = info or {}
        self.fitted_range = fitted_range  # the largest counts of the fitted steps (simkv.calibration.coverage)
        self.warnings: list[str] = []
        self.noise = None
        if noise_log_ratios is not None:
            ratios = np.asarray(noise_log_ratios, dtype=np.float64)
            if ratios.size == 0 or not np.isfinite(ratios).all():
                raise CalibrationError("step-time variation needs finite samples from the calibration's repeats")
            self.noise = ratios
            self.noise_seed = int(noise_seed)
            self._rng = np.random.default_rng(self.noise_seed)
            self.supports_decode_runs = False  # every step draws its own ratio

    def _time(self, E, W, T, S, Pp, Kp, Kd):
        """The formula, once; works on Python numbers and numpy arrays with identical floats."""
        return (self.c0 + self.cE * E + self.cW * W + self.cT * T + self.cH * np.maximum(T - self.knee, 0.0)
                + self.cS * S + self.cP * Pp + self.cKp * Kp + self.cKd * Kd)

    def graph_batch(self, num_decodes: int) -> int:
        """The captured size a decode-only step of `num_decodes` runs as (0: eager)."""
        return padded_size(self.graph_sizes, num_decodes)

    def piecewise_tokens(self, num_tokens: int) -> int:
        """The piecewise size a step of `num_tokens` not served by a decode graph runs as (0: eager)."""
        return padded_size(self.piecewise_sizes, num_tokens)

    def _step_time(self, T, S, Pp, Kp, Kd) -> float:
        """The formula for one step, its path decided as `effective_features` decides it."""
        b = self.graph_batch(T) if Kp == 0 else 0
        if b:
            return float(self._time(0, 0, b, b, Pp, Kp, Kd + b - T))
        p = self.piecewise_tokens(T)
        if p:
            return float(self._time(0, 1, p, S, Pp, Kp, Kd))
        return float(self._time(1, 0, T, S, Pp, Kp, Kd))

    def predict_features(self, features: np.ndarray) -> np.ndarray:
        return self._time(*effective_features(features, self.graph_sizes, self.piecewise_sizes))

    def execute(self, output: SchedulerOutput) -> float:
        t = self._step_time(*step_features(output))
        if self.noise is not None:
            t *= float(np.exp(self.noise[self._rng.integers(self.noise.size)]))
        return t

    def decode_step_line(self, num_decodes: int) -> tuple[int, int, int, int]:
        n = num_decodes  # `_time` of a pure-decode step: the step-invariant terms, and Kd's
        b = self.graph_batch(n)
        p = 0 if b else self.piecewise_tokens(n)
        if b:
            e, w, rows, seqs = 0, 0, b, b
        elif p:
            e, w, rows, seqs = 0, 1, p, n
        else:
            e, w, rows, seqs = 1, 0, n, n
        fixed = to_ticks(self.c0 + self.cE * e + self.cW * w + self.cT * rows + self.cH * max(rows - self.knee, 0.0)
                         + self.cS * seqs + self.cKd * (b - n if b else 0))
        per_token = per_token_ticks(self.cKd)
        return fixed, per_token, fixed, per_token

    def describe(self) -> dict:
        out = {"cost_model": "calibrated", "form": FORM, "knee": self.knee, **self.coefficients,
               "graph_sizes": list(self.graph_sizes), "piecewise_sizes": list(self.piecewise_sizes), **self.info}
        if self.noise is not None:
            q = np.exp(np.percentile(self.noise, [10, 50, 90]))
            out["step_noise"] = {"kind": "empirical", "samples": int(self.noise.size), "seed": self.noise_seed,
                                 "ratio_p10_p50_p90": [float(x) for x in q],
                                 "mean_ratio": float(np.exp(self.noise).mean())}
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out


# ---- calib.json ---------------------------------------------------------------------------------
def load_calibration(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CalibrationError(f"cannot read calibration file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CalibrationError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CalibrationError(f"{path} is not a simkv calibration file (no \"format\": \"{FORMAT}\")")
    if data.get("format_version") != FORMAT_VERSION:
        raise CalibrationError(f"{path} has calibration format version {data.get('format_version')}; this simkv "
                               f"reads version {FORMAT_VERSION}. Re-run `simkv calibrate`.")
    fit = data.get("fit")
    if not isinstance(fit, dict) or "coefficients" not in fit or "knee" not in fit:
        raise CalibrationError(f"{path} holds no fitted model (the calibration did not reach the fit; "
                               f"its measured points are kept under \"grid\")")
    data["_path"] = str(path)
    return data


def _device_label(device: dict | None) -> str:
    if not device:
        return "an unknown device"
    return f"{device.get('type')} ({device.get('name')})"


def check_calibration(calib: dict, model: str | None = None, device: dict | None = None,
                      versions: dict | None = None, gpu: str | None = None) -> list[str]:
    """Refuse a calibration from another model or device; return warnings for version drift.

    `device` is a measured run's device dict (type, name); `gpu` a simkv GPU spec name that a
    simulated replay stands for; `versions` the library versions to compare with."""
    src = calib.get("_path", "calib.json")
    cal_model = calib.get("model")
    cal_dev = calib.get("device") or {}
    if model is not None and cal_model != model:
        raise CalibrationError(
            f"{src} was calibrated for model '{cal_model}', not '{model}': step costs of different models "
            f"are not interchangeable. Run `simkv calibrate --model {model}` (or replay with --model {cal_model}).")
    if device is not None:
        if device.get("type") != cal_dev.get("type") or device.get("name") != cal_dev.get("name"):
            raise CalibrationError(
                f"{src} was calibrated on {_device_label(cal_dev)}, but the run it is used for ran on "
                f"{_device_label(device)}. Calibrate on that device.")
    if gpu is not None and cal_dev.get("type") == "cuda":
        from simkv.specs import gpu_names

        cal_gpu = calib.get("gpu")
        if cal_gpu in gpu_names() and cal_gpu != gpu:
            raise CalibrationError(
                f"{src} was calibrated on {cal_dev.get('name')} ({cal_gpu}) but this replay is configured for "
                f"GPU {gpu} (its memory sets the KV capacity). Pass --gpu {cal_gpu}, or calibrate on {gpu}.")
    warnings = []
    if versions is not None:
        mine = calib.get("versions") or {}
        diffs = [f"{k} {mine.get(k)} vs {versions.get(k)}" for k in ("torch", "triton", "transformers", "cuda", "simkv")
                 if k in versions and mine.get(k) != versions.get(k)]
        if diffs:
            warnings.append(f"{src}: library versions differ from the calibration ({'; '.join(diffs)}); "
                            "accepted, but timings may have shifted")
    return warnings


def step_noise_log_ratios(calib: dict) -> np.ndarray:
    """log(sample / median of its point) over every grid point with at least 3 samples."""
    out = []
    for row in (calib.get("grid") or {}).get("measured") or []:
        xs = np.asarray(row.get("samples_s") or [], dtype=np.float64)
        if xs.size >= 3 and (xs > 0).all():
            out.append(np.log(xs / np.median(xs)))
    if not out:
        raise CalibrationError(f"{calib.get('_path', 'calib.json')} has no grid point with 3 or more samples: "
                               "no step-time variation to draw from (calibrate with --repeats 3 or more)")
    return np.concatenate(out)


def calibrated_range(calib: dict) -> dict | None:
    """The fit's range (`simkv.calibration.coverage`); for a file written before fits recorded
    it, that of its grid points when the fit was made on them alone (None: unknown)."""
    fitted = calib["fit"].get("range")
    if fitted is not None:
        return {k: int(v) for k, v in fitted.items()}
    rows = (calib.get("grid") or {}).get("measured") or []
    if (not rows or (calib.get("source") or {}).get("measured_steps")
            or not all(isinstance(row.get("features"), list) and len(row["features"]) == 5 for row in rows)):
        return None
    from simkv.calibration.coverage import fitted_range

    return fitted_range([row["features"] for row in rows])


STEP_NOISE = ("none", "empirical")


def cost_model_from_file(path: str | Path, model: str | None = None, gpu: str | None = None,
                         step_noise: str = "none", noise_seed: int = 0) -> CalibratedCostModel:
    if step_noise not in STEP_NOISE:
        raise CalibrationError(f"step noise '{step_noise}' is not one of {', '.join(STEP_NOISE)}")
    calib = load_calibration(path)
    warnings = check_calibration(calib, model=model, gpu=gpu)
    fit = calib["fit"]
    info = {"calibration_file": str(path), "calibrated_model": calib.get("model"), "device": calib.get("device"),
            "dtype": calib.get("dtype"), "calibration_versions": calib.get("versions"),
            "holdout": (fit.get("holdout") or {}).get("mape"), "cuda_graphs": calib.get("cuda_graphs"),
            "layer_ops": calib.get("layer_ops")}
    noise = step_noise_log_ratios(calib) if step_noise == "empirical" else None
    cm = CalibratedCostModel(fit["coefficients"], fit["knee"], info, graph_sizes=fit.get("graph_sizes", ()),
                             noise_log_ratios=noise, noise_seed=noise_seed,
                             piecewise_sizes=fit.get("piecewise_sizes", ()), fitted_range=calibrated_range(calib))
    cm.warnings.extend(warnings)
    return cm
