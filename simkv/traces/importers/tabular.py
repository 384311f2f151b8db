"""Column-mapped CSV / parquet importer (any table with a time, a prompt and an output column).

The file is streamed (pyarrow's incremental CSV reader, or parquet row batches), so memory is
bounded by the batch size, not the file. Mapped CSV columns are read as text and converted with
Arrow casts; when a cast fails the batch is re-checked cell by cell to name the first bad row.
Rows with zero prompt or zero output tokens are dropped and counted. Arrival = time - time of the
first data row (``origin="first"``) or the time itself (``origin="zero"``), in seconds.
Azure's LLM inference CSVs are this importer with a fixed mapping (see ``AZURE``).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from simkv.traces import _columns as col
from simkv.traces._tableio import locate_csv_problem
from simkv.traces.build import canonical_table
from simkv.traces.errors import TraceError
from simkv.traces.importers.report import ImportReport

# Divisor from the source unit to seconds (date-times are parsed to nanoseconds).
TIME_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9, "datetime": 1e9}
CSV_BLOCK_BYTES = 8 << 20


@dataclass(frozen=True)
class ColumnMap:
    """Which source columns hold what; ``time_unit`` 'datetime' parses wall-clock strings."""

    time: str
    prompt: str
    output: str
    request_id: str | None = None
    time_unit: str = "s"
    origin: str = "first"
    extra: tuple[str, ...] = ()  # more columns read as text, for importers built on this one (burstgpt)
    session: str | None = None  # the conversation a row belongs to (empty cells: none)

    def check(self) -> None:
        if self.time_unit not in TIME_UNITS:
            raise TraceError(f"--time-unit must be one of {', '.join(TIME_UNITS)}, got {self.time_unit!r}")
        if self.origin not in ("first", "zero"):
            raise TraceError(f"--time-origin must be 'first' or 'zero', got {self.origin!r}")

    def names(self) -> list[str]:
        return [name for name in (self.time, self.prompt, self.output, self.request_id, self.session, *self.extra)
                if name]


AZURE = ColumnMap(time="TIMESTAMP", prompt="ContextTokens", output="GeneratedTokens", time_unit="datetime")


def tabular_batches(path: str | Path, mapping: ColumnMap, report: ImportReport) -> Iterator[pa.Table]:
    """Canonical tables in file order."""
    mapping.check()
    state = _Origin()
    row = 0
    for batch in source_batches(path, mapping):
        report.rows_read += batch.num_rows
        table = _convert(batch, path, mapping, row, state, report)
        row += batch.num_rows
        if table.num_rows:
            yield table


class _Origin:
    """The time of the first data row, once seen."""

    value: float | None = None


def source_batches(path: str | Path, mapping: ColumnMap) -> Iterator[pa.RecordBatch]:
    name = str(path).lower()
    if name.endswith((".parquet", ".pq")):
        yield from _parquet_batches(path, mapping)
    elif name.endswith((".csv", ".csv.gz", ".tsv")):
        yield from _csv_batches(path, mapping)
    else:
        raise TraceError(f"{path}: unknown table type (expected .csv, .csv.gz or .parquet)")


def _parquet_batches(path: str | Path, mapping: ColumnMap) -> Iterator[pa.RecordBatch]:
    try:
        source = pq.ParquetFile(path)
        _require_columns(path, source.schema_arrow.names, mapping)
        yield from source.iter_batches(batch_size=1 << 18, columns=mapping.names())
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0][:120]})") from None


def _csv_batches(path: str | Path, mapping: ColumnMap) -> Iterator[pa.RecordBatch]:
    delimiter = "\t" if str(path).lower().endswith(".tsv") else ","
    options = dict(
        read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES, use_threads=False),
        parse_options=pacsv.ParseOptions(delimiter=delimiter),
        convert_options=pacsv.ConvertOptions(
            include_columns=mapping.names(),
            column_types={name: pa.string() for name in mapping.names()},
            null_values=[""], strings_can_be_null=True,
        ),
    )
    try:
        reader = pacsv.open_csv(path, **options)
        yield from reader
    except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
        text = str(exc)
        missing = "does not exist in CSV file" in text
        if missing:
            raise TraceError(f"{path}: {text.splitlines()[0][:200]}") from None
        problem = locate_csv_problem(path)
        raise TraceError(f"{path}: {problem or 'unreadable CSV (' + text.splitlines()[0][:120] + ')'}") from None


def _require_columns(path: str | Path, present: list[str], mapping: ColumnMap) -> None:
    for name in mapping.names():
        if name not in present:
            raise TraceError(f"{path}: missing column '{name}' (columns: {', '.join(present[:12])})")


def _convert(
    batch: pa.RecordBatch, path: str | Path, mapping: ColumnMap, row: int, origin: _Origin, report: ImportReport
) -> pa.Table:
    source = str(path)
    times, divisor = times_of(batch.column(mapping.time), source, mapping, row)
    prompt = token_counts(batch.column(mapping.prompt), source, mapping.prompt, row)
    output = token_counts(batch.column(mapping.output), source, mapping.output, row)
    ids = col.string_column(batch.column(mapping.request_id), source, mapping.request_id, row) if mapping.request_id else None
    sessions = None
    if mapping.session:
        sessions = col.string_column(batch.column(mapping.session), source, mapping.session, row, nullable=True)
        sessions = np.array([None if s in (None, "") else s for s in sessions.tolist()], dtype=object)
    if origin.value is None and len(times):
        origin.value = times[0] if mapping.origin == "first" else 0
    arrival = (times - origin.value) / divisor
    early = arrival < 0
    if early.any():
        where = int(np.argmax(early))
        col.fail(source, mapping.time, row + where, "time is before the first row's time")
    keep = (prompt > 0) & (output > 0)
    report.drop("zero prompt tokens", int((prompt == 0).sum()))
    report.drop("zero output tokens", int(((output == 0) & (prompt > 0)).sum()))
    return canonical_table(arrival[keep], prompt[keep], output[keep], request_id=None if ids is None else ids[keep],
                           session_id=None if sessions is None else sessions[keep])


def token_counts(arr: pa.Array, source: str, name: str, row: int) -> np.ndarray:
    if pa.types.is_string(arr.type):
        try:
            arr = pc.cast(arr, pa.int64())
        except pa.ArrowInvalid:
            pass  # the cell-by-cell check below names the bad row
    return col.int_column(arr, source, name, row, minimum=0)


def times_of(arr: pa.Array, source: str, mapping: ColumnMap, row: int) -> tuple[np.ndarray, float]:
    """Times in source units and the divisor to seconds (date-times: int64 ns, exact differences)."""
    if mapping.time_unit == "datetime":
        return _wall_clock(arr, source, mapping.time, row), TIME_UNITS["datetime"]
    if pa.types.is_string(arr.type):
        try:
            arr = pc.cast(arr, pa.float64())
        except pa.ArrowInvalid:
            pass
    return col.float_column(arr, source, mapping.time, row), TIME_UNITS[mapping.time_unit]


def _wall_clock(arr: pa.Array, source: str, name: str, row: int) -> np.ndarray:
    """Wall-clock strings (e.g. '2023-11-16 18:15:46.6805900') -> int64 nanoseconds since the epoch."""
    flat = col.flat_array(arr)
    if flat.null_count:
        col.fail(source, name, row + int(np.argmax(pc.is_null(flat).to_numpy(zero_copy_only=False))), "missing value")
    if pa.types.is_timestamp(flat.type):
        return flat.cast(pa.timestamp("ns")).cast(pa.int64()).to_numpy()
    texts = pd.Series(flat.to_numpy(zero_copy_only=False), dtype=object)
    try:
        stamps = pd.to_datetime(texts, format="ISO8601", errors="coerce", utc=True).dt.tz_convert(None)
    except (ValueError, TypeError, OverflowError) as exc:
        raise TraceError(f"{source}: column '{name}': unreadable date-times ({str(exc)[:80]})") from None
    bad = stamps.isna().to_numpy()
    if bad.any():
        where = int(np.argmax(bad))
        col.fail(source, name, row + where, f"not a date-time: {str(texts.iloc[where])[:40]!r}")
    return stamps.to_numpy(dtype="datetime64[ns]").astype(np.int64)
