"""``simkv trace inspect`` statistics.

Percentiles use linear interpolation (numpy's default); the text report rounds them half to
even, which is how the README figures of the shared traces are written. Peak rates count
arrivals in fixed windows [k*w, (k+1)*w) from t = 0.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from simkv.traces.reuse import describes_reply, hashed_positions, prefix_reuse
from simkv.traces.schema import Trace


@dataclass(frozen=True)
class Spread:
    """p50/p90/p99 (linear interpolation) and max of a length column."""

    p50: float
    p90: float
    p99: float
    max: int
    mean: float

    @staticmethod
    def of(values: np.ndarray) -> "Spread":
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return Spread(float(p50), float(p90), float(p99), int(values.max()), float(values.mean()))


@dataclass(frozen=True)
class TraceStats:
    """Everything ``inspect`` prints; rates are None when the trace spans no time."""

    rows: int
    first_arrival_s: float
    time_span_s: float
    mean_rate_per_s: float | None
    mean_rate_per_min: float | None
    peak_per_s: int
    peak_per_min: int
    prompt: Spread
    output: Spread
    total_prompt_tokens: int
    total_output_tokens: int
    total_tokens: int
    mean_tokens_per_request: float
    longest_request_tokens: int
    block_size: int
    reuse_ratio: float | None
    prompt_blocks: int | None
    reused_blocks: int | None
    distinct_first_blocks: int | None
    replies_described: int | None = None  # rows whose hash list goes on over the reply
    sessions: int | None = None  # distinct session_id values (None: no such column)
    turns_in_sessions: int | None = None
    max_turns_per_session: int | None = None  # the longest session's rows (sticky routing piles them on one replica)
    largest_session_tokens_share: float | None = None  # the share of all prompt tokens the largest session sends
    lora_adapters: int | None = None  # distinct lora_name values (None: no adapter named)
    rows_with_adapter: int | None = None
    mm_items: int | None = None  # multimodal items (images; None: no mm_* columns)
    rows_with_items: int | None = None
    distinct_items: int | None = None
    mm_item_tokens: int | None = None  # their placeholder tokens, all rows
    max_items_per_row: int | None = None  # the most images one prompt shows (vLLM's --limit-mm-per-prompt)
    request_classes: dict[str, int] | None = None  # rows per request_class, by first arrival (None: no such column)
    class_stats: dict[str, dict] | None = None  # per class: mean rate, prompt and output spreads

    def to_dict(self) -> dict:
        return asdict(self)


def _peak(times: np.ndarray, window_s: float) -> int:
    _, counts = np.unique(np.floor(times / window_s), return_counts=True)
    return int(counts.max())


def trace_stats(trace: Trace, block_size: int = 16) -> TraceStats:
    """Compute the inspect statistics (reuse fields are None for traces without block hashes)."""
    times = trace.arrival_time_s
    span = float(times[-1] - times[0])
    rate = len(trace) / span if span > 0 else None
    totals = trace.prompt_tokens + trace.output_tokens
    reuse = prefix_reuse(trace, block_size)
    return TraceStats(
        rows=len(trace),
        first_arrival_s=float(times[0]),
        time_span_s=span,
        mean_rate_per_s=rate,
        mean_rate_per_min=rate * 60 if rate is not None else None,
        peak_per_s=_peak(times, 1.0),
        peak_per_min=_peak(times, 60.0),
        prompt=Spread.of(trace.prompt_tokens),
        output=Spread.of(trace.output_tokens),
        total_prompt_tokens=int(trace.prompt_tokens.sum()),
        total_output_tokens=int(trace.output_tokens.sum()),
        total_tokens=int(totals.sum()),
        mean_tokens_per_request=float(totals.mean()),
        longest_request_tokens=int(totals.max()),
        block_size=block_size,
        reuse_ratio=reuse.ratio if reuse else None,
        prompt_blocks=reuse.total_blocks if reuse else None,
        reused_blocks=reuse.reused_blocks if reuse else None,
        distinct_first_blocks=reuse.distinct_first_blocks if reuse else None,
        replies_described=_replies_described(trace),
        **_sessions(trace),
        **_adapters(trace),
        **_items(trace),
        request_classes=class_counts(trace),
        class_stats=_class_stats(trace),
    )


def _class_stats(trace: Trace) -> dict[str, dict] | None:
    """Each request class's rate over the whole trace's span and its prompt and output spreads."""
    counts = class_counts(trace)
    if counts is None:
        return None
    labels = trace.request_class
    times = trace.arrival_time_s
    span = float(times[-1] - times[0])
    out = {}
    for name, n in counts.items():
        rows = labels == name
        out[name] = {"rows": n, "mean_rate_per_s": n / span if span > 0 else None,
                     "prompt": asdict(Spread.of(trace.prompt_tokens[rows])),
                     "output": asdict(Spread.of(trace.output_tokens[rows]))}
    return out


def class_counts(trace: Trace) -> dict[str, int] | None:
    """Rows per request class, in the order the classes first arrive (None: no such column)."""
    if trace.request_class is None:
        return None
    return dict(Counter(trace.request_class.tolist()))


def _items(trace: Trace) -> dict:
    if trace.mm_items is None:
        return {}
    counts = np.diff(trace.mm_item_offsets)
    return {"mm_items": len(trace.mm_items), "rows_with_items": int((counts > 0).sum()),
            "distinct_items": len(np.unique(trace.mm_items[:, 2])), "mm_item_tokens": int(trace.mm_items[:, 1].sum()),
            "max_items_per_row": int(counts.max()) if len(counts) else 0}


def _adapters(trace: Trace) -> dict:
    from simkv.traces.lora import named_adapters

    named = named_adapters(trace)
    return {"lora_adapters": len(set(named)), "rows_with_adapter": len(named)} if named else {}


def _replies_described(trace: Trace) -> int | None:
    if trace.hash_offsets is None or trace.hash_block_tokens is None:
        return None
    return int(describes_reply(hashed_positions(trace), trace.prompt_tokens, trace.hash_block_tokens).sum())


def format_stats(stats: TraceStats, source: str = "") -> str:
    """A short human-readable report."""
    def spread(s: Spread) -> str:
        return f"p50 {s.p50:.0f}  p90 {s.p90:.0f}  p99 {s.p99:.0f}  max {s.max:,}  mean {s.mean:.1f}"

    def rate(value: float | None, unit: str) -> str:
        return f"{value:,.2f} {unit}" if value is not None else "- (all at one time)"

    lines = [
        f"trace          {source}",
        f"rows           {stats.rows:,}",
        f"time span      {stats.time_span_s:,.3f} s (first arrival {stats.first_arrival_s:,.3f} s)",
        f"mean rate      {rate(stats.mean_rate_per_s, 'req/s')}, {rate(stats.mean_rate_per_min, 'req/min')}",
        f"peak rate      {stats.peak_per_s:,} req in one second, {stats.peak_per_min:,} req in one minute",
        f"prompt tokens  {spread(stats.prompt)}",
        f"output tokens  {spread(stats.output)}",
        f"total tokens   {stats.total_tokens:,} (prompt {stats.total_prompt_tokens:,} + output "
        f"{stats.total_output_tokens:,}); mean {stats.mean_tokens_per_request:.1f} per request, "
        f"longest request {stats.longest_request_tokens:,}",
    ]
    if stats.reuse_ratio is None:
        lines.append("prefix reuse   - (no block_hashes" + ("; with sessions, `simkv trace transform --session-history` "
                                                           "infers the turns' history)" if stats.sessions else ")"))
    else:
        lines.append(
            f"prefix reuse   {stats.reuse_ratio:.4f} at {stats.block_size}-token blocks "
            f"({stats.reused_blocks:,} of {stats.prompt_blocks:,} blocks); "
            f"{stats.distinct_first_blocks:,} distinct first blocks"
        )
        lines.append(f"replies        {stats.replies_described:,} rows describe their reply (a later prompt may hit it)")
    if stats.sessions is not None:
        lines.append(f"sessions       {stats.sessions:,} ({stats.turns_in_sessions:,} rows; a replay paces each turn on "
                     "its previous reply)")
        if stats.sessions:
            lines.append(f"               longest {stats.max_turns_per_session:,} turns; the largest sends "
                         f"{100 * stats.largest_session_tokens_share:.1f} % of the prompt tokens (one replica's "
                         "under --router session_affinity)")
    if stats.lora_adapters is not None:
        lines.append(f"lora adapters  {stats.lora_adapters:,} ({stats.rows_with_adapter:,} rows name one; replay with "
                     "--enable-lora --max-loras K)")
    if stats.mm_items is not None:
        share = stats.mm_item_tokens / stats.total_prompt_tokens if stats.total_prompt_tokens else 0.0
        lines.append(f"images         {stats.mm_items:,} in {stats.rows_with_items:,} rows ({stats.distinct_items:,} "
                     f"distinct), {stats.mm_item_tokens:,} tokens ({100 * share:.1f} % of the prompts'); at most "
                     f"{stats.max_items_per_row:,} in one prompt")
    if stats.request_classes is not None:
        mix = ", ".join(f"{label} {n:,}" for label, n in stats.request_classes.items())
        lines.append(f"classes        {len(stats.request_classes):,}: {mix} (a replay breaks its latencies down by "
                     "them; --goodput NAME:ttft:MS holds one to its own SLO)")
        for label, c in (stats.class_stats or {}).items():
            p, o = c["prompt"], c["output"]
            rate = "-" if c["mean_rate_per_s"] is None else f"{c['mean_rate_per_s']:,.2f} req/s"
            lines.append(f"  {label:<12} {rate}; prompt p50 {p['p50']:.0f} p99 {p['p99']:.0f} mean {p['mean']:.1f}; "
                         f"output p50 {o['p50']:.0f} p99 {o['p99']:.0f} mean {o['mean']:.1f}")
    return "\n".join(lines)


def _sessions(trace) -> dict:
    """Sessions: how many, their rows, the longest's turns and the largest's share of the prompt
    tokens (None each without a session_id column)."""
    if trace.session_id is None:
        return {}
    ids = trace.session_id.tolist()
    turns: dict = {}
    tokens: dict = {}
    for sid, prompt in zip(ids, trace.prompt_tokens.tolist()):
        if sid is not None:
            turns[sid] = turns.get(sid, 0) + 1
            tokens[sid] = tokens.get(sid, 0) + prompt
    total = int(trace.prompt_tokens.sum())
    return {"sessions": len(turns), "turns_in_sessions": sum(turns.values()),
            "max_turns_per_session": max(turns.values(), default=0),
            "largest_session_tokens_share": max(tokens.values(), default=0) / total if total else 0.0}
