"""The canonical trace schema: one row per request, validated, sorted stably by arrival time.

Columns (parquet or CSV):
  required  arrival_time_s (float, seconds from trace start, finite, >= 0),
            prompt_tokens (int >= 1), output_tokens (int >= 1)
  optional  request_id (str; default the file's row number), block_hashes (list<int64>; in CSV a
            space-separated or JSON-list string) with hash_block_tokens (int column or parquet
            metadata key), cache_salt (str or null), priority (int), n (int >= 1, default 1),
            session_id (str or null: the turns of one conversation, in arrival order) with
            think_time_s (float >= 0, default 0): a replay sends a turn no earlier than its
            previous turn's finish + its think time (simkv/replay/sessions.py), lora_name (str or
            null: the LoRA adapter a request runs with, vLLM's LoRARequest; needs --enable-lora),
            mm_offsets + mm_lengths + mm_hashes (list<int64> each, one entry per multimodal item
            of the prompt, an image: where its placeholder tokens start, how many there are (its
            encoder embeddings) and an identifier, equal for equal images, which share vLLM's
            encoder cache; items by offset, not overlapping, inside the prompt), request_class
            (str, not empty: a label such as "chat" or "batch" that a replay breaks its latencies
            and SLOs down by; `simkv trace merge` sets it, simkv/replay/classes.py).

Prefix rule: position p carries content (block_hashes[p // H], p % H) with H = hash_block_tokens;
positions past the hash list carry content unique to the request. Positions from prompt_tokens on
are the reply's: a hash list may reach into it (up to ceil((prompt_tokens + output_tokens) / H)
ids) when a later prompt repeats the reply, as a chat's next turn does. Rows without hashes may
carry H = 0 or null.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from simkv.traces import _columns as col
from simkv.traces._frames import frame_to_table
from simkv.traces._tableio import read_table, write_table
from simkv.traces.errors import TraceError

__all__ = [
    "Trace",
    "TraceError",
    "read_trace",
    "trace_from_frame",
    "trace_from_table",
    "trace_to_frame",
    "trace_to_table",
    "write_trace",
]

REQUIRED_COLUMNS = ("arrival_time_s", "prompt_tokens", "output_tokens")
HASH_META_KEY = b"hash_block_tokens"


@dataclass(frozen=True, eq=False)
class Trace:
    """A validated trace. Rows are sorted by arrival (stable: ties keep file order).

    Row i's block hashes are ``hash_ids[hash_offsets[i]:hash_offsets[i + 1]]`` (CSR layout);
    ``hash_block_tokens[i]`` is 0 for rows without hashes. Optional columns are None when absent.
    """

    arrival_time_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    request_id: np.ndarray
    hash_ids: np.ndarray | None = None
    hash_offsets: np.ndarray | None = None
    hash_block_tokens: np.ndarray | None = None
    cache_salt: np.ndarray | None = None
    priority: np.ndarray | None = None
    n: np.ndarray | None = None
    session_id: np.ndarray | None = None
    think_time_s: np.ndarray | None = None
    lora_name: np.ndarray | None = None
    # multimodal items, CSR as the hashes: row i's are mm_items[mm_item_offsets[i]:mm_item_offsets[i + 1]],
    # an (items, 3) int64 array of (offset, length, mm_hash)
    mm_items: np.ndarray | None = None
    mm_item_offsets: np.ndarray | None = None
    request_class: np.ndarray | None = None
    source: str = ""

    def __len__(self) -> int:
        return len(self.arrival_time_s)

    def block_hashes(self, i: int) -> np.ndarray:
        """Row i's hash ids (an empty int64 array when the row or the trace has none)."""
        if self.hash_ids is None or self.hash_offsets is None:
            return np.zeros(0, np.int64)
        return self.hash_ids[self.hash_offsets[i] : self.hash_offsets[i + 1]]

    def multimodal_items(self, i: int) -> tuple[tuple[int, int, int], ...]:
        """Row i's multimodal items, (offset, length, mm_hash) each, by offset (() if none)."""
        if self.mm_items is None or self.mm_item_offsets is None:
            return ()
        rows = self.mm_items[self.mm_item_offsets[i] : self.mm_item_offsets[i + 1]]
        return tuple(map(tuple, rows.tolist()))

    def mm_tokens(self) -> np.ndarray:
        """Per row, its multimodal items' placeholder tokens (zeros for a text-only trace)."""
        out = np.zeros(len(self.prompt_tokens), np.int64)
        if self.mm_items is not None and self.mm_item_offsets is not None and len(self.mm_items):
            rows = np.repeat(np.arange(len(out)), np.diff(self.mm_item_offsets))
            np.add.at(out, rows, self.mm_items[:, 1])
        return out

    def max_mm_item_tokens(self) -> int:
        """The largest multimodal item's placeholder tokens (0 for a text-only trace)."""
        return int(self.mm_items[:, 1].max()) if self.mm_items is not None and len(self.mm_items) else 0

    def __eq__(self, other: object) -> bool:
        """Same rows and columns (``source`` is ignored)."""
        if not isinstance(other, Trace):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self) if f.name != "source")

    __hash__ = None  # type: ignore[assignment]


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.all(a == b))


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a .parquet / .csv / .csv.gz trace; raises TraceError."""
    table = read_table(path)
    meta = table.schema.metadata or {}
    scalar = _meta_block_tokens(meta, str(path))
    return trace_from_table(table, source=str(path), hash_block_tokens=scalar)


def _meta_block_tokens(meta: dict, source: str) -> int | None:
    raw = meta.get(HASH_META_KEY)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise TraceError(f"{source}: metadata 'hash_block_tokens' is not an integer") from None


def trace_from_frame(df: pd.DataFrame, source: str = "<frame>", hash_block_tokens: int | None = None) -> Trace:
    """Validate a pandas frame in the canonical schema (same rules as ``read_trace``)."""
    return trace_from_table(frame_to_table(df, source), source=source, hash_block_tokens=hash_block_tokens)


def trace_from_table(
    table: pa.Table, source: str = "<table>", hash_block_tokens: int | None = None, row_offset: int = 0
) -> Trace:
    """Validate an Arrow table (file order) and return the Trace sorted stably by arrival."""
    if table.num_rows == 0:
        raise TraceError(f"{source}: the trace has no rows")
    for name in REQUIRED_COLUMNS:
        if name not in table.column_names:
            raise TraceError(f"{source}: missing required column '{name}'")
    if len(set(table.column_names)) != len(table.column_names):
        raise TraceError(f"{source}: duplicate column names")
    parts = _validated_columns(table, source, hash_block_tokens, row_offset)
    return _sorted(Trace(source=source, **parts))


def _validated_columns(table: pa.Table, source: str, scalar_h: int | None, row_offset: int) -> dict:
    get = table.column
    prompt = col.int_column(get("prompt_tokens"), source, "prompt_tokens", row_offset)
    output = col.int_column(get("output_tokens"), source, "output_tokens", row_offset)
    parts = dict(
        arrival_time_s=col.float_column(get("arrival_time_s"), source, "arrival_time_s", row_offset),
        prompt_tokens=prompt,
        output_tokens=output,
        request_id=_request_ids(table, source, row_offset),
    )
    if "block_hashes" in table.column_names:
        parts.update(_hashes(table, prompt, output, source, scalar_h, row_offset))
    if "cache_salt" in table.column_names:
        parts["cache_salt"] = col.string_column(get("cache_salt"), source, "cache_salt", row_offset, nullable=True)
    if "priority" in table.column_names:
        parts["priority"] = col.int_column(get("priority"), source, "priority", row_offset, minimum=None)
    if "n" in table.column_names:
        parts["n"] = col.int_column(get("n"), source, "n", row_offset, minimum=1)
    if "session_id" in table.column_names:
        parts["session_id"] = col.string_column(get("session_id"), source, "session_id", row_offset, nullable=True)
    if "lora_name" in table.column_names:
        parts["lora_name"] = col.string_column(get("lora_name"), source, "lora_name", row_offset, nullable=True)
    if any(name in table.column_names for name in MM_COLUMNS):
        parts.update(_multimodal_items(table, prompt, source, row_offset))
    if "request_class" in table.column_names:
        parts["request_class"] = _request_classes(table, source, row_offset)
    if "think_time_s" in table.column_names:
        if "session_id" not in table.column_names:
            raise TraceError(f"{source}: column 'think_time_s' needs a 'session_id' column (the turns it paces)")
        parts["think_time_s"] = col.float_column(get("think_time_s"), source, "think_time_s", row_offset)
    return parts


MM_COLUMNS = ("mm_offsets", "mm_lengths", "mm_hashes")


def _multimodal_items(table: pa.Table, prompt: np.ndarray, source: str, row_offset: int) -> dict:
    """The three mm_* columns as one CSR of (offset, length, mm_hash) rows, checked: the three
    lists of a row equally long, items by offset without overlap inside the prompt, and one
    length per mm_hash (vLLM refuses a request whose item's identifier names cached embeddings
    of another size)."""
    missing = [name for name in MM_COLUMNS if name not in table.column_names]
    if missing:
        raise TraceError(f"{source}: multimodal items need the columns {', '.join(MM_COLUMNS)}; "
                         f"missing {', '.join(missing)}")
    lists = {name: col.hash_lists(table.column(name), source, row_offset, name) for name in MM_COLUMNS}
    offsets = lists["mm_offsets"][1]
    for name in MM_COLUMNS[1:]:
        unequal = np.diff(lists[name][1]) != np.diff(offsets)
        if unequal.any():
            row = int(np.argmax(unequal))
            col.fail(source, name, row_offset + row, f"{int(np.diff(lists[name][1])[row])} entries, but mm_offsets "
                     f"has {int(np.diff(offsets)[row])}")
    starts, lengths, hashes = (lists[name][0] for name in MM_COLUMNS)
    if not len(starts):
        return {}
    row_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))

    def check(bad: np.ndarray, column: str, what) -> None:
        if bad.any():
            k = int(np.argmax(bad))
            col.fail(source, column, row_offset + int(row_of[k]), what(k))

    check(starts < 0, "mm_offsets", lambda k: f"offset {starts[k]} is negative")
    check(lengths < 1, "mm_lengths", lambda k: f"length {lengths[k]} must be >= 1")
    ends = starts + lengths
    check(ends > prompt[row_of], "mm_lengths",
          lambda k: f"item at {starts[k]} of {lengths[k]} tokens ends past the prompt ({prompt[row_of[k]]} tokens)")
    same_row = row_of[1:] == row_of[:-1]
    overlap = np.concatenate(([False], same_row & (starts[1:] < ends[:-1])))
    check(overlap, "mm_offsets", lambda k: f"item at {starts[k]} starts before the previous one ends "
          f"({ends[k - 1]}): items go by offset and do not overlap")
    order = np.lexsort((lengths, hashes))
    sorted_hashes, sorted_lengths = hashes[order], lengths[order]
    clash = (sorted_hashes[1:] == sorted_hashes[:-1]) & (sorted_lengths[1:] != sorted_lengths[:-1])
    if clash.any():
        k = int(order[int(np.argmax(clash)) + 1])
        col.fail(source, "mm_hashes", row_offset + int(row_of[k]),
                 f"mm_hash {hashes[k]} has {lengths[k]} tokens here and another length elsewhere: equal "
                 "hashes name one item")
    items = np.stack([starts, lengths, hashes], axis=1).astype(np.int64)
    return dict(mm_items=items, mm_item_offsets=offsets)


def _request_classes(table: pa.Table, source: str, row_offset: int) -> np.ndarray:
    labels = col.string_column(table.column("request_class"), source, "request_class", row_offset)
    empty = np.array([not str(x).strip() for x in labels], dtype=bool)
    if empty.any():
        col.fail(source, "request_class", row_offset + int(np.argmax(empty)), "an empty label (name every row's "
                 "class, or leave the column out)")
    return labels


def _request_ids(table: pa.Table, source: str, row_offset: int) -> np.ndarray:
    if "request_id" not in table.column_names:
        ids = np.arange(row_offset, row_offset + table.num_rows).astype(str).astype(object)
        return ids
    ids = col.string_column(table.column("request_id"), source, "request_id", row_offset)
    duplicate = col.first_duplicate(ids)
    if duplicate is not None:
        col.fail(source, "request_id", row_offset + duplicate, f"duplicate request id {str(ids[duplicate])[:40]!r}")
    return ids


def _hashes(table: pa.Table, prompt: np.ndarray, output: np.ndarray, source: str, scalar_h: int | None,
            row_offset: int) -> dict:
    values, offsets = col.hash_lists(table.column("block_hashes"), source, row_offset)
    if len(values) == 0:
        return {}
    counts = np.diff(offsets)
    per_row = _block_tokens(table, source, scalar_h, row_offset)
    missing = (counts > 0) & (per_row < 1)
    if missing.any():
        row = int(np.argmax(missing))
        col.fail(source, "hash_block_tokens", row_offset + row, "block_hashes given without hash_block_tokens >= 1")
    per_row = np.where(counts > 0, per_row, 0)
    total = prompt + output
    allowed = -(-total // np.maximum(per_row, 1))
    too_long = counts > allowed
    if too_long.any():
        row = int(np.argmax(too_long))
        col.fail(
            source, "block_hashes", row_offset + row,
            f"{counts[row]} hash ids, but {prompt[row]} prompt + {output[row]} output tokens at {per_row[row]} "
            f"tokens per block need at most {allowed[row]}",
        )
    return dict(hash_ids=values, hash_offsets=offsets, hash_block_tokens=per_row.astype(np.int64))


def _block_tokens(table: pa.Table, source: str, scalar_h: int | None, row_offset: int) -> np.ndarray:
    fill = scalar_h if scalar_h is not None else 0
    if scalar_h is not None and scalar_h < 1:
        raise TraceError(f"{source}: hash_block_tokens must be >= 1, got {scalar_h}")
    if "hash_block_tokens" not in table.column_names:
        return np.full(table.num_rows, fill, np.int64)
    arr = col.flat_array(table.column("hash_block_tokens"))
    if arr.null_count:
        arr = pc.fill_null(arr, str(fill) if pa.types.is_string(arr.type) else fill)
    return col.int_column(arr, source, "hash_block_tokens", row_offset, minimum=0)


def _sorted(trace: Trace) -> Trace:
    arrival = trace.arrival_time_s
    if len(arrival) < 2 or bool(np.all(arrival[1:] >= arrival[:-1])):
        return trace
    order = np.argsort(arrival, kind="stable")
    return take_rows(trace, order)


def take_rows(trace: Trace, rows: np.ndarray) -> Trace:
    """A new Trace with the given rows (an index array) in the given order."""
    parts = {}
    for f in fields(trace):
        value = getattr(trace, f.name)
        if f.name in ("hash_ids", "hash_offsets", "mm_items", "mm_item_offsets", "source") or value is None:
            continue
        parts[f.name] = value[rows]
    if trace.hash_ids is not None and trace.hash_offsets is not None:
        parts["hash_ids"], parts["hash_offsets"] = _take_csr(trace.hash_ids, trace.hash_offsets, rows)
    if trace.mm_items is not None and trace.mm_item_offsets is not None:
        parts["mm_items"], parts["mm_item_offsets"] = _take_csr(trace.mm_items, trace.mm_item_offsets, rows)
    return Trace(source=trace.source, **parts)


def _take_csr(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.diff(offsets)[rows]
    new_offsets = col.offsets_of(lengths)
    gather = np.repeat(offsets[:-1][rows] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1], dtype=np.int64)
    return values[gather], new_offsets


def trace_to_table(trace: Trace) -> pa.Table:
    """The canonical Arrow table of a Trace (no metadata: stable bytes when written)."""
    columns = {
        "arrival_time_s": pa.array(trace.arrival_time_s, pa.float64()),
        "prompt_tokens": pa.array(trace.prompt_tokens, pa.int64()),
        "output_tokens": pa.array(trace.output_tokens, pa.int64()),
        "request_id": pa.array(trace.request_id, pa.string()),
    }
    if trace.hash_ids is not None and trace.hash_offsets is not None:
        columns["block_hashes"] = _list_array(trace.hash_ids, trace.hash_offsets)
        columns["hash_block_tokens"] = pa.array(trace.hash_block_tokens, pa.int64())
    if trace.cache_salt is not None:
        columns["cache_salt"] = pa.array(trace.cache_salt, pa.string())
    if trace.priority is not None:
        columns["priority"] = pa.array(trace.priority, pa.int64())
    if trace.n is not None:
        columns["n"] = pa.array(trace.n, pa.int64())
    if trace.session_id is not None:
        columns["session_id"] = pa.array(trace.session_id, pa.string())
    if trace.think_time_s is not None:
        columns["think_time_s"] = pa.array(trace.think_time_s, pa.float64())
    if trace.lora_name is not None:
        columns["lora_name"] = pa.array(trace.lora_name, pa.string())
    if trace.mm_items is not None and trace.mm_item_offsets is not None:
        for k, name in enumerate(MM_COLUMNS):
            columns[name] = _list_array(np.ascontiguousarray(trace.mm_items[:, k]), trace.mm_item_offsets)
    if trace.request_class is not None:
        columns["request_class"] = pa.array(trace.request_class, pa.string())
    return pa.table(columns)


def _list_array(values: np.ndarray, offsets: np.ndarray) -> pa.Array:
    if offsets[-1] < 2**31 - 1:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int64()))
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values, pa.int64()))


def trace_to_frame(trace: Trace) -> pd.DataFrame:
    """A pandas frame in the canonical schema (block_hashes as lists of int)."""
    return trace_to_table(trace).to_pandas()


def write_trace(trace: Trace | pd.DataFrame, path: str | os.PathLike) -> None:
    """Validate (frames) and write atomically: parquet, or CSV for .csv / .csv.gz."""
    if isinstance(trace, pd.DataFrame):
        trace = trace_from_frame(trace)
    table = trace_to_table(trace)
    if not str(path).lower().endswith((".parquet", ".pq")):
        for name in ("block_hashes",) + MM_COLUMNS:
            if name in table.column_names:
                table = _list_as_text(table, name)
    write_table(table, path)


def _list_as_text(table: pa.Table, name: str) -> pa.Table:
    """CSV: a list column as space-separated text (None for an empty list), as the reader takes it."""
    texts = [" ".join(map(str, ids)) or None for ids in table.column(name).to_pylist()]
    return table.set_column(table.column_names.index(name), name, pa.array(texts, pa.string()))
