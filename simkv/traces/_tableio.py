"""File level I/O: read a trace file into a pyarrow Table, write tables atomically and reproducibly."""
from __future__ import annotations

import contextlib
import csv
import gzip
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from simkv import atomic
from simkv.traces.errors import TraceError

PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv", ".csv.gz")
# Columns read from CSV as text whatever they look like ("007" must stay a string).
TEXT_COLUMNS = ("request_id", "cache_salt", "block_hashes", "lora_name", "mm_offsets", "mm_lengths", "mm_hashes",
                "request_class")
# Fixed writer settings: the same table always gives the same bytes.
PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=False, write_statistics=False)
ROW_GROUP_ROWS = 1 << 20


def file_kind(path: str | os.PathLike) -> str:
    """'parquet' or 'csv' by suffix; TraceError for anything else."""
    name = str(path).lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(CSV_SUFFIXES):
        return "csv"
    raise TraceError(f"{path}: unknown trace file type (expected .parquet, .csv or .csv.gz)")


def read_table(path: str | os.PathLike) -> pa.Table:
    """Read a whole trace file; every failure is a one-line TraceError."""
    kind = file_kind(path)
    if not os.path.isfile(path):
        raise TraceError(f"{path}: no such file")
    if os.path.getsize(path) == 0:
        raise TraceError(f"{path}: empty file")
    table = _read_parquet(path) if kind == "parquet" else _read_csv(path)
    try:
        table.column_names  # noqa: B018 - Arrow decodes the names lazily
    except UnicodeDecodeError:
        problem = locate_csv_problem(path) if kind == "csv" else None
        raise TraceError(f"{path}: {problem or 'column names that are not UTF-8'}") from None
    return table


def _read_parquet(path: str | os.PathLike) -> pa.Table:
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TraceError(f"{path}: not a readable parquet file ({_first_line(exc)})") from None


def _read_csv(path: str | os.PathLike) -> pa.Table:
    convert = pacsv.ConvertOptions(
        column_types={name: pa.string() for name in TEXT_COLUMNS},
        null_values=[""],
        strings_can_be_null=True,
        quoted_strings_can_be_null=False,
    )
    try:
        table = pacsv.read_csv(path, convert_options=convert)
    except (pa.ArrowException, OSError, ValueError, EOFError) as exc:
        problem = locate_csv_problem(path)
        if problem is not None:
            raise TraceError(f"{path}: {problem}") from None
        if "conversion error" in str(exc):
            return _read_csv_as_text(path)
        raise TraceError(f"{path}: unreadable CSV ({_first_line(exc)})") from None
    if any(pa.types.is_binary(field.type) for field in table.schema):
        # Arrow types a column holding non-UTF-8 bytes as binary: find the line for the message.
        raise TraceError(f"{path}: {locate_csv_problem(path) or 'bytes that are not UTF-8'}")
    return table


def _read_csv_as_text(path: str | os.PathLike) -> pa.Table:
    """Fallback when type inference fails mid-file: read every column as text, validate later."""
    header = _csv_header(path)
    convert = pacsv.ConvertOptions(
        column_types={name: pa.string() for name in header}, null_values=[""], strings_can_be_null=True
    )
    try:
        return pacsv.read_csv(path, convert_options=convert)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TraceError(f"{path}: unreadable CSV ({_first_line(exc)})") from None


def _open_text_lines(path: str | os.PathLike) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if str(path).lower().endswith(".gz") else open(path, "rb")


def _csv_header(path: str | os.PathLike) -> list[str]:
    with _open_text_lines(path) as handle:
        first = handle.readline().decode("utf-8", errors="replace")
    return next(csv.reader([first]), [])


def locate_csv_problem(path: str | os.PathLike) -> str | None:
    """Slow exact scan used only after a fast read failed: the first bad line, or None."""
    try:
        with _open_text_lines(path) as handle:
            return _scan_lines(handle)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        return f"cannot read ({_first_line(exc)})"


def _scan_lines(handle: io.BufferedIOBase) -> str | None:
    width = None
    for number, raw in enumerate(handle, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"line {number}: bytes that are not UTF-8 at position {exc.start}"
        if not text.strip():
            continue
        try:
            fields = next(csv.reader([text]), [])
        except csv.Error as exc:
            return f"line {number}: {exc}"
        if width is None:
            width = len(fields)
        elif len(fields) != width:
            return f"line {number}: expected {width} fields, got {len(fields)}"
    if width is None:
        return "empty file"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temp path in the target's folder; on success it replaces ``path``, on error it is removed."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise TraceError(f"{path}: folder {folder} does not exist")
    with atomic.atomic_path(path) as temp:
        yield temp


def write_table(table: pa.Table, path: str | os.PathLike) -> None:
    """Write ``table`` as parquet or CSV (by suffix), atomically, with stable bytes."""
    kind = file_kind(path)
    with atomic_path(path) as temp:
        if kind == "parquet":
            pq.write_table(table, temp, row_group_size=ROW_GROUP_ROWS, **PARQUET_OPTIONS)
        else:
            _write_csv(table, temp, gzipped=str(path).lower().endswith(".gz"))


def _write_csv(table: pa.Table, temp: str, gzipped: bool) -> None:
    buffer = io.BytesIO()
    pacsv.write_csv(table, buffer, write_options=pacsv.WriteOptions(quoting_style="needed"))
    data = buffer.getvalue()
    with open(temp, "wb") as raw:
        if gzipped:
            # mtime=0 and no file name in the header: identical input gives identical bytes.
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as zipped:
                zipped.write(data)
        else:
            raw.write(data)


class ParquetBatchWriter:
    """Stream record batches into one parquet file; use inside ``atomic_path``."""

    def __init__(self, temp_path: str, schema: pa.Schema) -> None:
        self.schema = schema
        self._writer = pq.ParquetWriter(temp_path, schema, **PARQUET_OPTIONS)

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        self._writer.write_table(table, row_group_size=ROW_GROUP_ROWS)

    def close(self) -> None:
        self._writer.close()
