"""Latency metrics an autoscaler reads (`--autoscale-metric ttft_p95=2`): a percentile of vLLM's
own latency histograms over the fleet, as a Prometheus query behind KEDA or a custom-metrics
adapter computes it:

    histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))

- `ttft_pQ`: vLLM's `time_to_first_token_seconds`, observed when a request's first token is
  sampled (each sequence of a parallel-sampling request), from its arrival at the server;
- `e2e_pQ`: `e2e_request_latency_seconds`, observed when a request (a sequence) finishes;
- `itl_pQ`: `inter_token_latency_seconds`, one observation per request per step that sampled
  its next token: the gap since its previous one. Read from each replica's step log and
  scheduler as token_gaps.parquet counts them (results.itl_samples): a step closes its
  `num_decode_tokens` gaps of its own duration, less the steady decoders it resumed, whose gaps
  (and every other irregular one: a preempted request's, a token after a stall) run from the end
  of the step of the previous token to the end of the step of this one.

Each observation falls into vLLM's default buckets for its histogram (or those of
`histogram_buckets`, vLLM's --custom-histogram-buckets): the first upper bound `le` it does not
exceed. The query counts the observations of the last `window_s` seconds (the range of `rate`), strictly before the decision instant, over every replica, and interpolates
within the bucket that holds the quantile as `histogram_quantile` does: linearly from the
bucket's lower bound (0 for the first), and, past the last finite bound, that bound. With no
observation in the window the query has no value (Prometheus: NaN) and the metric recommends
nothing. A request held while the fleet scales from zero waits before the server: vLLM's
clock for it starts once a replica is ready.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import re
from collections import Counter

from simkv.clock import TICKS_PER_SECOND

# vLLM's default bucket bounds (vllm/v1/metrics: TIME_TO_FIRST_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS)
BUCKETS = {
    "ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0),
    "e2e": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0),
    "itl": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
}
HISTOGRAMS = {"ttft": "time to first token", "e2e": "end-to-end latency", "itl": "inter-token latency"}
# vLLM's bucket families (--custom-histogram-buckets' keys) of these histograms, and its others
FAMILIES = {"time_to_first_token": "ttft", "request_latency": "e2e", "inter_token_latency": "itl"}
OTHER_FAMILIES = ("iteration_tokens", "request_params_n", "request_num_preemptions", "request_tokens",
                  "kv_cache_residency")


def custom_buckets(text: str, flag: str) -> dict[str, list[float]]:
    """vLLM's --custom-histogram-buckets JSON ({"inter_token_latency": [0.005, 0.01, ...]}),
    every family checked as vLLM checks it ("": none)."""
    try:
        families = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not a JSON object: {exc.msg}") from None
    if not isinstance(families, dict):
        raise ValueError(f"{flag}: expected a JSON object of bucket families, e.g. "
                         '{"inter_token_latency": [0.005, 0.01, 0.015, 0.02]}')
    for family, bounds in families.items():
        if family not in FAMILIES and family not in OTHER_FAMILIES:
            raise ValueError(f"{flag}: unknown bucket family {family!r}; known families: "
                             f"{', '.join(sorted((*FAMILIES, *OTHER_FAMILIES)))}")
        if not isinstance(bounds, list) or not bounds or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b > 0 for b in bounds):
            raise ValueError(f"{flag}: {family}: expected a non-empty list of finite bounds > 0, got {bounds!r}")
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"{flag}: {family}: bounds {bounds} must be strictly increasing")
    return families


def latency_bounds(families: dict[str, list[float]]) -> dict[str, tuple[float, ...]]:
    """The bounds of the histograms an autoscaler reads (ttft, e2e, itl) among `families`."""
    return {FAMILIES[family]: tuple(float(b) for b in bounds) for family, bounds in families.items()
            if family in FAMILIES}


_NAME = re.compile(r"(ttft|e2e|itl)_p(\d+(?:\.\d+)?)")


def latency_metric(name: str) -> tuple[str, float] | None:
    """('ttft', 0.95) for 'ttft_p95'; None for a name that is no latency metric."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    q = float(match.group(2)) / 100.0
    return (match.group(1), q) if 0.0 < q < 1.0 else None


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: list[int]) -> float | None:
    """Prometheus' histogram_quantile over buckets `bounds` (upper bounds, increasing; the last
    count is the +Inf bucket's) holding `counts` observations each; None when empty."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for b, count in enumerate(counts):
        if below + count >= rank and count > 0:
            if b == len(bounds):  # (the +Inf bucket: the last finite bound)
                return bounds[-1]
            lower = bounds[b - 1] if b > 0 else 0.0
            return lower + (bounds[b] - lower) * (rank - below) / count
        below += count
    return bounds[-1]


class LatencyWatch:
    """The fleet's latency observations, (tick, seconds) per histogram, fed by its engines
    (ReplayEngine.latency_watch) and read by the autoscaler at its decision instants."""

    def __init__(self, kinds, window_s: float, held: dict[int, int] | None = None, engines=(),
                 buckets: dict[str, tuple[float, ...]] | None = None) -> None:
        self.window = max(1, math.ceil(window_s * TICKS_PER_SECOND))
        self.buckets = BUCKETS | (buckets or {})  # (vLLM's defaults, or --custom-histogram-buckets')
        # (tick, seconds, observations) sorted by tick
        self.samples: dict[str, list[tuple[int, float, int]]] = {kind: [] for kind in kinds}
        self.held = held if held is not None else {}  # (scale to zero: row -> tick its replica is ready)
        self.gaps = [StepGaps(engine) for engine in engines] if "itl" in self.samples else []

    def _observe(self, kind: str, tick: int, request, times: int = 1) -> None:
        samples = self.samples.get(kind)
        if samples is None:
            return
        start = request.arrival_time
        held = self.held.get(request.index)
        if held is not None:
            start = max(start, held / TICKS_PER_SECOND)
        bisect.insort(samples, (tick, max(0.0, tick / TICKS_PER_SECOND - start), times))

    def first_tokens(self, out, tick: int) -> None:
        """After step `out`'s output, at `tick`: the requests whose first token it sampled."""
        if "ttft" not in self.samples:
            return
        for chunk in out.chunks:
            request = chunk.request
            if request.first_token_step == out.step:
                self._observe("ttft", tick, request, request.num_samples)

    def finished(self, requests, tick: int) -> None:
        for request in requests:
            self._observe("e2e", tick, request)

    def quantile(self, kind: str, q: float, tick: int) -> float | None:
        """The q-quantile of `kind` over the window before `tick` (None: no observation). Asked at
        ticks that never decrease: the samples before the window are dropped."""
        samples = self.samples[kind]
        for source in self.gaps if kind == "itl" else ():  # (the gaps of the steps ended since the last query)
            for sample in source.read_until(tick):
                bisect.insort(samples, sample)
        first = bisect.bisect_right(samples, (tick - self.window, math.inf))
        del samples[:first]
        bounds = self.buckets[kind]
        counts = [0] * (len(bounds) + 1)
        for sample_tick, seconds, times in samples:
            if sample_tick >= tick:
                break
            counts[bisect.bisect_left(bounds, seconds)] += times
        return histogram_quantile(q, bounds, counts)


