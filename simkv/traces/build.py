"""Assemble canonical Arrow tables from numpy columns (used by generators and importers)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from simkv.traces._columns import concat_ranges, offsets_of
from simkv.traces.schema import Trace, trace_from_table


def canonical_table(
    arrival_time_s: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    *,
    request_id: np.ndarray | list[str] | None = None,
    hash_ids: np.ndarray | None = None,
    hash_offsets: np.ndarray | None = None,
    hash_block_tokens: int | np.ndarray | None = None,
    cache_salt: np.ndarray | list[str | None] | None = None,
    session_id: np.ndarray | list[str | None] | None = None,
    think_time_s: np.ndarray | None = None,
    request_class: np.ndarray | list[str] | None = None,
) -> pa.Table:
    """A table in the canonical column order; hashes given as CSR (values + offsets of len n+1)."""
    columns: dict[str, pa.Array] = {
        "arrival_time_s": pa.array(np.asarray(arrival_time_s, np.float64)),
        "prompt_tokens": pa.array(np.asarray(prompt_tokens, np.int64)),
        "output_tokens": pa.array(np.asarray(output_tokens, np.int64)),
    }
    if request_id is not None:
        columns["request_id"] = pa.array(request_id, pa.string())
    if hash_ids is not None and hash_offsets is not None:
        offsets = np.asarray(hash_offsets, np.int64)
        columns["block_hashes"] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(hash_ids, pa.int64()))
        per_row = np.broadcast_to(np.asarray(hash_block_tokens, np.int64), offsets.shape[:1])[: len(offsets) - 1]
        columns["hash_block_tokens"] = pa.array(np.where(np.diff(offsets) > 0, per_row, 0))
    if cache_salt is not None:
        columns["cache_salt"] = pa.array(cache_salt, pa.string())
    if session_id is not None:
        columns["session_id"] = pa.array(session_id, pa.string())
    if think_time_s is not None:
        columns["think_time_s"] = pa.array(np.asarray(think_time_s, np.float64))
    if request_class is not None:
        columns["request_class"] = pa.array(request_class, pa.string())
    return pa.table(columns)


def build_trace(source: str, **columns: object) -> Trace:
    """``canonical_table`` validated and sorted into a Trace."""
    return trace_from_table(canonical_table(**columns), source=source)  # type: ignore[arg-type]


def consecutive_ids(bases: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR where row i holds ``bases[i], bases[i]+1, ..., bases[i]+counts[i]-1``."""
    counts = np.asarray(counts, np.int64)
    offsets = offsets_of(counts)
    values = np.repeat(np.asarray(bases, np.int64), counts) + concat_ranges(counts)
    return values, offsets
