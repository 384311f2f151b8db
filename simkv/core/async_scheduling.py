"""Async scheduling (vLLM's `--async-scheduling`, its serving default): the engine schedules
step K+1 while step K runs, before K's sampled tokens are processed.

The caller (simkv/replay/engine.py) then calls `schedule()` for K+1 before
`update_from_output(K)`. What changes, as in vLLM 0.33's AsyncScheduler:
- a chunk's tokens count as computed when it is scheduled, and a request whose prompt ends in
  step K decodes in K+1 already (vLLM: an output placeholder); its token is in flight;
- a request whose last token is sampled in step K is left out of step K+1 but keeps its seat
  (max_num_seqs) and its blocks until K's output is processed: finished requests free their
  blocks one step later. It can still be chosen as a preemption victim; it then loses its
  blocks at once and finishes all the same, its last token being in flight;
- a preempted request's in-flight token is still delivered to it (vLLM: stale output);
- the KV of a decode token is cached when its step's output is processed, so a decoder
  preempted before that finds one token less of its own on resume (a block less when that
  token ended a block); one that no step in flight ran (a budget left it out, or the engine
  processed that step's output first) keeps all of them.
The scheduler knows the latest step it scheduled and the latest whose output was processed
(steps that ran tokens: a schedule() that runs nothing is none).
Decode runs (steady_decoders.py) still apply from a state with nothing pending; requests whose
last token a run's last step samples stay decoders until the next schedule() retires them
(ReplayEngine._plan_async_run, _close_async_run).
"""

from __future__ import annotations

from operator import attrgetter

from simkv.core.request import Request, RequestStatus

_seq_of = attrgetter("seq")


