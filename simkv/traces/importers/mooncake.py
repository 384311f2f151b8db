"""Mooncake JSON lines: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

Arrival = timestamp / 1000 s (timestamps are already offsets from the trace start). ``hash_ids``
become block_hashes at 512 tokens per block (``block_tokens``). Rows with zero input or output
tokens are dropped and counted; every other problem is an error naming file, line and field.
The file is read line by line and emitted in batches (memory bounded by the batch size).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from simkv.traces._columns import csr
from simkv.traces.build import canonical_table
from simkv.traces.errors import TraceError
from simkv.traces.importers.report import ImportReport
from simkv.traces.importers.values import BatchBuffer, whole_number

BATCH_ROWS = 65536


def mooncake_batches(path: str | Path, report: ImportReport, block_tokens: int = 512) -> Iterator[pa.Table]:
    """Canonical tables in file order."""
    if block_tokens < 1:
        raise TraceError(f"{path}: --block-tokens must be >= 1")
    buffer = BatchBuffer()
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            report.rows_read += 1
            row = _parse_line(raw, path, number, block_tokens)
            if row[1] == 0 or row[2] == 0:
                report.drop("zero input tokens" if row[1] == 0 else "zero output tokens", 1)
                continue
            buffer.add(*row)
            if len(buffer) >= BATCH_ROWS:
                yield _table(buffer.take(), block_tokens)
    if len(buffer):
        yield _table(buffer.take(), block_tokens)


def _parse_line(raw: bytes, path: str | Path, number: int, block_tokens: int) -> tuple[float, int, int, list[int]]:
    where = f"{path}: line {number}"
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{where}: bytes that are not UTF-8 at position {exc.start}") from None
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{where}: not a JSON object ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: not a JSON object")
    timestamp = _field(record, "timestamp", where)
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp) or timestamp < 0:
        raise TraceError(f"{where}: field 'timestamp': expected a finite number >= 0 (ms), got {str(timestamp)[:30]!r}")
    prompt = whole_number(_field(record, "input_length", where), f"{where}: field 'input_length'")
    output = whole_number(_field(record, "output_length", where), f"{where}: field 'output_length'")
    hashes = _hash_ids(record.get("hash_ids", []), where, prompt, block_tokens)
    return float(timestamp) / 1000.0, prompt, output, hashes


def _field(record: dict, name: str, where: str) -> object:
    if name not in record:
        raise TraceError(f"{where}: field '{name}' is missing")
    return record[name]


def _hash_ids(value: object, where: str, prompt: int, block_tokens: int) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise TraceError(f"{where}: field 'hash_ids': expected a list of integers")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not -(2**63) <= item < 2**63:
            raise TraceError(f"{where}: field 'hash_ids': {str(item)[:30]!r} is not an int64")
    limit = -(-prompt // block_tokens)
    if len(value) > limit:
        raise TraceError(f"{where}: field 'hash_ids': {len(value)} ids for {prompt} tokens (at most {limit})")
    return value


def _table(rows: tuple[list, list, list, list], block_tokens: int) -> pa.Table:
    arrival, prompt, output, hashes = rows
    values, offsets = csr(hashes)
    return canonical_table(
        np.asarray(arrival), np.asarray(prompt), np.asarray(output),
        hash_ids=values, hash_offsets=offsets, hash_block_tokens=block_tokens,
    )
