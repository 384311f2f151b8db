"""Prefill/decode disaggregation in the engine core, as vLLM's KV connector (NIXL, pull mode)
drives its scheduler. No clock here: the replay's P/D fleet (simkv/replay/disaggregated.py)
says when transfers end.

A request has a KV role (`Request.kv_role`):
- KV_SEND, on a prefill engine: it runs its prompt and samples one token (max_tokens=1), then
  finishes but keeps its blocks until the decode side has read them (`finished_sending`).
  vLLM: the connector's `request_finished` returns delay_free_blocks for a
  `do_remote_decode` request.
- KV_PULL, on a decode engine: when it first reaches the head of the waiting queue it looks up
  its local prefix hits and gets blocks for its whole prompt (the rest is "external"; blocks
  are not cached until the data is there), takes no tokens of the step's budget, enters
  WAITING_FOR_REMOTE_KVS and is set aside in the KV-holding queue. The step that admitted it
  starts the pull (`SchedulerOutput.kv_loads`). Requests in that queue are looked at before
  the waiting queue every step; one whose pull has not ended (`finished_recving`) is skipped
  without blocking the others. Once it has, its blocks are cached, its computed tokens are the
  prompt less one (the last prompt token is computed again so that the next one can be sampled)
  and it is scheduled like any waiting request that holds KV: a one-token prefill, then decode.
  A pulled request that is preempted later recomputes locally (one pull per request).

Models with linear-attention layers (vLLM's NIXL connector with Mamba layers, its
`_prefill_backoff`): the decode side needs the state after the prompt's last token but one, so
that it computes that token itself; the prefill engine drops its prompt's last token when the
request arrives (`_truncate_for_prefill`), and a pull takes the prompt less that token (plus
each linear-attention group's state). A pull whose local prefix hits already cover that much
has nothing to pull: it is scheduled as a local request, and stays a pull until it is (a later
lookup may find less). Under Mamba prefix caching a pull's lookup is NIXL's per-group one
(core/mamba_align.py, `get_computed_blocks_for_pull`). Multi-module MTP backs off K - 1 tokens
the same way (NIXL keeps the drafter's lookahead window off the prefill engine, whose MTP modules
would otherwise hold KV built from unverified drafts), without states to pull.

With a CPU tier beside NIXL (vLLM's MultiConnector, NIXL first; core/kv_offload.py), a send's
prompt hits load from the tier as without P/D, and a pull is NIXL's: the tier loads nothing for
it but is asked too, and its "ask again later" holds the pull back a step (`_tier_delays_pull`);
CPU-tier loads are the step's offload jobs, `SchedulerOutput.kv_loads` its pulls only.

Under async scheduling a connector that consumes KV (NIXL's kv_both, on either pool) makes
vLLM defer block frees (`defer_block_free`): a step in flight might still write a request's
blocks while the connector fills them for another, so
- a request that finishes while a step that ran it is in flight gives its blocks back to the
  pool only when that step's output is processed;
- a preemption whose victim ran in the step in flight does not happen: the requester is not
  scheduled, nor are the running requests after it (vLLM's `_request_blocks_can_be_freed`).
The steps here are those that ran tokens, as vLLM's fence counts them.
"""

from __future__ import annotations

from collections import deque

from simkv.core.admission_limits import KV_CACHE, KV_TRANSFER, MAX_LORAS, NONE
from simkv.core.request import KV_PULL, KV_SEND, Request, RequestStatus
from simkv.core.request_queue import PriorityRequestQueue


