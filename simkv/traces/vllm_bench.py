"""Export a trace for vLLM's own benchmark client (`vllm bench serve --dataset-name timed_trace`),
and read one back as the client reads it (`read_timed_trace`).

vLLM's timed-trace dataset is JSON Lines, one request a line: ``timestamp`` (seconds from the
benchmark's start), ``input_length``, ``output_length`` and ``hash_ids``. The client builds each
prompt from its hash ids, ``chunk`` tokens an id (``--timed-trace-chunk-hash-size``): the same id
gives the same random token ids within one run, and a partial last chunk gets tokens of its own.
It sends the prompt as token ids at the line's timestamp (open loop), with EOS ignored, so the
server computes exactly ``input_length`` prompt tokens and generates ``output_length``.

The prompt is only as long as its ids reach, so every position needs one: where simkv's prefix
rule gives a position content unique to its request (past the row's hash list), the export gives
it an id no other line uses. simkv's content rule (position p carries ``(hash[p // H], p % H)``)
is kept at the chunk granularity ``g = gcd(H, block size)``: an H-token block becomes H / g ids,
so a prompt that stops inside a shared H-token block still shares its leading g-token chunks,
as it does in simkv (vLLM's client would give a partial H-token chunk different tokens).

What the client cannot send is dropped, and the export writes the simkv trace the server will see
beside the JSON Lines (same rows, hash ids as exported): a cache salt becomes part of the ids,
a reply's ids are left out (the server's model writes its own reply, which no later prompt
repeats), and sessions are not paced (the client sends at the timestamps). Rows with ``n`` > 1
are refused: the client sends one sequence a request.
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from simkv.atomic import atomic_write
from simkv.traces._columns import offsets_of
from simkv.traces.errors import TraceError
from simkv.traces.reuse import describes_reply, hashed_positions
from simkv.traces.schema import Trace, write_trace

#: The field names vLLM's timed-trace dataset reads by default.
TIMESTAMP, INPUT_LENGTH, OUTPUT_LENGTH, HASH_IDS = "timestamp", "input_length", "output_length", "hash_ids"


@dataclass
class TimedTraceExport:
    """The exported requests: JSON-Lines text, the trace the server sees, and what was dropped."""

    chunk_tokens: int
    served: Trace  # the same rows with the exported hash ids (no salts, replies, sessions or priorities)
    lines: list[str]
    notes: list[str] = field(default_factory=list)


def chunk_tokens_for(trace: Trace, block_size: int) -> int:
    """The id granularity: gcd of the engine's block size and every hash block size in the trace."""
    if block_size < 1:
        raise TraceError(f"--block-size must be >= 1, got {block_size}")
    sizes = [] if trace.hash_block_tokens is None else np.unique(trace.hash_block_tokens[trace.hash_block_tokens > 0])
    return math.gcd(block_size, *[int(h) for h in sizes])


def check_jsonl_path(path: str | os.PathLike) -> None:
    if not str(path).endswith(".jsonl"):
        raise TraceError(f"{path}: the timed trace is JSON Lines: name it *.jsonl")


def export_timed_trace(trace: Trace, block_size: int = 16) -> TimedTraceExport:
    """The trace as vLLM's timed-trace JSON Lines (in arrival order) and as the simkv trace the
    server will see (see the module's docstring)."""
    if trace.n is not None and bool(np.any(trace.n > 1)):
        row = int(np.argmax(trace.n > 1))
        raise TraceError(f"{trace.source}: column 'n', row {row}: n = {int(trace.n[row])}; vLLM's benchmark "
                         f"client sends one sequence a request (drop the column or the row)")
    if trace.mm_items is not None:
        raise TraceError(f"{trace.source}: columns mm_*: the trace has images; vLLM's timed-trace client sends "
                         "text prompts only")
    g = chunk_tokens_for(trace, block_size)
    keys, offsets, notes = _chunk_keys(trace, g)
    ids = _first_seen_ids(keys)
    served = Trace(arrival_time_s=trace.arrival_time_s, prompt_tokens=trace.prompt_tokens,
                   output_tokens=trace.output_tokens, request_id=trace.request_id, hash_ids=ids,
                   hash_offsets=offsets, hash_block_tokens=np.full(len(trace), g, np.int64), source=trace.source)
    lines = [_line(float(trace.arrival_time_s[i]), int(trace.prompt_tokens[i]), int(trace.output_tokens[i]),
                   ids[offsets[i]:offsets[i + 1]], str(trace.request_id[i])) for i in range(len(trace))]
    return TimedTraceExport(chunk_tokens=g, served=served, lines=lines, notes=notes)


