"""A step's host-side inputs, built the way vLLM's persistent input batch builds them.

Block tables are the bulk of a step's inputs: 256 decodes at 4k context hold 65,536 block ids.
The scheduler hands over each scheduled request's whole table every step; turning each of those
lists into a numpy row again, request by request, cost more host time than a GPU decode step
takes at large batches (`bench/step_inputs.py`: 10 ms for 256 decodes at 4k context on this
project's CPU host). vLLM's model runner keeps every running request's table in a persistent
array and appends only the blocks a step added. `BlockTableRows` does the same: a request's
table only grows while it runs, except for a copy on write of the block a step writes into, so
each step copies the new tail; the row is dropped when the request is preempted (its blocks were
freed) or finishes, and rebuilt when the list it is handed differs from the row at the written
block's entry or at its last entry.

Decode rows, which are most rows, are gathered without per-token Python work: positions, sequence
lengths and the slot mapping come out of vectorised numpy over the step's table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simkv.core.outputs import SchedulerOutput


def filler_token_id(request, position: int, vocab: int) -> int:
    """The id fed at an output position the runner holds no sampled id for (calibration's
    synthetic steps, for one): deterministic, spread over the vocabulary."""
    return (request.index * 7919 + position) % vocab


@dataclass
class StepBatch:
    """Host-side arrays of one step, before they go to the device."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray  # [num_seqs, longest table]; zeros past each sequence's own blocks
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    samplers: list  # (request, position of the sampled token) per logits row
    max_query_len: int
    max_seq_len: int


