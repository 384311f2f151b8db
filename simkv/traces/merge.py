"""``simkv trace merge``: one trace of several kinds of traffic, each row labelled with its class.

A serving fleet rarely sees one kind of request: chat turns arrive beside batch summaries, coding
agents beside a RAG front end. Merging their traces onto one clock, each row's `request_class`
naming where it came from, lets a replay say what each kind of traffic gets (simkv/replay/classes.py)
and hold each to its own SLOs (`--goodput chat:ttft:500`).

Rules, so that a merge changes nothing but the mix:
- arrival times are kept (each trace starts where it started; `simkv trace transform --rate` or
  `--time-scale` first to set each one's load); rows interleave by arrival, ties in input order;
- request and session ids are prefixed with their input's label (``chat/17``; with its position,
  ``0/17``, for every input when two share a label or one keeps its own column), so that no two
  inputs' rows or conversations run together;
- prompt content stays apart: each input's block hashes and image identifiers are mapped through
  a bijection seeded by the input's position, so two traces that number their blocks alike (as
  Mooncake-style traces do, from 0) share no prefix by accident. ``shared_content=True`` keeps
  them as they are, for slices of one source whose requests do share prompts;
- a column that only some inputs have is filled with what its absence means (no hashes, no salt,
  priority 0, one sequence, no session, no adapter, no images).
"""
from __future__ import annotations

from dataclasses import fields

import numpy as np
import pandas as pd

from simkv.traces.errors import TraceError
from simkv.traces.schema import MM_COLUMNS, Trace, trace_from_frame, trace_to_frame

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# what a row means when its input lacks the column
_FILL = {"cache_salt": None, "priority": 0, "n": 1, "session_id": None, "think_time_s": 0.0, "lora_name": None,
         "hash_block_tokens": 0}
_LIST_COLUMNS = ("block_hashes",) + MM_COLUMNS


def merge_traces(parts: list[tuple[str | None, Trace]], shared_content: bool = False) -> Trace:
    """The rows of every (label, trace) part on one clock, `request_class` set to the label (or,
    label None, kept from the trace's own column). TraceError when a part has neither."""
    if len(parts) < 2:
        raise TraceError("merge needs at least two traces")
    labelled = [(_label(name, trace), trace) for name, trace in parts]
    prefixes = _prefixes([label for label, _ in labelled])
    frames = [_frame(trace, label, prefix, None if shared_content else k)
              for k, ((label, trace), prefix) in enumerate(zip(labelled, prefixes))]
    columns = [c for c in _canonical_order() if any(c in f.columns for f in frames)]
    for frame in frames:
        for column in columns:
            if column not in frame.columns:
                frame[column] = _missing(column, len(frame))
    merged = pd.concat([f[columns] for f in frames], ignore_index=True)
    for column in ("priority", "n", "hash_block_tokens"):
        if column in merged.columns:
            merged[column] = merged[column].astype(np.int64)
    return trace_from_frame(merged, source=" + ".join(t.source or "<trace>" for _, t in parts))


def _label(name: str | None, trace: Trace) -> str | np.ndarray:
    if name is not None:
        if not name.strip():
            raise TraceError(f"{trace.source}: an empty class label")
        return name
    if trace.request_class is None:
        raise TraceError(f"{trace.source}: no request_class column; name its class (NAME=PATH)")
    return trace.request_class


def _prefixes(labels: list) -> list[str]:
    """Each input's id prefix: its label where every input has a label of its own (one label for
    the whole input, no other input with it), else its position, for every input alike."""
    names = [label if isinstance(label, str) else None for label in labels]
    if None not in names and len(set(names)) == len(names):
        return [f"{name}/" for name in names]
    return [f"{k}/" for k in range(len(names))]


def _canonical_order() -> list[str]:
    frame_columns = {"hash_ids": ["block_hashes"], "hash_offsets": [],
                     "mm_items": list(MM_COLUMNS), "mm_item_offsets": [], "source": []}
    return [c for f in fields(Trace) for c in frame_columns.get(f.name, [f.name])]


def _frame(trace: Trace, label, prefix: str, seed: int | None) -> pd.DataFrame:
    frame = trace_to_frame(trace)
    frame["request_id"] = [prefix + str(x) for x in frame["request_id"]]
    if "session_id" in frame.columns:
        frame["session_id"] = [None if x is None else prefix + str(x) for x in frame["session_id"]]
    frame["request_class"] = label if isinstance(label, str) else list(label)
    if seed is not None:
        if trace.hash_ids is not None:
            frame["block_hashes"] = _remapped(trace.hash_ids, trace.hash_offsets, seed)
        if trace.mm_items is not None:
            frame["mm_hashes"] = _remapped(np.ascontiguousarray(trace.mm_items[:, 2]), trace.mm_item_offsets, seed)
    return frame


def _remapped(values: np.ndarray, offsets: np.ndarray, seed: int) -> list[list[int]]:
    """Ids through splitmix64's finalizer after an input-specific xor: one-to-one within an input,
    apart across inputs."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) ^ (np.uint64(seed + 1) * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    mapped = z.view(np.int64)
    return [mapped[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def _missing(column: str, n: int) -> list:
    if column in _LIST_COLUMNS:
        return [[] for _ in range(n)]
    return [_FILL[column]] * n
