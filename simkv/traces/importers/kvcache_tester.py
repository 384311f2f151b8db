"""kv-cache-tester agentic-coding conversations: one JSON object per file.

Each file has ``block_size`` (64) and ``requests``: entries with ``t`` (s from the conversation
start), ``in``, ``out``, ``hash_ids`` (local ids of ``block_size``-token blocks), ``think_time``,
``api_time``, ... and sub-agent entries (``type: "subagent"``) holding their own ``requests`` on
the same clock and in the parent's hash namespace. Sub-agent requests are spliced in at the
entry's place. Conversations share no clock: conversation k starts at ``start[k]`` (a fixed gap,
or Poisson starts at a given rate, seeded) and each request keeps its own ``t`` offset.

Rows carry ``session_id`` (the conversation's main agent, or one sub-agent: ``<file>/<agent_id>``)
and ``think_time_s`` (the entry's ``think_time``: the client's delay after the session's previous
reply, 0 where absent), so a replay sends a turn no earlier than its previous reply + think time.

Hash ids are only meaningful inside one conversation, so they are namespaced: conversation k's
ids are shifted into their own range [base_k, base_k + span_k). Files are read one at a time
(sorted by name when a folder is given). Requests with zero input or output are dropped.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from simkv.traces.arrivals import ArrivalProcess, arrival_rng
from simkv.traces._columns import csr
from simkv.traces.build import canonical_table
from simkv.traces.errors import TraceError
from simkv.traces.importers.report import ImportReport
from simkv.traces.importers.values import whole_number


@dataclass(frozen=True)
class ConversationStarts:
    """Fixed ``gap_s`` between conversation starts, or Poisson starts at ``rate`` per second."""

    gap_s: float = 0.0
    rate: float | None = None
    seed: int = 0

    def times(self, count: int) -> np.ndarray:
        if self.rate is not None:
            return ArrivalProcess("poisson", self.rate).times(count, arrival_rng(self.seed, stream=4))
        if not self.gap_s >= 0:
            raise TraceError(f"--conversation-gap must be >= 0, got {self.gap_s}")
        return np.arange(count, dtype=np.float64) * self.gap_s


def conversation_files(sources: list[str | Path]) -> list[Path]:
    """Expand folders into their sorted ``*.json`` files; keep the order of explicit files."""
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise TraceError(f"{path}: no *.json conversation files in this folder")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise TraceError(f"{path}: no such file or folder")
    if not files:
        raise TraceError("kvcache-tester: no conversation files given")
    return files


def kvcache_batches(
    sources: list[str | Path], report: ImportReport, starts: ConversationStarts = ConversationStarts()
) -> Iterator[pa.Table]:
    """One canonical table per conversation, in file order."""
    files = conversation_files(sources)
    start_times = starts.times(len(files))
    next_base = 0
    for path, start in zip(files, start_times):
        conversation = _load(path)
        block, rows = _flatten(conversation, path)
        report.rows_read += len(rows)
        table, span = _conversation_table(rows, path, block, float(start), next_base, report)
        next_base += span
        if table is not None:
            yield table


def _load(path: Path) -> dict:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: bytes that are not UTF-8 at position {exc.start}") from None
    if not text.strip():
        raise TraceError(f"{path}: empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{path}: not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise TraceError(f"{path}: field 'requests': expected a conversation object with a list of requests")
    return data


@dataclass(frozen=True)
class _Request:
    where: str
    label: str
    t: float
    prompt: int
    output: int
    hashes: list[int]
    session: str = ""  # the main agent's requests, or one sub-agent's
    think: float = 0.0  # seconds the client waited after the session's previous reply


def _flatten(conversation: dict, path: Path) -> tuple[int, list[_Request]]:
    """The conversation's block size and its requests, sub-agent requests spliced in."""
    block = whole_number(conversation.get("block_size", 64), f"{path}: field 'block_size'")
    if block < 1:
        raise TraceError(f"{path}: field 'block_size': must be >= 1")
    rows: list[_Request] = []
    for i, entry in enumerate(conversation["requests"]):
        where = f"{path}: requests[{i}]"
        if isinstance(entry, dict) and entry.get("type") == "subagent":
            inner = entry.get("requests", [])
            if not isinstance(inner, list):
                raise TraceError(f"{where}: field 'requests': expected a list")
            agent = str(entry.get("agent_id", f"agent{i}"))
            rows.extend(_request(sub, f"{where}.requests[{j}]", f"{agent}/{j}", block, f"{path.stem}/{agent}")
                        for j, sub in enumerate(inner))
        else:
            rows.append(_request(entry, where, str(i), block, path.stem))
    return block, rows


def _request(entry: object, where: str, label: str, block: int, session: str) -> _Request:
    if not isinstance(entry, dict):
        raise TraceError(f"{where}: expected a JSON object")
    if entry.get("type") == "subagent":
        raise TraceError(f"{where}: nested sub-agents are not supported")
    for name in ("t", "in", "out"):
        if name not in entry:
            raise TraceError(f"{where}: field '{name}' is missing")
    t = entry["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 <= t < float("inf")):
        raise TraceError(f"{where}: field 't': expected a finite number >= 0, got {str(t)[:30]!r}")
    prompt = whole_number(entry["in"], f"{where}: field 'in'")
    output = whole_number(entry["out"], f"{where}: field 'out'")
    hashes = entry.get("hash_ids") or []
    if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hashes):
        raise TraceError(f"{where}: field 'hash_ids': expected a list of integers")
    if len(hashes) > -(-prompt // block):
        raise TraceError(f"{where}: field 'hash_ids': {len(hashes)} ids for {prompt} tokens at {block} per block")
    think = entry.get("think_time") or 0.0
    if isinstance(think, bool) or not isinstance(think, (int, float)) or not (0 <= think < float("inf")):
        raise TraceError(f"{where}: field 'think_time': expected a finite number >= 0, got {str(think)[:30]!r}")
    return _Request(where, label, float(t), prompt, output, hashes, session, float(think))


def _conversation_table(
    rows: list[_Request], path: Path, block: int, start: float, base: int, report: ImportReport
) -> tuple[pa.Table | None, int]:
    """The kept rows as a table, and the width of the id range this conversation used."""
    every = [h for row in rows for h in row.hashes]
    low = min(every, default=0)
    span = max(every, default=-1) - low + 1
    if span and max(abs(low), abs(base + span)) >= 2**62:
        raise TraceError(f"{path}: field 'hash_ids': ids out of range")
    kept = [row for row in rows if row.prompt > 0 and row.output > 0]
    report.drop("zero input tokens", sum(row.prompt == 0 for row in rows))
    report.drop("zero output tokens", sum(row.prompt > 0 and row.output == 0 for row in rows))
    if not kept:
        return None, span
    values, offsets = csr([row.hashes for row in kept])
    values += base - low
    table = canonical_table(
        np.array([start + row.t for row in kept]),
        np.array([row.prompt for row in kept]),
        np.array([row.output for row in kept]),
        request_id=[f"{path.stem}/{row.label}" for row in kept],
        hash_ids=values,
        hash_offsets=offsets,
        hash_block_tokens=block,
        session_id=[row.session for row in kept],
        think_time_s=np.array([row.think for row in kept]),
    )
    return table, span

