"""A `vllm bench serve --save-detailed` result as a trace: the traffic a benchmark sent.

Any of the benchmark client's datasets (random, sharegpt, ...) at any request rate: row i is the
i-th request the client sent, arriving at its ``start_times`` entry (the moment it was sent,
counted from the first send), with ``input_lens`` prompt and ``output_lens`` output tokens (what
the server generated; with --ignore-eos, what was asked). Request ids are ``bench-<i>``, which is
how `simkv compare SIM_DIR bench.json` matches the two runs' requests. The result records no prompt
content, so no prefix is shared: a dataset whose prompts share prefixes (prefix_repetition, or
the prompts of a timed trace) is better replayed from its own trace (`simkv trace export`).
Requests that failed have no output length and are dropped, counted in the report.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from simkv.traces.build import canonical_table
from simkv.traces.errors import TraceError
from simkv.traces.importers.report import ImportReport

REQUEST_ID_PREFIX = "bench-"


def vllm_bench_batches(path: str | Path, report: ImportReport) -> Iterator[pa.Table]:
    from simkv.compare.vllm_bench import read_bench_result

    try:
        result = read_bench_result(path)
    except ValueError as exc:
        raise TraceError(str(exc)) from None
    n = len(result["ttfts"])
    report.rows_read += n
    start = np.asarray(result["start_times"], dtype=np.float64)
    prompt = np.asarray(result["input_lens"], dtype=np.int64)
    output = np.asarray(result["output_lens"], dtype=np.int64)
    ok = np.array([not e for e in result["errors"]]) & (output > 0) & (prompt > 0)
    report.drop("a failed request (no output length)", int((~ok).sum()))
    if not ok.any():
        return
    first = start[ok].min()
    report.notes.append("no prompt content in a benchmark result: nothing is shared between prompts")
    yield canonical_table(start[ok] - first, prompt[ok], output[ok],
                          request_id=[f"{REQUEST_ID_PREFIX}{i}" for i in np.flatnonzero(ok)])