class BlockTableRows:
    """Each running request's block table as an int32 array, kept from step to step.

    Keyed by the request object itself, so that two requests never share a row (calibration's
    synthetic requests share an index). `sync` appends what the handed list adds to the row. The
    engine rewrites a running request's table in two ways only: preemption (`prepare_step` drops
    the row before it reads the new list) and copy-on-write of a shared block when the step
    writes into it, which is the block of the step's first new token: with lookahead slots not
    necessarily the last. So a list that is shorter, or that differs from the row at the written
    block's entry or at the row's last entry, replaces the row; other entries are trusted, not
    compared (tests/gpu_backend/test_input_batch.py checks every step of replays with each
    preemption mode, forks, lookahead slots and prefix hits against a full rebuild).
    """

    def __init__(self) -> None:
        # request -> (int32 array with spare capacity, number of valid ids, the last valid id)
        self._rows: dict = {}

    def __len__(self) -> int:
        return len(self._rows)

    def sync(self, request, block_ids: list[int], written: int) -> np.ndarray:
        """The request's table, equal to `block_ids` (a view into the kept row); `written` is the
        table entry of the block that receives the step's first new token."""
        n = len(block_ids)
        entry = self._rows.get(request)
        if entry is None:
            row, have = np.empty(max(n + n // 2, 16), dtype=np.int32), 0
        else:
            row, have, last = entry
            if written < have - 1 and row[written] != block_ids[written]:  # (have - 1: `last` below)
                have = 0  # the written block was copied on write: take the whole list again
            elif have == n and n and last == block_ids[n - 1]:
                return row[:n]  # no new block this step (most decodes)
            elif have > n or (have and last != block_ids[have - 1]):
                have = 0  # not an extension of the row: take the whole list again
        if n > have:
            if n > len(row):
                grown = np.empty(max(2 * len(row), n), dtype=np.int32)
                grown[:have] = row[:have]
                row = grown
            row[have:n] = block_ids[have:n]
        self._rows[request] = (row, n, block_ids[n - 1] if n else -1)
        return row[:n]

    def drop(self, request) -> None:
        self._rows.pop(request, None)


def prepare_step(runner, rows: BlockTableRows, output: SchedulerOutput) -> StepBatch:
    """The arrays of one step: prefill chunks first, then decodes, one query run per request.

    `runner` gives token content (`token_ids`, `prompt_token_ids`, `outputs`, `vocab`) and the
    block size; `rows` keeps the block tables between steps."""
    for request in output.preempted:  # their blocks were freed: the rows are stale
        rows.drop(request)
    bs = runner.block_size
    chunks, decodes = output.chunks, output.decodes or ()
    views: list[np.ndarray] = []
    ids, poss, slots, lens, qsl, logits_idx, samplers = [], [], [], [], [0], [], []
    t = 0
    for c in chunks:
        request, computed, new = c.request, c.num_computed_tokens, c.num_new_tokens
        if c.block_ids is None:
            raise ValueError("the GPU backend needs block ids: run the scheduler with detail=True")
        table = rows.sync(request, c.block_ids, computed // bs)
        views.append(table)
        end = computed + new
        pos = np.arange(computed, end, dtype=np.int64)
        ids.append(runner.token_ids(request, computed, end))
        poss.append(pos)
        slots.append(table[pos // bs].astype(np.int64) * bs + pos % bs)
        lens.append(end)
        t += new
        qsl.append(t)
        # A chunk that reaches the end of the request's known tokens samples the next one.
        if end >= request.num_prompt_tokens + request.num_output_tokens:
            logits_idx.append(t - 1)
            samplers.append((request, end))
    num_chunks = len(chunks)
    num_decodes = len(decodes)
    if num_decodes:
        outputs, vocab, sync = runner.outputs, runner.vocab, rows.sync
        dec_pos, dec_ids = [], []
        for d in decodes:
            request, p = d.request, d.num_computed_tokens
            if d.block_ids is None:
                raise ValueError("the GPU backend needs block ids: run the scheduler with detail=True")
            views.append(sync(request, d.block_ids, p // bs))
            dec_pos.append(p)
            j = p - request.num_prompt_tokens
            if j < 0:
                dec_ids.append(int(runner.prompt_token_ids(request, p, p + 1)[0]))
            else:
                outs = outputs.get(request.index)
                # the sampled token, or the runner's filler for a position never sampled here
                dec_ids.append(outs[j] if outs is not None and j < len(outs) else filler_token_id(request, p, vocab))
            samplers.append((request, p + 1))
        dec_pos = np.asarray(dec_pos, dtype=np.int64)
        ids.append(np.asarray(dec_ids, dtype=np.int64))
        poss.append(dec_pos)
    num_seqs = num_chunks + num_decodes
    lengths = np.fromiter(map(len, views), dtype=np.int64, count=num_seqs)
    width = int(lengths.max()) if num_seqs and lengths.max() > 0 else 1
    block_tables = np.zeros((num_seqs, width), dtype=np.int32)
    if num_seqs:  # row-major mask: fills row by row, in the order of the concatenated tables
        block_tables[np.arange(width) < lengths[:, None]] = np.concatenate(views)
    if num_decodes:
        rows_d = np.arange(num_chunks, num_seqs)
        slots.append(block_tables[rows_d, dec_pos // bs].astype(np.int64) * bs + dec_pos % bs)
        first = t
        t += num_decodes
        logits_idx.extend(range(first, t))
        qsl.extend(range(first + 1, t + 1))
    seq_lens = np.asarray(lens, dtype=np.int32)
    if num_decodes:
        seq_lens = np.concatenate([seq_lens, (dec_pos + 1).astype(np.int32)])
    q_lens = np.diff(np.asarray(qsl))
    return StepBatch(
        input_ids=np.concatenate(ids) if ids else np.zeros(0, np.int64),
        positions=np.concatenate(poss) if poss else np.zeros(0, np.int64),
        slot_mapping=np.concatenate(slots) if slots else np.zeros(0, np.int64),
        block_tables=block_tables if num_seqs else np.zeros((0, 1), np.int32),
        seq_lens=seq_lens, query_start_loc=np.asarray(qsl, dtype=np.int32),
        logits_indices=np.asarray(logits_idx, dtype=np.int64), samplers=samplers,
        max_query_len=int(q_lens.max()) if q_lens.size else 0,
        max_seq_len=int(seq_lens.max()) if seq_lens.size else 0)
