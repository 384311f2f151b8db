"""Vectorised checks and conversions of single trace columns (pyarrow in, numpy out).

Every function here raises ``TraceError`` naming the source, the column and the FIRST offending
row. ``row_offset`` is added to row indices so that callers validating a file in batches still
report the 0-based data row of the whole file.
"""
from __future__ import annotations

import json
from typing import NoReturn

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from simkv.traces.errors import TraceError

# Token counts above this are rejected as "too large": sums over a million rows stay exact in int64.
MAX_TOKENS = 1 << 40


def fail(source: str, column: str, row: int, what: str) -> NoReturn:
    """Raise the project's one-line error for a bad cell."""
    raise TraceError(f"{source}: column '{column}', row {row}: {what}")


def flat_array(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        return arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return arr


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _reject_nulls(arr: pa.Array, source: str, column: str, row_offset: int) -> None:
    if arr.null_count:
        nulls = pc.is_null(arr).to_numpy(zero_copy_only=False)
        fail(source, column, row_offset + _first(nulls), "missing value")


def _strings_to_float(arr: pa.Array, source: str, column: str, row_offset: int) -> np.ndarray:
    values = arr.to_numpy(zero_copy_only=False)
    numbers = pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(dtype=np.float64)
    bad = np.isnan(numbers)
    if bad.any():
        row = _first(bad)
        fail(source, column, row_offset + row, f"not a number: {str(values[row])[:40]!r}")
    return numbers


def _numeric(arr: pa.Array, source: str, column: str, row_offset: int) -> np.ndarray:
    """Return the column as int64 or float64 numpy (nulls already rejected)."""
    kind = arr.type
    if pa.types.is_boolean(kind):
        fail(source, column, row_offset, "wrong type: boolean, expected a number")
    if pa.types.is_unsigned_integer(kind):
        values = arr.to_numpy(zero_copy_only=False)
        too_big = values > np.iinfo(np.int64).max
        if too_big.any():
            fail(source, column, row_offset + _first(too_big), "value too large")
        return values.astype(np.int64)
    if pa.types.is_integer(kind):
        return arr.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return arr.cast(pa.float64()).to_numpy(zero_copy_only=False)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return _strings_to_float(arr, source, column, row_offset)
    if pa.types.is_null(kind):
        fail(source, column, row_offset, "missing value")
    fail(source, column, row_offset, f"wrong type: {kind}, expected a number")


def float_column(arr: pa.Array | pa.ChunkedArray, source: str, column: str, row_offset: int = 0) -> np.ndarray:
    """A required, finite, non-negative float64 column (arrival times)."""
    flat = flat_array(arr)
    _reject_nulls(flat, source, column, row_offset)
    values = _numeric(flat, source, column, row_offset).astype(np.float64, copy=False)
    bad = ~np.isfinite(values)
    if bad.any():
        fail(source, column, row_offset + _first(bad), f"not a finite number: {values[_first(bad)]}")
    negative = values < 0
    if negative.any():
        fail(source, column, row_offset + _first(negative), f"negative value {values[_first(negative)]}")
    return values


def int_column(
    arr: pa.Array | pa.ChunkedArray, source: str, column: str, row_offset: int = 0, minimum: int | None = 1
) -> np.ndarray:
    """A required integer column; floats must be integral; values must be >= ``minimum``."""
    flat = flat_array(arr)
    _reject_nulls(flat, source, column, row_offset)
    values = _numeric(flat, source, column, row_offset)
    if values.dtype.kind == "f":
        values = _integral(values, source, column, row_offset)
    if minimum is not None:
        low = values < minimum
        if low.any():
            fail(source, column, row_offset + _first(low), f"value {values[_first(low)]} is below {minimum}")
    high = np.abs(values) > MAX_TOKENS
    if high.any():
        fail(source, column, row_offset + _first(high), f"value {values[_first(high)]} is too large")
    return values


def _integral(values: np.ndarray, source: str, column: str, row_offset: int) -> np.ndarray:
    bad = ~np.isfinite(values)
    if bad.any():
        fail(source, column, row_offset + _first(bad), f"not a finite number: {values[_first(bad)]}")
    huge = np.abs(values) >= 2.0**62
    if huge.any():
        fail(source, column, row_offset + _first(huge), "value too large")
    fractional = values != np.floor(values)
    if fractional.any():
        fail(source, column, row_offset + _first(fractional), f"not an integer: {values[_first(fractional)]}")
    return values.astype(np.int64)


def string_column(
    arr: pa.Array | pa.ChunkedArray, source: str, column: str, row_offset: int = 0, nullable: bool = False
) -> np.ndarray:
    """A string column as an object array of ``str`` (or ``None`` where allowed)."""
    flat = flat_array(arr)
    if not nullable:
        _reject_nulls(flat, source, column, row_offset)
    kind = flat.type
    if pa.types.is_integer(kind):
        flat = flat.cast(pa.string())
    elif not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        fail(source, column, row_offset, f"wrong type: {kind}, expected text")
    values = flat.to_numpy(zero_copy_only=False)
    return values.astype(object, copy=False)


def first_duplicate(values: np.ndarray) -> int | None:
    """Index of the first value that repeats an earlier one, or None."""
    duplicated = pd.Series(values, dtype=object).duplicated().to_numpy()
    return _first(duplicated) if duplicated.any() else None


def hash_lists(
    arr: pa.Array | pa.ChunkedArray, source: str, row_offset: int = 0, column: str = "block_hashes"
) -> tuple[np.ndarray, np.ndarray]:
    """Parse a column of integer lists (``block_hashes``, the ``mm_*`` columns) into CSR (values
    int64, offsets int64 of len n+1). Null = an empty list."""
    flat = flat_array(arr)
    kind = flat.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _arrow_lists(flat, source, row_offset, column)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return _text_lists(flat, source, row_offset, column)
    if pa.types.is_null(kind):
        return np.zeros(0, np.int64), np.zeros(len(flat) + 1, np.int64)
    fail(source, column, row_offset, f"wrong type: {kind}, expected a list of integers")


def _arrow_lists(flat: pa.Array, source: str, row_offset: int, column: str) -> tuple[np.ndarray, np.ndarray]:
    offsets = flat.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    if flat.null_count:
        # A null list may still own a (garbage) offset range; make it empty.
        lengths = np.diff(offsets)
        lengths[pc.is_null(flat).to_numpy(zero_copy_only=False)] = 0
        starts = offsets[:-1]
        keep = np.repeat(starts, lengths) + concat_ranges(lengths)
        values_all = flat.values
        values = values_all.take(pa.array(keep)) if len(keep) else values_all.slice(0, 0)
        offsets = offsets_of(lengths)
    else:
        values = flat.values.slice(offsets[0], offsets[-1] - offsets[0])
        offsets = offsets - offsets[0]
    if values.null_count:
        bad = _first(pc.is_null(values).to_numpy(zero_copy_only=False))
        row = int(np.searchsorted(offsets, bad, side="right") - 1)
        fail(source, column, row_offset + row, "null hash id in list")
    numbers = _numeric(values, source, column, row_offset) if len(values) else np.zeros(0, np.int64)
    if numbers.dtype.kind == "f":
        try:
            numbers = _integral(numbers, source, column, 0)
        except TraceError:
            bad = _first((numbers != np.floor(numbers)) | ~np.isfinite(numbers) | (np.abs(numbers) >= 2.0**62))
            row = int(np.searchsorted(offsets, bad, side="right") - 1)
            fail(source, column, row_offset + row, "hash ids must be integers")
    return numbers.astype(np.int64, copy=False), offsets


def offsets_of(lengths) -> np.ndarray:
    """CSR offsets (len(lengths) + 1, from 0) of rows of these lengths."""
    return np.concatenate(([0], np.cumsum(np.asarray(lengths, np.int64)))).astype(np.int64)


def csr(rows) -> tuple[np.ndarray, np.ndarray]:
    """Rows of integers (lists or arrays) as CSR: (values, offsets)."""
    offsets = offsets_of([len(row) for row in rows])
    values = np.fromiter((x for row in rows for x in row), np.int64, count=int(offsets[-1]))
    return values, offsets


def concat_ranges(lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(l) for each l in lengths (vectorised)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)


def _text_lists(flat: pa.Array, source: str, row_offset: int, column: str) -> tuple[np.ndarray, np.ndarray]:
    texts = flat.to_numpy(zero_copy_only=False)
    lengths = np.zeros(len(texts), np.int64)
    parts: list[list[int]] = []
    present = np.flatnonzero(pc.is_valid(flat).to_numpy(zero_copy_only=False))
    for i in present:
        ids = _parse_hash_text(texts[i], source, row_offset + int(i), column)
        lengths[i] = len(ids)
        parts.append(ids)
    return np.fromiter((h for ids in parts for h in ids), np.int64, count=int(lengths.sum())), offsets_of(lengths)


def _parse_hash_text(text: str, source: str, row: int, column: str) -> list[int]:
    """'1 2 3' or '[1, 2, 3]' -> [1, 2, 3]; empty text -> []."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            fail(source, column, row, f"not a JSON list: {text[:40]!r}")
    else:
        items = text.replace(",", " ").split()
    if not isinstance(items, list):
        fail(source, column, row, "expected a list of integers")
    return [_hash_id(item, source, row, column) for item in items]


def _hash_id(item: object, source: str, row: int, column: str) -> int:
    if isinstance(item, bool) or not isinstance(item, (int, str)):
        fail(source, column, row, f"hash id {str(item)[:30]!r} is not an integer")
    try:
        value = int(item)
    except ValueError:
        fail(source, column, row, f"hash id {str(item)[:30]!r} is not an integer")
    if not -(2**63) <= value < 2**63:
        fail(source, column, row, "hash id out of int64 range")
    return value
