"""Request classes: what each kind of traffic in a trace gets from the engine.

A trace's `request_class` column (`simkv trace merge`, `trace transform --request-class`) labels
each request, "chat" or "batch" say; without it, a trace whose `priority` column takes more than
one value is broken down by priority ("priority=0", "priority=1", ...), which is what priority
scheduling is for. A replay then writes the label into requests.parquet and, per class, into
summary.json's `classes`: requests and their statuses, tokens, prefix-cache hits among the
prompt tokens its sequences asked for (prompt x n under parallel sampling), preemptions,
TTFT / TPOT / E2E / queueing distributions and throughputs over the whole run's duration (and,
with --goodput, each class's attainment: simkv/replay/goodput.py, where an SLO may be given for
one class, `chat:ttft:500`).

TPOT is per request (the mean gap between a request's tokens); `itl_s` is token-level, every
gap between two tokens of the class's requests (the engine counts each step's gaps per class:
Scheduler.track_classes), as the whole run's `itl_s` counts all.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simkv.replay.results import dist

CLASS_COLUMN = "request_class"
TRACE_COLUMNS = (CLASS_COLUMN, "priority", "n")  # (the trace's columns a request table carries)


def labels_of(request_class: np.ndarray | None, priority: np.ndarray | None) -> tuple[str, np.ndarray] | None:
    """(what the classes are by, a label per request), or None when there is nothing to break down."""
    if request_class is not None:
        return CLASS_COLUMN, np.asarray(request_class, dtype=object)
    if priority is not None and len(np.unique(priority)) > 1:
        return "priority", np.array([f"priority={int(p)}" for p in priority], dtype=object)
    return None


def trace_labels(trace) -> tuple[str, np.ndarray] | None:
    return labels_of(getattr(trace, "request_class", None), getattr(trace, "priority", None))


def request_labels(requests: pd.DataFrame) -> tuple[str, np.ndarray] | None:
    """As `trace_labels`, from the columns `with_trace_columns` put into a request table."""
    return labels_of(requests[CLASS_COLUMN].to_numpy(object) if CLASS_COLUMN in requests else None,
                     requests["priority"].to_numpy() if "priority" in requests else None)


def missing_class(names, labels: np.ndarray) -> tuple[str, str] | None:
    """The first of `names` that no request is labelled with, and "has no request class 'X'
    (its classes: ...)" to say so; None when every one is there."""
    known = list(dict.fromkeys(labels.tolist()))
    for name in names:
        if name not in known:
            shown = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
            return name, f"has no request class '{name}' (its classes: {shown})"
    return None


def with_trace_columns(requests: pd.DataFrame, trace) -> pd.DataFrame:
    """The request table (rows in the trace's order) with the trace's `request_class`,
    `priority` and `n` (sequences asked for) beside `request_id`, where the trace has them, and
    for a trace with images each prompt's image placeholder tokens (`mm_tokens`, counted in
    `prompt_tokens`) after `prompt_tokens`."""
    if len(requests) != len(trace):
        raise ValueError(f"request table of {len(requests)} rows for a trace of {len(trace)}")
    frame = requests.drop(columns=[c for c in TRACE_COLUMNS if c in requests.columns])
    at = frame.columns.get_loc("request_id") + 1 if "request_id" in frame.columns else 0
    for name in reversed(TRACE_COLUMNS):
        values = getattr(trace, name, None)
        if values is None:
            continue
        if name == CLASS_COLUMN:
            values = pd.Series(values, dtype=object).astype(str).to_numpy(object)
        else:
            values = np.asarray(values, dtype=np.int64)
        frame.insert(at, name, values)
    if getattr(trace, "mm_items", None) is not None and "prompt_tokens" in frame.columns:
        frame = frame.drop(columns=["mm_tokens"], errors="ignore")
        frame.insert(frame.columns.get_loc("prompt_tokens") + 1, "mm_tokens", trace.mm_tokens())
    return frame


