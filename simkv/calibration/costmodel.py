"""The calibrated cost model: one formula, fitted on measured steps, used as a replay backend.

A step is described by five counts (`step_features`):
  T   tokens computed        = prefill tokens + decodes
  S   sequences in the batch = prefill chunks + decodes
  Pp  prefill attention query-key pairs (a chunk of n new after c cached: n*c + n*(n+1)/2)
  Kp  prefill KV tokens read (c + n per chunk)
  Kd  decode context tokens attended (cached + the new one, summed over decodes)
and its duration is

  t = c0 + cT*T + cH*max(T - knee, 0) + cS*S + cP*Pp + cKp*Kp + cKd*Kd

with every coefficient >= 0. The hinge at `knee` tokens is the roofline's bend: below it a
step is bound by reading the weights (cost nearly flat in T), above it by matmul FLOPs
(steeper). cS carries per-sequence host work (input preparation, the per-sequence attention
launch or loop). The formula is written once in `_time`, so Python integers and numpy arrays
give the same floats. The replay times pure-decode steps with `decode_step_line`, the same
formula in clock ticks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from simkv.backends.base import prefill_work
from simkv.core.outputs import SchedulerOutput
from simkv.clock import per_token_ticks, to_ticks

FORMAT = "simkv-calibration"
FORMAT_VERSION = 1
COEFFICIENTS = ("c0", "cT", "cH", "cS", "cP", "cKp", "cKd")
FORM = "t = c0 + cT*T + cH*max(T - knee, 0) + cS*S + cP*Pp + cKp*Kp + cKd*Kd  (all c >= 0)"


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


def design_matrix(features: np.ndarray, knee: float) -> np.ndarray:
    """Columns in COEFFICIENTS order for an [N, 5] array of (T, S, Pp, Kp, Kd)."""
    f = np.asarray(features, dtype=np.float64)
    t = f[:, 0]
    return np.column_stack([np.ones(len(f)), t, np.maximum(t - knee, 0.0), f[:, 1], f[:, 2], f[:, 3], f[:, 4]])


class CalibratedCostModel:
    """A StepBackend whose durations come from a fitted `calib.json`."""

    name = "calibrated"
    supports_decode_runs = True
    needs_request_detail = False

    def __init__(self, coefficients: dict, knee: float, info: dict | None = None) -> None:
        missing = [k for k in COEFFICIENTS if k not in coefficients]
        if missing:
            raise CalibrationError(f"calibration fit lacks coefficients {missing}")
        c = {k: float(coefficients[k]) for k in COEFFICIENTS}
        if any(not np.isfinite(v) for v in c.values()) or not np.isfinite(knee):
            raise CalibrationError("calibration fit has non-finite coefficients")
        self.c0, self.cT, self.cH, self.cS = c["c0"], c["cT"], c["cH"], c["cS"]
        self.cP, self.cKp, self.cKd = c["cP"], c["cKp"], c["cKd"]
        self.knee = float(knee)
        self.coefficients = c
        self.info = info or {}
        self.warnings: list[str] = []

    def _time(self, T, S, Pp, Kp, Kd):
        """The formula, once; works on Python numbers and numpy arrays with identical floats."""
        return (self.c0 + self.cT * T + self.cH * np.maximum(T - self.knee, 0.0) + self.cS * S
                + self.cP * Pp + self.cKp * Kp + self.cKd * Kd)

    def predict_features(self, features: np.ndarray) -> np.ndarray:
        f = np.asarray(features, dtype=np.int64)
        return self._time(f[:, 0], f[:, 1], f[:, 2], f[:, 3], f[:, 4])

    def execute(self, output: SchedulerOutput) -> float:
        return float(self._time(*step_features(output)))

    def decode_step_line(self, num_decodes: int) -> tuple[int, int, int, int]:
        n = num_decodes  # `_time` of a pure-decode step: the step-invariant terms, and Kd's
        fixed = to_ticks(self.c0 + self.cT * n + self.cH * max(n - self.knee, 0.0) + self.cS * n)
        per_token = per_token_ticks(self.cKd)
        return fixed, per_token, fixed, per_token

    def describe(self) -> dict:
        out = {"cost_model": "calibrated", "form": FORM, "knee": self.knee, **self.coefficients, **self.info}
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


def cost_model_from_file(path: str | Path, model: str | None = None, gpu: str | None = None) -> CalibratedCostModel:
    calib = load_calibration(path)
    warnings = check_calibration(calib, model=model, gpu=gpu)
    fit = calib["fit"]
    info = {"calibration_file": str(path), "calibrated_model": calib.get("model"), "device": calib.get("device"),
            "dtype": calib.get("dtype"), "calibration_versions": calib.get("versions"),
            "holdout": (fit.get("holdout") or {}).get("mape"), "cuda_graphs": calib.get("cuda_graphs")}
    cm = CalibratedCostModel(fit["coefficients"], fit["knee"], info)
    cm.warnings.extend(warnings)
    return cm
