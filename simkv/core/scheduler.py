"""vLLM-v1 scheduler: a token budget per step, running requests first, then waiting ones.

Semantics follow vLLM 0.33's synchronous `Scheduler` (see docs/semantics.md): running
requests are served in list order (one token for a decode, the rest of a prefill up to the
budget), then waiting requests from the head until one does not fit; an allocation failure
preempts the newest running request (RECOMPUTE) and blocks admissions for the step.

Speed: steady decoders are not touched every step (steady_decoders.py): a step costs
O(events + log running), not O(running), and runs of event-free decode steps are jumped over
with results identical to stepping one by one. Under speculative decoding (spec_decode.py) a
decode is a chunk of 1 + K tokens whose outcome varies, so there are no steady decoders: every
running request is stepped. Models with sliding-window layers have steady decoders too: their
window releases are events like block boundaries, and the context they attend is counted per
layer (steady_decoders.py).

Invariants: `running` is ordered by `seq` (admission order); a request is in `_prefilling`
iff it is running and not a steady decoder; steady decoders have `decode_base` set.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from operator import attrgetter

from simkv.config import EngineConfig
from simkv.core.admission_limits import (ADMISSION_CAP, ENCODER, FINISHING, KV_CACHE, KV_TRANSFER, MAX_LORAS, MAX_NUM_SEQS,
                                         NONE, PIPELINE, PREEMPTION, PREFILL_CADENCE, TOKEN_BUDGET)
from simkv.core.async_scheduling import AsyncScheduling
from simkv.core.contiguous import ContiguousKVCacheManager
from simkv.core.encoder_cache import EncoderCacheManager, encoder_budget
from simkv.core.kv_cache_coordinator import KVCacheCoordinator
from simkv.core.mamba_align import MambaAlignCoordinator, mamba_block_aligned_split
from simkv.core.kv_cache_manager import ComputedBlocks, KVCacheManager
from simkv.core.outputs import ScheduledChunk, ScheduledDecode, SchedulerOutput
from simkv.core.parallel_sampling import FIRST_SEQUENCE_INDEX, fan_out, sequence_of
from simkv.core.kv_offload import KVOffload
from simkv.core.kv_offload_hybrid import HybridKVOffload
from simkv.core.kv_offload_mamba import MambaKVOffload
from simkv.core.remote_kv import RemoteKV
from simkv.core.request import KV_PULL, KV_SEND, Request, RequestStatus
from simkv.core.request_queue import FCFSRequestQueue, PriorityRequestQueue
from simkv.core.spec_decode import SpecDecode
from simkv.core.steady_decoders import SteadyDecoders
from simkv.core.step_plan import StepPlan

_seq_of = attrgetter("seq")


_HOLDS_KV = ComputedBlocks()  # a request that holds its KV (swapped out, or pulled) does no prefix lookup


class LivelockError(RuntimeError):
    """Requests keep being preempted and none finishes: the configuration cannot make progress."""


# the states a request can be aborted in (Scheduler.abort_request; async: a finishing one too)
_ABORTABLE = (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_REMOTE_KVS)


class _EveryItem:
    """The embedding store as an ec_consumer engine finds it: the proxy sends a request on only
    once an encode instance has stored every item of it (simkv/replay/encode_pool.py)."""

    def __contains__(self, mm_hash) -> bool:
        return True


_EVERY_ITEM = _EveryItem()


class Scheduler(SteadyDecoders, AsyncScheduling, RemoteKV, SpecDecode):
    def __init__(self, config: EngineConfig, num_gpu_blocks: int, detail: bool = False,
                 num_cpu_blocks: int = 0, kv_connector: bool = False, num_offload_chunks: int = 0) -> None:
        """`kv_connector`: the engine runs under P/D disaggregation (vLLM: a kv_transfer_config),
        which keeps EAGLE's legacy block keys (and its block drop). `num_offload_chunks`: the
        CPU tier of KV offloading, in blocks (core/kv_offload.py; 0: none)."""
        sc, cc = config.scheduler, config.cache
        self.config = config
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        # vLLM's token budget (max_num_scheduled_tokens) beside the batch's rows (max_num_batched_tokens);
        # where no drafting slots take rows, a step schedules the smaller of the two
        self.max_num_scheduled_tokens = sc.max_num_scheduled_tokens or sc.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        # (an encode instance consumes prompts in chunks whatever the option says: vLLM's mm_encoder_only)
        self.enable_chunked_prefill = sc.enable_chunked_prefill or sc.ec_role == "ec_producer"
        self.long_prefill_token_threshold = sc.long_prefill_token_threshold
        self.adaptive_threshold = sc.long_prefill_token_threshold_adaptive
        self.policy = sc.scheduling_policy
        self.reserve_full_isl = sc.scheduler_reserve_full_isl
        self.num_lookahead_tokens = config.num_lookahead_tokens
        # core/spec_decode.py; decodes are chunks under it
        self._init_spec(config.speculative, config.ngram_drafts_on_device)
        # Policy knobs (vLLM's behaviour by default; other engines' step models otherwise).
        self.max_num_admissions_per_step = sc.max_num_admissions_per_step or (1 << 62)
        # vLLM's max_num_active_seqs: the admission limit (max_num_seqs still sizes the runner)
        self.max_num_active = config.max_num_active
        # vLLM's local prefill cadence (prefill_schedule_interval): a step holds prefill back until
        # that many executed steps have passed since the last one that carried prefill, unless
        # the last release step left requests waiting (capacity-bound: the cadence lets go)
        # On data-parallel ranks vLLM's DP engine core drives the cadence instead: the replay sets
        # `throttle_prefills` before each schedule() (replay/data_parallel.py) and the local one is off.
        dp = config.hardware.data_parallel_size > 1
        self.prefill_interval = 1 if dp else sc.prefill_schedule_interval
        self.dp_cadence = dp and sc.prefill_schedule_interval > 1
        self.throttle_prefills = False
        self._last_prefill_step = -self.prefill_interval
        self._num_executed_steps = 0
        self._prefill_capacity_bound = False
        # LoRA (vLLM's lora_config): at most max_loras distinct adapters in the running batch
        self.max_loras = sc.max_loras if sc.enable_lora else None
        self.num_lora_deferrals = 0  # (a waiting request passed over in a step for want of an adapter slot)
        # (the waiting queue's length and the running adapters when a step passed over every waiting
        # request for want of a slot: nothing is admitted until one of them changes; decode runs)
        self._lora_stuck: tuple[int, frozenset] | None = None
        # Multimodal models (core/encoder_cache.py): vLLM's encoder compute budget of a step and its
        # encoder cache, both max(max_num_batched_tokens, the largest item's embeddings), in embeddings
        mm_tokens = sc.mm_max_tokens_per_item or 0
        self.encoder_budget = encoder_budget(self.max_num_batched_tokens, mm_tokens) if mm_tokens else 0
        self.encoder_cache = EncoderCacheManager(self.encoder_budget) if mm_tokens else None
        self.disable_chunked_mm_input = sc.disable_chunked_mm_input
        self.num_encoded_items = 0
        self.num_encoded_embeds = 0
        # Encoder disaggregation (vLLM's ec_connector, shared storage): the identifiers of the items
        # in the embedding store, which the scheduler loads instead of encoding (they take encoder
        # cache room, not encoder budget); None without one. An encode instance (`ec_producer`)
        # adds what it encodes, once the step ran.
        self.ec_producer = sc.ec_role == "ec_producer"
        self.ec_store: set | None = (set() if self.ec_producer else _EVERY_ITEM if sc.ec_role == "ec_consumer"
                                     else None)
        self._ec_saves: list[int] = []
        self.num_loaded_items = 0
        self.num_loaded_embeds = 0
        self.num_encoder_stops = 0  # (a chunk cut short before an item: budget, cache or unchunked items)
        self.admit_before_running = sc.admission_order == "before_running"
        self.preemption_victim = sc.preemption_victim
        self.preemption_mode = sc.preemption_mode
        self.block_size = cc.block_size
        self.detail = detail
        self.async_scheduling = sc.async_scheduling  # schedule() for K+1 comes before update_from_output(K)
        self._finishing: list[Request] = []  # async: last token in flight, blocks still held
        # async, PP: (step, blocks it took) of the schedule() calls whose output is not processed
        self._recent_takes: list[tuple[int, int]] = []
        self._scheduled_through = -1  # async: the latest step scheduled (that runs tokens)
        self._processed_through = -1  # async: the latest step whose output was processed
        self._output_pending = False  # a schedule() whose output is not processed yet (synchronous scheduling)
        # Pipeline parallelism: the engine keeps pp_size batches in flight (one more under async
        # scheduling), so schedule() runs ahead of update_from_output by several steps. A decode
        # is then a chunk, as under speculative decoding, and vLLM's counters say what is in
        # flight; under async scheduling a request that sampled waits pp_size schedule() calls
        # (vLLM's decode stagger, which its batch queue's sampled-token ring needs).
        self.pipeline_parallel_size = config.hardware.pipeline_parallel_size
        pipelined = self.pipeline_parallel_size > 1
        self.overlapped = self.async_scheduling or pipelined  # schedule() comes before an earlier step's output
        self.chunked_decodes = bool(self.num_spec_tokens) or pipelined
        # vLLM's counters (spec_decode.py): a chunk's tokens count as computed when it is scheduled;
        # placeholders stand for the tokens in flight under async scheduling only
        self._counts_in_flight = self.chunked_decodes and self.overlapped
        self._decode_stagger = self.pipeline_parallel_size if pipelined and self.async_scheduling else 0
        self._num_schedule_calls = 0  # (vLLM's current_step: every schedule() call, empty ones too)
        # under pipeline parallelism every token gap is timed from step ends (replay/results.py):
        # (previous token's step, token's step) -> tokens
        self.pipeline_gaps: dict[tuple[int, int], int] | None = {} if pipelined else None
        self.pipeline_gap_log: list[tuple[int, int]] | None = None  # (the same gaps in order, for a reader
        # that drains it as steps end: replay/autoscale_latency.py's StepGaps)
        groups = config.kv_cache_groups
        # EAGLE family and MTP without a connector: a block's key covers the token after it (the
        # K after it under multi-module MTP; vLLM's lookahead block hashes; under a connector the
        # last-block drop instead)
        lookahead = config.num_prefill_lookahead
        hash_lookahead = lookahead if config.speculative.is_eagle_family and not kv_connector else 0
        eagle_block_drop = config.speculative.is_eagle_family and kv_connector
        # multi-module MTP: a prefill chunk ends at the prompt's end or at least K tokens before it
        # (the modules read K prompt tokens ahead); its last K - 1 tokens' blocks wait to be cached
        self.num_prefill_lookahead = lookahead if lookahead > 1 else 0
        # (multimodal items: vLLM shifts the encoder's window by the drafter's read-ahead, EAGLE's 1 too)
        self.encoder_window_shift = lookahead
        reprefillable = max(lookahead - 1, 0)
        if cc.allocator == "contiguous":
            self.kv_cache_manager = ContiguousKVCacheManager(num_gpu_blocks, cc.block_size, self.max_model_len)
        elif config.mamba_align:  # linear-attention groups under prefix caching (vLLM's mamba_cache_mode "align")
            self.kv_cache_manager = MambaAlignCoordinator(
                num_gpu_blocks, cc.block_size, self.max_model_len, tuple(g.linear for g in groups.groups),
                cc.enable_prefix_caching, cc.watermark, config.attention.prefix_cache_retention_interval,
                config.mamba_prefill_checkpoints,
                num_speculative_blocks=config.speculative.num_speculative_tokens if config.speculative.enabled else 0,
                hash_lookahead=hash_lookahead, eagle_block_drop=eagle_block_drop)
        elif groups.has_sliding_window:  # a block table per KV-cache group (vLLM's hybrid manager)
            self.kv_cache_manager = KVCacheCoordinator(
                num_gpu_blocks, cc.block_size, self.max_model_len, groups.windows, cc.enable_prefix_caching,
                cc.watermark, config.max_in_flight_tokens, config.attention.prefix_cache_retention_interval,
                hash_lookahead=hash_lookahead, reprefillable=reprefillable,
                eagle_block_drop=eagle_block_drop, chunked=groups.chunked)
        else:
            self.kv_cache_manager = KVCacheManager(
                num_gpu_blocks, cc.block_size, self.max_model_len, cc.enable_prefix_caching,
                cc.watermark, cc.prefix_caching_hash_bits, cc.reserve_null_block,
                hash_lookahead=hash_lookahead, reprefillable=reprefillable,
                eagle_block_drop=eagle_block_drop,
                num_state_blocks=groups.num_linear_groups * config.state_blocks_per_group,
                num_state_groups=groups.num_linear_groups)
        # P/D: a pull is admitted only if it also leaves the blocks of one speculative step free
        # (in every KV-cache group: vLLM's _spec_decode_step_blocks sums them)
        self._spec_step_blocks = config.spec_step_blocks * (len(groups.groups) if groups.has_sliding_window else 1)
        self.waiting = PriorityRequestQueue() if self.policy == "priority" else FCFSRequestQueue()
        # P/D (core/remote_kv.py): waiting requests that hold blocks (their KV being pulled, or
        # pulled), looked at before `waiting`; finished requests whose blocks wait to be read.
        self.kv_holding = PriorityRequestQueue() if self.policy == "priority" else FCFSRequestQueue()
        self._num_kv_ready = 0  # in kv_holding with their pull ended
        self._aborted_loads: dict[Request, list] = {}  # aborted while their KV loads: blocks held till it ends
        self._aborted: list[Request] = []  # detail mode: aborted since the last schedule() (SchedulerOutput.aborted)
        self.kv_held: dict[int, Request] = {}
        # finished sends left out of the table, (blocks, their deferred free) held till read or expiry
        self._abandoned_sends: dict[Request, tuple[int, list]] = {}
        # (vLLM defers with a connector whenever batches overlap: async scheduling, pipeline stages)
        # (NIXL's _prefill_backoff: a linear-attention model's last prompt token, multi-module MTP's
        # K - 1, are left to the decode side)
        self._init_remote_kv(defer_block_free=config.max_concurrent_batches > 1 and kv_connector,
                             prefill_backoff=max(int(groups.num_linear_groups > 0), lookahead - 1) if kv_connector else 0)
        # KV offloading to CPU memory (vLLM's OffloadingConnector): a second prefix-cache tier
        self.offload = self._offload_tier(config, num_offload_chunks) if num_offload_chunks else None
        # KV offloading on linear-attention layers storing decode states (core/kv_offload_mamba.py):
        # vLLM caches a decoder's states as it schedules them, so steady decoders that complete a
        # chunk cache theirs at that step, offered in running order (`_state_offer_marks`)
        self._decode_state_offers = (isinstance(self.offload, MambaKVOffload) and not self.offload.prompt_only
                                     and self.offload.retention_interval != 0)
        self._state_offer_marks = (0, 0)  # (the offers before this schedule(), and before its admissions)
        self.running: list[Request] = []
        self.current_step = 0
        self._next_seq = 0
        self._prefilling: list[Request] = []
        self._num_decoders = 0
        self._sum_decode_base = 0
        self._resuming: list[Request] = []  # steady decoders the budget left out of the latest step
        self._boundary_heap: list[tuple] = []
        self._finish_heap: list[tuple] = []
        # Sliding-window layers (steady_decoders.py): (full-attention layers, window layers,
        # window) count the attended context in layer-tokens; decoders below the window (their
        # number and base sum) and the steps at which they reach it. Under the coordinator a
        # decoder's window releases are events on the boundary heap.
        self._window_context = self._layer_split(config) if not self.chunked_decodes else None
        # DeepSeek sparse attention: a decoder's query attends min(context, top-k) tokens, which
        # the window's bookkeeping counts (decoders below top-k, the steps they reach it) beside
        # the whole context its indexer scores (decode_capped_context_tokens)
        self._sparse_cap = config.hardware.model_spec().index_topk if not self.chunked_decodes else 0
        if self._sparse_cap:
            self._window_context = (1, 0, self._sparse_cap)
        self._window_chunk = config.attention_chunk_size  # chunked local attention's chunk (0: windows slide)
        self._window_releases = isinstance(self.kv_cache_manager, (KVCacheCoordinator, MambaAlignCoordinator))
        # Mamba prefix caching: prefill chunks end where a state must be written (mamba_align.py)
        self._mamba_split = isinstance(self.kv_cache_manager, MambaAlignCoordinator)
        self._max_prefill_tokens = min(self.max_num_scheduled_tokens, sc.long_prefill_token_threshold or (1 << 62))
        self._async_releases = self._window_releases and self.overlapped
        # P/D with sliding-window layers: vLLM gives back a finished request's out-of-window
        # blocks before it hands the block table to the connector (and before any other free)
        self._release_at_finish = self._window_releases and kv_connector
        self._num_below = 0
        self._sum_base_below = 0
        self._crossing_heap: list[tuple] = []
        # The block calendar (steady_decoders.py) serves a paged pool without lookahead slots
        # until the first forked sequence: per residue of the step modulo block_size, the
        # decoders due for a block then, and their block tables, in seq order.
        periodic = isinstance(self.kv_cache_manager, KVCacheManager) and self.num_lookahead_tokens == 0
        self._calendar: list[list[Request]] | None = [[] for _ in range(self.block_size)] if periodic else None
        self._calendar_tables: list[list[list]] | None = [[] for _ in range(self.block_size)] if periodic else None
        # priority policy: the running requests by victim order (`_victim_entry`)
        self._victim_heap: list[tuple] = []
        self._blocked_marker: tuple | None = None  # (head, frees, budget, its ADMISSION_LIMITS code)
        # What kept requests waiting after the last schedule() (core/admission_limits.py), and
        # while _schedule_waiting runs, the first reason a request was passed over and why a pull stopped it
        self.admission_limit = self._passed_over = self._pull_limit = NONE
        # Counters.
        self.num_preemptions = 0
        self.num_preempted_requests = 0
        self._preemptions_since_finish = 0
        self._next_child_index = FIRST_SEQUENCE_INDEX  # parallel-sampling sequences: beyond any trace row
        self.num_done_sequences = 0  # finished or aborted (a parallel-sampling request's each; DP ranks count them)
        self.fan_out = config.scheduler.parallel_sampling == "fan_out"
        # Swap preemption (vLLM v0): CPU blocks in use, and counters.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_blocks_used = 0
        self.num_swapped = 0
        self.num_swap_outs = 0
        self.total_swap_out_blocks = 0
        self.total_swap_in_blocks = 0
        self.irregular_gaps: list[tuple[int, int]] = []  # (last token step, token step)
        # the steps in which a steady decoder the budget had left out decoded again: each has one
        # irregular gap, and one fewer one-step gap than its num_decode_tokens
        self.resumed_steps: list[int] = []
        # Request classes (track_classes): the steady decoders of each class, and the class of
        # each irregular gap (of each pipeline gap, keyed (previous step, step, class)); None: untracked
        self.decoders_by_class: list[int] | None = None
        self.irregular_gap_classes: list[int] | None = None
        self.resumed_classes: list[int] | None = None
        self.pipeline_gaps_by_class: dict[tuple[int, int, int], int] | None = None
        # Decodes as chunks (speculative decoding, pipeline stages), one KV-cache group and none of the
        # features that act on running requests: a step in which every running request with tokens to
        # run decodes or verifies its drafts may be scheduled by _decode_chunks_step (spec_decode.py)
        self._decode_chunks_fast = (self.chunked_decodes and self.offload is None
                                    and self.max_loras is None and not self.detail and self.prefill_interval <= 1
                                    and not self.dp_cadence and self.spec_drafts_by_batch is None
                                    and not self.admit_before_running
                                    and type(self.kv_cache_manager) is KVCacheManager)

    @staticmethod
    def _layer_split(config: EngineConfig) -> tuple[int, int, int] | None:
        """(full-attention layers, sliding-window layers, window) of a model with one window
        size (chunked local attention: local layers, chunk); None without sliding-window layers."""
        if not config.has_sliding_window:
            return None
        layers = config.layer_windows
        windows = {w for w in layers if w}
        if len(windows) != 1:
            raise ValueError("steady decoders model one sliding-window size")
        window = windows.pop()
        num_window = sum(1 for w in layers if w)
        return len(layers) - num_window, num_window, window

    # ---- queues ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if request.kv_role == KV_SEND and self.prefill_backoff:
            self._truncate_for_prefill(request)
        self.waiting.add_request(request)
        if request.num_samples > 1 and self.fan_out:
            self._fan_out(request)

    def _fan_out(self, root: Request) -> None:
        """Parallel sampling as vLLM v1 does it (core/parallel_sampling.py): the request's other
        n - 1 sequences are requests of their own, queued right after it."""
        members = fan_out(root, self._next_child_index)
        self._next_child_index += len(members)
        for member in members:
            self.waiting.add_request(member)

    def _sequence_of(self, root: Request, k: int) -> Request:
        """Sequence `k` of parallel-sampling request `root` (vLLM v0's forks)."""
        self._next_child_index += 1
        return sequence_of(root, k, self._next_child_index - 1)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.kv_holding)

    def track_classes(self, num_classes: int) -> None:
        """Count each step's token gaps per request class (`Request.class_code`, 0 to
        num_classes - 1) beside the totals: SchedulerOutput.decodes_by_class and
        spec_emissions_by_class, DecodeRun.decodes_by_class, irregular_gap_classes and
        pipeline_gaps_by_class. Call before the first request arrives."""
        self.decoders_by_class = [0] * num_classes
        self.irregular_gap_classes = []
        self.resumed_classes = []
        if self.pipeline_gaps is not None:
            self.pipeline_gaps_by_class = {}

    def _resume(self, step: int) -> None:
        """The steady decoders left out of the previous step that decode in `step`: their
        tokens' gaps span the steps they missed, an irregular gap each, which `step`'s
        one-step gaps (num_decode_tokens) leave out (`resumed_steps`)."""
        for request in self._resuming:
            if request.decode_base is None or request.stall_step == step or request.stall_gap_from < 0:
                continue  # (preempted, finished or left out again)
            request.last_token_step = request.stall_gap_from
            request.stall_gap_from = -1
            self._note_irregular_gap(request, step)
            self.resumed_steps.append(step)
            if self.resumed_classes is not None:
                self.resumed_classes.append(request.class_code)
        self._resuming = []

    def _note_irregular_gap(self, request: Request, step: int) -> None:
        """The request's token sampled in `step` follows its previous one by more than a step."""
        self.irregular_gaps.append((request.last_token_step, step))
        if self.irregular_gap_classes is not None:
            self.irregular_gap_classes.append(request.class_code)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or len(self.kv_holding) > 0

    def _position(self, request: Request) -> int:
        return bisect_left(self.running, request.seq, key=_seq_of)

    def _append_running(self, request: Request) -> None:
        request.seq = self._next_seq
        self._next_seq += 1
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._prefilling.append(request)
        if self.policy == "priority":
            heapq.heappush(self._victim_heap, self._victim_entry(request))

    @staticmethod
    def _victim_entry(request: Request) -> tuple:
        """The priority policy's victim heap entry: the max (priority, arrival) first; equal
        arrivals in trace order, but a fanned-out request's members (one arrival time in vLLM
        too) the first in running order, as vLLM's max() over its running list takes them."""
        return -request.priority, -request.arrival_time, -request.prompt_owner, request.seq, request

    def _remove_running(self, request: Request) -> None:
        del self.running[self._position(request)]

    # ---- preemption --------------------------------------------------------------------------
    def _pick_victim(self, requester: Request) -> Request:
        if self.preemption_victim == "requester":
            return requester
        if self.policy != "priority":
            return self.running[-1]
        heap = self._victim_heap
        while True:
            request = heap[0][-1]
            if request.status == RequestStatus.RUNNING and request.seq == heap[0][-2]:
                return request
            heapq.heappop(heap)

    def _preempt(self, request: Request, step: int, scheduled_tokens: int, plan: StepPlan | None = None) -> None:
        decoding = request.decode_base is not None or request.is_finishing
        in_flight = self.async_scheduling and self._ran_in_flight(request)  # (before it leaves decoding)
        if request.decode_base is not None:
            computed = self._leave_decoding(request, step)
            request.last_token_step = step - 1 if request.stall_gap_from < 0 else request.stall_gap_from
            request.stall_gap_from = -1
        else:
            computed = request.num_computed_tokens
            if not request.is_finishing:  # (a finishing request has left the prefilling list already)
                self._prefilling.remove(request)
        kv = self.kv_cache_manager
        held = kv.num_blocks_of(request)
        swap = self.preemption_mode == "swap" and self.cpu_blocks_used + held <= self.num_cpu_blocks
        # A swapped request keeps its computed tokens (its KV waits in CPU memory); the GPU
        # blocks are released like a finished request's. Otherwise RECOMPUTE (or restart).
        cache_end = computed + scheduled_tokens
        if self._counts_in_flight:
            cache_end = self._spec_async_preempt(request)
        elif self.async_scheduling and decoding:
            cache_end = self._async_cache_end(request, computed, scheduled_tokens, step, in_flight)
        kv.free(request, cache_end, finished=swap)
        self._free_items(request)
        self._remove_running(request)
        request.status = RequestStatus.PREEMPTED
        if request.is_finishing:
            # async: its last token is in flight; it finishes when that step's output is processed
            self._count_preemption(request)
            return
        if swap:
            request.num_computed_tokens = computed
            request.swapped_blocks = held
            self.cpu_blocks_used += held
            self.num_swapped += 1
            self.num_swap_outs += 1
            self.total_swap_out_blocks += held
            if plan is not None:
                plan.swap_out_blocks += held
        else:
            request.num_computed_tokens = 0
        request.spec_drafts = 0
        if self.preemption_mode == "restart":
            request.num_output_tokens = 0
        self._count_preemption(request)
        self.waiting.prepend_request(request)

    def _count_preemption(self, request: Request) -> None:
        if request.num_preemptions == 0:
            self.num_preempted_requests += 1
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preemptions_since_finish += 1
        if self._preemptions_since_finish > 200 + 20 * (len(self.running) + len(self.waiting)):
            raise LivelockError(
                f"{self._preemptions_since_finish} preemptions in a row without any request finishing "
                f"(last victim {request.request_id}, preempted {request.num_preemptions} times; "
                f"preemption_mode={self.preemption_mode}, preemption_victim={self.preemption_victim}): "
                "the KV cache is too small for the requests running together; raise num_gpu_blocks or "
                "lower max_num_seqs")

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._decode_chunks_fast:  # (decodes as chunks: most steps only decode or verify drafts)
            out = self._decode_chunks_step()
            if out is not None:
                return out
        step = self.current_step
        self.current_step += 1
        self._num_schedule_calls += 1
        if self.offload is not None:
            self.offload.step = step  # (KV offloading on window groups: the step its allocations come in)
            if self._decode_state_offers:
                self._state_offer_marks = (len(self.kv_cache_manager.state_offers),) * 2
        if self.overlapped:
            used_before = self.kv_cache_manager.block_pool.get_num_used_blocks()
            self._retire_finished_decoders(step)
        plan = StepPlan(self.max_num_scheduled_tokens, self._prefill_threshold(), self.spec_draft_slots,
                        self.max_num_batched_tokens)
        plan.encoder_budget = self.encoder_budget
        if self.prefill_interval > 1:
            plan.defer_prefills = self._holds_prefill()
        elif self.throttle_prefills:  # (data-parallel ranks: a step off the coordinated cadence)
            plan.defer_prefills = not self._prefill_capacity_bound and self._decodes_running()
        if self._mamba_split:
            self.kv_cache_manager.new_step_starts()
        if self._window_context is not None:
            self._settle_crossings(step)
        due = self._due_at(step)
        kv = self.kv_cache_manager
        if (not self._prefilling and not self._finishing and not self.admit_before_running and not kv.num_forks
                and plan.budget >= len(self.running)
                and (not due or self._blocks_due(due, step) <= kv.block_pool.get_num_free_blocks())):
            # Only steady decoders run, all fit the budget and every one due for a block gets
            # one: nothing can preempt, so they are served in bulk (same blocks, same order).
            if due:
                self._take_boundary_blocks(due, step)
            plan.budget -= len(self.running)
            stall_pos = -1
        else:
            if self.chunked_decodes:  # (every running request is a chunk; those with nothing to run are left
                # out: _schedule_running's num_new <= 0, inline on this hot path)
                active = [r for r in self._prefilling if r.num_computed_tokens < r.num_prompt_tokens
                          + r.num_output_tokens + r.spec_drafts + r.num_output_placeholders]
            else:
                active = self._prefilling + due
                if self._finishing:
                    active += self._running_finishing()
                active.sort(key=_seq_of)
            if self.admit_before_running:
                plan.first_new_seq = self._next_seq
                self._schedule_waiting(step, plan)
            stall_pos = self._schedule_running(step, active, plan)
        num_stalled = stalled_base = stalled_below = stalled_below_base = 0
        stalled = self.running[stall_pos:] if stall_pos >= 0 else None
        if stalled:
            num_stalled, stalled_base, stalled_below, stalled_below_base = self._stall_counts(stalled)
        num_decodes = self._num_decoders - num_stalled
        by_class = self.decoders_by_class
        if by_class is not None:
            by_class = list(by_class)
            for request in stalled or ():
                if request.decode_base is not None:
                    by_class[request.class_code] -= 1
        decode_base_sum = self._sum_decode_base + num_stalled - stalled_base  # bases before slip
        num_below, below_base_sum = self._num_below - stalled_below, self._sum_base_below + stalled_below - stalled_below_base
        decode_context = self._decode_context(step, num_decodes, decode_base_sum, num_below, below_base_sum)
        capped_context = (self._capped_context(step, num_decodes, num_below, below_base_sum)
                          if self._sparse_cap else 0)
        if self._decode_state_offers:
            self._state_offer_marks = (self._state_offer_marks[0], len(kv.state_offers))
        if not plan.preempted and not self.admit_before_running:
            self._schedule_waiting(step, plan)
        elif plan.preempted and (not self.admit_before_running or self.admission_limit == NONE):
            # (vLLM admits nothing in a step that preempted; admitting first, only the victims wait)
            self.admission_limit = PREEMPTION
        if plan.chunks or num_decodes or not self.async_scheduling:  # (an executed step)
            if num_stalled:
                self._stall(stalled, step)
            if self._resuming:
                self._resume(step)
            if num_stalled:
                self._resuming = [request for request in stalled if request.decode_base is not None]
        elif num_stalled:  # (an async schedule() that runs nothing is no step: nobody slips)
            self._refile(stalled, step)
        if self.offload is not None:
            self._offload_stores(plan, stall_pos)
        if self.detail:
            self._fill_block_ids(plan.chunks)
        decodes = self._list_decodes(step, stall_pos) if self.detail else None
        # (before async scheduling turns the chunks that end their prompts into decoders)
        lora_tokens, adapters = self._lora_load(plan.chunks, stall_pos) if self.max_loras is not None else (0, ())
        num_waiting = len(self.waiting) + len(self.kv_holding)
        num_blocks_used = self.kv_cache_manager.block_pool.get_num_used_blocks()
        verify = drafts = to_propose = 0
        if self.prefill_interval > 1 or self.dp_cadence:  # (before async scheduling adds this step's placeholders)
            self._mark_prefill_chunks(plan.chunks)
        if self.chunked_decodes:
            to_propose = self._spec_tokens_to_schedule(len(plan.chunks))
            if self._counts_in_flight:
                verify, drafts = self._spec_async_after_schedule(plan.chunks, to_propose)
            else:
                verify, drafts = self._spec_after_schedule(plan.chunks)
        if self.overlapped:
            self._note_take(step, num_blocks_used - used_before)
            finishing = self._num_preempted_finishing()
            if finishing and not num_waiting:  # (they leave when their last token comes back)
                self.admission_limit = FINISHING
            num_waiting += finishing
            if plan.chunks:
                if not self._counts_in_flight:  # (under it, _spec_async_after_schedule did)
                    self._advance_scheduled_chunks(plan.chunks, step)
            elif not num_decodes:
                self.current_step = step  # nothing to run: not a step (the engine waits for the one in flight)
            if plan.chunks or num_decodes:
                self._scheduled_through = step
                for chunk in plan.chunks:
                    chunk.request.last_sched_step = step
        if self.prefill_interval > 1 and (plan.chunks or num_decodes):  # (an executed step)
            self._num_executed_steps += 1
            if plan.prefill_carried:
                self._last_prefill_step = self._num_executed_steps
        self._output_pending = True  # (until update_from_output)
        encoded = loaded = ()
        if plan.encoder_inputs:
            encoded = tuple(e for items in plan.encoder_inputs.values() for e in items)
            self.num_encoded_items += len(encoded)
            self.num_encoded_embeds += sum(encoded)
        if plan.encoder_loads:
            loaded = tuple(e for items in plan.encoder_loads.values() for e in items)
            self.num_loaded_items += len(loaded)
            self.num_loaded_embeds += sum(loaded)
        if plan.encoder_saves:  # (in the store once the step ran: update_from_output)
            self._ec_saves = [h for hashes in plan.encoder_saves.values() for h in hashes]
        return SchedulerOutput(
            step=step, chunks=plan.chunks, num_decode_reqs=num_decodes, decode_context_tokens=decode_context,
            decode_capped_context_tokens=capped_context, decodes=decodes, preempted=plan.preempted, num_running=len(self.running),
            num_waiting=num_waiting, num_blocks_used=num_blocks_used,
            prefix_query_tokens=plan.query, prefix_hit_tokens=plan.hit, num_swapped=self.num_swapped,
            num_swap_out_blocks=plan.swap_out_blocks, num_swap_in_blocks=plan.swap_in_blocks,
            kv_loads=plan.kv_loads or None, num_verify_tokens=verify, num_draft_tokens=drafts,
            num_spec_tokens_to_schedule=to_propose,
            offload_jobs=self.offload.take_step_jobs() if self.offload is not None else None,
            num_lora_tokens=lora_tokens, num_active_loras=len(adapters), lora_adapters=adapters,
            encoder_item_embeds=encoded, encoder_loaded_embeds=loaded,
            aborted=self._take_aborted(), admission_limit=self.admission_limit if num_waiting else NONE,
            decodes_by_class=by_class)

    def _offload_tier(self, config: EngineConfig, num_chunks: int) -> KVOffload:
        """KV offloading's connector: one group's (core/kv_offload.py), or the groups' of a model
        with sliding-window layers (core/kv_offload_hybrid.py) or linear-attention layers
        (core/kv_offload_mamba.py). `self._offload_view(request)`
        says what it needs of the request's blocks (their count; the groups' table)."""
        cc, kv = config.cache, self.kv_cache_manager
        options = dict(blocks_per_chunk=cc.offload_blocks_per_chunk, prompt_only=cc.kv_offloading_prompt_only,
                       eagle=config.speculative.is_eagle_family, policy=cc.kv_offloading_policy,
                       store_threshold=cc.kv_offloading_store_threshold,
                       max_tracker_size=cc.kv_offloading_max_tracker_size)
        if isinstance(kv, MambaAlignCoordinator):
            tier = MambaKVOffload(num_chunks, cc.block_size, kv.hasher, kv, **options)
            self._offload_view = tier.view
            return tier
        if isinstance(kv, KVCacheCoordinator):
            tier = HybridKVOffload(num_chunks, cc.block_size, kv.hasher, kv.windows, kv.retention_interval, kv,
                                   chunked=kv.chunked, **options)
            self._offload_view = tier.view
            return tier
        self._offload_view = kv.num_blocks_of
        return KVOffload(num_chunks, cc.block_size, kv.hasher, **options)

    # ---- prefill cadence (vLLM's local prefill_schedule_interval) -----------------------------------
    def _holds_prefill(self) -> bool:
        """This step holds prefill back: the interval since the last step that carried prefill has
        not passed, the last release step did not leave requests waiting, and some running
        request decodes (vLLM's gate)."""
        return (not self._prefill_capacity_bound
                and self._num_executed_steps + 1 - self._last_prefill_step < self.prefill_interval
                and self._decodes_running())

    def _decodes_running(self) -> bool:
        """Some running request is not a prompt chunk (vLLM's any(not is_prefill_chunk)); under
        async scheduling one whose last token is in flight counts."""
        return (self._num_decoders > 0 or any(not r.prefill_chunk for r in self._prefilling)
                or any(r.status == RequestStatus.RUNNING for r in self._finishing))

    @staticmethod
    def _mark_prefill_chunks(chunks) -> None:
        """Each scheduled chunk notes whether it leaves prompt to compute (vLLM's is_prefill_chunk:
        its end short of the known tokens, and under async scheduling of the ones in flight)."""
        for chunk in chunks:
            request = chunk.request
            request.prefill_chunk = (chunk.num_computed_tokens + chunk.num_new_tokens
                                     < request.num_tokens + request.num_output_placeholders)

    def _schedule_running(self, step: int, active: list[Request], plan: StepPlan) -> int:
        """Serve running requests in list order; returns the position from which requests were
        left unscheduled by an exhausted budget (-1 if none). Steady decoders between the
        `active` ones (prefills, decoders crossing a block boundary) each take one token. When
        decodes are chunks there are no steady decoders: `active` holds the running requests
        that have tokens to run, in running order, no positions are kept, and -1 is returned."""
        prev_pos = -1
        kv = self.kv_cache_manager
        chunked = self.chunked_decodes
        for request in active:
            if request.status != RequestStatus.RUNNING:
                continue
            if chunked:
                if plan.budget <= 0 or plan.input_budget <= plan.draft_slots:
                    plan.budget = 0
                    return -1
            else:
                pos = self._position(request)
                quiet = pos - prev_pos - 1
                if quiet >= plan.budget or plan.input_budget <= plan.draft_slots:
                    return self._exhaust_budget(plan, prev_pos)
                plan.budget -= quiet
                prev_pos = pos
            if request.is_finishing:
                continue  # async: its last token is in flight; it needs no more
            if plan.defer_prefills and request.prefill_chunk:
                continue  # prefill cadence: its prompt's next chunk waits for a step that carries prefill
            if request.num_output_placeholders and self._spec_async_done(request):
                continue
            if self._num_schedule_calls < request.next_decode_call:
                continue  # pipeline parallelism, async: it sampled fewer than pp_size calls ago
            plan.moved_ahead = False
            is_decoder = request.decode_base is not None  # a steady decoder due for a block (or a copy)
            if is_decoder:
                num_new = 1
                scheduled = self._decode_slot(request, step + request.decode_base, step, plan)
            else:
                computed = request.num_computed_tokens
                num_new = request.num_tokens + request.spec_drafts + request.num_output_placeholders - computed
                if 0 < plan.threshold < num_new:
                    num_new = plan.threshold
                num_new = min(num_new, plan.request_budget(), self.max_model_len - computed - 1)
                if self._mamba_split and num_new > 0:
                    num_new = self._mamba_aligned(request, computed, num_new)
                encoding = None
                if request.mm_items and num_new > 0:
                    num_new, encoding = self._encoder_inputs(request, computed, num_new, plan)
                if self.num_prefill_lookahead:
                    num_new = self._reserve_prefill_lookahead(request, computed, num_new)
                if num_new <= 0:
                    continue
                # async with window releases: they go by the tokens whose output was processed
                processed = {"num_processed_tokens": self._processed_tokens(request, computed, step)} \
                    if self._async_releases else {}
                while kv.allocate_slots(request, computed, num_new, num_lookahead_tokens=self.num_lookahead_tokens,
                                        **processed) is None:
                    if self._preempt_for(request, step, plan):
                        break
                scheduled = request.status == RequestStatus.RUNNING and not plan.blocked
                if scheduled and self._counts_in_flight:
                    self._note_cached(request, computed + num_new)
                if scheduled and encoding is not None:
                    self._encode(request, encoding, plan)
            if plan.blocked:  # it and the requests after it wait (the budget stays for admissions)
                return self._position(request)
            if not scheduled:  # it preempted itself
                prev_pos = self._position(request) - 1
                if self.policy == "priority" or self.preemption_victim == "requester":
                    continue
                return -1
            if plan.moved_ahead and not chunked:
                prev_pos = self._position(request)
            plan.schedule(request, num_new)
            if is_decoder:
                if self._calendar is None:  # (in the calendar it stays in its bucket)
                    self._push_boundary(request, step + 1)
            else:
                chunk = ScheduledChunk(request, computed, num_new, request.num_output_tokens > 0)
                if request.prefill_chunk:
                    plan.prefill_carried = True
                plan.chunks.append(chunk)
                request.prev_chunk_step, request.prev_chunk_tokens = request.last_chunk_step, request.last_chunk_tokens
                request.last_chunk_step, request.last_chunk_tokens = step, num_new
                if self.num_spec_tokens:
                    self._spec_scheduled(request, chunk, plan)
        if chunked:
            return -1
        end = self._position_of_seq(plan.first_new_seq) if plan.first_new_seq >= 0 else len(self.running)
        quiet = end - prev_pos - 1
        if quiet > plan.budget:
            return self._exhaust_budget(plan, prev_pos)
        plan.budget -= quiet
        return -1

    def _decode_slot(self, request: Request, computed: int, step: int, plan: StepPlan) -> bool:
        """A steady decoder's next token needs a block (a new one at a boundary, or a copy of a
        shared partial block): preempt until one is free, as allocate_slots would. Returns False
        if the request preempted itself."""
        kv = self.kv_cache_manager
        free_queue = kv.block_pool.free_block_queue
        if self._window_releases:  # the coordinator: the window's release, then a block per group
            kv.decode_release(request, self._decoder_release_point(request, computed, step))
            need = kv.decode_block_need(request, computed, 0)
            while need > free_queue.num_free_blocks:
                if self._preempt_for(request, step, plan):
                    return False
            if need:
                kv.decode_write(request, computed)
            return True
        if not kv.num_forks:  # no forked sequences: the event is a block boundary
            while free_queue.num_free_blocks == 0:
                if self._preempt_for(request, step, plan):
                    return False
            kv.append_block(request)
            return True
        lookahead = self.num_lookahead_tokens
        need = kv.decode_block_need(request, computed, lookahead)
        while need and free_queue.num_free_blocks == 0:
            if self._preempt_for(request, step, plan):
                return False
            need = kv.decode_block_need(request, computed, lookahead)
        if need:
            kv.decode_write(request, computed)
        return True

    def _preempt_for(self, request: Request, step: int, plan: StepPlan) -> bool:
        """Preempt one victim so that `request` may get blocks; True if it was `request` itself,
        or if the victim's blocks cannot be freed now (`plan.blocked`: `request` waits)."""
        victim = self._pick_victim(request)
        if self.defer_block_free and self._ran_in_flight(victim):
            plan.blocked = True
            return True
        # A steady decoder ahead of `request` already took its token implicitly.
        implicit = victim.seq < request.seq and victim.decode_base is not None
        if victim.seq < request.seq:
            plan.moved_ahead = True  # the running list shifted before `request`
        self._preempt(victim, step, plan.unschedule(victim, implicit), plan)
        plan.preempted.append(victim)
        return victim is request

    @staticmethod
    def _exhaust_budget(plan: StepPlan, prev_pos: int) -> int:
        """The quiet decoders after `prev_pos` take the rest of the budget; the first one
        left without a token is at the returned position."""
        stall_pos = prev_pos + 1 + plan.budget
        plan.budget = 0
        return stall_pos

    def _position_of_seq(self, seq: int) -> int:
        return bisect_left(self.running, seq, key=_seq_of)

    def _prefill_threshold(self) -> int:
        threshold = self.long_prefill_token_threshold
        num_eligible = len(self.running) + len(self.waiting) + len(self.kv_holding)
        if num_eligible <= 1:
            return 0
        if threshold > 0 and self.adaptive_threshold:
            threshold = max(threshold, self.max_num_batched_tokens // num_eligible)
        return threshold

    def _schedule_waiting(self, step: int, plan: StepPlan) -> None:
        kv = self.kv_cache_manager
        admitted = 0
        skipped: list[Request] = []  # P/D: set aside this step (core/remote_kv.py)
        skipped_waiting: list[Request] = []  # KV offloading, LoRA: to look up again at a later step
        # LoRA: the adapters of every running request, scheduled this step or not (vLLM's scheduled_loras)
        loras = {r.lora_id for r in self.running if r.lora_id} if self.max_loras is not None else None
        lora_skips = 0
        limit = self._passed_over = NONE  # (what stops the loop; the first reason a request was passed over)
        while plan.budget > 0 and (self.waiting or self.kv_holding):
            if plan.input_budget <= plan.draft_slots:
                limit = TOKEN_BUDGET
                break
            if len(self.running) >= self.max_num_active:
                limit = MAX_NUM_SEQS
                break
            if admitted >= self.max_num_admissions_per_step:
                limit = ADMISSION_CAP
                break
            if self.kv_holding or self.waiting.peek_request().kv_role == KV_PULL:
                head = self._next_waiting(skipped, plan, skipped_waiting, loras)
                if head is None:  # (a pull whose blocks do not fit, or every one left passed over)
                    limit = self._pull_limit
                    break
                queue, request, holds_kv = head
            else:
                queue = self.waiting
                request = queue.peek_request()
                holds_kv = bool(request.swapped_blocks)
            if request.num_stale_tokens:  # (pipeline parallelism: an output from before its preemption is in
                self._set_aside(queue, skipped, skipped_waiting, PIPELINE)  # flight; resuming could resample its position)
                continue
            if self._lora_deferred(request, loras):  # (no adapter slot: it waits, the next may go)
                lora_skips += 1
                self._set_aside(queue, skipped, skipped_waiting, MAX_LORAS)
                continue
            swapped = request.swapped_blocks
            # A request that holds its KV (swapped out, or pulled) does no prefix lookup.
            computed = _HOLDS_KV if holds_kv else kv.get_computed_blocks(request)
            if self.offload is not None and not holds_kv:  # (then the CPU tier, past the local hit)
                external = self.offload.lookup(request, computed.num_tokens)
                if external is None:  # (ask again at a later step; vLLM counts lookups at admission)
                    self._pass_over(KV_TRANSFER)
                    skipped_waiting.append(queue.pop_request())
                    continue
                if external:
                    if not self._admit_offload_load(request, computed, external, plan, skipped):
                        limit = self._block(request, plan, KV_CACHE)
                        break
                    self._pass_over(KV_TRANSFER)  # (its load starts: it waits in the KV-holding queue)
                    skipped.append(queue.pop_request())
                    continue
            base = request.num_computed_tokens if holds_kv else 0
            if plan.defer_prefills and base + computed.num_tokens < request.num_tokens - 1:
                limit = PREFILL_CADENCE  # (a prompt to compute: it waits for a step that carries prefill)
                break
            num_new = request.num_tokens - base - computed.num_tokens
            padded = False
            if self.num_spec_tokens and num_new == 1:
                num_new = self._spec_padding(base + computed.num_tokens, num_new, plan)
                if num_new == 0:  # its padded rows do not fit this step
                    limit = TOKEN_BUDGET
                    break
                padded = num_new > 1
            if 0 < plan.threshold < num_new:
                num_new = plan.threshold
            if not self.enable_chunked_prefill and num_new > plan.request_budget():
                limit = self._block(request, plan, TOKEN_BUDGET)
                break
            num_new = min(num_new, plan.request_budget())
            if self._mamba_split:
                num_new = self._mamba_aligned(request, base + computed.num_tokens, num_new)
                if num_new == 0:  # (no block-aligned chunk fits the budget)
                    limit = self._block(request, plan, TOKEN_BUDGET)
                    break
                if padded and num_new != 1 + self.num_spec_tokens:  # (the split cut the padded rows:
                    num_new, padded = 1, False  # vLLM drops the padding rather than shorten it)
            encoding = None
            passed_for = TOKEN_BUDGET  # (if nothing of it fits below)
            if request.mm_items:
                stops = self.num_encoder_stops
                num_new, encoding = self._encoder_inputs(request, base + computed.num_tokens, num_new, plan)
                if self.num_encoder_stops != stops:
                    passed_for = ENCODER
            if self.num_prefill_lookahead:
                num_new = self._reserve_prefill_lookahead(request, base + computed.num_tokens, num_new)
            if num_new == 0:  # (an item that does not fit the encoder's budget or cache, or no chunk that
                # keeps multi-module MTP's runway within the budget: it is passed over)
                self._set_aside(queue, skipped, skipped_waiting, passed_for)
                continue
            new_blocks = kv.allocate_slots(
                request, base, num_new, computed, self.num_lookahead_tokens,
                full_sequence_must_fit=self.reserve_full_isl, has_scheduled_reqs=bool(self.running))
            if new_blocks is None:
                self._free_items(request)  # (the cached items it looked up)
                limit = self._block(request, plan, KV_CACHE)
                break
            if request.kv_role == KV_PULL:  # (P/D: its local hits covered what a pull would load)
                request.kv_role = 0
            if self._counts_in_flight:
                self._note_cached(request, base + computed.num_tokens + num_new)
            if swapped:  # swap-in: its KV comes back from CPU memory into the new blocks
                self.cpu_blocks_used -= swapped
                self.num_swapped -= 1
                self.total_swap_in_blocks += swapped
                plan.swap_in_blocks += swapped
                request.swapped_blocks = 0
            elif not holds_kv:
                kv.record_prefix_cache_stats(request, computed.num_tokens)
                plan.query += request.num_tokens
                plan.hit += computed.num_tokens
            queue.pop_request()
            request.set_aside = False
            if queue is self.kv_holding:
                self._num_kv_ready -= 1
            is_resumed = request.status == RequestStatus.PREEMPTED
            self._append_running(request)
            if encoding is not None:
                self._encode(request, encoding, plan)
            if loras is not None and request.lora_id:
                loras.add(request.lora_id)
            if request.first_scheduled_step < 0:
                request.first_scheduled_step = step
                if not holds_kv:
                    request.num_prefix_hit_tokens = computed.num_tokens
            request.num_total_prefix_hit_tokens += computed.num_tokens
            chunk = ScheduledChunk(request, base + computed.num_tokens, num_new, is_resumed)
            if chunk.num_computed_tokens < request.num_tokens - 1:  # (admitted with a prompt to compute)
                plan.prefill_carried = True
            request.prev_chunk_step, request.prev_chunk_tokens = request.last_chunk_step, request.last_chunk_tokens
            request.last_chunk_step, request.last_chunk_tokens = step, num_new
            if padded:
                chunk.num_spec_tokens = num_new - 1
                chunk.spec_placeholder = True
            if self.num_spec_tokens:
                # An in-flight prefill from now on (P/D: what pulls must leave free), or, a pulled
                # request, until the step's end (vLLM drops it from the set after scheduling).
                request.spec_prefill_chunk = (chunk.num_computed_tokens + num_new < request.num_tokens
                                              or queue is self.kv_holding)
            plan.chunks.append(chunk)
            plan.schedule(request, num_new)
            admitted += 1
        if limit == NONE:  # (the loop ran out of budget, or of requests not passed over)
            limit = TOKEN_BUDGET if plan.budget <= 0 else self._passed_over
        self.admission_limit = limit
        if loras is not None:  # (every waiting request was looked at, and each lacked an adapter slot)
            stuck = lora_skips and lora_skips == len(skipped_waiting) and not self.waiting and not self.kv_holding
            self._lora_stuck = (lora_skips, frozenset(loras)) if stuck else None
        if skipped:
            self._requeue_skipped(skipped)
        for request in reversed(skipped_waiting):
            self.waiting.prepend_request(request)
        if self.prefill_interval > 1 or self.dp_cadence:
            self._note_set_aside(skipped_waiting, plan)

    def _set_aside(self, queue, skipped: list[Request], skipped_waiting: list[Request], reason: int) -> None:
        """The head of `queue` is passed over this step (for `reason`, an ADMISSION_LIMITS code);
        it goes back (vLLM's skip_request) to the KV-holding queue if it holds KV blocks by vLLM's
        test (computed tokens, or a load in flight), else to the waiting queue, blocks and all (a
        pulled one-token prompt: its computed count is 0)."""
        self._pass_over(reason)
        request = queue.pop_request()
        if queue is not self.kv_holding:
            skipped_waiting.append(request)
        elif request.num_computed_tokens > 0 or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            skipped.append(request)
        else:
            self._num_kv_ready -= 1  # (it leaves the KV-holding queue)
            skipped_waiting.append(request)

    def _pass_over(self, reason: int) -> None:
        """A waiting request is passed over this step for `reason`: the step's admission limit if
        nothing else stops the loop (the first such reason)."""
        if self._passed_over == NONE:
            self._passed_over = reason

    def _block(self, request: Request, plan: StepPlan, reason: int) -> int:
        """The waiting queue's head cannot be admitted (for `reason`) until blocks are freed or the
        budget changes: a decode run may go on while that holds (steady_decoders'
        _admission_stuck). Returns `reason`."""
        self._blocked_marker = (request, self.kv_cache_manager.num_frees, plan.budget, reason)
        return reason

    def _lora_deferred(self, request: Request, loras: set | None) -> bool:
        """LoRA: the step's adapter slots are all taken by other adapters than the request's
        (vLLM's max_loras check, before any prefix lookup): it is passed over, and counted."""
        if loras is not None and request.lora_id and len(loras) == self.max_loras and request.lora_id not in loras:
            self.num_lora_deferrals += 1
            return True
        return False

    def _note_set_aside(self, skipped_waiting: list[Request], plan: StepPlan) -> None:
        """Prefill cadence: the requests skipped this step (LoRA, a CPU-tier lookup to retry) are
        set aside until admitted (vLLM's deferred_waiting); a release step that leaves a waiting
        request not set aside makes the engine capacity-bound. The KV-holding queue's requests
        (pulls, CPU-tier loads) are all set aside."""
        for request in skipped_waiting:
            request.set_aside = True
        if not plan.defer_prefills:
            self._prefill_capacity_bound = any(not request.set_aside for request in self.waiting)

    def _offload_stores(self, plan: StepPlan, stall_pos: int) -> None:
        """KV offloading: the step's requests offer the blocks it computes (prompt blocks only by
        default), in the step's order (vLLM's build_connector_meta); a request whose last store
        found no room offers again. Under async scheduling a block is offered once the tokens it
        holds are known: a decoder's last token is, one step after it is scheduled."""
        offload = self.offload
        step = self.current_step - 1
        scheduled = [(c.request, c.num_computed_tokens + c.num_new_tokens) for c in plan.chunks]
        if offload.num_retrying or not offload.prompt_only:  # (steady decoders are not in the plan)
            skip = {r.seq for r in self.running[stall_pos:]} if stall_pos >= 0 else set()  # (stalled)
            skip |= {r.seq for r, _ in scheduled}  # (listed already)
            offering = offload.retrying() if offload.num_retrying else []
            if not offload.prompt_only:  # (decode chunks too: the decoders that complete one)
                offering += self._decoders_completing(step, offload.chunk_tokens, offload)
            completing = []
            for request in offering:  # (the steady decoders this step runs: the others are in the plan)
                if (request.decode_base is not None and request.status == RequestStatus.RUNNING
                        and not request.is_finishing and request.seq not in skip):  # (async: last token in flight)
                    skip.add(request.seq)
                    scheduled.append((request, step + request.decode_base + 1))
                    completing.append(request)
            if self._decode_state_offers:
                self._cache_decode_states(completing, step)
        if (self.async_scheduling or self.num_spec_tokens) and not offload.prompt_only:  # (drafts are not known tokens)
            scheduled = [(r, self._known_tokens(r, step, n)) for r, n in scheduled]
        scheduled.sort(key=lambda entry: entry[0].seq)
        offload.build_stores(scheduled, self._offload_view)

    def _cache_decode_states(self, decoders: list[Request], step: int) -> None:
        """KV offloading on linear-attention layers storing decode states: steady decoders that
        complete a chunk in this step cache their blocks up to their known tokens, as vLLM's
        allocate_slots caches them when it schedules them; their states are offered among the
        running requests' (by running order), before the admissions'. Under async scheduling a
        state a steady decoder caches within its processed tokens was cached when its output was
        processed (vLLM's update_from_output; a decoder left out of the step before): offered first."""
        kv = self.kv_cache_manager
        offers = kv.state_offers
        first, admitted = self._state_offer_marks
        later = offers[admitted:]
        del offers[admitted:]
        for request in decoders:
            kv.decode_cache(request, self._known_tokens(request, step, step + request.decode_base + 1))
        running = sorted(offers[first:], key=lambda offer: offer[0].seq)
        if self.async_scheduling:
            running = self._processed_states_first(running, step)
        offers[first:] = running + later

    def _processed_states_first(self, offers: list, step: int) -> list:
        """Async scheduling: the states within a steady decoder's processed tokens go first (vLLM
        cached them when the output was processed, before this schedule())."""
        at_output, at_schedule = [], []
        for offer in offers:
            request = offer[0]
            processed = request.decode_base is not None and \
                offer[2] <= self._decoder_release_point(request, step + request.decode_base, step)
            (at_output if processed else at_schedule).append(offer)
        return at_output + at_schedule

    def _known_tokens(self, request: Request, step: int, num_after: int) -> int:
        """Of a request's first `num_after` tokens, those whose ids are known when `step` is
        scheduled (vLLM's num_tokens): drafts are not; under async scheduling a decoder that ran
        in the step in flight waits for its token."""
        if request.decode_base is not None:
            computed = step + request.decode_base
            return min(num_after, computed if self._ran_in_flight(request) else computed + 1)
        return min(num_after, request.num_tokens)

    def offload_job_done(self, job) -> None:
        """KV offloading: a transfer has ended (seen at a step boundary); a load's request is
        then promoted by the next schedule()."""
        self.offload.job_done(job)
        if not job.is_store:
            self.finished_recving(job.request)

    # ---- multimodal items (core/encoder_cache.py) ---------------------------------------------
    def _encoder_inputs(self, request: Request, computed: int, num_new: int, plan: StepPlan) -> tuple[int, tuple]:
        """vLLM's _try_schedule_encoder_inputs: the items a chunk of `num_new` tokens after
        `computed` reaches that must be encoded in this step, and the chunk cut short before the
        first item that does not fit the step's encoder budget or the encoder cache (to nothing
        if the chunk starts inside it), or, under disable_chunked_mm_input, before an item the
        chunk would split. Cached items the chunk reaches are referenced now; items in the
        embedding store (`ec_store`) are loaded, not encoded. Returns the chunk's tokens and what
        `_encode` commits if the request is scheduled: (items to encode, items repeated within
        them, the budget left, items to load)."""
        cache = self.encoder_cache
        budget = plan.encoder_budget
        shift = self.encoder_window_shift  # (the drafter reads that many prompt tokens ahead: EAGLE 1, MTP modules K)
        end = computed + num_new + shift
        store = self.ec_store
        to_encode: list[int] = []
        loaded: list[int] = []
        repeated: list[int] = []
        encoding: dict[int, int] = {}  # mm_hash -> embeddings, the items to encode so far
        embeds = 0
        for i, (offset, length, mm_hash) in enumerate(request.mm_items):
            if offset + length <= computed:
                continue
            if offset >= end:
                break
            if self.disable_chunked_mm_input and computed <= offset and computed + num_new < offset + length:
                num_new = max(0, offset - (computed + shift))
                self.num_encoder_stops += 1
                break
            if mm_hash in encoding:  # (the same image twice in the chunk: encoded once)
                repeated.append(i)
                continue
            if cache.check_and_update_cache(request, i):
                continue
            if not cache.can_allocate(length, budget, embeds):
                num_new = min(num_new, offset - computed) if computed < offset else 0
                self.num_encoder_stops += 1
                break
            embeds += length
            encoding[mm_hash] = length
            if store is not None and mm_hash in store:  # (loaded: cache room, no budget)
                loaded.append(i)
                continue
            budget -= length
            to_encode.append(i)
        return num_new, (to_encode, repeated, budget, loaded)

    def _encode(self, request: Request, encoding: tuple, plan: StepPlan) -> None:
        """The request is scheduled: its items from `_encoder_inputs` are encoded (or loaded from
        the store) in this step."""
        to_encode, repeated, budget, loaded = encoding
        if not (to_encode or loaded):
            return
        items = request.mm_items
        if to_encode:
            plan.encoder_budget = budget
            plan.encoder_inputs[request.seq] = [items[i][1] for i in to_encode]
            if self.ec_producer:
                plan.encoder_saves[request.seq] = [items[i][2] for i in to_encode]
        if loaded:
            plan.encoder_loads[request.seq] = [items[i][1] for i in loaded]
        cache = self.encoder_cache
        for i in to_encode + loaded:  # (vLLM's order: the encoded items, then the loaded ones)
            cache.allocate(request, i)
        for i in repeated:
            cache.check_and_update_cache(request, i)

    def _free_items(self, request: Request) -> None:
        """A request that leaves (finished, preempted, aborted) or was passed over drops its
        references to the encoder cache's entries."""
        if request.mm_items and self.encoder_cache is not None:
            self.encoder_cache.free(request)

    def _free_encoded(self, chunks: list[ScheduledChunk]) -> None:
        """After a step (synchronous scheduling): the items the step's chunks computed past are
        no longer needed by their requests."""
        cache = self.encoder_cache
        for chunk in chunks:
            request = chunk.request
            if request.mm_items and request.status == RequestStatus.RUNNING:
                cache.free_computed(request, request.num_computed_tokens)

    def _free_encoded_async(self, output: SchedulerOutput) -> None:
        """Async scheduling, pipeline stages, when a step's output is processed: as vLLM, each
        request the step ran drops the items its computed tokens, less those sampled or drafted
        by steps not yet processed (this one's included), have passed. With vLLM's counters kept
        (decodes as chunks) that is num_computed_tokens - num_output_placeholders; otherwise a
        request whose latest chunk is in flight and sampled counts one token less, and one that
        decoded since its prompt's end has passed every item."""
        cache = self.encoder_cache
        step = output.step
        ran = {chunk.request for chunk in output.chunks}
        if not self._counts_in_flight:  # (steady decoders the step ran that still hold items)
            ran.update(r for r in cache.request_inputs if r.decode_base is not None and self._ran_in(r, step))
        for request in sorted(ran, key=_seq_of):
            if request not in cache.request_inputs:
                continue
            if self._counts_in_flight:
                point = request.num_computed_tokens - request.num_output_placeholders
            elif request.last_chunk_step >= step:
                sampled = request.decode_base is not None or request.is_finishing
                point = request.num_computed_tokens - sampled
            else:
                point = request.num_prompt_tokens + request.num_output_tokens
            cache.free_computed(request, point)

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new: int) -> int:
        """Multi-module MTP (vLLM's _reserve_prefill_lookahead): a prefill chunk ends at the
        prompt's end or at least num_prefill_lookahead tokens before it, since the modules read
        that many tokens past the chunk; shortened, possibly to nothing."""
        remaining = request.num_tokens - num_computed_tokens - num_new
        if 0 < remaining < self.num_prefill_lookahead:
            num_new -= self.num_prefill_lookahead - remaining
        return max(num_new, 0)

    def _mamba_aligned(self, request: Request, start: int, num_new: int) -> int:
        """A prefill chunk from `start` cut where a linear-attention state must be written."""
        return mamba_block_aligned_split(start, num_new, request.num_tokens, request.num_prompt_tokens,
                                         self.block_size, self._max_prefill_tokens,
                                         self.kv_cache_manager.prefill_checkpoints,
                                         self.kv_cache_manager.junction(request),
                                         self.kv_cache_manager.eagle_block_drop)

    def _fill_block_ids(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            chunk.block_ids = self.kv_cache_manager.get_block_ids(chunk.request)

    def _lora_load(self, chunks: list[ScheduledChunk], stall_pos: int) -> tuple[int, tuple[int, ...]]:
        """LoRA: the step's tokens of requests with an adapter and their distinct adapters, in
        ascending order (what the cost model prices and the worker loads), over its chunks and
        its decoders (those before `stall_pos`)."""
        stop = stall_pos if stall_pos >= 0 else len(self.running)
        adapters = set()
        tokens = 0
        for chunk in chunks:
            if chunk.request.lora_id:
                tokens += chunk.num_new_tokens
                adapters.add(chunk.request.lora_id)
        for request in self.running[:stop]:
            if request.lora_id and request.decode_base is not None:
                tokens += 1
                adapters.add(request.lora_id)
        return tokens, tuple(sorted(adapters))

    def lora_decode_load(self) -> tuple[int, tuple[int, ...]]:
        """LoRA: (decoders with an adapter, their distinct adapters) of a decode run's steps,
        (0, ()) without LoRA."""
        return self._lora_load([], -1) if self.max_loras is not None else (0, ())

    def _list_decodes(self, step: int, stall_pos: int) -> list[ScheduledDecode]:
        stop = stall_pos if stall_pos >= 0 else len(self.running)
        kv = self.kv_cache_manager
        out = []
        for request in self.running[:stop]:
            if request.decode_base is not None:
                computed = step + request.decode_base
                out.append(ScheduledDecode(request, computed, kv.get_block_ids(request)))
        return out

    # ---- after the step ------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput) -> list[Request]:
        """Apply the step's sampled tokens: prefills that reached their end sample a token,
        every decode samples one; requests at their length limit finish and free blocks."""
        step = output.step
        self._output_pending = False
        if self._ec_saves:  # (an encode instance: what the step encoded is in the store now)
            self.ec_store.update(self._ec_saves)
            self._ec_saves = []
        if self.encoder_cache is not None and self.encoder_cache.request_inputs and self.overlapped:
            self._free_encoded_async(output)
        if self.overlapped:
            self.output_processed(step)
        if self.chunked_decodes:
            done = self._spec_async_update(output) if self._counts_in_flight else self._spec_update(output)
            if self.encoder_cache is not None and not self.overlapped:
                self._free_encoded(output.chunks)
            output.finished, output.num_blocks_used_end = self._end_step(done, step)
            return output.finished
        if self.async_scheduling:
            output.finished, output.num_blocks_used_end = self.step_output_processed(step)
            return output.finished
        finished = []
        for chunk in output.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = chunk.num_computed_tokens + chunk.num_new_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue
            finished += self._sample_after_prefill(request, step)
        if self.encoder_cache is not None:
            self._free_encoded(output.chunks)
        for request in self._pop_due(self._finish_heap, step):
            self._leave_decoding(request, step + 1)
            finished.append(request)
        output.finished, output.num_blocks_used_end = self._end_step(finished, step)
        return output.finished

    def step_output_processed(self, step: int) -> tuple[list[Request], int]:
        """Async scheduling: `step`'s output is processed (its tokens were accounted for when it
        was scheduled): the requests whose last token it sampled finish. Returns them and the
        blocks in use after the step (as `update_from_output`; a decode run's last step)."""
        self.output_processed(step)
        return self._end_step(self._finish_in_flight(step), step)

    def _end_step(self, finished: list[Request], step: int) -> tuple[list[Request], int]:
        """Release the step's finished sequences; returns the completed requests and the blocks
        in use after the step."""
        if finished:
            finished.sort(key=_seq_of)
            finished = self._finish(finished, step)
        used = self.kv_cache_manager.block_pool.get_num_used_blocks()
        takes = self._recent_takes
        if takes and takes[0][0] <= step:
            takes[:] = [entry for entry in takes if entry[0] > step]
        for _, taken in takes:  # async, PP: later steps were scheduled first; their blocks are not this step's
            used -= taken
        return finished, used

    def _note_take(self, step: int, taken: int) -> None:
        """A schedule() call for `step` took `taken` blocks (a call that ran nothing, then the
        one that runs `step`, keep the latter's)."""
        takes = self._recent_takes
        if takes and takes[-1][0] == step:
            takes[-1] = (step, taken)
        else:
            takes.append((step, taken))

    def _sample_after_prefill(self, request: Request, step: int) -> list[Request]:
        """The request's prefill (or recompute) ended in `step`, which samples its next token:
        it decodes from `step + 1` on, unless that token was its last (returned). A parallel
        sampling request forks its other sequences here."""
        request.num_output_tokens += 1
        if request.first_token_step < 0:
            request.first_token_step = step
        else:
            self._note_irregular_gap(request, step)
        sequences = [request]
        if request.num_samples > 1 and not request.forked:
            sequences += self._fork(request, step)
        last = []
        for seq_request in sequences:
            if seq_request.num_output_tokens >= seq_request.max_tokens or seq_request.num_tokens >= self.max_model_len:
                last.append(seq_request)
            else:
                self._enroll_decoder(seq_request, step + 1)
        return last

    def _finish(self, finished: list[Request], step: int) -> list[Request]:
        """Release finished sequences; returns the requests that are now complete (a parallel
        sampling group completes with its last sequence)."""
        self._preemptions_since_finish = 0
        self.num_done_sequences += len(finished)
        kv = self.kv_cache_manager
        if self.offload is not None:  # (the next schedule() retires them from the CPU tier's recency)
            for request in finished:
                self.offload.request_finished(request, self._offload_view(request))
        complete = []
        for request in finished:
            self._free_items(request)
            if request in self._prefilling:
                self._prefilling.remove(request)
            if self._release_at_finish:  # (async: by the processed tokens, as if scheduling the next step)
                computed = request.num_computed_tokens
                kv.decode_release(request, self._processed_tokens(request, computed, step + 1)
                                  if self.async_scheduling else computed)
            if not self._hold_for_sending(request):
                cache_end = self._cached_end(request) if self._counts_in_flight else request.num_computed_tokens
                self._free_finished(request, cache_end, completed=True)
            if request.status == RequestStatus.RUNNING:  # (async: a preempted one has left already)
                self._remove_running(request)
            request.status = RequestStatus.FINISHED
            request.finish_step = step
            root = request.parent or request
            root.group_remaining -= 1
            root.group_output_tokens += request.num_output_tokens
            if root.group_remaining == 0:
                root.finish_step = step
                complete.append(root)
        return complete

    # ---- aborts ----------------------------------------------------------------------------------
    def abort_group(self, request: Request, chunk_ends: dict[int, int] | None = None) -> bool:
        """Abort a request and, fanned out, its other members (vLLM's front end aborts a parent
        request's children), the first first; `chunk_ends`: where each one's chunk in the step
        just run ended, by id (synchronous scheduling). False if none was in the engine."""
        aborted = False
        for member in (request, *request.members):
            aborted |= self.abort_request(member, chunk_ends.get(id(member)) if chunk_ends else None)
        return aborted

    def abort_request(self, request: Request, chunk_end: int | None = None) -> bool:
        """vLLM's `finish_requests(id, FINISHED_ABORTED)` (its client went away), between two
        steps or after a step ran and before its output is processed, as vLLM's engine core takes
        aborts that arrived meanwhile; `chunk_end` (synchronous scheduling): where its chunk in
        that step ended, whose KV exists (vLLM counts it computed when it schedules it). The
        request leaves the running list or a waiting queue and frees its blocks, tail first; its
        full blocks keep their cache entries (a retry of the same prompt finds them), and the
        step's output skips it. With a CPU tier it is finished for the connector too. False if it
        was no longer in the engine."""
        status = request.status
        if status not in _ABORTABLE and not request.is_finishing:
            return False
        num_blocks = self.kv_cache_manager.num_blocks_of(request)
        offload_view = self._offload_view(request) if self.offload is not None else None
        # (async scheduling, pipeline stages: its tokens scheduled, and sampled, by steps whose
        # output is not processed yet; known before it leaves decoding)
        in_flight = unknown = 0
        if status == RequestStatus.RUNNING and self.overlapped and (
                self.offload is not None or self._release_at_finish):
            in_flight, unknown = ((request.num_in_flight_tokens, 0) if self._counts_in_flight
                                  else self._unprocessed_work(request))
        elif status == RequestStatus.RUNNING and self._release_at_finish and self._output_pending:
            in_flight = self._ran_unprocessed_tokens(request, chunk_end)
        self._free_items(request)
        if request.is_finishing:  # async: its last token is in flight (preempted: its blocks are gone)
            self._finishing.remove(request)
        if status == RequestStatus.RUNNING:
            self._abort_running(request, chunk_end, in_flight)
        elif not request.is_finishing:  # (preempted with its last token in flight: vLLM's waiting queue holds it, simkv's not)
            self._abort_waiting(request, num_blocks)
        if self.offload is not None:  # (as a finish: the next schedule() stores what it left, then retires it)
            self.offload.request_finished(request, offload_view, self._aborted_storable(request, unknown))
        request.status = RequestStatus.ABORTED
        request.is_finishing = False
        self._lora_stuck = None  # (the waiting queue or the running adapters changed)
        self.num_done_sequences += 1
        if self.detail:
            self._aborted.append(request)
        return True

    @staticmethod
    def _aborted_storable(request: Request, unknown: int) -> int:
        """KV offloading: the tokens an aborted request leaves for the CPU tier to store: its
        computed ones, less those an unprocessed step holds; none if it was never scheduled (a
        pull aborted before its first step: the connector has no block table of it)."""
        if request.first_scheduled_step < 0:
            return 0
        return min(request.num_computed_tokens, request.num_tokens - unknown)

    def _take_aborted(self) -> list[Request] | None:
        """Detail mode: the requests aborted since the previous schedule() (None if none)."""
        if not self._aborted:
            return None
        aborted, self._aborted = self._aborted, []
        return aborted

    def _ran_unprocessed_tokens(self, request: Request, chunk_end: int | None) -> int:
        """Synchronous scheduling, an abort after a step ran and before its output: the request's
        tokens in that step (vLLM's num_in_flight_tokens): its chunk, or a steady decoder's one."""
        if chunk_end is not None:
            return chunk_end - request.num_computed_tokens
        return int(request.decode_base is not None and self._ran_in(request, self.current_step - 1))

    def _abort_running(self, request: Request, chunk_end: int | None, in_flight: int) -> None:
        """A running request aborted: it leaves the running list; its blocks are freed (deferred,
        with a connector under async scheduling, if a step not yet processed ran it), cached as
        far as vLLM had cached them; `in_flight`: its tokens of steps whose output is not processed."""
        unprocessed = self.defer_block_free and self._ran_unprocessed(request)  # (before it leaves decoding)
        if self.overlapped:
            computed, cache_end = self._async_abort_extent(request)
        elif request.decode_base is not None:  # (its token of a step that ran counts: current_step is past it)
            computed = cache_end = self._leave_decoding(request, self.current_step)
        else:
            computed = cache_end = request.num_computed_tokens if chunk_end is None else chunk_end
            self._prefilling.remove(request)
        if self._release_at_finish:
            self._release_outside_windows(request, computed - in_flight)
        self._free_finished(request, cache_end, unprocessed)
        self._remove_running(request)
        request.num_computed_tokens = computed  # (as it stood: the work done for it)

    def _release_outside_windows(self, request: Request, num_processed: int) -> None:
        """With a connector vLLM first gives back what left a finished request's windows, by its
        processed tokens (the computed ones less those in flight), before the connector sees its
        blocks and before any other free."""
        self.kv_cache_manager.decode_release(request, num_processed)

    def _abort_waiting(self, request: Request, num_blocks: int) -> None:
        """A waiting request aborted: from the waiting queue (its swapped KV goes too), or, with a
        CPU tier, from the KV-holding queue: loaded (its blocks go, cached) or loading (as vLLM,
        its blocks stay until the load has ended; the loaded ones are not cached)."""
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.kv_holding.remove_request(request)
            if request.kv_loaded:
                self._num_kv_ready -= 1
                self._free_finished(request, request.num_prefix_hit_tokens)
            else:
                self._abort_loading(request)
            request.num_computed_tokens = request.num_prefix_hit_tokens
        elif num_blocks:  # (its load ended and it was promoted: it waits in the KV-holding queue, or, a
            # pulled one-token prompt passed over, in the waiting queue)
            if any(r is request for r in self.kv_holding):
                self.kv_holding.remove_request(request)
                self._num_kv_ready -= 1
            else:
                self.waiting.remove_request(request)
            self._free_finished(request, request.num_computed_tokens)
        else:
            self.waiting.remove_request(request)
            if request.swapped_blocks:  # (its KV in CPU swap space goes too)
                self.cpu_blocks_used -= request.swapped_blocks
                self.num_swapped -= 1
                request.swapped_blocks = 0

    def _fork(self, request: Request, step: int) -> list[Request]:
        """Parallel sampling: after the prompt, n-1 more sequences share its blocks; each has
        sampled its own first token."""
        request.forked = True
        if self._calendar is not None:
            self._calendar_to_heap(step + 1)
        children = []
        for k in range(1, request.num_samples):
            child = self._sequence_of(request, k)
            child.num_output_tokens = 1
            child.num_computed_tokens = request.num_computed_tokens
            child.first_scheduled_step = request.first_scheduled_step
            child.first_token_step = step
            self.kv_cache_manager.fork(request, child)
            self._append_running(child)
            children.append(child)
        return children
