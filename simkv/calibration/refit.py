"""Refit a calib.json's measured grid points without measuring again (`simkv calibrate --refit`).

Every grid point keeps all its timed samples, so the per-point statistic (median or mean) and
the formula can be changed after the fact: a GPU calibration costs device time, a refit costs
a second on any machine. The record keeps the measurements and says what it was refitted from.
Needs numpy only.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from simkv.calibration.costmodel import CalibrationError, load_calibration
from simkv.calibration.fit import fit_rows
from simkv.calibration.profile import summarise_samples, write_json_atomic

STATISTICS = ("median", "mean")


def refit_calibration(path: str | Path, out: str | Path, statistic: str = "median", holdout_fraction: float = 0.2,
                      seed: int = 0, model: str | None = None) -> dict:
    """Fit the grid points of calib.json `path` again, each valued by `statistic` of its samples;
    write the new record to `out` atomically and return it (`model`: refuse another model's file)."""
    if statistic not in STATISTICS:
        raise CalibrationError(f"unknown statistic '{statistic}' (use one of {sorted(STATISTICS)})")
    try:
        record = load_calibration(path)
    except CalibrationError as exc:
        if "holds no fitted model" not in str(exc):
            raise
        import json  # an interrupted calibration: its measured points can still be fitted

        record = json.loads(Path(path).read_text())
    record.pop("_path", None)
    if model is not None and record.get("model") != model:
        raise CalibrationError(f"--model {model}, but {path} is a calibration of '{record.get('model')}'")
    measured = (record.get("grid") or {}).get("measured") or []
    if len(measured) < 3:
        raise CalibrationError(f"{path} has {len(measured)} measured grid points: too few to fit")
    for i, row in enumerate(measured):
        samples = row.get("samples_s")
        if not samples or any(not np.isfinite(x) or x <= 0 for x in samples):
            raise CalibrationError(f"{path}: grid point {i} ({row.get('label')}) has no valid samples_s")
        summarise_samples(row, statistic)
    record["settings"] = {**(record.get("settings") or {}), "statistic": statistic}
    record["refit"] = {"of": str(path), "statistic": statistic,
                       "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record["fit"] = fit_rows(measured, holdout_fraction, seed, graph_sizes=record.get("cuda_graph_sizes") or (),
                             piecewise_sizes=record.get("cuda_piecewise_sizes") or ())

    write_json_atomic(Path(out), record)
    return record
