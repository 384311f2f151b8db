"""Steady decoders: the scheduler's O(events) bookkeeping and its jumps over decode runs.

A running request whose prompt is done decodes exactly one token per step, so its computed
tokens are `current_step + decode_base`; the step after which it finishes sits in a heap.
The steps at which it needs its next block are kept one of two ways:
- the block calendar (the common case: a paged pool, no lookahead slots, no forked sequences):
  a steady decoder needs a block every `block_size` steps, at the steps where
  `step % block_size == -decode_base % block_size`. The calendar holds, per residue, the
  decoders due then, in running order, with their block tables: a step's boundary
  allocations are one bucket, with no per-allocation heap work.
- the boundary heap otherwise (lookahead slots, copy-on-write of blocks shared by forked
  sequences): one event per decoder, its next boundary or copy.
`decode_run_limit` / `advance_decode_run` apply many event-free decode steps at once, with the
same block allocations in the same order as stepping one by one would make them
(tests/core/test_properties.py compares the two).

Models with sliding-window layers:
- under the KV-cache coordinator (vLLM's hybrid manager) a decoder's events are its block
  boundaries (a block for every group) and its window releases, on the boundary heap;
- a decoder's window layers attend min(context, window) tokens: the step's attended context is
  counted in layer-tokens (summed over the layers), affine in the step between the steps at which
  a decoder reaches the window (the crossing heap), where decode runs are cut;
- under chunked local attention a decoder's local layers attend the tokens of its current chunk:
  its crossings are the steps at which it starts a chunk, every `attention_chunk_size` steps;
- while a request waits for blocks, a run stops before the next event (a release may admit it).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from itertools import chain
from operator import attrgetter

from simkv.core.admission_limits import KV_TRANSFER, MAX_LORAS, MAX_NUM_SEQS, NONE, TOKEN_BUDGET
from simkv.core.outputs import DecodeRun
from simkv.core.request import Request, RequestStatus

_seq_of = attrgetter("seq")


class SteadyDecoders:
    """Mixed into Scheduler: uses its queues, its KV-cache manager and its counters."""

    def num_computed_tokens(self, request: Request) -> int:
        """The request's computed tokens before the next step is scheduled."""
        if request.decode_base is not None:
            return self.current_step + request.decode_base
        return request.num_computed_tokens

    # ---- the block calendar --------------------------------------------------------------
    def _calendar_add(self, request: Request, from_step: int) -> None:
        """File a new (or slipped) steady decoder under its boundary residue, in seq order."""
        bs = self.block_size
        blocks = self.kv_cache_manager.req_to_blocks[request.index]
        first = len(blocks) * bs - request.decode_base  # its first boundary step
        # Prefills allocate ceil(tokens / block_size) blocks, so the first boundary comes
        # within one block's worth of steps: the calendar's first visit is that boundary.
        assert from_step <= first < from_step + bs, (request, from_step, first)
        residue = first % bs
        members = self._calendar[residue]
        i = bisect_left(members, request.seq, key=_seq_of)
        members.insert(i, request)
        self._calendar_tables[residue].insert(i, blocks)

    def _calendar_remove(self, request: Request) -> None:
        residue = -request.decode_base % self.block_size
        members = self._calendar[residue]
        i = bisect_left(members, request.seq, key=_seq_of)
        del members[i]
        del self._calendar_tables[residue][i]

    def _calendar_to_heap(self, from_step: int) -> None:
        """At the first forked sequence: copy-on-write events are not periodic. Every steady
        decoder's next boundary moves to the heap, which serves from then on."""
        calendar, self._calendar, self._calendar_tables = self._calendar, None, None
        for members in calendar:
            for request in members:
                self._push_boundary(request, from_step)

    def _due_at(self, step: int) -> list[Request]:
        """Steady decoders that need a block (or a copy) at `step`, in running order."""
        if self._calendar is not None:
            return list(self._calendar[step % self.block_size])
        return self._pop_due(self._boundary_heap, step)

    def _decoder_release_point(self, request: Request, computed: int, step: int) -> int:
        """The computed tokens a steady decoder's window release goes by at `step`: all of them,
        or under async scheduling those whose output was processed: one less than computed
        after a step it decoded in, its last prefill chunk less in its first decode step, all
        after a step a budget left it out of. Its release events come no later than that point
        (they are those of the computed tokens); one that finds nothing to release waits a step."""
        if not self.async_scheduling or self._processed_through >= step - 1:
            return computed  # (nothing in flight)
        if request.stall_step == step - 1:
            return computed
        if request.last_chunk_step == step - 1:
            return computed - request.last_chunk_tokens
        return computed - 1

    def _processed_tokens(self, request: Request, computed: int, step: int) -> int:
        """Async scheduling: a running request's computed tokens less those of its chunk in the
        step before, whose output is not processed yet (vLLM's num_in_flight_tokens). Under
        speculative decoding the request counts its tokens in flight itself (drafts included)."""
        if self._counts_in_flight:
            return max(computed - request.num_in_flight_tokens, 0)
        in_flight = request.last_chunk_step == step - 1 and self._processed_through < step - 1
        return computed - request.last_chunk_tokens if in_flight else computed

    def _decoders_completing(self, step: int, tokens: int, offload=None) -> list[Request]:
        """Steady decoders scheduled at `step` whose known tokens after it complete a chunk of
        `tokens` (a multiple of the block size): KV offloading's decode stores. Known: computed,
        or under async scheduling, for a decoder that ran in the step in flight, one less; with
        `offload`, any chunk it has not offered yet counts (under async scheduling a decoder's
        known tokens may pass a chunk's end while it cannot offer it). In running order."""
        bs = self.block_size
        if self._calendar is not None:  # (due for a block at the step after, or at this one)
            candidates = self._calendar[(step + 1) % bs]
            if self.async_scheduling:
                candidates = sorted(candidates + self._calendar[step % bs], key=_seq_of)
        else:
            candidates = [r for r in self.running if r.decode_base is not None]
        out = []
        for r in candidates:
            if r.decode_from_step > step:
                continue
            known = step + 1 + r.decode_base
            if self.async_scheduling and self._ran_in_flight(r):
                known -= 1
            if offload.has_unoffered(r, known) if offload is not None else known % tokens == 0:
                out.append(r)
        return out

    def _steps_to_completing(self, tokens: int) -> int:
        """Steps from the next one before a steady decoder completes `tokens` tokens' worth (at
        most `tokens`): a decode run stops short of a step with KV offloading's decode stores
        (under async scheduling, of a step at which one completes them, known or not)."""
        step = self.current_step
        for d in range(tokens):
            if self._decoders_completing(step + d, tokens):
                return d
            if self.async_scheduling and self._decoders_completing(step + d - 1, tokens):
                return d
        return tokens

    def _blocks_due(self, due: list[Request], step: int) -> int:
        """Blocks the steady decoders due at `step` take (before any window release)."""
        if not self._window_releases:
            return len(due)
        need = self.kv_cache_manager.decode_block_need
        return sum(need(request, step + request.decode_base, 0) for request in due)

    def _enroll_decoder(self, request: Request, next_step: int) -> None:
        self._prefilling.remove(request)  # small list: prefilling requests only
        request.decode_base = request.num_computed_tokens - next_step
        request.decode_from_step = next_step
        request.epoch += 1
        self._num_decoders += 1
        self._sum_decode_base += request.decode_base
        if self.decoders_by_class is not None:
            self.decoders_by_class[request.class_code] += 1
        chunk = self._window_chunk
        if self._window_context is not None and (chunk or request.num_computed_tokens + 1 < self._window_context[2]):
            # (chunked local attention: every decoder attends its chunk's tokens so far)
            request.window_offset = request.num_computed_tokens // chunk * chunk if chunk else 0
            request.window_below = True
            self._num_below += 1
            self._sum_base_below += request.decode_base - request.window_offset
        self._push_decoder_events(request, next_step)

    def _finish_step_of(self, request: Request) -> int:
        target = min(request.max_tokens + request.num_prompt_tokens - 1, self.max_model_len - 1)
        return target - 1 - request.decode_base

    def _push_decoder_events(self, request: Request, from_step: int) -> None:
        request.decode_last_step = self._finish_step_of(request)
        heapq.heappush(self._finish_heap, (request.decode_last_step, request.seq, request.epoch, request))
        if request.window_below:  # the step from which it attends a whole window (or its next chunk)
            crossing = (request.window_offset + self._window_chunk if self._window_chunk
                        else self._window_context[2] - 1) - request.decode_base
            heapq.heappush(self._crossing_heap, (crossing, request.seq, request.epoch, request))
        if self._calendar is not None:
            self._calendar_add(request, from_step)
            return
        kv = self.kv_cache_manager
        computed = from_step + request.decode_base
        if kv.num_forks and kv.decode_block_need(request, computed, self.num_lookahead_tokens):
            # a forked sequence whose next token goes into a shared partial block: copy first
            heapq.heappush(self._boundary_heap, (from_step, request.seq, request.epoch, request))
        else:
            self._push_boundary(request, from_step)

    def _push_boundary(self, request: Request, from_step: int) -> None:
        """Schedule the step at which the steady decoder needs its next block (or, under the
        KV-cache coordinator, its next window release), if before it ends."""
        if self._window_releases:
            step = self.kv_cache_manager.next_decode_event(request) - request.decode_base
        else:
            held = len(self.kv_cache_manager.req_to_blocks[request.index]) * self.block_size
            if held >= self.max_model_len:
                return
            step = held - self.num_lookahead_tokens - request.decode_base
        if step < from_step:
            step = from_step
        if step <= request.decode_last_step:
            heapq.heappush(self._boundary_heap, (step, request.seq, request.epoch, request))

    def _leave_decoding(self, request: Request, step: int) -> int:
        """Materialise a steady decoder's counters at `step`; returns its computed tokens."""
        computed = step + request.decode_base
        if self._calendar is not None:
            self._calendar_remove(request)
        self._num_decoders -= 1
        self._sum_decode_base -= request.decode_base
        if self.decoders_by_class is not None:
            self.decoders_by_class[request.class_code] -= 1
        if request.window_below:
            request.window_below = False
            self._num_below -= 1
            self._sum_base_below -= request.decode_base - request.window_offset
        request.decode_base = None
        request.epoch += 1
        request.num_computed_tokens = computed
        request.num_output_tokens = computed + 1 - request.num_prompt_tokens
        return computed

    @staticmethod
    def _stall_counts(requests: list[Request]) -> tuple[int, int, int, int]:
        """Requests left unscheduled (by an exhausted budget): the decoders' count and base sum,
        and the same for those of them below the window."""
        num = base_sum = num_below = below_base_sum = 0
        for request in requests:
            if request.decode_base is None:
                continue
            num += 1
            base_sum += request.decode_base
            if request.window_below:
                num_below += 1
                below_base_sum += request.decode_base - request.window_offset
        return num, base_sum, num_below, below_base_sum

    def _refile(self, requests: list[Request], step: int) -> None:
        """The decoders among requests left out by an async schedule() that ran nothing: no step
        passed, so they do not slip; the events of theirs that `step` took are filed again."""
        if self._calendar is not None:  # (the calendar took none)
            return
        for request in requests:
            if request.decode_base is not None:
                request.epoch += 1
                self._push_decoder_events(request, step)

    def _stall(self, requests: list[Request], step: int) -> None:
        """The decoders among requests left unscheduled in `step` slip one step."""
        for request in requests:
            if request.decode_base is None:
                continue
            if self._calendar is not None:
                self._calendar_remove(request)  # it slips to the next residue
            request.prev_stall_step, request.stall_step = request.stall_step, step
            if request.stall_gap_from < 0:  # (its last token: the step before its first missed one)
                request.stall_gap_from = step - 1
            if request.window_below:
                self._sum_base_below -= 1
            request.decode_base -= 1
            self._sum_decode_base -= 1
            request.epoch += 1
            self._push_decoder_events(request, step + 1)

    # ---- sliding-window layers: the attended context -------------------------------------------
    def _settle_crossings(self, step: int) -> None:
        """Decoders that attend a whole window from `step` on stop counting as below it (chunked
        local attention: decoders that start a chunk at `step` attend from there)."""
        heap = self._crossing_heap
        chunk = self._window_chunk
        while heap and heap[0][0] <= step:
            at, seq, epoch, request = heapq.heappop(heap)
            if epoch != request.epoch or not request.window_below:
                continue
            if chunk:
                request.window_offset += chunk
                self._sum_base_below -= chunk
                heapq.heappush(heap, (at + chunk, seq, epoch, request))
            else:
                request.window_below = False
                self._num_below -= 1
                self._sum_base_below -= request.decode_base

    def _next_crossing(self) -> int | None:
        heap = self._crossing_heap
        while heap:
            at, _, epoch, request = heap[0]
            if epoch == request.epoch and request.window_below:
                return at
            heapq.heappop(heap)
        return None

    def _decode_context(self, step: int, num: int, base_sum: int, num_below: int, below_base_sum: int) -> int:
        """Context tokens `num` decoders (bases summing to `base_sum`; `num_below` of them below
        the window, bases `below_base_sum`) attend at `step`: tokens, or with sliding-window
        layers layer-tokens (each layer's attended tokens, summed over the layers)."""
        if self._window_context is None:
            return num * (step + 1) + base_sum
        full_layers, window_layers, window = self._window_context
        return (full_layers * (num * (step + 1) + base_sum)
                + window_layers * (num_below * (step + 1) + below_base_sum + (num - num_below) * window))

    def _capped_context(self, step: int, num: int, num_below: int, below_base_sum: int) -> int:
        """Sparse attention: the tokens `num` decoders' queries attend at `step`, each at most
        top-k (those below it, `num_below` of them, attend all they have)."""
        return num_below * (step + 1) + below_base_sum + (num - num_below) * self._sparse_cap

    def decode_run_capped(self) -> tuple[int, int]:
        """Sparse attention: a decode run's (capped context in its first step, its growth per
        step), as `decode_run_shape` gives the whole context's."""
        self._settle_crossings(self.current_step)
        return (self._capped_context(self.current_step, self._num_decoders, self._num_below, self._sum_base_below),
                self._num_below)

    def _pop_due(self, heap: list[tuple], step: int) -> list[Request]:
        due = []
        while heap and heap[0][0] <= step:
            at, _, epoch, request = heapq.heappop(heap)
            if epoch == request.epoch and request.status == RequestStatus.RUNNING:
                assert at == step, f"missed event of {request} at step {at} (now {step})"
                due.append(request)
        return due

    def decode_run_limit(self) -> int:
        """Number of upcoming steps guaranteed to be plain decode steps (the last one may
        finish requests), or 0 when the next step must be scheduled normally."""
        if (self._prefilling or self._finishing or not self.running or self.detail or self._num_kv_ready
                or self._resuming):  # (a decoder left out of the previous step: its next gap is irregular)
            return 0
        if self._deferred_frees:  # (an aborted request's blocks come back at a step's output)
            return 0
        if self.encoder_cache is not None and self._images_pending():
            return 0
        if self.waiting and (self.prefill_interval > 1 or not self._admission_stuck()):
            return 0  # (prefill cadence: its holds and releases are stepped while requests wait)
        offload = self.offload
        if offload is not None and (offload.num_retrying or offload.has_finished_offers):
            return 0  # (they offer their stores at the next schedule())
        at = self._next_finish_step()
        if at is None:
            return 0
        limit = at - self.current_step + 1
        if offload is not None and not offload.prompt_only:  # (decode stores: a run stops short of a step with any)
            limit = min(limit, self._steps_to_completing(offload.chunk_tokens))
        if self._window_context is not None:  # the slope of the attended context is constant in a run
            self._settle_crossings(self.current_step)
            crossing = self._next_crossing()
            if crossing is not None:
                limit = min(limit, crossing - self.current_step)
        if self._window_releases and self.waiting:  # a window release may let the head in
            event = self._first_live(self._boundary_heap)
            if event is not None:
                limit = min(limit, event - self.current_step)
        return limit

    def _next_finish_step(self) -> int | None:
        """The step in which the next steady decoder samples its last token (None: no decoder)."""
        return self._first_live(self._finish_heap)

    @staticmethod
    def _first_live(heap: list[tuple]) -> int | None:
        """The step of the heap's first event filed for a decoding stint that still runs."""
        while heap:
            at, _, epoch, request = heap[0]
            if epoch == request.epoch and request.status == RequestStatus.RUNNING:
                return at
            heapq.heappop(heap)
        return None

    def _lora_stuck_now(self) -> bool:
        """LoRA: the last schedule passed over every waiting request for want of an adapter slot,
        and neither the waiting queue nor the running adapters changed since."""
        stuck = self._lora_stuck
        return stuck is not None and stuck[0] == len(self.waiting) and stuck[1] == frozenset(
            r.lora_id for r in self.running if r.lora_id)

    def _admission_budget(self) -> int:
        """The token budget a plain decode step leaves the waiting queue."""
        budget = min(self.max_num_scheduled_tokens, self.max_num_batched_tokens)
        if not self.admit_before_running:
            budget -= self._num_decoders
        return budget

    def _lora_deferring(self) -> bool:
        """LoRA: every step of a decode run passes over every waiting request for want of an
        adapter slot (the waiting queue is looked at: a seat and some budget are free)."""
        return (self._lora_stuck_now() and len(self.running) < self.max_num_active
                and self._admission_budget() > 0)

    def _admission_stuck(self) -> int:
        """Whether a plain decode step would admit nothing from the waiting queue: the limit that
        stops it (an ADMISSION_LIMITS code, in the order _schedule_waiting meets them), or 0."""
        budget = self._admission_budget()
        if budget <= 0:
            return TOKEN_BUDGET
        if len(self.running) >= self.max_num_active:
            return MAX_NUM_SEQS
        if self._lora_stuck_now():
            return MAX_LORAS
        marker = self._blocked_marker
        if (marker is not None and marker[0] is self.waiting.peek_request()
                and marker[1] == self.kv_cache_manager.num_frees and marker[2] == budget):
            return marker[3]
        return NONE

    def _run_admission_limit(self) -> int:
        """What keeps the requests waiting during a decode run (its steps admit nothing)."""
        if self.waiting:
            return self._admission_stuck()
        return KV_TRANSFER if self.kv_holding else NONE

    def _images_pending(self) -> bool:
        """Multimodal items: an event a decode run would step over. A running request still holds
        an image (async scheduling: a decoder drops the image that ends its prompt at its first
        decode's output), or the waiting head has images (a decoder's new block may evict the
        head's cached prefix, and the shorter hit may start it at an image it must stop before,
        which passes it over and lets the requests behind it go)."""
        if self.waiting and self.waiting.peek_request().mm_items:
            return True
        return any(r.status == RequestStatus.RUNNING for r in self.encoder_cache.request_inputs)

    def decode_run_shape(self) -> tuple[int, int, int]:
        """(decodes per step, attended context in the first step, its growth per step) of a
        decode run (tokens, or layer-tokens with sliding-window layers: _decode_context)."""
        n = self._num_decoders
        if self._window_context is not None:
            self._settle_crossings(self.current_step)
        context = self._decode_context(self.current_step, n, self._sum_decode_base, self._num_below,
                                       self._sum_base_below)
        if self._window_context is None:
            return n, context, n
        full_layers, window_layers, _ = self._window_context
        return n, context, full_layers * n + window_layers * self._num_below

    def _run_events(self, start: int, end: int, offsets: list[int]) -> int:
        """Apply the boundary (or copy-on-write) events of decode steps [start, end) from the
        heap (lookahead slots, forked sequences; the calendar serves the rest). Allocations happen in (step, running order), exactly as stepping would
        make them. If the pool runs dry at step t, the run ends before t (returned); the
        allocations already made for step t are the ones step t makes first anyway."""
        kv = self.kv_cache_manager
        free_queue = kv.block_pool.free_block_queue
        heap = self._boundary_heap
        block_need, write, push_boundary = kv.decode_block_need, kv.decode_write, self._push_boundary
        lookahead = self.num_lookahead_tokens
        while heap and heap[0][0] < end:
            event = heapq.heappop(heap)
            at, _, epoch, request = event
            if epoch != request.epoch or request.status != RequestStatus.RUNNING:
                continue
            computed = at + request.decode_base
            if block_need(request, computed, lookahead):
                if free_queue.num_free_blocks == 0:
                    heapq.heappush(heap, event)
                    return at
                write(request, computed)
                offsets.append(at - start)
            push_boundary(request, at + 1)
        return end

    def _run_window_events(self, start: int, end: int, counts: list[int]) -> tuple[int, int]:
        """`_run_events` under the KV-cache coordinator: an event releases the blocks that left
        the decoder's window, then, at a block boundary, takes a block for every group. `counts`
        gets each step's net change of blocks in use. Returns the run's end and the net change
        made for that step (which is not part of the run) before the pool ran dry."""
        kv = self.kv_cache_manager
        free_queue = kv.block_pool.free_block_queue
        heap = self._boundary_heap
        release, block_need, write, push_boundary = kv.decode_release, kv.decode_block_need, kv.decode_write, self._push_boundary
        counts += [0] * (end - start)
        while heap and heap[0][0] < end:
            event = heapq.heappop(heap)
            at, _, epoch, request = event
            if epoch != request.epoch or request.status != RequestStatus.RUNNING:
                continue
            computed = at + request.decode_base
            free_before = free_queue.num_free_blocks
            release(request, self._decoder_release_point(request, computed, at))
            need = block_need(request, computed, 0)
            if need > free_queue.num_free_blocks:
                heapq.heappush(heap, event)  # step `at` is scheduled normally: it preempts
                counts[at - start] += free_before - free_queue.num_free_blocks
                early = sum(counts[at - start:])
                del counts[at - start:]
                return at, early
            if need:
                write(request, computed)
            counts[at - start] += free_before - free_queue.num_free_blocks
            push_boundary(request, at + 1)
        return end, 0

    def _run_calendar(self, start: int, end: int, counts: list[int]) -> int:
        """The decode steps [start, end) take their boundary blocks from the calendar: step t
        gives one block to each decoder of bucket t % block_size, in running order. If the
        pool cannot cover step t, the run ends before t (returned); step t is then scheduled
        normally: its first decoders take the blocks left and the next one preempts, as
        stepping one by one does. `counts` gets the allocations of each step."""
        bs = self.block_size
        tables = self._calendar_tables
        first = start % bs
        last = first + end - start
        visits = tables[first:last] if last <= bs else (tables * (last // bs + 1))[first:last]
        counts += map(len, visits)
        need = sum(counts)
        if not need:
            return end
        pool = self.kv_cache_manager.block_pool
        free = pool.free_block_queue.num_free_blocks
        if need > free:
            need = 0
            for i, count in enumerate(counts):
                if need + count > free:
                    break
                need += count
            end = start + i
            del visits[i:], counts[i:]
            if not need:
                return end
        for table, block in zip(chain.from_iterable(visits), pool.get_new_blocks(need)):
            table.append(block)
        return end

    def _take_boundary_blocks(self, requests: list[Request], at: int) -> None:
        """Steady decoders due at step `at` (in running order; the pool has a block for each)
        take the head of the free queue in one pop, and their next boundaries are pushed."""
        kv = self.kv_cache_manager
        if self._window_releases:  # each in turn: its window's release, then its blocks
            if self.offload is not None:
                self.offload.step = at  # (a decode run's step)
            for request in requests:
                computed = at + request.decode_base
                kv.decode_release(request, self._decoder_release_point(request, computed, at))
                if kv.decode_block_need(request, computed, 0):
                    kv.decode_write(request, computed)
                self._push_boundary(request, at + 1)
            return
        blocks = kv.block_pool.get_new_blocks(len(requests))
        if self._calendar is not None:  # `requests` is the bucket; they stay in it
            for table, block in zip(self._calendar_tables[at % self.block_size], blocks):
                table.append(block)
            return
        tables = kv.req_to_blocks
        for request, block in zip(requests, blocks):
            tables[request.index].append(block)
            self._push_boundary(request, at + 1)

    def advance_decode_run(self, num_steps: int, finish: bool = True, after_in_flight: bool = False) -> DecodeRun | None:
        """Apply up to `num_steps` (<= decode_run_limit()) decode steps at once. The run is
        cut before the first step whose block allocations the pool cannot cover (that step
        must be scheduled normally, since it preempts). Returns None if no step can run.
        `finish=False` (async scheduling): requests whose last token the run's last step
        samples stay decoders; the next schedule() retires them. `after_in_flight` (async):
        the step before the run was in flight when its first step would have been scheduled
        (the engine processed that output first, as it changes nothing)."""
        start = self.current_step
        admission_limit = self._run_admission_limit()  # (before the run's finishing requests leave)
        if after_in_flight:
            self._processed_through = start - 2
        end = start + num_steps
        kv = self.kv_cache_manager
        n, first_context, per_step = self.decode_run_shape()
        by_class = list(self.decoders_by_class) if self.decoders_by_class is not None else None
        first_used = kv.block_pool.get_num_used_blocks()
        counts: list[int] = []  # block allocations per step of the run
        early = 0  # allocations made for step `end`, which is not part of the run
        if self._calendar is not None:
            end = self._run_calendar(start, end, counts)
        elif self._window_releases:
            end, early = self._run_window_events(start, end, counts)
        else:
            offsets: list[int] = []
            end = self._run_events(start, end, offsets)
            counts = [0] * max(end - start, 0)
            for offset in offsets:
                if offset < end - start:
                    counts[offset] += 1
                else:
                    early += 1
        if end <= start:
            return None
        if self._lora_deferring():  # (LoRA: each step of the run passes over every waiting request)
            self.num_lora_deferrals += self._lora_stuck[0] * (end - start)
        self.current_step = end
        if self.prefill_interval > 1:  # (plain decode steps: none carries prefill; nothing waits, so
            self._num_executed_steps += end - start  # the run's first step released the cadence)
            self._prefill_capacity_bound = False
        if self.async_scheduling:  # (its last step is in flight when the next is scheduled)
            self._scheduled_through = end - 1
            self._processed_through = max(self._processed_through, end - 2)
        finished: list[Request] = []
        for request in self._pop_due(self._finish_heap, end - 1) if finish else ():
            self._leave_decoding(request, end)
            finished.append(request)
        run = DecodeRun(start, end - start, n, first_context, len(self.running), self.num_waiting(),
                        first_used, counts, finished, num_swapped=self.num_swapped, context_per_step=per_step,
                        admission_limit=admission_limit, decodes_by_class=by_class)
        if finished:
            finished.sort(key=_seq_of)
            run.finished = self._finish(finished, end - 1)
        run.last_num_blocks_used_end = kv.block_pool.get_num_used_blocks() - early
        return run