def class_order(labels: np.ndarray) -> list[str]:
    """Classes in the order their first requests arrive (priority classes: by priority)."""
    first = dict.fromkeys(labels.tolist())
    names = list(first)
    if all(name.startswith("priority=") for name in names):
        names.sort(key=lambda name: int(name.split("=", 1)[1]))
    return names


def class_attainment(requests: pd.DataFrame, good: np.ndarray) -> dict[str, tuple[int, float]] | None:
    """Per class (in `class_order`): its good requests and their share of the class's requests
    sent (a client's unsent ones do not count); None without classes."""
    found = request_labels(requests)
    if found is None:
        return None
    labels = found[1]
    sent = requests["status"].to_numpy() != "not_sent"
    out = {}
    for name in class_order(labels):
        rows = (labels == name) & sent
        num_good = int(good[rows].sum())
        out[name] = (num_good, num_good / int(rows.sum()) if rows.any() else 0.0)
    return out


def held_by(column: pd.Series) -> dict[str, int]:
    """Requests per limit that held them in the waiting queue longest (requests.parquet's
    queue_held_by; those that waited on none left out), most first."""
    counts = pd.Series(column.astype(str)).value_counts()
    return {str(k): int(v) for k, v in counts.items() if v and k != "none"}


def classes_summary(requests: pd.DataFrame, duration_s: float, good: np.ndarray | None = None,
                    itl: dict[str, dict] | None = None) -> dict:
    """summary.json's `classes` section ({} when the trace has no classes). `good`: which
    requests met their SLOs (simkv/replay/goodput.py's `judge`), for each class's attainment;
    `itl`: each class's token-level inter-token latencies (results.class_itl)."""
    found = request_labels(requests)
    if found is None:
        return {}
    by, labels = found
    status = requests["status"].to_numpy()
    attained = class_attainment(requests, good) if good is not None else None
    out = {}
    for name in class_order(labels):
        rows = labels == name
        part = requests[rows]
        finished = status[rows] == "finished"
        sequences = part["n"].to_numpy()[finished] if "n" in part else 1  # (parallel sampling: each queries)
        prompt = int(part["prompt_tokens"].to_numpy()[finished].sum())
        queried = int((part["prompt_tokens"].to_numpy()[finished] * sequences).sum())
        hits = int(part["prefix_hit_tokens"].to_numpy()[finished].sum())
        out_tokens = int(part["output_tokens"].to_numpy()[finished].sum())
        statuses = dict(sorted(pd.Series(status[rows]).value_counts().items()))
        entry = {
            "num_requests": int(rows.sum()),
            "num_finished": int(finished.sum()),
            "statuses": {str(k): int(v) for k, v in statuses.items()},
            "prompt_tokens": prompt,
            "output_tokens": out_tokens,
            "prefix_hit_tokens": hits,
            "prefix_hit_share": hits / queried if queried else 0.0,
            "num_preemptions": int(part["num_preemptions"].to_numpy()[finished].sum()),
            "ttft_s": dist(part["ttft_s"].to_numpy()),
            "tpot_s": dist(part["mean_itl_s"].to_numpy()),
            **({"itl_s": itl[name]} if itl and name in itl else {}),
            "e2e_s": dist(part["e2e_s"].to_numpy()),
            "queue_s": dist(part["queue_s"].to_numpy()),
            **({"queue_held_by": held_by(part["queue_held_by"])} if "queue_held_by" in part else {}),
            "request_throughput_req_s": float(finished.sum()) / duration_s if duration_s > 0 else 0.0,
            "output_throughput_tok_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        }
        if attained is not None:
            num_good, share = attained[name]
            entry |= {"num_good": num_good, "slo_attainment": share,
                      "request_goodput_req_s": num_good / duration_s if duration_s > 0 else 0.0}
        out[name] = entry
    return {"classes": {"by": by, "classes": out}}
