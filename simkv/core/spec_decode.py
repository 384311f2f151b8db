"""Speculative decoding in the engine core, as vLLM 0.33's scheduler handles it.

After every step in which a request samples, its drafter proposes `num_speculative_tokens`
(K) draft tokens (`Request.spec_drafts`). The request's next step schedules its last sampled
token plus the drafts (1 + K tokens, fewer if the budget or max_model_len cuts them) and the
target model verifies them: the accepted drafts and one more token (the bonus, sampled by the
target) are kept, and `num_computed_tokens` gives back the rejected ones. A request waiting
with one token left (a full prefix hit, a resumed request) is padded to 1 + K rows whose drafts
are placeholders, as vLLM pads new decodes for its CUDA graphs. Methods with their own draft
network (EAGLE family, a draft model) reserve K lookahead KV slots; a draft model takes one
more batch row per request (`StepPlan.draft_slots`); the EAGLE family's block hashes cover the
token after each block (core/block_hashing.py).

Under async scheduling (vLLM's AsyncScheduler) the drafts stay on the device: a request whose
step is in flight has `num_output_placeholders` (1 + its drafts) counted in its computed tokens,
its next step schedules 1 + K placeholder drafts at once, and when the step's output arrives the
rejected drafts are taken back from both counts. A request preempted with a step in flight gets
that step's tokens all the same (stale output: its counters stay as the preemption reset them).

Which drafts are accepted is the model's business, not the scheduler's: a request's draft i
is accepted with probability `rates[i]` given that drafts 0..i-1 were, drawn from a hash of
(seed, request, output position, i), so a replay is deterministic and one request's draws do
not depend on the others. An n-gram or suffix proposer finds a match with probability
`spec_ngram_match_rate` (drawn per request and output position, a stream of its own). On the
host (suffix, ngram on vLLM's V1 model runner) it proposes nothing without one; vLLM's V2 runner
looks n-grams up on the device and always drafts K, filling a miss's drafts with the last token,
which are taken as all rejected (`drafts_on_miss`). A match proposes K drafts, except under suffix decoding, whose
proposals are as long as its suffix tree is confident: their lengths are drawn (a third stream)
from a geometric distribution cut at K with mean `spec_mean_draft_tokens`.
"""

from __future__ import annotations

from bisect import bisect_right

from simkv.config import SpeculativeConfig
from simkv.core.outputs import ScheduledChunk, SchedulerOutput
from simkv.core.request import Request, RequestStatus

_M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


_MATCH_STREAM = 0x6E6772616D5F6D61  # (the n-gram match draws' own stream, apart from the acceptances)
_LENGTH_STREAM = 0x7375666669785F6C  # (suffix decoding's proposal lengths, a third stream)


def truncated_geometric_ratio(mean: float, cap: int) -> float:
    """q such that min(G, cap) has mean `mean`, G geometric on 1, 2, ... with P(G > l | G >= l) = q:
    E[min(G, cap)] = (1 - q^cap) / (1 - q), increasing in q from 1 (q = 0) to cap (q = 1)."""
    if mean <= 1.0:
        return 0.0
    if mean >= cap:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        q = (lo + hi) / 2
        if sum(q ** i for i in range(cap)) < mean:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


def proposal_length_thresholds(mean: float, cap: int) -> list[int]:
    """53-bit draw thresholds: a proposal has 1 + (the thresholds at or below the draw) drafts,
    P(length > l) = q^l for l < cap (`truncated_geometric_ratio`), never more than cap."""
    q = truncated_geometric_ratio(mean, cap)
    return [int((1.0 - q ** l) * (1 << 53)) for l in range(1, cap)]