class AsyncScheduling:
    """Mixed into Scheduler: the steps of async scheduling that differ from the synchronous ones."""

    def token_delivered(self, step: int) -> bool:
        """Whether a token sampled in `step` (-1: none yet) has reached its client: its step's
        output was processed (async scheduling counts a token when its step is scheduled)."""
        return 0 <= step and (not self.overlapped or step <= self._processed_through)

    def _ran_in_flight(self, request: Request) -> bool:
        """Whether the latest scheduled step, if its output is not processed yet, runs `request`;
        under pipeline parallelism (several steps in flight, decodes are chunks) whether any
        unprocessed step does (vLLM's last_sched_seq > processed_step_seq)."""
        if self.pipeline_parallel_size > 1:
            return request.last_sched_step > self._processed_through
        step = self._scheduled_through
        return step > self._processed_through and self._ran_in(request, step)

    @staticmethod
    def _ran_in(request: Request, step: int) -> bool:
        """Whether `step` (one of the last two scheduled) ran `request`."""
        if request.last_sched_step == step:  # a chunk of it
            return True
        if request.decode_base is not None:  # a steady decoder: every step but the stalled ones
            return request.decode_from_step <= step and step != request.stall_step and step != request.prev_stall_step
        return request.is_finishing and request.decode_last_step == step  # (its last token's step)

    def _ran_unprocessed(self, request: Request) -> bool:
        """Whether a step whose output is not processed yet ran `request` (vLLM's
        last_sched_seq > processed_step_seq): the one in flight, or, when an abort comes
        before a step's output, that step too."""
        if self._ran_in_flight(request):
            return True
        if self.pipeline_parallel_size > 1:  # (every unprocessed step counted above)
            return False
        step = self._scheduled_through - 1  # (the step before the latest, if unprocessed)
        return step > self._processed_through and self._ran_in(request, step)

    def _unprocessed_work(self, request: Request) -> tuple[int, int]:
        """(tokens scheduled, tokens sampled) for `request` by steps whose output is not processed
        yet: vLLM's num_in_flight_tokens, and the output tokens counted here that vLLM does not
        know yet. Its chunks' tokens (the last two are kept), a decoder's one a step; a step
        samples for a decoder, and for a prompt at its end."""
        tokens = samples = 0
        for step in range(self._processed_through + 1, self._scheduled_through + 1):
            if request.last_chunk_step == step:
                tokens += request.last_chunk_tokens
            elif request.prev_chunk_step == step:
                tokens += request.prev_chunk_tokens
            elif self._ran_in(request, step):
                tokens += 1
            else:
                continue
            if request.decode_base is not None or request.is_finishing or request.first_token_step == step:
                samples += 1
        return tokens, samples

    def output_processed(self, step: int) -> None:
        """`step`'s output is being processed; first thing (as in vLLM's update_from_output),
        the block frees deferred until then reach the pool (P/D: core/remote_kv.py)."""
        if step <= self._processed_through:
            return
        self._processed_through = step
        if self._deferred_frees:
            self._drain_deferred_frees(step)

    def settle_run_step(self) -> bool:
        """After a decode run without finishes its last step counts as in flight (as it would,
        stepping); an engine with nothing else to wait for processes it now. False if no step
        is in flight."""
        if self._scheduled_through <= self._processed_through:
            return False
        self.output_processed(self._scheduled_through)
        return True

    def _retire_finished_decoders(self, step: int) -> None:
        """Before scheduling `step`: decoders whose last token was sampled in `step - 1` stop
        decoding; they wait, holding their blocks, for that step's output."""
        for request in self._pop_due(self._finish_heap, step - 1):
            self._leave_decoding(request, step)
            self._mark_finishing(request, step - 1)

    def _mark_finishing(self, request: Request, last_step: int) -> None:
        request.is_finishing = True
        request.decode_last_step = last_step
        self._finishing.append(request)

    def _advance_scheduled_chunks(self, chunks, step: int) -> None:
        """After scheduling `step`: its chunks count as computed now; a chunk that ends its
        prompt samples a token in `step`, and its request decodes from `step + 1` (or, if that
        token is its last, waits for the step's output to finish)."""
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.num_computed_tokens + chunk.num_new_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue
            for sequence in self._sample_after_prefill(request, step):
                self._prefilling.remove(sequence)
                sequence.decode_from_step = step + 1  # (it would have decoded from then on)
                self._mark_finishing(sequence, step)

    def finish_due(self, step: int) -> bool:
        """Whether some decoder samples its last token in `step` (a decode run's last step)."""
        at = self._next_finish_step()
        return at is not None and at <= step

    def _finish_in_flight(self, step: int) -> list[Request]:
        """`step`'s output is processed: the requests whose last token it sampled finish."""
        done = [r for r in self._finishing if r.decode_last_step <= step]
        if not done:
            return []
        self._finishing = [r for r in self._finishing if r.decode_last_step > step]
        for request in done:
            request.is_finishing = False
        done.sort(key=_seq_of)
        return done

    def _running_finishing(self) -> list[Request]:
        return [r for r in self._finishing if r.status == RequestStatus.RUNNING]

    def _num_preempted_finishing(self) -> int:
        """Preempted while their last token was in flight: vLLM keeps them in its waiting
        queue until that token arrives (and they finish)."""
        return sum(1 for r in self._finishing if r.status == RequestStatus.PREEMPTED)

    def _async_abort_extent(self, request: Request) -> tuple[int, int]:
        """A running request aborted (its client left) after a step ended and before its output
        is processed, the next step in flight: its computed tokens (those scheduled count) and
        how many of them have their KV cached (as for a preemption victim at the next schedule)."""
        if self._counts_in_flight:  # (speculative decoding: every request runs chunks; what is cached is counted)
            if not request.is_finishing:
                self._prefilling.remove(request)
            return request.num_computed_tokens, self._spec_async_preempt(request)
        step = self.current_step  # (the next step to schedule)
        in_flight = self._ran_in_flight(request)  # (before it leaves decoding)
        if request.decode_base is not None:
            computed = self._leave_decoding(request, step)
        elif request.is_finishing:
            computed = request.num_computed_tokens
        else:
            self._prefilling.remove(request)
            return request.num_computed_tokens, request.num_computed_tokens
        return computed, self._async_cache_end(request, computed, 0, step, in_flight)

    def _async_cache_end(self, request: Request, computed: int, scheduled_tokens: int, step: int,
                         in_flight: bool) -> int:
        """Tokens of a preempted decoder (or finishing request) whose KV vLLM has cached: the
        tokens known when its blocks were last allocated, or those written by processed steps.
        One less than synchronously, except when its last step was its prompt's end and it was
        not scheduled in this one; the same as synchronously if no step in flight ran it (a
        budget left it out of the step before, or that step's output was processed: under P/D
        a victim never ran in a step in flight)."""
        if not in_flight:
            return computed + scheduled_tokens
        decoded_last_step = request.decode_from_step <= step - 1
        if scheduled_tokens or decoded_last_step:
            return computed + scheduled_tokens - 1
        return computed
