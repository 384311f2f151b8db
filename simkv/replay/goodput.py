"""Goodput: the requests that met every latency SLO, per second, as vLLM's serving benchmark
counts it (`vllm bench serve --goodput ttft:MS tpot:MS e2el:MS`).

A request is good when it finished and each of its metrics named in the SLOs is at most the
limit: TTFT (arrival to first token), TPOT (time per output token after the first: (E2E -
TTFT) / (output tokens - 1), 0 for a one-token answer) and E2EL (arrival to last token). Limits
are in milliseconds, as vLLM takes them. Goodput is good requests / duration of the run; the
attainment is good requests / all requests of the trace (a rejected or unfinished request is
never good) but those its client never sent (status not_sent: it stopped early).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

# vLLM's SLO names -> the column of requests.parquet holding that metric, in seconds
SLO_COLUMNS = {"ttft": "ttft_s", "tpot": "mean_itl_s", "e2el": "e2e_s"}


class GoodputError(ValueError):
    """A malformed --goodput value; the message names it."""


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:100"]`` (or one comma-separated string) -> ``{"ttft": 2000.0, "tpot": 100.0}``
    (milliseconds)."""
    slo: dict[str, float] = {}
    for spec in specs:
        for item in str(spec).split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, value = item.partition(":")
            key = key.strip().lower()
            if not sep or key not in SLO_COLUMNS:
                raise GoodputError(f"--goodput '{item}': expected KEY:MILLISECONDS with KEY one of "
                                   f"{', '.join(SLO_COLUMNS)} (e.g. ttft:2000)")
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


def describe_slo(slo_ms: dict[str, float]) -> str:
    return ", ".join(f"{k} <= {v:g} ms" for k, v in slo_ms.items())


def good_requests(requests: pd.DataFrame, slo_ms: dict[str, float]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per request: meets every SLO; and per SLO: meets that one (both False when unfinished)."""
    finished = requests["status"].to_numpy() == "finished"
    each = {}
    for key, limit in slo_ms.items():
        values = requests[SLO_COLUMNS[key]].to_numpy(dtype=np.float64)
        if key == "tpot":
            values = np.where(np.isnan(values) & finished, 0.0, values)  # one output token: no TPOT
        with np.errstate(invalid="ignore"):
            each[key] = finished & (values <= limit / 1000.0)
    good = finished.copy()
    for ok in each.values():
        good &= ok
    return good, each


def goodput_summary(requests: pd.DataFrame, slo_ms: dict[str, float], duration_s: float) -> dict:
    """What summary.json records under ``goodput``."""
    good, each = good_requests(requests, slo_ms)
    n = int((requests["status"].to_numpy() != "not_sent").sum())
    return {
        "slo_ms": dict(slo_ms),
        "num_good": int(good.sum()),
        "slo_attainment": float(good.sum() / n) if n else 0.0,
        "attainment_by_slo": {k: float(v.sum() / n) if n else 0.0 for k, v in each.items()},
        "request_goodput_req_s": float(good.sum() / duration_s) if duration_s > 0 else 0.0,
    }
