"""plots.html: one inline-SVG chart per (metric, swept key); one line per combination of the other
swept keys (and trace). Self-contained: opens offline, no plotting library."""

from __future__ import annotations

import html

import numpy as np

from simkv.compare.svg import COLORS, W, H, _Frame, _svg, page
from simkv.sweep.table import METRICS, metric_columns

PLOT_METRICS = [m for m in METRICS if m not in ("num_requests", "num_finished")]


def _numeric(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def chart(rows: list[dict], metric: str, key: str, other_keys: list[str]) -> str:
    """`metric` against `key`; non-numeric keys (bool, str) are placed at 0, 1, 2... in grid order."""
    ok = [r for r in rows if r["status"] == "ok" and r.get(metric) is not None]
    levels = list(dict.fromkeys(r[key] for r in rows))
    numeric = _numeric(levels)
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for r in ok:
        x = float(r[key]) if numeric else float(levels.index(r[key]))
        groups.setdefault(tuple(r.get(k) for k in other_keys), []).append((x, float(r[metric])))
    series = []
    for group, points in groups.items():
        points.sort()
        label = ", ".join(f"{k}={v}" for k, v in zip(other_keys, group)) or metric
        series.append((label, np.array([p[0] for p in points]), np.array([p[1] for p in points])))
    xlabel = key if numeric else f"{key} (" + ", ".join(f"{i}={v}" for i, v in enumerate(levels)) + ")"
    return points_chart(series, f"{metric} vs {key}", xlabel, metric)


def points_chart(series: list[tuple[str, np.ndarray, np.ndarray]], title: str, xlabel: str, ylabel: str) -> str:
    """Lines with a marker at every cell, so one-value grids and overlapping lines stay visible."""
    if not series:
        return _svg([f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">{html.escape(title)}: no data</text>'], [])
    frame = _Frame([s[1] for s in series], [s[2] for s in series])
    parts = frame.axes(title, xlabel, ylabel)
    for i, (_, x, y) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        px, py = frame.px(x), frame.py(y)
        if len(x) > 1:
            pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px, py))
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.4" points="{pts}"/>')
        parts.extend(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="{3.5 - 0.4 * (i % 4):.1f}" fill="{color}"/>'
                     for a, b in zip(px, py))
    return _svg(parts, [s[0] for s in series] if len(series) > 1 else [])


def plots_html(rows: list[dict], swept_keys: list[str], title: str) -> str:
    multi_trace = len({r["trace"] for r in rows}) > 1
    body = []
    failed = [r for r in rows if r["status"] != "ok"]
    body.append(f"<p>{len(rows)} cells, {len(rows) - len(failed)} ok, {len(failed)} failed"
                + (" (not plotted)" if failed else "") + ".</p>")
    keys = swept_keys or ["trace"]
    for metric in [m for m in metric_columns(rows) if m in PLOT_METRICS or m not in METRICS]:
        charts = []
        for key in keys:
            others = (["trace"] if multi_trace and key != "trace" else []) + [k for k in swept_keys if k != key]
            charts.append(chart(rows, metric, key, others))
        body.append(f"<h2>{html.escape(metric)}</h2><div class='charts'>" + "".join(charts) + "</div>")
    return page(title, body)
