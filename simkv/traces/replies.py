"""``simkv trace transform --link-replies``: describe replies that later prompts repeat.

Traces list the content of prompts only, yet in a chat or an agent loop the next request's
prompt repeats the previous reply, and an engine that cached the reply's blocks (vLLM hashes
output tokens too) serves them from its prefix cache. This edit finds those pairs in the hash
lists and lengthens a request's list over its reply (docs/traces.md: a list longer than its
prompt needs goes on over the reply).

Row j *continues* row i when j arrives later (in the same session, where the trace has
`session_id`), j's list starts with all of i's full-block ids
(the ids of i's first floor(P_i / H) blocks, at least one) and goes on past them, and j's prompt
holds i's prompt and reply (P_j >= P_i + O_i). Each row continues at most one row (the one whose
match reaches deepest, the latest among equals) and is continued at most once (by the first
such row). Row i's list becomes j's first ceil((P_i + O_i) / H) ids, where that is longer than
i's prompt needs (a reply that ends inside the prompt's last hash block stays unique).

This is an inference: a client that edits the reply before sending it back (reasoning removed,
say), or two conversations whose whole prompts agree, defeat it. The count of linked rows is
reported so that it can be checked against what the trace is.

A trace without `session_id` also gets one from the links: a row that continues another could
not have been sent before that reply existed, so each chain of linked rows becomes a session
(`chain-<request_id of its first row>`; rows in no chain get none), which a replay paces
(simkv/replay/sessions.py; think times 0: a turn waits for its previous reply and no longer).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from simkv.traces._columns import offsets_of
from simkv.traces.errors import TraceError
from simkv.traces.reuse import _prefix_nodes, describes_reply
from simkv.traces.schema import Trace


def link_replies(trace: Trace) -> tuple[Trace, int]:
    """The trace with continued rows' lists lengthened over their replies, and how many were."""
    if trace.hash_ids is None or trace.hash_offsets is None or trace.hash_block_tokens is None:
        raise TraceError(f"{trace.source}: --link-replies needs block_hashes (the trace has none)")
    nodes = _prefix_nodes(trace).tolist()
    offsets = trace.hash_offsets.tolist()
    prompt = trace.prompt_tokens.tolist()
    output = trace.output_tokens.tolist()
    block = trace.hash_block_tokens.tolist()
    sessions = trace.session_id.tolist() if trace.session_id is not None else [None] * len(trace)
    continued_by = [-1] * len(trace)
    # (session, node of a row's last full-block id) -> rows not yet continued
    waiting: dict[tuple[str | None, int], list[int]] = {}
    for j in range(len(trace)):
        start, stop = offsets[j], offsets[j + 1]
        session = sessions[j]
        for level in range(stop - start - 2, -1, -1):  # deepest first; j must go on past the match
            rows = waiting.get((session, nodes[start + level]))
            if rows and prompt[j] >= prompt[rows[-1]] + output[rows[-1]]:
                continued_by[rows.pop()] = j
                break
        full = min(prompt[j] // block[j], stop - start) if block[j] else 0
        if full and stop - start <= -(-prompt[j] // block[j]):  # (a list that describes no reply yet)
            waiting.setdefault((session, nodes[start + full - 1]), []).append(j)
    lengths = np.diff(trace.hash_offsets)
    new_lengths = lengths.copy()
    linked = 0
    for i, j in enumerate(continued_by):
        if j < 0:
            continue
        reach = min(int(lengths[j]), -(-(prompt[i] + output[i]) // block[i]))
        if describes_reply(reach * block[i], prompt[i], block[i]):
            new_lengths[i] = reach
            continued_by[i] = j
            linked += 1
        else:
            continued_by[i] = -1
    if not linked:
        return trace, 0
    source_rows = np.where(np.array(continued_by) >= 0, continued_by, np.arange(len(trace)))
    starts = trace.hash_offsets[source_rows]
    new_offsets = offsets_of(new_lengths)
    positions = np.repeat(starts, new_lengths) + (np.arange(int(new_offsets[-1])) - np.repeat(new_offsets[:-1], new_lengths))
    trace = replace(trace, hash_ids=trace.hash_ids[positions], hash_offsets=new_offsets.astype(np.int64))
    if trace.session_id is None:
        trace = replace(trace, session_id=_chains(continued_by, trace.request_id))
    return trace, linked


def _chains(continued_by: list[int], request_id: np.ndarray) -> np.ndarray:
    """A session id per chain of linked rows (rows come after the rows they continue)."""
    session = np.full(len(continued_by), None, dtype=object)
    for i, j in enumerate(continued_by):
        if j >= 0:
            if session[i] is None:
                session[i] = f"chain-{request_id[i]}"
            session[j] = session[i]
    return session
