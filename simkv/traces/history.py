"""``simkv trace transform --session-history``: content ids for conversations that have lengths only.

Production logs and public traces (BurstGPT, a CSV with a conversation column) often tell which
conversation a request belongs to but not what its prompt holds, so a replay finds no prefix hits
in them. A chat client, though, sends each turn with the conversation so far: the system prompt,
every earlier message and reply, then the new message, so turn j's prompt starts with turn
j-1's prompt and reply. This edit writes hash lists that say so, in `block_tokens`-token chunks:

- a turn whose prompt is at least its session's previous prompt + reply
  (P_j >= P_{j-1} + O_{j-1}) repeats them: its list starts with the previous turn's first
  floor((P_{j-1} + O_{j-1}) / H) ids (the chunks that held nothing after the reply), and the
  previous turn's list goes on over its reply to that length (docs/traces.md: a list longer than
  its prompt needs goes on over the reply, whose cached blocks a replay then finds);
- a turn at least as long as the previous prompt but shorter than prompt + reply (a client that
  sends the reply back without its reasoning, say) repeats that prompt only: its first
  floor(P_{j-1} / H) ids;
- the rest of a prompt, and every prompt of a turn shorter than the previous prompt (a log that
  keeps only each new message) or that opens a session, is content of its own (fresh ids).

This is an inference from lengths: a client that trims the history, summarises it or drops the
reasoning, and conversations that share a system prompt, defeat it, and the count of turns it
linked is reported so that it can be checked against what the trace is. Rows without a session
keep no list.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from simkv.traces._columns import csr
from simkv.traces.errors import TraceError
from simkv.traces.schema import Trace

DEFAULT_BLOCK_TOKENS = 16


def session_history(trace: Trace, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> tuple[Trace, int, int, int]:
    """The trace with hash lists for its sessions' turns; how many turns repeat their previous
    turn's prompt and reply, how many its prompt only, and how many later turns there are in all."""
    if trace.session_id is None:
        raise TraceError(f"{trace.source}: --session-history needs session_id (which request belongs to which "
                         "conversation); the trace has none")
    if trace.hash_ids is not None and len(trace.hash_ids):
        raise TraceError(f"{trace.source}: --session-history writes content ids for a trace that has none; this "
                         "one has block_hashes (--link-replies lengthens them over replies instead)")
    if block_tokens < 1:
        raise TraceError(f"--history-block-tokens must be >= 1, got {block_tokens}")
    prompt = trace.prompt_tokens.tolist()
    output = trace.output_tokens.tolist()
    lists: list[list[int]] = [[] for _ in prompt]
    previous: dict[str, int] = {}
    next_id = 1
    linked = prompt_only = later = 0

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    for j, session in enumerate(trace.session_id.tolist()):  # (rows are in arrival order)
        if session is None:
            continue
        need = -(-prompt[j] // block_tokens)
        i = previous.get(session)
        previous[session] = j
        if i is None:
            lists[j] = fresh(need)
            continue
        later += 1
        history = prompt[i] + output[i]
        if prompt[j] < prompt[i]:
            lists[j] = fresh(need)
            continue
        if prompt[j] >= history:
            linked += 1
            shared = history // block_tokens
        else:  # (the reply was not sent back whole: reasoning dropped, say)
            prompt_only += 1
            shared = prompt[i] // block_tokens
        if len(lists[i]) < shared:  # (the previous turn's list goes on over its reply)
            lists[i] += fresh(shared - len(lists[i]))
        lists[j] = lists[i][:shared] + fresh(need - shared)
    return _with_hash_lists(trace, lists, np.full(len(lists), block_tokens, np.int64)), linked, prompt_only, later


def with_system_prompt(trace: Trace, tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> tuple[Trace, int]:
    """``--system-prompt-tokens N``: every prompt of at least N tokens starts with the same N-token
    system prompt (an application's instructions), the rest of it as the trace says (its own ids,
    or content of its own for a row without). In content ids: the first floor(N / H) ids of each
    such row become ids that all rows share (H: the row's hash block tokens, `block_tokens` for a
    row without a list; a chunk that holds the system prompt's end and the row's own tokens stays
    the row's). Rows with shorter prompts are left as they are. The trace and how many rows start
    with the system prompt."""
    if tokens < 1:
        raise TraceError(f"--system-prompt-tokens must be >= 1, got {tokens}")
    if block_tokens < 1:
        raise TraceError(f"--history-block-tokens must be >= 1, got {block_tokens}")
    n = len(trace)
    offsets = trace.hash_offsets if trace.hash_offsets is not None else np.zeros(n + 1, np.int64)
    ids = trace.hash_ids if trace.hash_ids is not None else np.zeros(0, np.int64)
    chunk = (trace.hash_block_tokens if trace.hash_block_tokens is not None else np.zeros(n, np.int64)).copy()
    chunk[chunk == 0] = block_tokens
    next_id = int(ids.max()) + 1 if len(ids) else 1
    shared: dict[int, list[int]] = {}  # chunk size -> the system prompt's ids at it
    lists, given = [], 0
    for i, (prompt, h) in enumerate(zip(trace.prompt_tokens.tolist(), chunk.tolist())):
        own = ids[offsets[i]:offsets[i + 1]].tolist()
        if prompt < tokens:
            lists.append(own)
            continue
        given += 1
        k = tokens // h
        if h not in shared:
            shared[h] = list(range(next_id, next_id + k))
            next_id += k
        if own:
            lists.append(shared[h] + own[k:])
        else:  # (content of its own after the system prompt)
            rest = -(-prompt // h) - k
            lists.append(shared[h] + list(range(next_id, next_id + rest)))
            next_id += rest
    return _with_hash_lists(trace, lists, chunk), given


def _with_hash_lists(trace: Trace, lists: list[list[int]], chunk: np.ndarray) -> Trace:
    """`trace` with row i's content ids `lists[i]` at `chunk[i]` tokens each (rows with none: none)."""
    ids, offsets = csr(lists)
    return replace(trace, hash_ids=ids, hash_offsets=offsets,
                   hash_block_tokens=np.where(np.diff(offsets) > 0, chunk, 0).astype(np.int64))
