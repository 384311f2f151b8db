"""``simkv trace transform``: the edits users make before a replay.

Edits apply in this fixed order, whatever the order of the options: window -> head -> sample ->
max-prompt-tokens -> time-scale -> rate (or rate-profile) -> time-offset -> samples -> priority ->
request-class. Every edit keeps the request order (the trace
is sorted by arrival).
  window T0 T1   keep arrivals in [T0, T1) and shift them so that T0 becomes 0
  head N         keep the first N requests
  sample F       keep each request with probability F (numpy Generator, ``seed``)
  max-prompt-tokens N   keep the requests whose prompt has at most N tokens (e.g. below a
                 model's context length: an engine would reject the others)
  time-scale F   multiply every arrival time (and think time) by F (F < 1 compresses, F > 1 stretches)
  rate R         re-time to a Poisson process at R req/s (first request at 0), order kept
  rate-profile T0=R0,T1=R1,...   re-time to a Poisson process whose rate is R0 req/s from T0 (0),
                 R1 from T1, ... (piecewise constant: a day's load, a burst), order kept
  time-offset S  add S seconds to every arrival (a trace that started S seconds after another
                 it is merged with; the first arrival must stay >= 0)
  samples N      every request asks for N sequences (parallel sampling: the `n` column; best-of-N,
                 RL rollouts)
  priority P     every request gets priority P (vLLM's: lower is served first under
                 --scheduling-policy priority); merge traces to give each kind of traffic its own
  request-class NAME   label every request with this class (the `request_class` column, which a
                 replay breaks its latencies and SLOs down by; `simkv trace merge` sets it per input)
  class-by-prompt-tokens / class-by-output-tokens BINS   label each request by its size instead:
                 "short<2048,medium<8192,long" (a class below each bound, the last for the rest)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from simkv.traces.arrivals import ArrivalProcess, arrival_rng
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace, take_rows


@dataclass(frozen=True)
class Edits:
    """Which edits to apply (None = not requested)."""

    window: tuple[float, float] | None = None
    head: int | None = None
    sample: float | None = None
    max_prompt_tokens: int | None = None
    time_scale: float | None = None
    rate: float | None = None
    rate_profile: tuple[tuple[float, float], ...] | None = None  # ((from second, req/s), ...), the first from 0
    time_offset: float | None = None
    samples: int | None = None
    priority: int | None = None
    request_class: str | None = None
    # ("prompt_tokens" or "output_tokens", ((class, upper bound), ...), the last class): classes by size
    class_by: tuple[str, tuple[tuple[str, int], ...], str] | None = None
    seed: int = 0

    def check(self) -> None:
        if self.window is not None and not (0 <= self.window[0] < self.window[1]):
            raise TraceError(f"--window needs 0 <= T0 < T1, got {self.window[0]} {self.window[1]}")
        if self.head is not None and self.head < 1:
            raise TraceError(f"--head must be >= 1, got {self.head}")
        if self.sample is not None and not (0 < self.sample <= 1):
            raise TraceError(f"--sample must be in (0, 1], got {self.sample}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise TraceError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.time_scale is not None and not (0 < self.time_scale < float("inf")):
            raise TraceError(f"--time-scale must be > 0, got {self.time_scale}")
        if self.rate is not None and not (0 < self.rate < float("inf")):
            raise TraceError(f"--rate must be > 0, got {self.rate}")
        if self.rate_profile is not None:
            if self.rate is not None:
                raise TraceError("--rate re-times at one rate, --rate-profile at several: give one")
            starts = [t for t, _ in self.rate_profile]
            if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
                raise TraceError("--rate-profile: the times must start at 0 and increase (0=2,600=10,1200=2)")
            if any(not (0 <= r < float("inf")) for _, r in self.rate_profile) or not any(r > 0 for _, r in self.rate_profile):
                raise TraceError("--rate-profile: rates must be >= 0 req/s, and one of them > 0")
        if self.time_offset is not None and not np.isfinite(self.time_offset):
            raise TraceError(f"--time-offset must be a number of seconds, got {self.time_offset}")
        if self.samples is not None and self.samples < 1:
            raise TraceError(f"--samples must be >= 1, got {self.samples}")
        if self.request_class is not None and not self.request_class.strip():
            raise TraceError("--request-class must name a class, got an empty label")
        if self.request_class is not None and self.class_by is not None:
            raise TraceError("--request-class labels every request alike, --class-by-* by size: give one")


def transform(trace: Trace, edits: Edits) -> Trace:
    """Apply ``edits``; TraceError if no request is left."""
    edits.check()
    if edits.window is not None:
        trace = _window(trace, *edits.window)
    if edits.head is not None:
        trace = take_rows(trace, np.arange(min(edits.head, len(trace))))
    if edits.sample is not None:
        keep = np.random.default_rng([edits.seed, 5]).random(len(trace)) < edits.sample
        trace = _nonempty(take_rows(trace, np.flatnonzero(keep)), "--sample")
    if edits.max_prompt_tokens is not None:
        keep = np.flatnonzero(np.asarray(trace.prompt_tokens) <= edits.max_prompt_tokens)
        trace = _nonempty(take_rows(trace, keep), "--max-prompt-tokens")
    if edits.time_scale is not None:
        trace = replace(trace, arrival_time_s=trace.arrival_time_s * edits.time_scale)
        if trace.think_time_s is not None:
            trace = replace(trace, think_time_s=trace.think_time_s * edits.time_scale)
    if edits.rate is not None:
        times = ArrivalProcess("poisson", edits.rate).times(len(trace), arrival_rng(edits.seed, stream=6))
        trace = replace(trace, arrival_time_s=times)
    if edits.rate_profile is not None:
        trace = replace(trace, arrival_time_s=profile_times(edits.rate_profile, len(trace),
                                                            arrival_rng(edits.seed, stream=6)))
    if edits.time_offset is not None:
        moved = trace.arrival_time_s + edits.time_offset
        if moved[0] < 0:
            raise TraceError(f"{trace.source}: --time-offset {edits.time_offset:g} moves the first arrival "
                             f"({trace.arrival_time_s[0]:g} s) before 0")
        trace = replace(trace, arrival_time_s=moved)
    if edits.samples is not None:
        trace = replace(trace, n=np.full(len(trace), edits.samples, dtype=np.int64))
    if edits.priority is not None:
        trace = replace(trace, priority=np.full(len(trace), edits.priority, dtype=np.int64))
    if edits.request_class is not None:
        trace = replace(trace, request_class=np.full(len(trace), edits.request_class, dtype=object))
    if edits.class_by is not None:
        column, bins, last = edits.class_by
        names = np.array([name for name, _ in bins] + [last], dtype=object)
        bounds = np.array([bound for _, bound in bins], dtype=np.int64)
        trace = replace(trace, request_class=names[np.searchsorted(bounds, getattr(trace, column), side="right")])
    return trace


def profile_times(profile: tuple[tuple[float, float], ...], count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` arrival times of a Poisson process with a piecewise-constant rate (the first at the
    profile's first instant of a rate > 0): unit-rate arrivals mapped through the inverse of the
    profile's cumulative rate."""
    starts = np.array([t for t, _ in profile], dtype=np.float64)
    rates = np.array([r for _, r in profile], dtype=np.float64)
    cumulative = np.concatenate(([0.0], np.cumsum(rates[:-1] * np.diff(starts))))  # expected arrivals by each start
    unit = np.concatenate(([0.0], np.cumsum(rng.exponential(1.0, count - 1)))) if count else np.zeros(0)
    segment = np.searchsorted(cumulative, unit, side="right") - 1
    if rates[-1] == 0 and (unit > cumulative[-1]).any():
        left = int((unit > cumulative[-1]).sum())
        raise TraceError(f"--rate-profile: its last rate is 0 from {starts[-1]:g} s and {left:,} requests are left "
                         "(end it on a rate > 0, or keep fewer requests with --head)")
    with np.errstate(divide="ignore", invalid="ignore"):
        return starts[segment] + np.where(rates[segment] > 0, (unit - cumulative[segment]) / rates[segment], 0.0)


