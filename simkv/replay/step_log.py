"""Per-step and per-request records of a replay, kept as numpy columns."""

from __future__ import annotations

from array import array
from bisect import bisect_right
from itertools import chain
from operator import itemgetter

import numpy as np

from simkv.clock import TICKS_PER_SECOND, run_ticks, steps_to_reach
from simkv.core.outputs import DecodeRun, SchedulerOutput
from simkv.core.request import Request

STEP_COLUMNS = ("step", "start_time_s", "duration_s", "num_running", "num_waiting",
                "num_prefill_tokens", "num_decode_tokens", "decode_context_tokens", "num_blocks_used",
                "num_blocks_used_end", "num_preemptions", "prefix_query_tokens", "prefix_hit_tokens", "num_finished",
                "num_swapped", "num_swap_blocks", "admission_limit")
_FLOAT_COLUMNS = {"start_time_s", "duration_s"}
SPEC_COLUMNS = ("num_draft_tokens", "num_accepted_tokens")  # steps and requests, under speculative decoding only
ENCODER_COLUMN = "num_encoder_embeds"  # steps, on a multimodal replay only: the embeddings the encoder computed


# One tuple per segment: its first step, its length, blocks used at its start and at its end,
# its timing (start tick; step j lasts c0 + c1 * j ticks before step `cross`, d0 + d1 * j from
# it on: simkv.clock.run_shape), the decode context step j attends (k0 + k1 * j), then the per-step
# values (counts that happen once per segment sit on its first or last row).
_ROW_COLUMNS = ("first_step", "length", "blocks", "blocks_end", "start_tick", "c0", "c1", "cross", "d0", "d1",
                "k0", "k1", "num_running", "num_waiting", "num_prefill_tokens", "num_decode_tokens", "num_preemptions",
                "prefix_query_tokens", "prefix_hit_tokens", "num_finished", "num_swapped", "num_swap_blocks",
                "admission_limit")