class AcceptanceModel:
    """How many of a request's drafts the target model accepts at an output position, and
    whether the n-gram proposer finds a match there (`match_rate`)."""

    def __init__(self, rates: tuple[float, ...], seed: int, match_rate: float = 1.0,
                 mean_draft_tokens: float | None = None, drafts_on_miss: bool = False) -> None:
        # Accept draft i iff its 53-bit draw is below rates[i] * 2**53 (exact integer compare).
        self.thresholds = [int(r * (1 << 53)) for r in rates]
        self.seed = mix64(seed & _M64)
        self.always_matches = match_rate >= 1.0
        self.match_threshold = int(match_rate * (1 << 53))
        # A lookup without a match still drafts K (vLLM's V2 device n-gram), none accepted
        self.drafts_on_miss = drafts_on_miss
        self.misses_rejected = drafts_on_miss and not self.always_matches
        self.always_k = (self.always_matches or drafts_on_miss) and mean_draft_tokens is None
        # suffix decoding: proposals of varying length (None: every proposal has K drafts)
        self.length_thresholds = (None if mean_draft_tokens is None
                                  else proposal_length_thresholds(mean_draft_tokens, len(rates)))

    def num_proposed(self, request_index: int, position: int, k: int) -> int:
        """The drafts proposed for the request with `position` output tokens, at most k: none
        without a match (k where misses draft too), else k, or under suffix decoding the
        proposal's drawn length."""
        if self.always_k:
            return k
        if not (self.always_matches or self.proposes(request_index, position)):
            return 0
        if self.length_thresholds is None:
            return k
        draw = mix64(self.seed ^ _LENGTH_STREAM ^ ((request_index << 32) | position)) >> 11
        return min(k, 1 + bisect_right(self.length_thresholds, draw))

    def proposes(self, request_index: int, position: int) -> bool:
        """The n-gram proposer finds a match for the request with `position` output tokens (one
        draw per request and position, its own stream)."""
        if self.always_matches:
            return True
        return mix64(self.seed ^ _MATCH_STREAM ^ ((request_index << 32) | position)) >> 11 < self.match_threshold

    def num_accepted(self, request_index: int, position: int, num_drafts: int) -> int:
        # A splitmix64 stream per (request, output position), its start hashed from both;
        # the mixing is inlined (a replay draws for every verifying request of every step).
        if self.misses_rejected and not self.proposes(request_index, position):
            return 0  # (drafts of a lookup that found no match)
        thresholds = self.thresholds
        z = ((self.seed ^ ((request_index << 32) | position)) + 0x9E3779B97F4A7C15) & _M64  # (mix64, inline)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        z ^= z >> 31
        for i in range(num_drafts):
            z = (z + 0x9E3779B97F4A7C15) & _M64
            x = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
            if (x ^ (x >> 31)) >> 11 >= thresholds[i]:
                return i
        return num_drafts