class RemoteKV:
    """Mixed into Scheduler: the KV-holding queue, pulled admissions, and blocks held for sending."""

    def finished_recving(self, request: Request) -> None:
        """The pull (or CPU-tier load) of `request`'s KV has ended (seen at a step boundary): the
        next schedule promotes it; if it was aborted meanwhile, its blocks go now (the loaded
        ones uncached), as vLLM frees them when the transfer reports."""
        held = self._aborted_loads.pop(request, None)
        if held is not None:  # (aborted while loading: the pool gets its blocks back now)
            self._give_back(held)
            return
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not request.kv_loaded, request
        request.kv_loaded = True
        self._num_kv_ready += 1

    def _abort_loading(self, request: Request) -> None:
        """A request aborted while its KV loads (a P/D pull, or from the CPU tier): as vLLM, its
        blocks go back to the pool only when the load has ended (`finished_recving`); they leave
        its table now (a retry of it is a request of its own), and the loaded ones are not cached."""
        self._aborted_loads[request] = self._free_later(request, request.num_prefix_hit_tokens,
                                                        finished=not request.may_resend)

    def _init_remote_kv(self, defer_block_free: bool, prefill_backoff: int = 0) -> None:
        self.defer_block_free = defer_block_free
        # prompt tokens a pull leaves for the decode side to compute (linear attention: 1)
        self.prefill_backoff = prefill_backoff
        self._num_pulled_states = self.config.kv_cache_groups.num_linear_groups if prefill_backoff else 0
        self._deferred_frees: deque[tuple[int, list]] = deque()  # (fence step, the manager's entries)

    def finished_sending(self, request: Request) -> None:
        """The decode side has read the blocks of this finished `request`, or told that it never
        will, or the connector's hold on them expired: release them. Their unique blocks stay
        findable if its client may send the request again."""
        abandoned = self._abandoned_sends.pop(request, None)
        if abandoned is not None:  # (out of the table already)
            self._give_back(abandoned[1])
            return
        held = self.kv_held.pop(request.index)
        self._free_finished(held, held.num_computed_tokens)

    def abandon_send(self, request: Request) -> None:
        """The client of this finished `request` gave up while the decode side had yet to read
        its blocks: they leave its table now (a retry of it is a request of its own) and go back
        to the pool at `finished_sending` (the read ends, or the connector's hold expires). A
        no-op if they were released already."""
        if self.kv_held.get(request.index) is not request:
            return
        del self.kv_held[request.index]
        num_blocks = self.kv_cache_manager.num_blocks_of(request)
        self._abandoned_sends[request] = (num_blocks, self._free_later(request, request.num_computed_tokens,
                                                                       finished=not request.may_resend))

    # ---- deferred block frees (async scheduling with a connector; transfers a request left) ----
    def _free_later(self, request: Request, cache_end: int, finished: bool) -> list:
        """Take `request`'s blocks out of its table now, cached as `free` caches them; the pool
        gets them back when the returned entries go to `_give_back`."""
        entries: list = []
        self.kv_cache_manager.free(request, cache_end, finished=finished, defer=entries)
        return entries

    def _give_back(self, entries: list) -> None:
        for entry in entries:
            self.kv_cache_manager.free_deferred(entry)

    def _free_finished(self, request: Request, cache_end: int, ran_unprocessed: bool | None = None,
                       completed: bool = False) -> None:
        """Free a finished request's blocks, or, if a step in flight ran it, defer their return
        (`ran_unprocessed`: whether an unprocessed step ran it, told by a caller that knows). An
        aborted request whose client may send it again leaves its blocks findable for the retry;
        a `completed` one (it finished) will not be sent again."""
        finished = completed or not request.may_resend
        if ran_unprocessed is None:
            ran_unprocessed = self.defer_block_free and self._ran_in_flight(request)
        if not (self.defer_block_free and ran_unprocessed):
            self.kv_cache_manager.free(request, cache_end, finished=finished)
            return
        self._deferred_frees.append((self._scheduled_through, self._free_later(request, cache_end, finished)))

    def _drain_deferred_frees(self, step: int) -> None:
        """`step`'s output is being processed: the deferred frees whose fence it is reach the pool."""
        deferred = self._deferred_frees
        while deferred and deferred[0][0] <= step:
            self._give_back(deferred.popleft()[1])

    @property
    def num_blocks_held_for_sending(self) -> int:
        kv = self.kv_cache_manager
        return sum(kv.num_blocks_of(r) for r in self.kv_held.values()) + sum(
            num_blocks for num_blocks, _ in self._abandoned_sends.values())

    def _hold_for_sending(self, request: Request) -> bool:
        """At a finish: a KV_SEND request keeps its blocks (True) until `finished_sending`."""
        if request.kv_role != KV_SEND:
            return False
        self.kv_held[request.index] = request
        return True

    def _truncate_for_prefill(self, request: Request) -> None:
        """A KV_SEND request arriving at a prefill engine of a linear-attention model: its
        prompt's last `prefill_backoff` tokens are left to the decode side (vLLM's
        _truncate_request_for_prefill)."""
        computed = self._pulled_prompt_tokens(request)
        if computed < request.num_prompt_tokens:  # (its block keys stay those of the whole prompt,
            request.num_prompt_tokens = computed  # as vLLM's block hashes, made before, do)
            request.max_tokens = 1

    def _pulled_prompt_tokens(self, request: Request) -> int:
        """The prompt tokens a pull loads, and a prefill engine computes: all of them, or all but
        the backoff (linear attention)."""
        n, backoff = request.num_prompt_tokens, self.prefill_backoff
        return n - backoff if n > backoff else n

    def _admit_pull(self, request: Request, hits, plan, skipped: list[Request]) -> bool | None:
        """A KV_PULL request at the head of the waiting queue, with its local prefix `hits`:
        blocks for its whole prompt (local prefix hits plus the external rest), then set aside
        until its pull ends. False if the blocks do not fit (the waiting queue stops, as for any
        admission); None if its local hits leave nothing to pull (it is scheduled as a local
        request)."""
        pulled_tokens = self._pulled_prompt_tokens(request)
        external = pulled_tokens - hits.num_tokens
        if external <= 0:  # (it stays a pull until it is scheduled: the hits may be gone by then)
            return None
        num_blocks = self._admit_external(request, hits, external, plan, skipped)
        if num_blocks is None:
            return False
        # what the link carries (a window group's blocks: its window only; linear attention: the
        # attention blocks of the pulled tokens past the local hits, and each linear group's state)
        if self._num_pulled_states:
            bs = self.block_size
            request.kv_pull_blocks = -(-pulled_tokens // bs) - hits.num_tokens // bs + self._num_pulled_states
        else:
            request.kv_pull_blocks = num_blocks
        request.kv_role = 0  # one pull per request: a later preemption recomputes locally
        plan.kv_loads.append(request)
        return True

    def _admit_offload_load(self, request: Request, hits, external: int, plan, skipped: list[Request]) -> bool:
        """KV offloading: a waiting request whose prompt continues in the CPU tier past its local
        hits loads it as a pull would (core/kv_offload.py; its job is in the step's `offload_jobs`).
        False if the blocks do not fit."""
        if self._admit_external(request, hits, external, plan, skipped) is None:
            return False
        self.offload.start_load(request, hits.num_tokens, external)
        return True

    def _admit_external(self, request: Request, hits, external: int, plan, skipped: list[Request]) -> int | None:
        """Blocks for the local hits plus `external` tokens that a transfer fills; the request then
        waits for it (WAITING_FOR_REMOTE_KVS). Returns the blocks allocated, None if they do not fit."""
        kv = self.kv_cache_manager
        # sliding-window groups: the pulled tokens count as computed (windows take only their tail);
        # one group: they are the new tokens, as vLLM's single-type manager sees them
        num_new, pulled = (0, {"num_external_tokens": external}) if self._window_releases else (external, {})
        blocks = kv.allocate_slots(request, 0, num_new, hits, 0, full_sequence_must_fit=self.reserve_full_isl,
                                   has_scheduled_reqs=bool(self.running), delay_cache=True,
                                   reserved_blocks=self._inflight_prefill_blocks(skipped) + self._spec_step_blocks,
                                   **pulled)
        if blocks is None:
            return None
        kv.record_prefix_cache_stats(request, hits.num_tokens)
        plan.query += request.num_tokens
        plan.hit += hits.num_tokens
        request.num_prefix_hit_tokens = hits.num_tokens
        request.num_total_prefix_hit_tokens += hits.num_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = hits.num_tokens + external
        return len(blocks)

    def _inflight_prefill_blocks(self, skipped: list[Request]) -> int:
        """The blocks that in-flight prefills still need for their whole prompt: a pull is
        admitted only if it leaves them free (it holds its blocks for the whole transfer and
        cannot be preempted meanwhile). vLLM sums them over its in-flight prefills, pulls
        included; under speculative decoding each also needs its first speculative step's
        1 + K + lookahead slots. Without it, pulls hold their whole prompt already, unless the
        prompt's last token is left to the decode side (linear attention) and needs a block, or
        the load is a CPU tier's (KV offloading: its blocks end where the hit does)."""
        kv = self.kv_cache_manager
        cap = self.max_model_len
        if self.num_spec_tokens:
            extra = 1 + self.num_spec_tokens + self.num_lookahead_tokens
            prefills = [r for r in self.running if r.spec_prefill_chunk] + list(self.kv_holding) + skipped
        else:
            extra = 0
            prefills = self._prefilling
            if self.chunked_decodes:  # (pipeline stages: decoders stay in `_prefilling`; vLLM drops a
                prefills = [r for r in prefills if r.num_computed_tokens < r.num_tokens]  # prompt's last chunk)
            if self.prefill_backoff or self.offload is not None:  # (a CPU-tier load holds part of its prompt)
                prefills = prefills + list(self.kv_holding) + skipped
        if self._mamba_split:  # (the Mamba groups' need goes by the target's tokens)
            return sum(kv.remaining_blocks(r, min(r.num_tokens, cap) + extra, min(r.num_tokens, cap))
                       for r in prefills)
        return sum(kv.remaining_blocks(r, min(r.num_tokens, cap) + extra) for r in prefills)

    def _promote_pulled(self, request: Request) -> None:
        """Its pull has ended: cache the blocks; the last prompt token is computed again."""
        self.kv_cache_manager.cache_shared_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        request.kv_loaded = False  # (KV offloading: a later preemption may load again)

    def _next_waiting(self, skipped: list[Request], plan, delayed: list[Request],
                      loras: set | None = None) -> tuple[object, Request, bool] | None:
        """The queue to admit from (KV-holding first), its head and whether it holds KV (no prefix
        lookup); requests whose pull is on are set aside in `skipped`, and new KV_PULL requests are
        admitted to the KV-holding queue on the way. With a CPU tier beside the pulls (vLLM's
        MultiConnector asks every connector), a pull whose tier lookup says "ask again later" waits
        for a later step in `delayed`, as does one whose LoRA adapter has no slot this step
        (`loras`: the step's adapters). None: nothing (more) to admit this step (`_pull_limit`
        says why: a pull's blocks do not fit, or NONE: every request left was passed over)."""
        holding = self.kv_holding
        while True:
            if holding:
                request = holding.peek_request()
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if not request.kv_loaded:
                        self._pass_over(KV_TRANSFER)
                        skipped.append(holding.pop_request())
                        continue
                    self._promote_pulled(request)
                return holding, request, True
            if not self.waiting:
                self._pull_limit = NONE  # (the requests left were passed over)
                return None
            request = self.waiting.peek_request()
            if request.kv_role != KV_PULL:
                return self.waiting, request, bool(request.swapped_blocks)
            if self._lora_deferred(request, loras):  # (vLLM checks max_loras before the connector)
                self._pass_over(MAX_LORAS)
                delayed.append(self.waiting.pop_request())
                continue
            hits = self._pull_hits(request)
            if self._tier_delays_pull(request, hits.num_tokens):
                self._pass_over(KV_TRANSFER)
                delayed.append(self.waiting.pop_request())
                continue
            admitted = self._admit_pull(request, hits, plan, skipped)
            if admitted is None:  # (its local hits cover what a pull would load)
                return self.waiting, request, False
            if not admitted:
                self._pull_limit = self._block(request, plan, KV_CACHE)
                return None
            self._pass_over(KV_TRANSFER)  # (its pull starts: it waits in the KV-holding queue)
            skipped.append(self.waiting.pop_request())

    def _pull_hits(self, request: Request):
        """A pull's local prefix hits. Under Mamba prefix caching NIXL lets them be the attention
        group's, the pull bringing the state at their end; with a CPU tier beside NIXL, vLLM's
        MultiConnector allows that only if every connector does, and the offloading one does not:
        the groups' common hit."""
        kv = self.kv_cache_manager
        if self._mamba_split and self.offload is None:
            return kv.get_computed_blocks_for_pull(request)
        return kv.get_computed_blocks(request)

    def _tier_delays_pull(self, request: Request, num_local: int) -> bool:
        """With a CPU tier beside the pulls, vLLM's MultiConnector looks the pull up in the tier too
        (NIXL claims it; the tier loads nothing): the tier's "ask again later" (a chunk of the hit
        is still being stored or loaded) holds the pull back for this step."""
        return self.offload is not None and self.offload.lookup(request, num_local) is None

    def _requeue_skipped(self, skipped: list[Request]) -> None:
        """Requests set aside this step go back to the front of the KV-holding queue, in order."""
        holding = self.kv_holding
        if isinstance(holding, PriorityRequestQueue):
            for request in skipped:
                holding.add_request(request)
        else:
            holding.extendleft(reversed(skipped))