class StepLog:
    """Steps recorded as segments: a single step, or a decode run of k identical steps.

    Per segment only scalars are kept (plus block allocations per step); per-step
    columns, times included, are expanded with numpy when asked for.
    """

    def __init__(self, speculative: bool = False, multimodal: bool = False) -> None:
        self._rows: list[tuple] = []  # per segment: _ROW_COLUMNS
        # Multimodal items: (step row, embeddings encoded) of the steps that encoded some
        self._encoded: list[tuple[int, int]] | None = [] if multimodal else None
        # Speculative decoding (no decode runs then): per step, drafts verified and accepted.
        self._spec: array | None = array("q") if speculative else None
        self._alloc_counts: list[int] = []  # per step: blocks allocated in runs (0 in single steps)
        self.num_steps = 0
        self._columns: dict[str, np.ndarray] | None = None
        # Request classes (track_classes): their names, and per segment each one's token gaps per step
        self.class_names: tuple[str, ...] = ()
        self._class_rows: list[tuple[int, ...]] | None = None
        self._gauge_cursor = (0, 0)  # (gauges_before: a segment, the index of its first step)

    def track_classes(self, names: tuple[str, ...]) -> None:
        """Keep each step's token gaps per request class (the scheduler's, numbered as `names`)."""
        self.class_names = tuple(names)
        self._class_rows = []

    def class_decode_tokens(self) -> np.ndarray:
        """Per step (rows) and class (columns): the token gaps it closes, as `num_decode_tokens`
        counts them for all; their row sums are that column."""
        width = len(self.class_names)
        rows = np.asarray(self._class_rows or [], dtype=np.int64).reshape(-1, width)
        lengths = np.fromiter((row[1] for row in self._rows), dtype=np.int64, count=len(self._rows))
        return np.repeat(rows, lengths, axis=0)

    def add_step(self, out: SchedulerOutput, start: int, duration: int) -> None:
        """One step, from tick `start`, lasting `duration` ticks. Its preemptions include those of
        schedule() calls that ran nothing before it (`out.earlier_preemptions`)."""
        self._rows.append((out.step, 1, out.num_blocks_used, out.num_blocks_used_end, start, duration, 0, 1, duration, 0,
                           out.decode_context_tokens, 0, out.num_running, out.num_waiting, out.num_prefill_tokens, out.num_decode_tokens,
                           len(out.preempted) + out.earlier_preemptions, out.prefix_query_tokens, out.prefix_hit_tokens, len(out.finished),
                           out.num_swapped, out.num_swap_out_blocks + out.num_swap_in_blocks, out.admission_limit))
        self._columns = None
        self._alloc_counts.append(0)
        if self._class_rows is not None:
            decodes, emitted = out.decodes_by_class, out.spec_emissions_by_class
            if decodes is None:
                decodes = [0] * len(self.class_names)
            self._class_rows.append(tuple(decodes) if emitted is None else tuple(map(int.__add__, decodes, emitted)))
        if self._encoded is not None and out.encoder_item_embeds:
            self._encoded.append((self.num_steps, out.num_encoder_embeds))
        self.num_steps += 1
        if self._spec is not None:
            self._spec.extend((out.num_draft_tokens, out.num_accepted_tokens))

    def add_run(self, run: DecodeRun, start: int, shape: tuple[int, int, int, int, int]) -> None:
        """A decode run from tick `start`, its step durations in `shape` (simkv.clock.run_shape);
        `run.earlier_preemptions` count on its first step."""
        self._rows.append((run.start_step, run.num_steps, run.first_num_blocks_used, run.last_num_blocks_used_end,
                           start, *shape, run.first_context_tokens, run.context_per_step, run.num_running, run.num_waiting, 0, run.num_decodes, run.earlier_preemptions, 0, 0,
                           len(run.finished), run.num_swapped, 0, run.admission_limit))
        self._columns = None
        self._alloc_counts += run.allocation_counts
        if self._class_rows is not None:
            self._class_rows.append(tuple(run.decodes_by_class))
        self.num_steps += run.num_steps

    def gauges_before(self, tick: int) -> tuple[int, int, int]:
        """(running, waiting, blocks used) after the last step that ended strictly before `tick`,
        as vLLM's engine reports them at a step's end (`num_requests_running`, `num_requests_waiting`,
        the blocks behind `kv_cache_usage_perc`): (0, 0, 0) before the first. Asked at ticks that
        never decrease (an autoscaler's decisions): a cursor skips the segments behind it."""
        rows = self._rows
        seg, first = self._gauge_cursor
        while seg + 1 < len(rows) and rows[seg + 1][4] + _segment_ticks(rows[seg + 1], 1) < tick:  # (one ended)
            first += rows[seg][1]
            seg += 1
        self._gauge_cursor = (seg, first)
        if not rows:
            return 0, 0, 0
        row = rows[seg]
        length, start = row[1], row[4]
        done = length if start + _segment_ticks(row, length) < tick else _steps_before(row, tick - start)
        if done == length:  # (the whole segment: its finished requests released)
            return row[12] - row[19], row[13], row[3]
        if done == 0:  # (the first segment, not yet through its first step)
            return 0, 0, 0
        return row[12], row[13], row[2] + sum(self._alloc_counts[first:first + done])

    def ended_steps(self, cursor: tuple[int, int], tick: int) -> tuple[list[tuple[int, int, int, int]], tuple[int, int]]:
        """The steps after `cursor` (a segment, and how many of its steps were read) that ended
        strictly before `tick`, in order: (step, end tick, ticks, num_decode_tokens) each; and
        the cursor after them."""
        rows = self._rows
        seg, done = cursor
        out = []
        while seg < len(rows):
            row = rows[seg]
            start, length = row[4], row[1]
            ended = length if start + _segment_ticks(row, length) < tick else _steps_before(row, tick - start)
            before = _segment_ticks(row, done)
            for j in range(done, ended):
                after = _segment_ticks(row, j + 1)
                out.append((row[0] + j, start + after, after - before, row[15]))
                before = after
            if ended < length:
                return out, (seg, ended)
            seg, done = seg + 1, 0
        return out, (seg, done)

    def end_tick(self, step: int) -> int | None:
        """When step number `step` ended (None: not logged yet)."""
        rows = self._rows
        seg = bisect_right(rows, step, key=itemgetter(0)) - 1
        if seg < 0 or step >= rows[seg][0] + rows[seg][1]:
            return None
        row = rows[seg]
        return row[4] + _segment_ticks(row, step - row[0] + 1)

    def columns(self) -> dict[str, np.ndarray]:
        if self._columns is not None:
            return self._columns
        width = len(_ROW_COLUMNS)
        rows = np.fromiter(chain.from_iterable(self._rows), dtype=np.int64,
                           count=len(self._rows) * width).reshape(-1, width)
        seg = dict(zip(_ROW_COLUMNS, rows.T))
        lengths = seg["length"]
        n = int(lengths.sum())
        seg_start_row = np.cumsum(lengths) - lengths
        within = np.arange(n, dtype=np.int64) - np.repeat(seg_start_row, lengths)
        out: dict[str, np.ndarray] = {
            "step": np.repeat(seg["first_step"], lengths) + within}
        second = within >= np.repeat(seg["cross"], lengths)
        ticks = np.where(second, np.repeat(seg["d0"], lengths) + np.repeat(seg["d1"], lengths) * within,
                         np.repeat(seg["c0"], lengths) + np.repeat(seg["c1"], lengths) * within)
        before = np.cumsum(ticks) - ticks  # ticks of all earlier steps
        since_seg_start = before - np.repeat(np.append(before, 0)[seg_start_row], lengths)
        out["start_time_s"] = (np.repeat(seg["start_tick"], lengths) + since_seg_start) / TICKS_PER_SECOND
        out["duration_s"] = ticks / TICKS_PER_SECOND
        out["decode_context_tokens"] = np.repeat(seg["k0"], lengths) + np.repeat(seg["k1"], lengths) * within
        for c in ("num_running", "num_waiting", "num_prefill_tokens", "num_decode_tokens", "num_swapped", "admission_limit"):
            out[c] = np.repeat(seg[c], lengths)
        allocs = np.cumsum(np.asarray(self._alloc_counts, dtype=np.int64))
        before = np.concatenate(([0], allocs))[np.repeat(seg_start_row, lengths)]
        out["num_blocks_used"] = np.repeat(seg["blocks"], lengths) + allocs - before
        last_row = np.zeros(n, dtype=bool)
        if n:
            last_row[seg_start_row + lengths - 1] = True
        first_row = np.zeros(n, dtype=bool)
        first_row[seg_start_row[lengths > 0]] = True
        for c in ("num_preemptions", "prefix_query_tokens", "prefix_hit_tokens", "num_swap_blocks"):
            col = np.zeros(n, dtype=np.int64)
            col[first_row] = seg[c][lengths > 0]
            out[c] = col
        used_end = out["num_blocks_used"].copy()
        used_end[last_row] = seg["blocks_end"][lengths > 0]
        out["num_blocks_used_end"] = used_end
        finished = np.zeros(n, dtype=np.int64)
        finished[last_row] = seg["num_finished"][lengths > 0]
        out["num_finished"] = finished
        self._columns = {c: out[c] for c in STEP_COLUMNS}
        if self._spec is not None:
            pairs = np.asarray(self._spec, dtype=np.int64).reshape(-1, 2)
            for j, c in enumerate(SPEC_COLUMNS):
                self._columns[c] = pairs[:, j]
        if self._encoded is not None:
            col = np.zeros(n, dtype=np.int64)
            if self._encoded:
                rows_at, embeds = np.asarray(self._encoded, dtype=np.int64).T
                col[rows_at] = embeds
            self._columns[ENCODER_COLUMN] = col
        return self._columns


