"""KV offloading to CPU memory, as vLLM's native OffloadingConnector drives its scheduler
(`--kv-offloading-size GiB`, `--kv-offloading-backend native`). No clock here: the replay
(simkv/replay/offload_feed.py) says when each transfer ends.

A second cache tier behind the GPU prefix cache, in chunks of `blocks_per_chunk` GPU blocks
(vLLM's default 1; `--kv-offloading-block-size`), each keyed by its last block's content key:
- **stores**: each step, every scheduled request offers the full chunks of its prompt that the
  step computes (vLLM's `offload_prompt_only`, on by default; off: its decoded chunks too, once
  their tokens are known) and that it has not offered before; the tier takes those it lacks,
  evicting as its policy says, and a store job copies them (the worker starts it when the next
  step starts). A key is readable once its job ends. A finished request offers what is left.
- **loads**: a request admitted from the waiting queue (no computed tokens) first looks up its
  local prefix hit, then the tier from there on: consecutive readable chunks, up to its whole
  prompt. A hit loads asynchronously, as a P/D pull does (core/remote_kv.py): blocks for its
  local hits plus the loaded tokens, WAITING_FOR_REMOTE_KVS until the load ends. A lookup that
  meets a chunk still being stored, or one being loaded for another request, or a request with
  a transfer of its own in flight, is retried at a later step (the request is skipped).
- an EAGLE-family drafter's layer in the group makes a request's last chunk volatile: never
  loaded, and stored only when the request finishes.

`CPUOffloadManager` is vLLM's CPUOffloadingManager with its "lru" policy: a chunk being written
or read cannot be evicted; recency is by request, ordered within a request so that its tail
goes before its head, and a finished request's chunks become the most recent, head last.
The "arc" policy is core/kv_offload_arc.py's.

`StoreAdmission` is vLLM's `store_threshold`: a chunk the tier lacks is stored only once it has
been offered that many times (counted per offer, over all requests, by a bounded LRU table).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from functools import partial
from itertools import compress, filterfalse
from operator import is_, itemgetter

from simkv.core.request import Request

_PENDING = -1  # a chunk's reference count while its store is in flight (vLLM's not-ready)
_IS_NONE = partial(is_, None)
_SECOND = itemgetter(1)
# vLLM's LRU order (rank, -position) as one int, in the same order (cheaper in the heap):
# rank * _POSITIONS + (_POSITIONS - 1 - position), token positions below _POSITIONS
_POSITIONS = 1 << 40
MAX_TRACKER_SIZE = 64_000  # vLLM's default max_tracker_size


class _Access:
    """What the tier has seen of one request (vLLM's _RequestCacheAccess and _RequestRank)."""

    __slots__ = ("rank", "keys", "seen", "finished", "inserted", "reused", "store_misses")

    def __init__(self) -> None:
        self.rank = 0  # 0: not assigned yet
        self.keys: list[tuple[int, int]] = []  # (position, key), in the order seen
        self.seen: set[int] = set()
        self.finished = False
        # (the "arc" policy's: core/kv_offload_arc.py)
        self.inserted: set[int] = set()  # keys it stored
        self.reused: set[int] = set()  # ready keys it loaded or offered again, not its own
        self.store_misses: set[int] = set()  # keys it offered that the tier lacked


class StoreAdmission:
    """vLLM's store_threshold (kv_connector_extra_config; >= 2): each store offer counts its keys
    in an LRU table of at most `max_tracker_size` keys, and a key the tier lacks is stored only
    once its count reaches `threshold`. A new key evicts the table's least recent one, never a key
    this offer counted again; with none left to evict it is not counted."""

    def __init__(self, threshold: int, max_tracker_size: int = MAX_TRACKER_SIZE) -> None:
        self.threshold = threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[int, int] = OrderedDict()
        self.num_skipped = 0  # chunks left unstored: their count was below the threshold

    def count(self, keys: list[tuple[int, int]]) -> None:
        counts = self.counts
        seen = 0
        for _, key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                seen += 1
        num_unprotected = len(counts) - seen
        for _, key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if not num_unprotected:
                    continue
                counts.popitem(last=False)
                num_unprotected -= 1
            counts[key] = 1

    def offer(self, keys: list[tuple[int, int]], to_store: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """A store offer of `keys`, of which the tier lacks `to_store`: counts them all, and gives
        the candidates it admits (what the tier's prepare_store goes on with)."""
        self.count(keys)
        return self.admit(to_store)

    def admit(self, to_store: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The store candidates offered often enough."""
        admitted = [(p, k) for p, k in to_store if self.counts.get(k, 0) >= self.threshold]
        self.num_skipped += len(to_store) - len(admitted)
        return admitted


class CPUOffloadManager:
    """The CPU tier: `num_chunks` chunks, LRU eviction (vLLM's CPUOffloadingManager + LRUCachePolicy)."""

    def __init__(self, num_chunks: int, admission: StoreAdmission | None = None) -> None:
        self.num_chunks = num_chunks
        self.admission = admission
        self.chunks: dict[int, int] = {}  # key -> its reference count (_PENDING: its store is in flight)
        # key -> its recency, vLLM's (request rank, -position) as one int (_POSITIONS): least first
        self._ranks: dict[int, int] = {}
        self._evictable: set[int] = set()
        self._pending: set[int] = set()  # keys whose store is in flight
        self._heap: list[tuple[tuple[int, int], int]] = []
        self._next_rank = 0
        self.num_evictions = 0

    # ---- lookups and loads --------------------------------------------------------------------
    def lookup(self, key: int) -> int:
        """0: miss, 1: readable, 2: its store is in flight."""
        ref_cnt = self.chunks.get(key)
        if ref_cnt is None:
            return 0
        return 2 if ref_cnt == _PENDING else 1

    def held_run(self, keys) -> tuple[int, bool]:
        """How many of `keys`, in order, the tier holds before the first it lacks, and whether
        one of those is still being stored (a run of `lookup`s)."""
        keys = keys if isinstance(keys, list) else list(keys)  # (C loops below: prompts of 10k chunks)
        missing = next(filterfalse(self.chunks.__contains__, keys), None)
        count = len(keys) if missing is None else keys.index(missing)
        pending = self._pending
        return count, bool(pending) and not pending.isdisjoint(keys[:count])

    def prepare_load(self, keys: list[tuple[int, int]], access: _Access) -> None:
        chunks, evictable = self.chunks, self._evictable
        for _, key in keys:
            ref_cnt = chunks[key]
            if ref_cnt == 0:
                evictable.discard(key)
            chunks[key] = ref_cnt + 1
        self._record(keys, access)

    def complete_load(self, keys: list[int]) -> None:
        chunks, idle = self.chunks, []
        for key in keys:
            ref_cnt = chunks[key] - 1
            chunks[key] = ref_cnt
            if ref_cnt == 0:
                idle.append(key)
        self._make_evictable(idle)

    # ---- stores -------------------------------------------------------------------------------
    def prepare_store(self, keys: list[tuple[int, int]], access: _Access) -> list[int] | None:
        """The keys a store job writes (those the tier lacks, and its admission takes); None if
        the tier cannot make room."""
        # (C loops: a prompt of 10k chunks that finds no room offers them all again every step)
        key_list = list(map(_SECOND, keys))
        to_store = list(compress(keys, map(_IS_NONE, map(self.chunks.get, key_list))))  # those it lacks
        pending = self._pending
        # those and the readable ones, in order
        recorded = keys if pending.isdisjoint(key_list) else [item for item in keys if item[1] not in pending]
        if self.admission is not None:
            admitted = self.admission.offer(keys, to_store)
            if len(admitted) < len(to_store):
                held_back = {k for _, k in to_store} - {k for _, k in admitted}
                recorded = [(p, k) for p, k in recorded if k not in held_back]
            to_store = admitted
        self._record(recorded, access)
        if not to_store:
            return []
        need = len(to_store) - (self.num_chunks - len(self.chunks))
        if need > 0:
            if need > len(self._evictable):
                return None
            if not self._evict(need, set(key_list)):
                return None
        # (the order of a key at `position`: top - position)
        top = self._request_rank(access) * _POSITIONS + _POSITIONS - 1
        stored = list(map(_SECOND, to_store))
        self.chunks.update(dict.fromkeys(stored, _PENDING))
        self._ranks.update(zip(stored, [top - position for position, _ in to_store]))
        self._pending.update(stored)
        return stored

    def complete_store(self, keys: list[int]) -> None:
        chunks = self.chunks
        done = [key for key in keys if chunks.get(key) == _PENDING]
        chunks.update(dict.fromkeys(done, 0))
        self._pending.difference_update(done)
        self._make_evictable(done)

    def _make_evictable(self, keys: list[int]) -> None:
        """Chunks no transfer holds any more: evictable, each in the heap at its rank."""
        if not keys:
            return
        self._evictable.update(keys)
        heap = self._heap
        entries = zip(map(self._ranks.__getitem__, keys), keys)
        if len(keys) * 8 > len(heap):  # (many: one heapify; the pops' order is the entries', not the layout's)
            heap.extend(entries)
            heapq.heapify(heap)
        else:
            push = heapq.heappush
            for entry in entries:
                push(heap, entry)
        self._compact()

    def _evict(self, n: int, protected: set[int]) -> bool:
        """Evict the n least recent evictable chunks not in `protected`, or none (False)."""
        heap, ranks, evictable, chunks = self._heap, self._ranks, self._evictable, self.chunks
        pop = heapq.heappop
        selected, deferred = [], []
        need = n
        while need and heap:
            entry = pop(heap)
            key = entry[1]
            # (stale entries: a rank since superseded, a chunk gone, pinned, or picked already)
            if ranks.get(key) != entry[0] or key not in evictable:
                continue
            if key in protected:
                deferred.append(entry)
                continue
            selected.append(key)
            evictable.discard(key)
            need -= 1
        for entry in deferred:
            heapq.heappush(heap, entry)
        if need:
            evictable.update(selected)
            for key in selected:
                heapq.heappush(heap, (ranks[key], key))
            return False
        for key in selected:
            del chunks[key]
            del ranks[key]
        self.num_evictions += n
        self._compact()
        return True

    def _compact(self) -> None:
        """Rebuild the heap once stale entries (superseded ranks, chunks gone or pinned) outnumber
        the evictable chunks (as vLLM's LRU policy does; the order is the same)."""
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """The heap of the evictable chunks alone, each at its current rank."""
        ranks = self._ranks
        self._heap = [(ranks[key], key) for key in self._evictable]
        heapq.heapify(self._heap)

    # ---- recency ------------------------------------------------------------------------------
    def _request_rank(self, access: _Access) -> int:
        if not access.rank:
            self._next_rank += 1
            access.rank = self._next_rank
        return access.rank

    def _record(self, keys: list[tuple[int, int]], access: _Access) -> None:
        """Keys this request touches for the first time: they rank as its own (tail first)."""
        seen = access.seen
        if seen.issuperset(map(_SECOND, keys)):
            return
        new = [item for item in keys if item[1] not in seen]
        seen.update(map(_SECOND, new))
        access.keys.extend(new)
        top = self._request_rank(access) * _POSITIONS + _POSITIONS - 1  # (a key at `position`: top - position)
        ranks, evictable = self._ranks, self._evictable
        updated = []  # (evictable keys whose rank rose)
        for position, key in compress(new, map(self.chunks.__contains__, map(_SECOND, new))):
            r = top - position
            if ranks[key] >= r:
                continue
            ranks[key] = r
            if key in evictable:
                updated.append(key)
        self._update_heap(updated)

    def request_finished(self, access: _Access) -> None:
        """Its chunks become the most recent, its head last (vLLM's on_request_finished)."""
        if access.finished:
            return
        access.finished = True
        keys = [key for _, key in sorted(access.keys, reverse=True)]  # (tail first)
        held = list(compress(keys, map(self.chunks.__contains__, keys)))
        first = self._next_rank + 1
        self._next_rank += len(held)
        # (ranks first, first + 1, ... at position 0: above every rank given so far)
        new_ranks = range(first * _POSITIONS + _POSITIONS - 1, (self._next_rank + 1) * _POSITIONS + _POSITIONS - 1,
                          _POSITIONS)
        self._ranks.update(zip(held, new_ranks))
        evictable = self._evictable
        # (ascending and above every entry in the heap: appended, the heap stays a heap)
        self._heap.extend(compress(zip(new_ranks, held), map(evictable.__contains__, held)))
        self._compact()

    def _update_heap(self, updated: list[int]) -> None:
        """Evictable keys re-ranked: pushed again, or (many of them, as vLLM does) the heap rebuilt."""
        if not updated:
            return
        if len(updated) >= max(64, len(self._evictable) // 4):
            self._rebuild_heap()
            return
        ranks, heap = self._ranks, self._heap
        for key in updated:
            heapq.heappush(heap, (ranks[key], key))
        self._compact()

    @property
    def num_used(self) -> int:
        return len(self.chunks)


class _OffloadState:
    """The connector's view of one request (vLLM's RequestOffloadState, one KV-cache group)."""

    __slots__ = ("request", "access", "next_stored", "jobs", "finished", "store_retry")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.access = _Access()
        self.next_stored = 0  # chunks offered so far
        self.jobs: set[int] = set()  # transfers in flight: one load, or stores
        self.finished = False
        self.store_retry = False  # its last store found no room: offered again when scheduled


class OffloadJob:
    """A transfer of `num_blocks` GPU blocks (the chunks `keys`) between the GPU and the CPU tier
    for `request`."""

    __slots__ = ("job_id", "request", "keys", "is_store", "num_blocks")

    def __init__(self, job_id: int, request: Request, keys: list[int], is_store: bool, num_blocks: int) -> None:
        self.job_id = job_id
        self.request = request
        self.keys = keys
        self.is_store = is_store
        self.num_blocks = num_blocks


class KVOffload:
    """The scheduler side of vLLM's OffloadingConnector for one full-attention KV-cache group.
    `blocks_per_chunk`: GPU blocks a CPU-tier chunk holds; `prompt_only`: vLLM's offload_prompt_only;
    `policy`: the tier's eviction policy, "lru" or "arc" (core/kv_offload_arc.py);
    `store_threshold` (>= 2) and `max_tracker_size`: the tier's StoreAdmission (vLLM's names);
    `eagle`: the group holds an EAGLE-family drafter's layer, whose KV at a chunk's last position
    depends on the token after it: a hit never loads its last chunk, and a decoding request does
    not store its last complete chunk until it finishes (vLLM's volatile trailing chunk)."""

    def __init__(self, num_chunks: int, block_size: int, hasher, blocks_per_chunk: int = 1,
                 prompt_only: bool = True, eagle: bool = False, policy: str = "lru",
                 store_threshold: int = 0, max_tracker_size: int = MAX_TRACKER_SIZE) -> None:
        self.admission = StoreAdmission(store_threshold, max_tracker_size) if store_threshold >= 2 else None
        if policy == "arc":
            from simkv.core.kv_offload_arc import ARCOffloadManager
            self.manager = ARCOffloadManager(num_chunks, self.admission)
        else:
            self.manager = CPUOffloadManager(num_chunks, self.admission)
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_tokens = block_size * blocks_per_chunk
        self.prompt_only = prompt_only
        self.eagle = eagle
        self.hasher = hasher
        self.step = 0  # the step being scheduled (set by the scheduler)
        self._states: dict[Request, _OffloadState] = {}  # (by request: a retry's state is its own)
        self._jobs: dict[int, OffloadJob] = {}
        self._next_job = 0
        self._being_loaded: set[int] = set()
        # (request, blocks it held, tokens it may store: None for a finish, the computed and known
        # ones for an abort), since the last schedule()
        self._finished: list[tuple[Request, int, int | None]] = []
        self.step_loads: list[OffloadJob] = []  # jobs this schedule() starts
        self.step_stores: list[OffloadJob] = []
        # counters
        self.num_loads = self.num_loaded_blocks = 0
        self.num_stores = self.num_stored_blocks = 0
        self.num_store_failures = 0
        self.num_lookup_retries = 0
        self.num_retrying = 0  # requests whose last store found no room
        self.num_hit_tokens = 0

    def _state(self, request: Request) -> _OffloadState:
        state = self._states.get(request)
        if state is None:
            state = self._states[request] = self._new_state(request)
        return state

    @staticmethod
    def _new_state(request: Request) -> _OffloadState:
        return _OffloadState(request)

    def _chunk_hashes(self, request: Request, first: int, end: int) -> list[int]:
        """The keys of chunks `first` to `end` (excluded): each one's last block's key, as vLLM
        keys a chunk (the block keys up to there memoised at once)."""
        if end <= first:
            return []
        bpc = self.blocks_per_chunk
        self.hasher.block_key(request, end * bpc - 1)
        return request.block_hashes[(first + 1) * bpc - 1:end * bpc:bpc]

    def _keys(self, request: Request, first: int, end: int) -> list[tuple[int, int]]:
        """Chunks `first` to `end` (excluded): each one's (end position, key)."""
        tpc = self.chunk_tokens
        return list(zip(range((first + 1) * tpc, (end + 1) * tpc, tpc), self._chunk_hashes(request, first, end)))

    # ---- admission ----------------------------------------------------------------------------
    def lookup(self, request: Request, num_local: int) -> int | None:
        """Tokens past the local hit `num_local` that the tier holds (loaded asynchronously), or
        None: ask again at a later step (vLLM's get_num_new_matched_tokens)."""
        state = self._state(request)
        state.next_stored = 0  # (computed from token 0 again: every chunk is offered again)
        if state.jobs:
            self.num_lookup_retries += 1
            return None
        tpc = self.chunk_tokens
        # its keyed chunks: of its tokens, or of the whole prompt a P/D prefill engine truncated
        keyed = max(request.num_tokens, request.num_keyed_tokens) // tpc
        max_hit = min(request.num_tokens, keyed * tpc)
        start = num_local // tpc  # (a local hit may end inside a chunk: the chunk is looked up)
        if max_hit - num_local < tpc:
            return 0
        # (an EAGLE group looks one chunk further, which it drops below: past a truncated prompt too)
        end = min(-(-(max_hit + (tpc if self.eagle else 0)) // tpc), keyed)
        if self.prompt_only:  # (only prompt chunks are ever stored: the first past the prompt misses)
            end = min(end, request.num_prompt_tokens // tpc + 1)
        chunk_keys = self._chunk_hashes(request, start, end)
        count, pending = self.manager.held_run(chunk_keys)
        if not count:
            return 0
        hit_keys = chunk_keys[:count]
        if pending:
            self.num_lookup_retries += 1
            return None
        if self.eagle:  # (its last hit chunk is volatile: not loaded)
            hit_keys.pop()
        num_hit = min(max_hit, (start + len(hit_keys)) * tpc) - num_local
        if num_hit < tpc:  # (less than a chunk past the local hit)
            return 0
        if not self._being_loaded.isdisjoint(hit_keys):
            self.num_lookup_retries += 1
            return None
        return num_hit

    def start_load(self, request: Request, num_local: int, num_external: int) -> OffloadJob:
        """The load of an admitted hit (vLLM's update_state_after_alloc): blocks past the local hit."""
        state = self._state(request)
        bs = self.block_size
        num_cached = num_local + num_external
        first_block = num_local // bs  # (the load fills the blocks past the local hit)
        end = -(-num_cached // self.chunk_tokens)
        keys = self._keys(request, first_block // self.blocks_per_chunk, end)
        return self._load(request, state, keys, end, -(-num_cached // bs) - first_block, num_external)

    def _load(self, request: Request, state: _OffloadState, keys: list[tuple[int, int]], end: int,
              num_blocks: int, num_external: int) -> OffloadJob:
        """The job that loads `keys` into `num_blocks` GPU blocks, `num_external` tokens' worth;
        chunks before `end` are not offered again (chunk level: what it hit)."""
        self.manager.prepare_load(keys, state.access)
        state.next_stored = end
        job = self._new_job(request, [k for _, k in keys], False, state, num_blocks)
        self._being_loaded.update(job.keys)
        self.step_loads.append(job)
        self.num_loads += 1
        self.num_loaded_blocks += num_blocks
        self.num_hit_tokens += num_external
        return job

    # ---- stores, at the end of schedule() -----------------------------------------------------
    def build_stores(self, scheduled: list[tuple[Request, int]], num_blocks_of) -> None:
        """`scheduled`: (request, computed tokens after this step) in the step's order; then the
        requests that finished since the last schedule(), which retire from the tier's recency."""
        prompt_only = self.prompt_only
        for request, num_after in scheduled:
            self._offer(request, min(num_after, request.num_prompt_tokens) if prompt_only else num_after,
                        num_blocks_of(request), False)
        finished, self._finished = self._finished, []
        for request, num_blocks, num_tokens in finished:  # (what is left to store, from its freed blocks)
            if request in self._states:
                if num_tokens is None:  # (a finish: the last sampled token's KV is never computed)
                    num_tokens = max(request.num_prompt_tokens, request.num_tokens - 1)
                if prompt_only:
                    num_tokens = min(num_tokens, request.num_prompt_tokens)
                self._offer(request, num_tokens, num_blocks, True)
        for request, _, _ in finished:  # (then, every store made, they leave the tier's recency)
            state = self._states.get(request)
            if state is None:
                continue
            state.finished = True
            self._set_retry(state, False)
            self.manager.request_finished(state.access)
            if not state.jobs:
                del self._states[request]

    def has_unoffered(self, request: Request, num_tokens: int) -> bool:
        """Whether the first `num_tokens` tokens hold a chunk the request has not offered yet."""
        state = self._states.get(request)
        return num_tokens // self.chunk_tokens > (state.next_stored if state is not None else 0)

    def _offer(self, request: Request, num_tokens: int, num_blocks: int, finished: bool) -> None:
        state = self._state(request)
        num_chunks = min(num_tokens // self.chunk_tokens, num_blocks // self.blocks_per_chunk)
        if self.eagle and num_tokens > request.num_prompt_tokens and not finished:
            num_chunks -= 1  # (a decoder's last complete chunk: rejected drafts may rewrite its drafter KV)
        if num_chunks <= state.next_stored:
            self._set_retry(state, False)
            return
        keys = self._keys(request, state.next_stored, num_chunks)
        self._store(request, state, keys, num_chunks, lambda stored: len(stored) * self.blocks_per_chunk)

    def _store(self, request: Request, state: _OffloadState, keys: list[tuple[int, int]], num_chunks: int,
               blocks_of) -> bool:
        """The request offers `keys`, its chunks up to `num_chunks` not offered yet; the tier takes
        those it lacks in one job, which reads `blocks_of(stored keys)` GPU blocks. False if the
        tier found no room (offered again the next time the request is scheduled)."""
        stored = self.manager.prepare_store(keys, state.access)
        if stored is None:
            self._set_retry(state, True)
            self.num_store_failures += 1
            return False
        self._set_retry(state, False)
        state.next_stored = max(state.next_stored, num_chunks)
        if stored:
            num_stored = blocks_of(stored)
            self.step_stores.append(self._new_job(request, stored, True, state, num_stored))
            self.num_stores += 1
            self.num_stored_blocks += num_stored
        return True

    def _new_job(self, request: Request, keys: list[int], is_store: bool, state: _OffloadState,
                 num_blocks: int) -> OffloadJob:
        job = OffloadJob(self._next_job, request, keys, is_store, num_blocks)
        self._next_job += 1
        self._jobs[job.job_id] = job
        state.jobs.add(job.job_id)
        return job

    def _set_retry(self, state: _OffloadState, retry: bool) -> None:
        if state.store_retry != retry:
            state.store_retry = retry
            self.num_retrying += 1 if retry else -1

    def retrying(self) -> list[Request]:
        """Requests whose last store found no room (rare: a tier full of chunks in transfer)."""
        return [s.request for s in self._states.values() if s.store_retry and not s.finished]

    # ---- completions --------------------------------------------------------------------------
    def job_done(self, job: OffloadJob) -> None:
        """A transfer's end, seen at a step boundary."""
        del self._jobs[job.job_id]
        if job.is_store:
            self.manager.complete_store(job.keys)
        else:
            self.manager.complete_load(job.keys)
            self._being_loaded.difference_update(job.keys)
        state = self._states[job.request]
        state.jobs.discard(job.job_id)
        if state.finished and not state.jobs:
            del self._states[job.request]

    def request_finished(self, request: Request, num_blocks: int, num_tokens: int | None = None) -> None:
        """`request` finished holding `num_blocks` blocks (the next schedule() retires it);
        `num_tokens`: an aborted request's tokens whose KV was computed and that are known
        (vLLM stores as far as both go)."""
        self._finished.append((request, num_blocks, num_tokens))

    @property
    def has_finished_requests(self) -> bool:
        """Whether requests finished since the last schedule() (it stores what they left and
        retires them from the tier's recency)."""
        return bool(self._finished)

    @property
    def has_finished_offers(self) -> bool:
        """Whether requests that finished since the last schedule() may offer decode chunks then."""
        return bool(self._finished) and not self.prompt_only

    def has_pending_jobs(self) -> bool:
        return bool(self._jobs)

    def reset_tier(self) -> bool:
        """Empty the tier, as a new engine's is (its store admission's counts too); only with no
        transfer in flight and no request tracked. False, with nothing changed, otherwise."""
        if self._jobs or self._states or self._finished or self._being_loaded:
            return False
        if self.admission is not None:
            self.admission = StoreAdmission(self.admission.threshold, self.admission.max_tracker_size)
        self.manager = type(self.manager)(self.manager.num_chunks, self.admission)
        return True

    def take_step_jobs(self) -> list[OffloadJob]:
        """The transfers the step just scheduled starts: its loads, then its stores."""
        jobs = self.step_loads + self.step_stores
        self.step_loads, self.step_stores = [], []
        return jobs

    def stats(self) -> dict:
        stats = {"cpu_chunks": self.manager.num_chunks, "cpu_chunks_used": self.manager.num_used,
                "chunk_tokens": self.chunk_tokens,
                "loads": self.num_loads, "loaded_blocks": self.num_loaded_blocks,
                "loaded_tokens": self.num_hit_tokens, "stores": self.num_stores,
                "stored_blocks": self.num_stored_blocks, "store_failures": self.num_store_failures,
                "evicted_blocks": self.manager.num_evictions, "lookup_retries": self.num_lookup_retries}
        if self.admission is not None:  # (vLLM reports stores_skipped only with a store_threshold)
            stats["store_threshold"] = self.admission.threshold
            stats["stores_skipped"] = self.admission.num_skipped
        return stats
