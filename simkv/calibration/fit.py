"""Fit the cost model: non-negative least squares on relative error, hinge knee by search,
quality reported on held-out grid points (numpy only; no scipy)."""

from __future__ import annotations

import numpy as np

from simkv.calibration.costmodel import (COEFFICIENTS, FORM, CalibratedCostModel, design_matrix, effective_features,
                                         normalise_graph_sizes)
from simkv.calibration.coverage import fitted_range


def nnls(A: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """Lawson-Hanson non-negative least squares: argmin ||Ax - b|| subject to x >= 0."""
    m, n = A.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = A.T @ (b - A @ x)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(A, 1) * max(m, n)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= ~(np.abs(x) < tol)
            x[~passive] = 0.0
        w = A.T @ (b - A @ x)
    return x


def _fit_fixed_knee(features: np.ndarray, y: np.ndarray, knee: float, graph_sizes=(), piecewise_sizes=()) -> np.ndarray:
    A = design_matrix(features, knee, graph_sizes, piecewise_sizes)
    for col in (1, 2):  # every step eager (E) or every step piecewise (W): that column is c0's again
        if A[:, col].min() == 1.0:
            A[:, col] = 0.0
    wgt = 1.0 / np.maximum(y, 1e-9)  # minimise relative error
    scale = np.maximum(np.abs(A * wgt[:, None]).max(axis=0), 1e-30)
    coef = nnls(A * wgt[:, None] / scale, y * wgt) / scale
    return coef


def errors(pred: np.ndarray, y: np.ndarray) -> dict:
    if len(y) == 0:
        return {"n": 0, "mape": None, "max_ape": None, "r2": None}
    ape = np.abs(pred - y) / np.maximum(y, 1e-12)
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"n": int(len(y)), "mape": float(ape.mean()), "p90_ape": float(np.percentile(ape, 90)),
            "max_ape": float(ape.max()), "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else None}


def _knee_candidates(tokens: np.ndarray) -> list[float]:
    tokens = np.unique(tokens)
    cands = [float(t) for t in tokens if t > tokens.min()]
    return [float(tokens.max() + 1)] + cands  # first candidate: no hinge at all


def fit_points(features: np.ndarray, y: np.ndarray, graph_sizes=(), piecewise_sizes=()) -> tuple[np.ndarray, float]:
    """Coefficients and knee minimising mean relative error on (features, y)."""
    best = None
    for knee in _knee_candidates(effective_features(features, graph_sizes, piecewise_sizes)[2]):
        coef = _fit_fixed_knee(features, y, knee, graph_sizes, piecewise_sizes)
        pred = design_matrix(features, knee, graph_sizes, piecewise_sizes) @ coef
        err = float((np.abs(pred - y) / np.maximum(y, 1e-12)).mean())
        if best is None or err < best[0] - 1e-12:
            best = (err, coef, knee)
    return best[1], best[2]


def holdout_mask(n: int, fraction: float = 0.2, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    k = max(1, int(round(n * fraction))) if n >= 5 else 0
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, size=k, replace=False)] = True
    return mask


def fit_calibration(features: np.ndarray, y: np.ndarray, holdout_fraction: float = 0.2, seed: int = 0,
                    graph_sizes=(), piecewise_sizes=()) -> dict:
    """Fit on the training points, report held-out error, then refit on all points for use.
    `graph_sizes`: the batch sizes of the CUDA graphs decode-only steps ran from (none: all eager);
    `piecewise_sizes`: the token counts of the piecewise graphs other steps ran from (none: eager).

    Returns the `fit` section of calib.json."""
    graph_sizes = list(normalise_graph_sizes(graph_sizes))
    piecewise_sizes = list(normalise_graph_sizes(piecewise_sizes))
    features = np.asarray(features, dtype=np.int64)
    y = np.asarray(y, dtype=np.float64)
    if len(y) < 3:
        raise ValueError(f"need at least 3 measured grid points to fit, got {len(y)}")
    mask = holdout_mask(len(y), holdout_fraction, seed)
    coef_tr, knee_tr = fit_points(features[~mask], y[~mask], graph_sizes, piecewise_sizes)
    pred_tr = design_matrix(features, knee_tr, graph_sizes, piecewise_sizes) @ coef_tr
    coef, knee = fit_points(features, y, graph_sizes, piecewise_sizes)
    model = CalibratedCostModel(dict(zip(COEFFICIENTS, coef)), knee, graph_sizes=graph_sizes,
                                piecewise_sizes=piecewise_sizes)
    pred_all = model.predict_features(features)
    return {
        "form": FORM,
        "graph_sizes": graph_sizes,
        "piecewise_sizes": piecewise_sizes,
        "features": {"T": "prefill tokens + decodes", "S": "prefill chunks + decodes",
                     "Pp": "prefill query-key pairs", "Kp": "prefill KV tokens read",
                     "Kd": "decode context tokens attended",
                     "E": "1 if the step ran eagerly, 0 if from a CUDA graph (a decode-only step of at most "
                          "max(graph_sizes) decodes, counted as the next graph size)",
                     "W": "1 if the step ran from piecewise CUDA graphs (not decode-only in a full graph, at most "
                          "max(piecewise_sizes) tokens; T counted as the next piecewise size)"},
        "coefficients": {k: float(v) for k, v in zip(COEFFICIENTS, coef)},
        "knee": float(knee),
        "method": "non-negative least squares on relative error; knee by exhaustive search over grid T values",
        "holdout_fraction": holdout_fraction,
        "train": errors(pred_tr[~mask], y[~mask]),
        "holdout": errors(pred_tr[mask], y[mask]),
        "holdout_indices": [int(i) for i in np.flatnonzero(mask)],
        "train_fit": {"coefficients": {k: float(v) for k, v in zip(COEFFICIENTS, coef_tr)}, "knee": float(knee_tr)},
        "all_points": errors(pred_all, y),
        "range": fitted_range(features),
    }


def fit_rows(rows: list[dict], holdout_fraction: float = 0.2, seed: int = 0, graph_sizes=(), piecewise_sizes=()) -> dict:
    """`fit_calibration` of measured grid rows (calib.json's `grid.measured`: each has its
    `features` and its fitted `value_s`)."""
    features = np.array([row["features"] for row in rows], dtype=np.int64).reshape(-1, 5)
    y = np.array([row["value_s"] for row in rows], dtype=np.float64)
    return fit_calibration(features, y, holdout_fraction, seed, graph_sizes, piecewise_sizes)
