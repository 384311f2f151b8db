"""Goodput: the requests that met every latency SLO, per second, as vLLM's serving benchmark
counts it (`vllm bench serve --goodput ttft:MS tpot:MS e2el:MS`).

A request is good when it finished and each of its metrics named in the SLOs is at most the
limit: TTFT (arrival to first token), TPOT (time per output token after the first: (E2E -
TTFT) / (output tokens - 1), 0 for a one-token answer) and E2EL (arrival to last token). Limits
are in milliseconds, as vLLM takes them. Goodput is good requests / duration of the run; the
attainment is good requests / all requests of the trace (a rejected or unfinished request is
never good) but those its client never sent (status not_sent: it stopped early).

An SLO may be given for one request class (simkv/replay/classes.py): ``chat:ttft:500`` holds the
trace's "chat" requests to a 500 ms TTFT, in place of a ``ttft`` SLO given for all; the other
classes keep the SLOs given for all. The summary then gives each class's attainment, and
`lowest_class_attainment`, which `simkv goodput` holds to its target (every class must attain it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pandas as pd

# vLLM's SLO names -> the column of requests.parquet holding that metric, in seconds
SLO_COLUMNS = {"ttft": "ttft_s", "tpot": "mean_itl_s", "e2el": "e2e_s"}


class GoodputError(ValueError):
    """A malformed --goodput value; the message names it."""


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:100"]`` (or one comma-separated string) -> ``{"ttft": 2000.0, "tpot": 100.0}``
    (milliseconds); ``"chat:ttft:500"`` -> ``{"chat:ttft": 500.0}`` (one request class's)."""
    slo: dict[str, float] = {}
    for spec in specs:
        for item in str(spec).split(","):
            item = item.strip()
            if not item:
                continue
            head, sep, value = item.rpartition(":")
            request_class, _, key = head.rpartition(":")
            key = key.strip().lower()
            if not sep or key not in SLO_COLUMNS or (request_class != "" and not request_class.strip()) or \
                    head.startswith(":"):
                raise GoodputError(f"--goodput '{item}': expected KEY:MILLISECONDS with KEY one of "
                                   f"{', '.join(SLO_COLUMNS)} (e.g. ttft:2000), or CLASS:KEY:MILLISECONDS for one "
                                   "request class (chat:ttft:500)")
            key = f"{request_class}:{key}" if request_class else key
            try:
                ms = float(value)
            except ValueError:
                raise GoodputError(f"--goodput '{item}': '{value}' is not a number of milliseconds") from None
            if not (0 < ms < float("inf")):
                raise GoodputError(f"--goodput '{item}': the limit must be a positive number of milliseconds")
            if key in slo:
                raise GoodputError(f"--goodput names '{key}' twice")
            slo[key] = ms
    return slo


def split_key(key: str) -> tuple[str | None, str]:
    """``"chat:ttft"`` -> ``("chat", "ttft")``; ``"ttft"`` -> ``(None, "ttft")``."""
    request_class, sep, metric = key.rpartition(":")
    return (request_class if sep else None), metric


def slo_classes(slo_ms: dict[str, float]) -> list[str]:
    """The request classes the SLOs name, in the order given."""
    return list(dict.fromkeys(c for c, _ in map(split_key, slo_ms) if c is not None))


def check_slo_classes(slo_ms: dict[str, float] | None, labels: tuple[str, np.ndarray] | None, source: str) -> None:
    """GoodputError unless every class an SLO names is one of the trace's (`labels`:
    simkv.replay.classes.trace_labels)."""
    named = slo_classes(slo_ms or {})
    if not named:
        return
    if labels is None:
        raise GoodputError(f"--goodput {named[0]}:...: {source} has no request classes (no request_class column, "
                           "and no priority column with more than one value); label them with simkv trace merge or "
                           "trace transform --request-class")
    from simkv.replay.classes import missing_class

    missing = missing_class(named, labels[1])
    if missing is not None:
        raise GoodputError(f"--goodput {missing[0]}:...: {source} {missing[1]}")