def parse_rate_profile(text: str) -> tuple[tuple[float, float], ...]:
    """'0=2,600=10,1200=2' -> ((0.0, 2.0), (600.0, 10.0), (1200.0, 2.0))."""
    out = []
    for item in text.split(","):
        t, sep, r = item.partition("=")
        try:
            out.append((float(t), float(r)))
        except ValueError:
            raise TraceError(f"--rate-profile {item!r}: expected SECONDS=REQ_PER_S (0=2,600=10,1200=2)") from None
        if not sep:
            raise TraceError(f"--rate-profile {item!r}: expected SECONDS=REQ_PER_S (0=2,600=10,1200=2)")
    return tuple(out)


def parse_class_bins(text: str, flag: str) -> tuple[tuple[tuple[str, int], ...], str]:
    """'short<2048,medium<8192,long' -> ((('short', 2048), ('medium', 8192)), 'long'): a class
    for the sizes below each bound (bounds increasing), the last for the rest."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) < 2:
        raise TraceError(f"{flag} {text!r}: give two classes or more, e.g. short<2048,long")
    bins: list[tuple[str, int]] = []
    for part in parts[:-1]:
        name, sep, bound = part.partition("<")
        try:
            value = int(bound)
        except ValueError:
            value = 0
        if not sep or not name.strip() or value < 1:
            raise TraceError(f"{flag} {text!r}: {part!r} is not CLASS<TOKENS (a class name, a bound >= 1)")
        if bins and value <= bins[-1][1]:
            raise TraceError(f"{flag} {text!r}: the bounds must increase ({bins[-1][1]} then {value})")
        bins.append((name.strip(), value))
    last = parts[-1]
    if not last or "<" in last:
        raise TraceError(f"{flag} {text!r}: the last class takes the rest and has no bound, e.g. ...,long")
    names = [name for name, _ in bins] + [last]
    if len(set(names)) != len(names):
        raise TraceError(f"{flag} {text!r}: a class is named twice")
    return tuple(bins), last


def _window(trace: Trace, start: float, end: float) -> Trace:
    times = trace.arrival_time_s
    rows = np.flatnonzero((times >= start) & (times < end))
    trace = _nonempty(take_rows(trace, rows), "--window")
    return replace(trace, arrival_time_s=trace.arrival_time_s - start)


def _nonempty(trace: Trace, edit: str) -> Trace:
    if len(trace) == 0:
        raise TraceError(f"{trace.source}: {edit} left no requests")
    return trace
