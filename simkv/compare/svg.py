"""Inline SVG charts (no plotting library): line/step series, scatter with a y=x diagonal, CDFs.

Every chart is a self-contained <svg> string, so an HTML report that embeds them opens offline.
"""

from __future__ import annotations

import html
import math

import numpy as np

W, H = 560, 300
ML, MR, MT, MB = 64, 16, 28, 44
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    start = math.ceil(lo / step) * step
    out, v = [], start
    while v <= hi + 1e-12 * abs(hi) and len(out) < 20:
        out.append(v)
        v += step
    return out


def _fmt(v: float) -> str:
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e4 or a < 1e-3:
        return f"{v:.2g}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def _thin(x: np.ndarray, y: np.ndarray, limit: int = 1500) -> tuple[np.ndarray, np.ndarray]:
    if len(x) <= limit:
        return x, y
    idx = np.unique(np.linspace(0, len(x) - 1, limit).astype(int))
    return x[idx], y[idx]


class _Frame:
    def __init__(self, xs: list[np.ndarray], ys: list[np.ndarray], square: bool = False) -> None:
        allx = np.concatenate([x[np.isfinite(x)] for x in xs]) if xs else np.zeros(0)
        ally = np.concatenate([y[np.isfinite(y)] for y in ys]) if ys else np.zeros(0)
        self.x0, self.x1 = (float(allx.min()), float(allx.max())) if allx.size else (0.0, 1.0)
        self.y0, self.y1 = (float(ally.min()), float(ally.max())) if ally.size else (0.0, 1.0)
        if square:
            lo, hi = min(self.x0, self.y0), max(self.x1, self.y1)
            self.x0 = self.y0 = lo
            self.x1 = self.y1 = hi
        self.y0 = min(self.y0, 0.0) if self.y0 >= 0 and not square else self.y0
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1.0
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1.0

    def px(self, x):
        return ML + (np.asarray(x, float) - self.x0) / (self.x1 - self.x0) * (W - ML - MR)

    def py(self, y):
        return H - MB - (np.asarray(y, float) - self.y0) / (self.y1 - self.y0) * (H - MT - MB)

    def axes(self, title: str, xlabel: str, ylabel: str) -> list[str]:
        e = html.escape
        parts = [f'<rect x="{ML}" y="{MT}" width="{W - ML - MR}" height="{H - MT - MB}" fill="none" stroke="#999"/>',
                 f'<text x="{W / 2}" y="18" text-anchor="middle" font-weight="bold">{e(title)}</text>',
                 f'<text x="{(ML + W - MR) / 2}" y="{H - 8}" text-anchor="middle">{e(xlabel)}</text>',
                 f'<text x="14" y="{(MT + H - MB) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(MT + H - MB) / 2})">{e(ylabel)}</text>']
        for t in _ticks(self.x0, self.x1):
            x = float(self.px(t))
            parts.append(f'<line x1="{x:.1f}" y1="{H - MB}" x2="{x:.1f}" y2="{H - MB + 4}" stroke="#999"/>'
                         f'<text x="{x:.1f}" y="{H - MB + 16}" text-anchor="middle">{_fmt(t)}</text>')
        for t in _ticks(self.y0, self.y1):
            y = float(self.py(t))
            parts.append(f'<line x1="{ML - 4}" y1="{y:.1f}" x2="{W - MR}" y2="{y:.1f}" stroke="#eee"/>'
                         f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
        return parts


def _svg(parts: list[str], legend: list[str]) -> str:
    leg = []
    for i, name in enumerate(legend):
        y = MT + 14 + 16 * i
        leg.append(f'<rect x="{ML + 8}" y="{y - 9}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>'
                   f'<text x="{ML + 22}" y="{y}">{html.escape(name)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            f'font-family="sans-serif" font-size="11">' + "".join(parts + leg) + "</svg>")


def line_chart(series: list[tuple[str, np.ndarray, np.ndarray]], title: str, xlabel: str, ylabel: str,
               step: bool = False) -> str:
    series = [(n, np.asarray(x, float), np.asarray(y, float)) for n, x, y in series if len(x)]
    if not series:
        return _svg([f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">{html.escape(title)}: no data</text>'], [])
    fr = _Frame([s[1] for s in series], [s[2] for s in series])
    parts = fr.axes(title, xlabel, ylabel)
    for i, (_, x, y) in enumerate(series):
        x, y = _thin(x, y)
        if step and len(x) > 1:
            x = np.repeat(x, 2)[1:]
            y = np.repeat(y, 2)[:-1]
        pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(fr.px(x), fr.py(y)))
        parts.append(f'<polyline fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="1.4" points="{pts}"/>')
    return _svg(parts, [s[0] for s in series] if len(series) > 1 else [])


def cdf_chart(series: list[tuple[str, np.ndarray]], title: str, xlabel: str) -> str:
    lines = []
    for name, v in series:
        v = np.sort(np.asarray(v, float)[np.isfinite(np.asarray(v, float))])
        if v.size:
            lines.append((name, v, np.arange(1, v.size + 1) / v.size))
    return line_chart(lines, title, xlabel, "fraction <= x", step=True)


def scatter_chart(x: np.ndarray, y: np.ndarray, title: str, xlabel: str, ylabel: str, diagonal: bool = True) -> str:
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = _thin(x[ok], y[ok], 3000)
    if not x.size:
        return line_chart([], title, xlabel, ylabel)
    fr = _Frame([x], [y], square=diagonal)
    parts = fr.axes(title, xlabel, ylabel)
    if diagonal:
        parts.append(f'<line x1="{float(fr.px(fr.x0)):.1f}" y1="{float(fr.py(fr.y0)):.1f}" '
                     f'x2="{float(fr.px(fr.x1)):.1f}" y2="{float(fr.py(fr.y1)):.1f}" stroke="#888" stroke-dasharray="4 3"/>')
    parts.extend(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2" fill="{COLORS[0]}" fill-opacity="0.55"/>'
                 for a, b in zip(fr.px(x), fr.py(y)))
    return _svg(parts, [])


def page(title: str, body: list[str]) -> str:
    """A whole HTML document; body items are HTML fragments (tables, <svg>...)."""
    style = ("body{font-family:sans-serif;max-width:1200px;margin:1em auto;color:#222}"
             "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.charts{display:flex;flex-wrap:wrap;gap:8px}"
             ".bad{color:#b00}.ok{color:#070}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>" + "\n".join(body) + "</body></html>\n")
