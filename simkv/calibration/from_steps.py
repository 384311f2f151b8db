"""Fit the cost model on the steps of measured replays (`simkv calibrate --from-steps DIR`).

A designed grid measures each shape in isolation, with equal contexts and back-to-back
repeats. A replay's steps are what serving really executes: ragged contexts, a scheduler
running between steps, every shape in the proportions the traffic makes. A measured replay
(`simkv replay --backend gpu --out DIR`) records each step's shape and duration in
`DIR/measured_steps.parquet`; this module fits the same formula to those rows, optionally
together with the grid points of a `calib.json`. Use a replay of other traffic (or another
slice of the trace) than the one you then predict: a model fitted on a run and checked on
the same run proves nothing.

Steps that compiled a kernel variant (`jit_compiles` > 0) are left out: a one-off compile
is not a property of the step's shape. Needs numpy and pandas only (no torch).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from simkv.calibration.costmodel import FORMAT, FORMAT_VERSION, CalibrationError, load_calibration
from simkv.calibration.fit import fit_calibration
from simkv.compare.step_model import features_of, load_measured_steps


def _run_identity(summary: dict) -> dict:
    return {"model": (summary.get("config") or {}).get("model"), "device": summary.get("device_info"),
            "dtype": summary.get("dtype"), "kernel_backend": summary.get("kernel_backend"),
            "layer_ops": summary.get("layer_ops"),
            "versions": summary.get("versions"), "timing": summary.get("timing"),
            "block_size": (summary.get("config") or {}).get("block_size"),
            "cuda_graphs": summary.get("cuda_graphs"), "graph_sizes": list(summary.get("cuda_graph_sizes") or []),
            "piecewise_sizes": list(summary.get("cuda_piecewise_sizes") or [])}


def load_step_rows(run_dir: str | Path) -> tuple[dict, np.ndarray, np.ndarray, int]:
    """(identity, features [N, 5], durations [N], steps left out) of one measured replay."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise CalibrationError(f"{run_dir} is not a replay output folder (no summary.json)")
    summary = json.loads(summary_path.read_text())
    if summary.get("backend") != "gpu":
        raise CalibrationError(f"{run_dir} is a '{summary.get('backend')}' replay; --from-steps needs a measured one "
                               "(simkv replay --backend gpu)")
    steps = load_measured_steps(run_dir)
    if steps is None:
        raise CalibrationError(f"{run_dir} has no measured_steps.parquet (written by simkv replay --backend gpu)")
    keep = np.ones(len(steps), dtype=bool)
    if "jit_compiles" in steps.columns:
        keep &= steps["jit_compiles"].to_numpy() == 0
    keep &= steps["duration_s"].to_numpy() > 0
    steps = steps[keep]
    return _run_identity(summary), features_of(steps), steps["duration_s"].to_numpy(np.float64), int((~keep).sum())


def _same_target(a: dict, b: dict, what_a: str, what_b: str) -> None:
    for key in ("model", "dtype", "block_size"):
        if a.get(key) != b.get(key):
            raise CalibrationError(f"{what_a} has {key} '{a.get(key)}' but {what_b} has '{b.get(key)}': "
                                   "their steps cannot be fitted together")
    if a.get("layer_ops") and b.get("layer_ops") and a["layer_ops"] != b["layer_ops"]:  # older files lack it
        raise CalibrationError(f"{what_a} ran {a['layer_ops']} but {what_b} ran {b['layer_ops']}: "
                               "their steps cannot be fitted together")
    if a.get("graph_sizes") != b.get("graph_sizes"):
        def graphs(x: dict) -> str:
            return f"CUDA graphs of sizes {x['graph_sizes']}" if x.get("graph_sizes") else "no CUDA graphs"
        raise CalibrationError(f"{what_a} ran decode steps with {graphs(a)} but {what_b} with {graphs(b)}: "
                               "fit them separately (or run both with the same --max-num-seqs / --enforce-eager)")
    if list(a.get("piecewise_sizes") or []) != list(b.get("piecewise_sizes") or []):
        raise CalibrationError(f"{what_a} ran piecewise CUDA graphs of {a.get('piecewise_sizes') or 'no'} token counts "
                               f"but {what_b} of {b.get('piecewise_sizes') or 'no'}: fit them separately (or run both "
                               "with the same --cudagraph-mode and --max-num-seqs)")
    da, db = a.get("device") or {}, b.get("device") or {}
    if (da.get("type"), da.get("name")) != (db.get("type"), db.get("name")):
        raise CalibrationError(f"{what_a} ran on {da.get('type')} ({da.get('name')}) but {what_b} on "
                               f"{db.get('type')} ({db.get('name')}): calibrate per device")


def calibrate_from_steps(step_dirs: list[str | Path], out: str | Path, grid_calibration: str | Path | None = None,
                         holdout_fraction: float = 0.2, seed: int = 0) -> dict:
    """Fit on the measured steps of `step_dirs` (plus the grid points of `grid_calibration`);
    write the calibration record to `out` atomically and return it."""
    if not step_dirs:
        raise CalibrationError("--from-steps needs at least one measured replay folder")
    ident, feats, ys, sources = None, [], [], []
    for d in step_dirs:
        this, f, y, dropped = load_step_rows(d)
        if ident is None:
            ident = this
        else:
            _same_target(this, ident, str(d), str(step_dirs[0]))
        feats.append(f)
        ys.append(y)
        sources.append({"dir": str(d), "steps": int(len(y)), "left_out_compiling": dropped})
    grid_rows = []
    if grid_calibration is not None:
        base = load_calibration(grid_calibration)
        _same_target({"model": base.get("model"), "dtype": base.get("dtype"), "block_size": base.get("block_size"),
                      "device": base.get("device"), "graph_sizes": list(base.get("cuda_graph_sizes") or []),
                      "piecewise_sizes": list(base.get("cuda_piecewise_sizes") or []),
                      "layer_ops": base.get("layer_ops")},
                     ident, str(grid_calibration), str(step_dirs[0]))
        grid_rows = base["grid"]["measured"]
        feats.append(np.array([m["features"] for m in grid_rows], dtype=np.int64).reshape(-1, 5))
        ys.append(np.array([m["value_s"] for m in grid_rows], dtype=np.float64))
    features = np.concatenate(feats)
    y = np.concatenate(ys)
    if len(y) < 3:
        raise CalibrationError(f"only {len(y)} usable steps: too few to fit")
    dev = ident["device"] or {}
    from simkv.calibration.profile import write_json_atomic

    from simkv.specs import canonical_gpu

    gpu = canonical_gpu(dev.get("name")) if dev.get("type") == "cuda" else None
    record = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model": ident["model"], "device": dev, "gpu": gpu,
        "dtype": ident["dtype"], "kernel_backend": ident["kernel_backend"],
        "layer_ops": ident["layer_ops"], "versions": ident["versions"],
        "timing": ident["timing"], "block_size": ident["block_size"],
        "cuda_graphs": ident["cuda_graphs"], "cuda_graph_sizes": ident["graph_sizes"],
        "cuda_piecewise_sizes": ident["piecewise_sizes"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {"measured_steps": sources, "grid_calibration": str(grid_calibration) if grid_calibration else None,
                   "grid_points": len(grid_rows)},
        "grid": {"measured": grid_rows, "num_points": len(grid_rows)},
        "complete": True,
        "fit": fit_calibration(features, y, holdout_fraction, seed, graph_sizes=ident["graph_sizes"],
                               piecewise_sizes=ident["piecewise_sizes"]),
    }
    write_json_atomic(Path(out), record)
    return record
