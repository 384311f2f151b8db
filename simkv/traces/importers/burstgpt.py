"""BurstGPT (Wang et al., KDD '25): ChatGPT and GPT-4 requests served on Azure, as its CSV
releases hold them. Columns (by name; the file's README): `Timestamp` (seconds from the first
day's 0:00), `Model` (ChatGPT, GPT-4), `Request tokens`, `Response tokens`, `Total tokens`,
`Log Type` ("Conversation log", "API log"), and in the newer releases `Session ID` (the
conversation a turn belongs to) and `Elapsed time` (seconds from the request to its last token).

What a trace row gets:
- `arrival_time_s`: the Timestamp less the first kept row's (rows sorted by it, stably);
- `request_class`: the Model, so a replay's tables and per-class SLOs keep the two apart;
- `session_id`: the Session ID where the row has one, so a replay sends a turn no sooner than
  its previous reply is done (simkv/replay/sessions.py); with `Elapsed time`, `think_time_s`:
  how long the user took after the previous turn's reply as the trace saw it (this turn's
  Timestamp less the previous turn's Timestamp + Elapsed time, 0 where that is negative).
Rows with 0 response tokens are the releases' failures, dropped and counted, as rows with 0
request tokens; `models` and `log_type` keep only the rows of those models or of that log type.
The trace has no content ids: its prompts share no blocks (like Azure's), and whether a turn's
request tokens hold the conversation's earlier turns the release does not say.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from simkv.traces import _columns as col
from simkv.traces._tableio import _csv_header
from simkv.traces.build import canonical_table
from simkv.traces.errors import TraceError
from simkv.traces.importers.report import ImportReport
from simkv.traces.importers.tabular import ColumnMap, source_batches, times_of, token_counts

TIME, MODEL, PROMPT, OUTPUT, LOG_TYPE = "Timestamp", "Model", "Request tokens", "Response tokens", "Log Type"
SESSION, ELAPSED = "Session ID", "Elapsed time"
LOG_TYPES = {"conversation": "Conversation log", "api": "API log"}


def burstgpt_batches(path: str | Path, report: ImportReport, models: tuple[str, ...] = (),
                     log_type: str | None = None) -> Iterator[pa.Table]:
    """One canonical table of the file's kept rows, in Timestamp order."""
    if log_type is not None and log_type not in LOG_TYPES:
        raise TraceError(f"--log-type must be one of {', '.join(LOG_TYPES)}, got {log_type!r}")
    optional = tuple(name for name in (SESSION, ELAPSED) if name in _columns(path))
    mapping = ColumnMap(TIME, PROMPT, OUTPUT, extra=(MODEL, LOG_TYPE) + optional)
    source = str(path)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("time", "prompt", "output", "model", "session", "elapsed")}
    row = 0
    for batch in source_batches(path, mapping):
        n = batch.num_rows
        report.rows_read += n
        times, _ = times_of(batch.column(TIME), source, mapping, row)
        prompt = token_counts(batch.column(PROMPT), source, PROMPT, row)
        output = token_counts(batch.column(OUTPUT), source, OUTPUT, row)
        model = col.string_column(batch.column(MODEL), source, MODEL, row)
        keep = (prompt > 0) & (output > 0)
        report.drop("zero request tokens", int((prompt == 0).sum()))
        report.drop("zero response tokens (failed)", int(((output == 0) & (prompt > 0)).sum()))
        if models:
            wanted = np.isin(model, list(models))
            report.drop("another model", int((keep & ~wanted).sum()))
            keep &= wanted
        if log_type is not None:
            kind = col.string_column(batch.column(LOG_TYPE), source, LOG_TYPE, row)
            wanted = kind == LOG_TYPES[log_type]
            report.drop("another log type", int((keep & ~wanted).sum()))
            keep &= wanted
        session = (col.string_column(batch.column(SESSION), source, SESSION, row, nullable=True)
                   if SESSION in optional else np.full(n, None, object))
        elapsed = (_elapsed(batch.column(ELAPSED), source, row) if ELAPSED in optional else np.zeros(n))
        for name, values in (("time", times), ("prompt", prompt), ("output", output), ("model", model),
                             ("session", session), ("elapsed", elapsed)):
            parts[name].append(values[keep])
        row += n
    if not parts["time"] or not sum(len(t) for t in parts["time"]):
        return
    data = {name: np.concatenate(values) for name, values in parts.items()}
    order = np.argsort(data["time"], kind="stable")
    data = {name: values[order] for name, values in data.items()}
    session = np.array([s if s not in (None, "") else None for s in data["session"].tolist()], dtype=object)
    has_sessions = any(s is not None for s in session.tolist())
    think = _think_times(data["time"], data["elapsed"], session) if has_sessions and ELAPSED in optional else None
    if has_sessions:
        count = len(set(session.tolist()) - {None})
        report.notes.append(f"{count:,} conversation{'s' if count != 1 else ''}")
    yield canonical_table(data["time"] - data["time"][0], data["prompt"], data["output"],
                          session_id=session if has_sessions else None, think_time_s=think,
                          request_class=data["model"])


def _columns(path: str | Path) -> list[str]:
    """The source's column names (a CSV's header line, a parquet file's schema)."""
    if str(path).lower().endswith((".parquet", ".pq")):
        try:
            return pq.ParquetFile(path).schema_arrow.names
        except (pa.ArrowException, OSError) as exc:
            raise TraceError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0][:120]})") from None
    return _csv_header(path)


def _elapsed(arr: pa.Array, source: str, row: int) -> np.ndarray:
    """Elapsed time in seconds; an empty one (a failed row's) reads as 0."""
    texts = pd.Series(col.flat_array(arr).to_numpy(zero_copy_only=False), dtype=object)
    values = pd.to_numeric(texts, errors="coerce").to_numpy(np.float64)
    given = texts.notna().to_numpy() & (texts.astype(str).str.strip() != "").to_numpy()
    bad = given & ~np.isfinite(values)
    if bad.any():
        where = int(np.argmax(bad))
        col.fail(source, ELAPSED, row + where, f"not a number: {str(texts.iloc[where])[:30]!r}")
    return np.maximum(np.where(given, values, 0.0), 0.0)


def _think_times(times: np.ndarray, elapsed: np.ndarray, session: np.ndarray) -> np.ndarray:
    """Per row (in time order), the gap between its session's previous reply as the trace saw it
    (that turn's time + elapsed) and its own time; 0 for a session's first turn and where negative."""
    think = np.zeros(len(times))
    done: dict[str, float] = {}
    for i, s in enumerate(session.tolist()):
        if s is None:
            continue
        if s in done:
            think[i] = max(0.0, times[i] - done[s])
        done[s] = times[i] + elapsed[i]
    return think