def _chunk_keys(trace: Trace, g: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Per row, one (kind, a, b) key per g-token chunk of its prompt: (1 + salt, hash id, chunk
    within the hash block) where the trace gives the content, (0, row, chunk) where it is the
    request's own. Returns the keys (n x 3), the rows' offsets into them, and notes."""
    n = len(trace)
    chunks = -(-trace.prompt_tokens // g)
    offsets = offsets_of(chunks)
    row = np.repeat(np.arange(n, dtype=np.int64), chunks)
    k = np.arange(offsets[-1], dtype=np.int64) - offsets[:-1][row]  # chunk index within its prompt
    keys = np.stack([np.zeros_like(k), row, k], axis=1)
    notes: list[str] = []
    if trace.hash_ids is not None and trace.hash_offsets is not None:
        h = trace.hash_block_tokens
        per = np.where(h > 0, h // g, 1)[row]  # g-chunks per hash block
        block = k // per
        listed = np.diff(trace.hash_offsets)[row]
        hashed = (h[row] > 0) & (block < listed)
        salt = _salt_codes(trace)[row]
        keys[hashed, 0] = 1 + salt[hashed]
        keys[hashed, 1] = trace.hash_ids[trace.hash_offsets[:-1][row][hashed] + block[hashed]]
        keys[hashed, 2] = (k % per)[hashed]
        replies = int(describes_reply(hashed_positions(trace), trace.prompt_tokens, h).sum())
        if replies:
            notes.append(f"{replies:,} rows describe their replies: left out (the server's model writes its own "
                         f"replies, which no later prompt repeats)")
    if trace.cache_salt is not None and any(s is not None for s in trace.cache_salt):
        notes.append("cache salts are folded into the hash ids (the benchmark client sends no cache_salt)")
    if trace.lora_name is not None and any(s is not None for s in trace.lora_name):
        notes.append("LoRA adapters are folded into the hash ids and not sent (the timed-trace client names none: "
                     "the server runs the base model)")
    if trace.priority is not None and len(np.unique(trace.priority)) > 1:
        notes.append("priorities are not sent by the benchmark client: the exported trace has none "
                     "(replay it with the default --scheduling-policy fcfs)")
    if trace.session_id is not None and any(s is not None for s in trace.session_id):
        notes.append("sessions are sent at their timestamps, not paced on their replies "
                     "(the exported trace has no session_id)")
    return keys, offsets, notes


def _salt_codes(trace: Trace) -> np.ndarray:
    from simkv.traces.lora import content_namespaces

    namespaces = content_namespaces(trace)  # (cache_salt and LoRA adapter)
    if namespaces is None:
        return np.zeros(len(trace), np.int64)
    salts = np.array(["" if s is None else "s" + str(s) for s in namespaces], dtype=object)
    _, codes = np.unique(salts.astype(str), return_inverse=True)
    return codes.astype(np.int64)


def _first_seen_ids(keys: np.ndarray) -> np.ndarray:
    """Dense ids 0, 1, 2, ... for the distinct keys, numbered in order of first appearance."""
    if len(keys) == 0:
        return np.zeros(0, np.int64)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int64)
    return rank[inverse.reshape(-1)]


def _line(t: float, prompt: int, output: int, ids: np.ndarray, request_id: str) -> str:
    import json

    return (f'{{"{TIMESTAMP}": {t!r}, "{INPUT_LENGTH}": {prompt}, "{OUTPUT_LENGTH}": {output}, '
            f'"{HASH_IDS}": [{", ".join(map(str, ids.tolist()))}], "request_id": {json.dumps(request_id)}}}')


def served_trace_path(jsonl_path: str | os.PathLike) -> Path:
    """Where the export writes the simkv trace beside the JSON Lines: the same name, .parquet."""
    path = Path(jsonl_path)
    return path.with_name(path.name.removesuffix(".jsonl") + ".parquet") if path.name.endswith(".jsonl") \
        else path.with_name(path.name + ".parquet")


def write_timed_trace(export: TimedTraceExport, jsonl_path: str | os.PathLike,
                      trace_path: str | os.PathLike) -> None:
    """Both files, each written to a temporary name and renamed into place."""
    check_jsonl_path(jsonl_path)
    buf = io.StringIO()
    for line in export.lines:
        buf.write(line)
        buf.write("\n")
    text = buf.getvalue()
    write_trace(export.served, trace_path)
    atomic_write(jsonl_path, lambda tmp: Path(tmp).write_text(text))


def bench_command(jsonl_path: str, num_requests: int, chunk_tokens: int, model: str = "MODEL") -> str:
    """The `vllm bench serve` command line that replays the export against a running server."""
    return (f"vllm bench serve --backend vllm --model {model} --dataset-name timed_trace "
            f"--dataset-path {jsonl_path} --timed-trace-chunk-hash-size {chunk_tokens} "
            f"--num-prompts {num_requests} --ready-check-timeout-sec 0 "
            f"--save-result --save-detailed --result-filename bench.json")


@dataclass(frozen=True)
class TimedTraceLabels:
    """The field names `--timed-trace-label-*` give (vLLM's defaults)."""

    timestamp: str = TIMESTAMP
    input_length: str = INPUT_LENGTH
    output_length: str = OUTPUT_LENGTH
    hash_ids: str = HASH_IDS


def read_timed_trace(path: str | os.PathLike, chunk_tokens: int = 16, sec_multiplier: float = 1.0,
                     num_prompts: int | None = None, labels: TimedTraceLabels = TimedTraceLabels()) -> Trace:
    """A timed trace as vLLM's client reads it (its TimedTrace dataset): the first
    `num_prompts` lines, each sent at its timestamp x `sec_multiplier` as the token ids its hash
    ids expand to, `chunk_tokens` an id and the rest of the input length for the last (the
    prompt is only as long as its ids reach), generating its output length. The same id (and
    size) gives the same tokens within a run: the ids are the trace's hash ids, `chunk_tokens`
    tokens a block. Rows are named `bench-<line index>`."""
    import json

    if chunk_tokens < 1:
        raise TraceError(f"--timed-trace-chunk-hash-size must be >= 1, got {chunk_tokens}")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(f"{path}: {exc}") from None
    times, prompts, outputs, ids, offsets = [], [], [], [], [0]
    for number, line in enumerate(text.splitlines(), 1):
        if num_prompts is not None and len(times) >= num_prompts:
            break
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{path}: line {number}: not JSON ({exc})") from None
        values = {}
        for key, name in (("timestamp", labels.timestamp), ("input_length", labels.input_length),
                          ("output_length", labels.output_length)):
            value = entry.get(name) if isinstance(entry, dict) else None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise TraceError(f"{path}: line {number}: field '{name}' must be a number >= 0, got {value!r}")
            values[key] = value
        hashes = entry.get(labels.hash_ids, [])
        if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
            raise TraceError(f"{path}: line {number}: field '{labels.hash_ids}' must be a list of integers")
        need = -(-int(values["input_length"]) // chunk_tokens)
        used = hashes[:need]
        prompt = min(int(values["input_length"]), len(used) * chunk_tokens)
        if prompt < 1 or int(values["output_length"]) < 1:
            raise TraceError(f"{path}: line {number}: a request needs a prompt of at least one token (hash ids to "
                             "cover it) and an output length of at least 1")
        times.append(float(values["timestamp"]) * sec_multiplier)
        prompts.append(prompt)
        outputs.append(int(values["output_length"]))
        ids.extend(used)
        offsets.append(len(ids))
    if not times:
        raise TraceError(f"{path}: no requests")
    from simkv.traces.build import build_trace

    n = len(times)
    return build_trace(f"{path} (vllm bench serve --dataset-name timed_trace)", arrival_time_s=np.asarray(times),
                       prompt_tokens=np.asarray(prompts), output_tokens=np.asarray(outputs),
                       request_id=[f"bench-{i}" for i in range(n)], hash_ids=np.asarray(ids, np.int64),
                       hash_offsets=np.asarray(offsets, np.int64), hash_block_tokens=chunk_tokens)