def _segment_ticks(row: tuple, num_steps: int) -> int:
    """The ticks of a segment's first `num_steps` steps."""
    return run_ticks(row[5:10], num_steps)


def _steps_before(row: tuple, ticks: int) -> int:
    """How many of a segment's steps end strictly within its first `ticks` ticks."""
    if ticks <= 0:
        return 0
    reached = steps_to_reach(row[5:10], ticks, row[1])
    return reached - 1 if _segment_ticks(row, reached) >= ticks else reached


REQUEST_INT_COLUMNS = ("first_scheduled_step", "first_token_step", "finish_step", "num_output_tokens",
                       "num_computed_tokens", "prefix_hit_tokens", "total_prefix_hit_tokens", "num_preemptions")


class RequestLog:
    """One slot per trace row, filled when the request finishes (or is rejected). Finished
    requests are kept as a flat int64 array (9 values each) until the columns are asked for."""

    STATUS_NAMES = ("unfinished", "finished", "rejected", "timed_out", "abandoned", "not_sent", "failed")

    def __init__(self, num_requests: int, speculative: bool = False) -> None:
        self.num_requests = num_requests
        self._finished = array("q")  # per finished request: index, *REQUEST_INT_COLUMNS
        self._spec: array | None = array("q") if speculative else None  # per finished request: drafts, accepted
        self._rejected: list[int] = []
        self._timed_out: list[int] = []  # rows whose clients gave up on their last attempt
        self._abandoned: list[int] = []  # turns never sent: an earlier turn of their session timed out
        self._failed: list[int] = []  # rows whose last attempt was lost with its replica (simkv/replay/failures.py)
        self.last_abort_s = 0.0  # when the engine last took a client's abort (or a P/D proxy dropped one)
        # rows fanned out over data-parallel ranks: when the last sequence finished (perhaps on
        # another rank, whose steps this log does not hold)
        self.finish_times_s: dict[int, float] = {}
        self.member_hit_tokens = 0  # prefix-hit tokens of fanned-out rows' later members (their group's prompt)
        self._columns: tuple[np.ndarray, dict[str, np.ndarray]] | None = None

    def finish(self, request: Request) -> None:
        """A row's request completed; a fanned-out one (parallel sampling) with its members' prefix
        hits, preemptions and drafts added to its own (its steps and computed tokens are its own)."""
        hits, total_hits, preemptions = (request.num_prefix_hit_tokens, request.num_total_prefix_hit_tokens,
                                         request.num_preemptions)
        drafts, accepted = request.num_draft_tokens, request.num_accepted_tokens
        for member in request.members:
            hits += member.num_prefix_hit_tokens
            total_hits += member.num_total_prefix_hit_tokens
            preemptions += member.num_preemptions
            drafts += member.num_draft_tokens
            accepted += member.num_accepted_tokens
        self.member_hit_tokens += hits - request.num_prefix_hit_tokens
        self._finished.extend((
            request.index, request.first_scheduled_step, request.first_token_step, request.finish_step,
            request.group_output_tokens,  # all sequences of the request
            request.num_computed_tokens, hits, total_hits, preemptions))
        if self._spec is not None:
            self._spec.extend((drafts, accepted))
        self._columns = None

    def reject(self, index: int) -> None:
        self._rejected.append(index)
        self._columns = None

    def time_out(self, index: int) -> None:
        self._timed_out.append(index)
        self._columns = None

    def abandon(self, index: int) -> None:
        self._abandoned.append(index)
        self._columns = None

    def fail(self, index: int) -> None:
        self._failed.append(index)
        self._columns = None

    @property
    def timed_out_rows(self) -> np.ndarray:
        return np.asarray(self._timed_out, dtype=np.int64)

    @property
    def status(self) -> np.ndarray:
        """Per trace row: 0 unfinished, 1 finished, 2 rejected, 3 timed out, 4 abandoned, 6 failed
        (STATUS_NAMES; 5, not sent, is the pacing's to say: `mark_not_sent`)."""
        return self._build()[0]

    @property
    def ints(self) -> dict[str, np.ndarray]:
        """Per trace row, the REQUEST_INT_COLUMNS of finished requests (-1 elsewhere)."""
        return self._build()[1]

    def _build(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if self._columns is None:
            n = self.num_requests
            status = np.zeros(n, dtype=np.int8)
            status[np.asarray(self._rejected, dtype=np.int64)] = 2
            status[np.asarray(self._timed_out, dtype=np.int64)] = 3
            status[np.asarray(self._abandoned, dtype=np.int64)] = 4
            status[np.asarray(self._failed, dtype=np.int64)] = 6
            ints = {c: np.full(n, -1, dtype=np.int64) for c in REQUEST_INT_COLUMNS}
            rows = np.array(self._finished, dtype=np.int64).reshape(-1, len(REQUEST_INT_COLUMNS) + 1)
            status[rows[:, 0]] = 1
            for j, c in enumerate(REQUEST_INT_COLUMNS, start=1):
                ints[c][rows[:, 0]] = rows[:, j]
            if self._spec is not None:
                pairs = np.asarray(self._spec, dtype=np.int64).reshape(-1, 2)
                for j, c in enumerate(SPEC_COLUMNS):
                    ints[c] = np.full(n, -1, dtype=np.int64)
                    ints[c][rows[:, 0]] = pairs[:, j]
            self._columns = (status, ints)
        return self._columns
