"""Prefix reuse of a trace at a given KV block size, from its block hashes.

A prompt of P tokens fills ceil(P / B) KV blocks of B tokens, its partial last block included.
Block j covers positions up to L = min((j + 1) * B, P); its content is the whole chain of content
in positions [0, L) -- by the prefix rule, the first k = ceil(L / H) hash ids plus L itself -- and
the request's cache salt and hash block size. The block is *reused* when an earlier request had a
block with the same content: in its prompt, or in its reply where its hash list goes on over the
reply (longer than the prompt needs; a full block of the reply's computed tokens, the last sampled one excluded, as an engine
caches it). Positions past a row's hash list are unique, so a block reaching past them (and every
block of a row without hashes) is never reused.

Equal prefixes are found with a level-by-level factorisation of (parent node, hash id): node ids
are equal exactly when the hash lists agree up to that level (vectorised numpy; no per-row loop).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simkv.traces._columns import concat_ranges
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace


@dataclass(frozen=True)
class PrefixReuse:
    """``reused_blocks / total_blocks`` is the reuse ratio."""

    block_size: int
    total_blocks: int
    reused_blocks: int
    distinct_first_blocks: int

    @property
    def ratio(self) -> float:
        return self.reused_blocks / self.total_blocks if self.total_blocks else 0.0


def prefix_reuse(trace: Trace, block_size: int) -> PrefixReuse | None:
    """Reuse statistics at ``block_size`` tokens per block; None when the trace has no hashes."""
    if block_size < 1:
        raise TraceError(f"--block-size must be >= 1, got {block_size}")
    if trace.hash_ids is None or trace.hash_offsets is None or trace.hash_block_tokens is None:
        return None
    prompt = trace.prompt_tokens
    total = int((-(-prompt // block_size)).sum())
    nodes = _prefix_nodes(trace)
    keys, key_rows, row_first = _block_keys(trace, nodes, block_size)
    reply_keys, reply_rows = _reply_keys(trace, nodes, block_size)
    if len(reply_keys):
        # A prompt block is reused unless it is the first of its content, replies counted
        # (rows are in arrival order; a row's prompt and reply blocks never share a key).
        rows = np.concatenate((key_rows, reply_rows))
        all_keys = np.concatenate((keys, reply_keys))
        is_prompt = np.arange(len(all_keys)) < len(keys)
        order = np.lexsort((rows, all_keys))
        first = np.ones(len(order), bool)
        first[1:] = all_keys[order][1:] != all_keys[order][:-1]
        reused = len(keys) - int((first & is_prompt[order]).sum())
    else:
        reused = len(keys) - len(np.unique(keys))
    valid_first = keys[row_first[row_first >= 0]]
    distinct_first = len(np.unique(valid_first)) + int((row_first < 0).sum())
    return PrefixReuse(block_size, total, reused, distinct_first)


def _prefix_nodes(trace: Trace) -> np.ndarray:
    """node[i] for every hash position: equal iff same root and same hash ids up to and including it."""
    offsets = trace.hash_offsets
    lengths = np.diff(offsets)
    from simkv.traces.lora import content_namespaces

    salt = content_namespaces(trace)  # (cache_salt and LoRA adapter: what blocks are shared within)
    if salt is None:
        salt = np.full(len(trace), None, dtype=object)
    roots = pd.MultiIndex.from_arrays([pd.Index(salt, dtype=object), trace.hash_block_tokens]).factorize()[0]
    _, hash_rank = np.unique(trace.hash_ids, return_inverse=True)
    width = int(hash_rank.max(initial=0)) + 1
    nodes = np.empty(len(trace.hash_ids), np.int64)
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    parent = roots[order].astype(np.int64)
    next_id = int(roots.max(initial=0)) + 1
    for level in range(int(lengths.max(initial=0))):
        active = int(np.searchsorted(-sorted_lengths, -level, side="left"))  # rows longer than `level`
        positions = offsets[order[:active]] + level
        key = parent[:active] * width + hash_rank[positions]
        _, inverse = np.unique(key, return_inverse=True)
        parent = inverse.astype(np.int64) + next_id
        next_id = int(parent.max()) + 1
        nodes[positions] = parent
    return nodes


def hashed_positions(trace: Trace) -> np.ndarray:
    """Per row, the positions its hash list covers (0 without one)."""
    return np.diff(trace.hash_offsets) * trace.hash_block_tokens


def describes_reply(covered, prompt, block):
    """Whether a hash list covering `covered` positions of a `prompt`-token prompt at `block`
    tokens per id goes on over the reply: it is longer than the prompt needs (numpy arrays or
    numbers; the engine's twin is core/request.py's, which knows no traces)."""
    return covered >= prompt + block


def _pack(trace: Trace, nodes: np.ndarray, row: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The content key (node of the chain up to position `ends`, `ends`) in one int64."""
    levels = -(-ends // trace.hash_block_tokens[row]) - 1
    node = nodes[trace.hash_offsets[row] + levels]
    return node * (int((trace.prompt_tokens + trace.output_tokens).max()) + 1) + ends


def _block_keys(trace: Trace, nodes: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys of every hashed prompt block (node, L) packed in int64, the row of each, and the
    index of each row's first key (-1: none)."""
    prompt = trace.prompt_tokens
    covered = hashed_positions(trace)
    valid = np.where(prompt <= covered, -(-prompt // block_size), covered // block_size)
    row = np.repeat(np.arange(len(trace)), valid)
    ends = np.minimum((concat_ranges(valid) + 1) * block_size, prompt[row])
    keys = _pack(trace, nodes, row, ends)
    firsts = np.concatenate(([0], np.cumsum(valid)[:-1]))
    return keys, row, np.where(valid > 0, firsts, -1)


def _reply_keys(trace: Trace, nodes: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys of the full reply blocks an engine caches where hash lists go on over replies
    (blocks holding a reply position, ending by the last computed token), and their rows."""
    prompt = trace.prompt_tokens
    covered = hashed_positions(trace)
    last = np.minimum(covered, prompt + trace.output_tokens - 1) // block_size  # blocks [0, last) full
    first = prompt // block_size  # the first block holding a reply position
    count = np.where(describes_reply(covered, prompt, trace.hash_block_tokens), np.maximum(last - first, 0), 0)
    row = np.repeat(np.arange(len(trace)), count)
    ends = (np.repeat(first, count) + concat_ranges(count) + 1) * block_size
    return _pack(trace, nodes, row, ends), row