def describe_target(slo_ms: dict[str, float], target: float) -> str:
    """How a search judges a probe: "99 % of requests meet all of them", or per class."""
    if slo_classes(slo_ms):
        return (f"{100 * target:g} % of each request class's requests meet the SLOs that apply to them (attainment: "
                "the lowest class's)")
    return f"{100 * target:g} % of requests meet all of them"


def describe_slo(slo_ms: dict[str, float]) -> str:
    return ", ".join(f"{k} <= {v:g} ms" for k, v in slo_ms.items())


@dataclass(frozen=True)
class Judgement:
    """What SLOs say of a request table: per request, whether it meets every SLO that applies to
    it (`good`; False when unfinished); per SLO, the requests it applies to and those of them
    that meet it."""
    good: np.ndarray
    applies: dict[str, np.ndarray]
    meets: dict[str, np.ndarray]


def judge(requests: pd.DataFrame, slo_ms: dict[str, float]) -> Judgement:
    """Each request against the SLOs. An SLO given for one class applies to that class's
    requests; one given for all, to every request whose class has no SLO of its own on that
    metric (the request classes are read once: simkv/replay/classes.py)."""
    finished = requests["status"].to_numpy() == "finished"
    named = slo_classes(slo_ms)
    labels = None
    if named:
        from simkv.replay.classes import request_labels

        found = request_labels(requests)
        labels = found[1] if found is not None else np.full(len(requests), None, dtype=object)
    good, applies, meets = finished.copy(), {}, {}
    for key, limit in slo_ms.items():
        request_class, metric = split_key(key)
        values = requests[SLO_COLUMNS[metric]].to_numpy(dtype=np.float64)
        if metric == "tpot":
            values = np.where(np.isnan(values) & finished, 0.0, values)  # one output token: no TPOT
        if labels is None:
            applies[key] = np.ones(len(requests), dtype=bool)
        elif request_class is not None:
            applies[key] = labels == request_class
        else:
            own = [c for c in named if f"{c}:{metric}" in slo_ms]
            applies[key] = ~np.isin(labels, np.array(own, dtype=object))
        with np.errstate(invalid="ignore"):
            meets[key] = finished & (values <= limit / 1000.0) & applies[key]
        good &= meets[key] | ~applies[key]
    return Judgement(good, applies, meets)


def good_requests(requests: pd.DataFrame, slo_ms: dict[str, float]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per request: meets every SLO that applies to it; and per SLO: meets that one (both False
    when unfinished; an SLO's entry is False too for the requests it does not apply to)."""
    judged = judge(requests, slo_ms)
    return judged.good, judged.meets


def goodput_summary(requests: pd.DataFrame, slo_ms: dict[str, float], duration_s: float,
                    judged: Judgement | None = None) -> dict:
    """What summary.json records under ``goodput``: attainment over the requests sent, and per
    SLO over the sent requests it applies to; per class where the trace has classes. `judged`:
    `judge(requests, slo_ms)`, where the caller has it already."""
    from simkv.replay.classes import class_attainment

    judged = judged or judge(requests, slo_ms)
    good = judged.good
    sent = requests["status"].to_numpy() != "not_sent"
    n = int(sent.sum())
    by_slo = {}
    for key, ok in judged.meets.items():
        m = int((sent & judged.applies[key]).sum())
        by_slo[key] = float(ok.sum() / m) if m else 0.0
    out = {
        "slo_ms": dict(slo_ms),
        "num_good": int(good.sum()),
        "slo_attainment": float(good.sum() / n) if n else 0.0,
        "attainment_by_slo": by_slo,
        "request_goodput_req_s": float(good.sum() / duration_s) if duration_s > 0 else 0.0,
    }
    per_class = class_attainment(requests, good)
    if per_class is not None:
        out["attainment_by_class"] = {name: a for name, (_, a) in per_class.items()}
        if slo_classes(slo_ms):
            out["lowest_class_attainment"] = min(out["attainment_by_class"].values())
    return out