class StepGaps:
    """One replica's inter-token gaps in time order, from its step log and scheduler (the
    sources of results.itl_samples), read as its steps end."""

    def __init__(self, engine) -> None:
        self.steps, self.scheduler = engine.steps, engine.scheduler
        self.cursor = (0, 0)  # (StepLog.ended_steps': the steps read)
        self.resumed: Counter = Counter()  # step -> steady decoders resumed in it (their gaps are irregular)
        self.resumed_read = 0
        self.irregular: list[tuple[int, int]] = []  # heap of (token step, previous token step) not yet ended
        self.irregular_read = 0
        # pipeline parallelism: every gap is timed from step ends (results.itl_samples), logged by
        # the scheduler as each step's output arrives; (token step, previous, tokens) not yet read
        self.pipelined = self.scheduler.pipeline_gaps is not None
        if self.pipelined:
            self.scheduler.pipeline_gap_log = []
        self.pending: list[tuple[int, int, int]] = []

    def read_until(self, tick: int) -> list[tuple[int, float, int]]:
        """The gaps closed by the steps that ended strictly before `tick` and after the last
        call: (tick, seconds, how many) each."""
        sched, steps = self.scheduler, self.steps
        resumed = sched.resumed_steps
        self.resumed.update(resumed[self.resumed_read:])
        self.resumed_read = len(resumed)
        irregular = sched.irregular_gaps
        for previous, step in irregular[self.irregular_read:]:
            heapq.heappush(self.irregular, (step, previous))
        self.irregular_read = len(irregular)
        out = self._pipeline_gaps(tick) if self.pipelined else []
        ended, self.cursor = steps.ended_steps(self.cursor, tick)
        for step, end, ticks, gaps in ended if not self.pipelined else ():
            gaps -= self.resumed.pop(step, 0)
            if gaps > 0:
                out.append((end, ticks / TICKS_PER_SECOND, gaps))
        while self.irregular:
            step, previous = self.irregular[0]
            end = steps.end_tick(step)
            if end is None or end >= tick:
                break
            heapq.heappop(self.irregular)
            start = steps.end_tick(previous) if previous >= 0 else 0
            out.append((end, (end - start) / TICKS_PER_SECOND, 1))
        return out

    def _pipeline_gaps(self, tick: int) -> list[tuple[int, float, int]]:
        """Pipeline parallelism: the logged gaps whose token's step ended strictly before `tick`
        (a step's duration, from its first stage's start, is no gap there)."""
        log, steps = self.scheduler.pipeline_gap_log, self.steps
        for (previous, step), n in Counter(log).items():
            heapq.heappush(self.pending, (step, previous, n))
        log.clear()
        out = []
        while self.pending:
            step, previous, n = self.pending[0]
            end = steps.end_tick(step)
            if end is None or end >= tick:
                break
            heapq.heappop(self.pending)
            start = steps.end_tick(previous) if previous >= 0 else 0
            out.append((end, (end - start) / TICKS_PER_SECOND, n))
        return out