class SpecDecode:
    """Mixed into Scheduler: the verify-and-roll-back side of speculative decoding."""

    def _init_spec(self, spec: SpeculativeConfig, drafts_on_miss: bool = False) -> None:
        """`drafts_on_miss`: the n-gram drafter runs on the device (EngineConfig.ngram_drafts_on_device)."""
        self.num_spec_tokens = spec.num_speculative_tokens if spec.enabled else 0
        self.spec_draft_slots = spec.draft_slots if spec.enabled else 0
        self.acceptance = (AcceptanceModel(spec.conditional_acceptance_rates, spec.spec_seed, spec.spec_ngram_match_rate,
                                           spec.spec_mean_draft_tokens, drafts_on_miss)
                           if spec.enabled else None)
        # Dynamic speculation: drafts per number of requests in a step (None: always K)
        self.spec_drafts_by_batch = None
        if spec.enabled and spec.batch_size_ranges is not None:
            self.spec_drafts_by_batch = [0] + [spec.drafts_for_batch(n) for n in range(1, self.max_num_seqs + 1)]
        k = self.num_spec_tokens
        self.spec_stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                           "num_padded": 0, "accepted_per_position": [0] * k}

    def _spec_scheduled(self, request: Request, chunk: ScheduledChunk, plan) -> None:
        """A running request was scheduled: vLLM's prefill flag is read before it is renewed;
        the drafts among its new tokens are marked, and it has none left to propose."""
        plan.prefill_scheduled |= request.spec_prefill_chunk
        plan.num_running_scheduled += 1
        drafts = request.spec_drafts
        if drafts:
            extra = chunk.num_computed_tokens + chunk.num_new_tokens - request.num_tokens - request.num_output_placeholders
            if extra > 0:
                chunk.num_spec_tokens = min(extra, drafts)
            request.spec_drafts = 0

    def _decode_chunks_step(self) -> SchedulerOutput | None:
        """schedule() for a step in which nothing waits and every running request with tokens
        to run decodes or verifies its drafts, each whole (1 + drafts tokens, within the budgets,
        the prefill threshold and max_model_len), with blocks enough for all (nobody is
        preempted): the output schedule() gives, with the same allocations in the same order,
        and the requests' counters as _spec_scheduled and _spec_after_schedule leave them (with
        a step in flight, async scheduling or pipeline stages: _spec_async_after_schedule),
        without the general path's per-request checks. Requests the general path passes over
        (their step in flight, a pipeline's decode stagger, a step in flight that may finish
        them) are passed over. None, having changed nothing, when some condition does not hold
        or nothing would run."""
        running = self._prefilling
        if (self.waiting or self.kv_holding or self._finishing or self._num_decoders or self.throttle_prefills
                or self._finish_heap or not running or len(running) != len(self.running)):
            return None
        kv = self.kv_cache_manager
        if kv.num_forks:
            return None
        counts = self._counts_in_flight  # (vLLM's counters of the tokens in flight)
        placeholders_on = self.async_scheduling
        calls = self._num_schedule_calls + 1  # (this call's number)
        tables, bs, threshold = kv.req_to_blocks, self.block_size, self._prefill_threshold()
        lookahead, max_len, slots = self.num_lookahead_tokens, self.max_model_len, self.spec_draft_slots
        status = RequestStatus.RUNNING
        tokens = verify = drafts = need = 0
        scheduled = []  # (request, whether allocate_slots has work: new blocks, or shared blocks to cache)
        caching = kv.enable_caching
        weak = caching and kv.hasher.weak
        for request in running:
            computed = request.num_computed_tokens
            n = 1 + request.spec_drafts
            placeholders = request.num_output_placeholders
            known = request.num_prompt_tokens + request.num_output_tokens
            if computed >= known + n - 1 + placeholders:
                continue  # (nothing to run: its step is in flight)
            if request.status != status:
                return None
            if calls < request.next_decode_call or (
                    placeholders and computed + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens):
                continue  # (a pipeline's decode stagger; the step in flight may finish it: _spec_async_done)
            if (computed + 1 != known + placeholders or n > max_len - computed - 1 or 0 < threshold < n
                    or not (counts or request.num_output_tokens)):
                return None
            tokens += n
            table = tables.get(request.index)
            if table is None:
                return None
            more = -(-min(computed + n + lookahead, max_len) // bs) - len(table)
            if more > 0:
                need += more
            scheduled.append((request, more > 0 or weak or (caching and request.num_shared_tokens > 0)))
        num = len(scheduled)
        # (within both budgets for every request in turn; a copy-on-write block for each at most)
        if (not num or tokens + num * slots > self.max_num_batched_tokens or tokens > self.max_num_scheduled_tokens
                or need + num > kv.block_pool.free_block_queue.num_free_blocks):
            return None
        step = self.current_step
        self.current_step += 1
        self._num_schedule_calls += 1
        pool = kv.block_pool
        used_before = pool.get_num_used_blocks()
        to_propose = self._spec_tokens_to_schedule(num)
        next_call = self._num_schedule_calls + self._decode_stagger if self._decode_stagger else 0
        chunks = []
        allocate = kv.allocate_slots
        num_hashed = kv.hasher.num_hashed_blocks
        for request, grow in scheduled:
            computed, d = request.num_computed_tokens, request.spec_drafts
            n = 1 + d
            if grow:
                allocate(request, computed, n, num_lookahead_tokens=lookahead)
            sampled = request.num_output_tokens > 0
            chunk = ScheduledChunk(request, computed, n, sampled)
            if d:
                chunk.num_spec_tokens = d
                request.spec_drafts = 0
            if sampled:
                verify += n
                drafts += d
            chunks.append(chunk)
            request.prev_chunk_step, request.prev_chunk_tokens = request.last_chunk_step, request.last_chunk_tokens
            request.last_chunk_step, request.last_chunk_tokens = step, n
            request.spec_prefill_chunk = False
            if counts:  # (_note_cached, then _spec_async_after_schedule)
                blocks = num_hashed(request, computed + n)
                if blocks > request.num_cached_blocks:
                    request.num_cached_blocks = blocks
                request.num_computed_tokens = computed + n
                request.num_in_flight_tokens += n
                chunk.samples = True
                if placeholders_on:
                    request.num_output_placeholders += 1 + d
                request.spec_drafts = to_propose
                if next_call:
                    request.next_decode_call = next_call
                request.last_sched_step = step
        used = pool.get_num_used_blocks()
        if counts:
            self._note_take(step, used - used_before)
            self._scheduled_through = step
        self._output_pending = True
        return SchedulerOutput(
            step=step, chunks=chunks, num_decode_reqs=0, decode_context_tokens=self._sum_decode_base, decodes=None,
            preempted=[], num_running=len(running), num_waiting=0, num_blocks_used=used, prefix_query_tokens=0,
            prefix_hit_tokens=0, num_swapped=self.num_swapped, num_verify_tokens=verify, num_draft_tokens=drafts,
            num_spec_tokens_to_schedule=to_propose, aborted=self._take_aborted())

    def _spec_tokens_to_schedule(self, num_scheduled: int) -> int:
        """Drafts proposed after a step of `num_scheduled` requests (vLLM's num_spec_tokens_to_schedule)."""
        if self.spec_drafts_by_batch is not None and num_scheduled:
            return self.spec_drafts_by_batch[num_scheduled]
        return self.num_spec_tokens

    def _spec_padding(self, num_computed: int, num_new: int, plan) -> int:
        """vLLM pads a waiting request with one token left to 1 + K rows (new decodes keep the
        step uniform for CUDA graphs): the padded count, 0 if it must wait for a roomier step,
        or `num_new` unchanged."""
        k = self.num_spec_tokens
        if (num_new != 1 or plan.prefill_scheduled or self.spec_drafts_by_batch is not None
                or not (plan.num_running_scheduled or num_computed > 0)
                or num_computed + 1 + k + 1 > self.max_model_len):
            return num_new
        return 1 + k if 1 + k <= plan.request_budget() else 0

    @staticmethod
    def _spec_after_schedule(chunks: list[ScheduledChunk]) -> tuple[int, int]:
        """The step is scheduled: each request notes whether its chunk leaves prompt to compute
        (vLLM's is_prefill_chunk). Returns the tokens of decodes' chunks (the last sampled token
        and the drafts) and the drafts among them."""
        verify = drafts = 0
        for chunk in chunks:
            request = chunk.request
            end = chunk.num_computed_tokens + chunk.num_new_tokens
            request.spec_prefill_chunk = end < request.num_tokens
            if request.num_output_tokens and chunk.num_computed_tokens == request.num_tokens - 1:
                verify += chunk.num_new_tokens
                drafts += chunk.num_spec_tokens
        return verify, drafts

    def _spec_update(self, output: SchedulerOutput) -> list[Request]:
        """Apply a step under speculative decoding: prefill chunks advance; every chunk that
        reaches the request's end samples its bonus token plus the accepted drafts (rejected
        drafts are given back), stopping at max_tokens / max_model_len; the request then has
        K new drafts. Returns the requests that finished."""
        step = output.step
        stats = self.spec_stats
        per_position = stats["accepted_per_position"]
        k = output.num_spec_tokens_to_schedule
        finished = []
        accepted_total = emissions = 0
        by_class = [0] * len(self.decoders_by_class) if self.decoders_by_class is not None else None
        running = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        # vLLM caches a sampling request's verified full blocks when its tokens arrive (under
        # speculative decoding); the single-group manager's lazy hashing orders them the same.
        cache_verified = getattr(self.kv_cache_manager, "cache_verified", None) if self.num_spec_tokens else None
        always_k = self.acceptance.always_k
        num_proposed = self.acceptance.num_proposed
        num_accepted = self.acceptance.num_accepted
        num_drafts = num_draft_tokens = num_padded = 0
        for chunk in output.chunks:
            request = chunk.request
            if request.status != running:  # (preempted later in the step)
                continue
            num_outputs = request.num_output_tokens
            num_tokens = request.num_prompt_tokens + num_outputs
            computed = chunk.num_computed_tokens + chunk.num_new_tokens
            if computed < num_tokens:
                request.num_computed_tokens = computed
                continue
            drafts = chunk.num_spec_tokens
            accepted = 0
            if drafts:
                if chunk.spec_placeholder:
                    num_padded += 1
                else:
                    accepted = num_accepted(request.index, num_outputs, drafts)
                    for i in range(accepted):
                        per_position[i] += 1
                num_drafts += 1
                num_draft_tokens += drafts
                request.num_draft_tokens += drafts
                request.num_accepted_tokens += accepted
                accepted_total += accepted
                computed -= drafts - accepted
            if request.first_token_step < 0:
                request.first_token_step = step
            elif request.last_token_step == step - 1:
                emissions += 1
                if by_class is not None:
                    by_class[request.class_code] += 1
            else:
                self._note_irregular_gap(request, step)
            request.last_token_step = step
            # The bonus token and the accepted drafts, up to the first stop (max_tokens or
            # max_model_len, both still ahead: the request runs); the tokens after it are dropped.
            new_tokens = 1 + accepted
            until_stop = min(request.max_tokens - num_outputs, max_model_len - num_tokens)
            if new_tokens >= until_stop:
                computed -= new_tokens - until_stop
                request.num_output_tokens = num_outputs + until_stop
                finished.append(request)
            else:
                request.num_output_tokens = num_outputs + new_tokens
                request.spec_drafts = k if always_k else num_proposed(request.index, num_outputs + new_tokens, k)
            request.num_computed_tokens = computed
            if cache_verified is not None:
                cache_verified(request, computed)
        stats["num_drafts"] += num_drafts
        stats["num_draft_tokens"] += num_draft_tokens
        stats["num_accepted_tokens"] += accepted_total
        stats["num_padded"] += num_padded
        output.num_accepted_tokens = accepted_total
        output.num_spec_emissions = emissions
        output.spec_emissions_by_class = by_class
        return finished

    # ---- async scheduling: vLLM's AsyncScheduler, drafts kept on the device ----------------------
    def _spec_async_done(self, request: Request) -> bool:
        """A request whose step in flight samples its last token even if every draft is rejected
        is left out (vLLM schedules no extra step for it)."""
        return (request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens)

    def _note_cached(self, request: Request, num_tokens: int) -> None:
        """vLLM caches the full blocks of the request's known tokens among the first `num_tokens`
        (at an allocation, or when a step's output arrives); the single-group manager hashes
        them lazily, at release, up to the furthest point reached."""
        blocks = self.kv_cache_manager.hasher.num_hashed_blocks(request, num_tokens)
        if blocks > request.num_cached_blocks:
            request.num_cached_blocks = blocks

    def _cached_end(self, request: Request) -> int:
        """The computed tokens to free the request's blocks with, so that those vLLM has cached
        (num_cached_blocks) stay findable: their tokens, and the reprefillable ones after them
        (multi-module MTP), which the hasher takes off again."""
        return request.num_cached_blocks * self.block_size + self.kv_cache_manager.hasher.reprefillable

    def _spec_async_preempt(self, request: Request) -> int:
        """The request is preempted: returns the tokens whose blocks vLLM has cached."""
        cache_end = self._cached_end(request)
        request.num_stale_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_cached_blocks = 0
        return cache_end

    def _spec_async_after_schedule(self, chunks: list[ScheduledChunk], num_to_propose: int) -> tuple[int, int]:
        """The step is scheduled (vLLM's AsyncScheduler._update_after_schedule): its tokens count
        as computed and in flight; a chunk that reaches the request's end samples, so the request
        gains placeholders for its token and its drafts, and K placeholder drafts to schedule
        next. Pipeline parallelism without async scheduling (vLLM's Scheduler) counts the tokens
        only: no placeholders, so a request that sampled waits for that step's output; with it,
        a request that sampled waits pp_size schedule() calls. Returns the tokens of decodes'
        chunks and the drafts among them."""
        placeholders_on = self.async_scheduling
        next_call = self._num_schedule_calls + self._decode_stagger if self._decode_stagger else 0
        verify = drafts = 0
        for chunk in chunks:
            request = chunk.request
            num_new = chunk.num_new_tokens
            placeholders = request.num_output_placeholders
            end = request.num_tokens + placeholders
            if request.num_output_tokens and chunk.num_computed_tokens + 1 == end:
                verify += num_new
                drafts += chunk.num_spec_tokens
            computed = chunk.num_computed_tokens + num_new
            request.num_computed_tokens = computed
            request.num_in_flight_tokens += num_new
            prefill = computed < end
            request.spec_prefill_chunk = prefill
            if not prefill:
                chunk.samples = True
                if placeholders_on:
                    request.num_output_placeholders = placeholders + 1 + chunk.num_spec_tokens
                request.spec_drafts = num_to_propose
                if next_call:
                    request.next_decode_call = next_call
        return verify, drafts

    def _spec_async_update(self, output: SchedulerOutput) -> list[Request]:
        """A step's output arrives under async scheduling (vLLM's update_from_output with the
        AsyncScheduler's placeholders): rejected drafts are taken back, the bonus token and the
        accepted drafts are appended up to the first stop, and the blocks of the verified tokens
        are cached. The output of a request preempted since (vLLM: stale output) is delivered
        but changes none of the counters the preemption reset, whether the request waits or,
        under pipeline parallelism, runs again already. Without async scheduling (pipeline
        parallelism's batch queue) there are no placeholders to resolve. Returns the requests
        that finished."""
        step = output.step
        stats = self.spec_stats
        per_position = stats["accepted_per_position"]
        finished = []
        accepted_total = emissions = 0
        running, done, aborted = RequestStatus.RUNNING, RequestStatus.FINISHED, RequestStatus.ABORTED
        cache_verified = getattr(self.kv_cache_manager, "cache_verified", None)  # (KVCacheCoordinator)
        max_model_len = self.max_model_len
        placeholders_on = self.async_scheduling
        pipeline_gaps = self.pipeline_gaps
        by_class = [0] * len(self.decoders_by_class) if self.decoders_by_class is not None else None
        gaps_by_class = self.pipeline_gaps_by_class
        gap_log = self.pipeline_gap_log
        for chunk in output.chunks:
            request = chunk.request
            request.num_in_flight_tokens -= chunk.num_new_tokens
            stale = request.num_stale_tokens > 0  # (scheduled before its preemption)
            if stale:
                request.num_stale_tokens -= chunk.num_new_tokens
            if request.status == done or request.status == aborted or not chunk.samples:
                continue  # (vLLM skips the output of a request no longer in the engine)
            # (pipeline parallelism: a preempted request may run again before a stale output comes)
            live = request.status == running and not stale
            num_outputs = request.num_output_tokens
            drafts = chunk.num_spec_tokens
            accepted = 0
            if drafts:
                if chunk.spec_placeholder:
                    stats["num_padded"] += 1
                else:
                    accepted = self.acceptance.num_accepted(request.index, num_outputs, drafts)
                    for i in range(accepted):
                        per_position[i] += 1
                stats["num_drafts"] += 1
                stats["num_draft_tokens"] += drafts
                stats["num_accepted_tokens"] += accepted
                request.num_draft_tokens += drafts
                request.num_accepted_tokens += accepted
                accepted_total += accepted
                if live:
                    request.num_computed_tokens -= drafts - accepted
                    request.num_output_placeholders -= drafts - accepted
            if request.first_token_step < 0:
                request.first_token_step = step
            elif pipeline_gaps is not None:  # (pipeline parallelism: every gap timed from step ends)
                gap = (request.last_token_step, step)
                pipeline_gaps[gap] = pipeline_gaps.get(gap, 0) + 1
                if gap_log is not None:
                    gap_log.append(gap)
                emissions += 1
                if by_class is not None:
                    by_class[request.class_code] += 1
                    gap = (*gap, request.class_code)
                    gaps_by_class[gap] = gaps_by_class.get(gap, 0) + 1
            elif request.last_token_step == step - 1:
                emissions += 1
                if by_class is not None:
                    by_class[request.class_code] += 1
            else:
                self._note_irregular_gap(request, step)
            request.last_token_step = step
            new_tokens = 1 + accepted
            until_stop = min(request.max_tokens - num_outputs, max_model_len - request.num_tokens)
            stopped = new_tokens >= until_stop
            kept = max(until_stop, 1) if stopped else new_tokens
            request.num_output_tokens = num_outputs + kept
            if live:
                if stopped:
                    request.num_computed_tokens -= new_tokens - kept
                if placeholders_on:
                    request.num_output_placeholders -= new_tokens  # (all of them, the dropped ones too)
                processed = request.num_computed_tokens - request.num_in_flight_tokens
                self._note_cached(request, processed)
                if cache_verified is not None:  # (the coordinator caches them now, as vLLM does)
                    cache_verified(request, processed)
            if stopped:
                if request.status != running:  # preempted: it leaves the waiting queue
                    self.waiting.remove_request(request)
                finished.append(request)
        output.num_accepted_tokens = accepted_total
        output.num_spec_emissions = emissions
        output.spec_emissions_by_class = by_class
        return finished
