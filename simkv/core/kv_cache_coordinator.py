"""KV-cache coordinator: one block table per KV-cache group over one shared pool (vLLM's hybrid
KV-cache manager), for models with sliding-window layers.

Every group (core/kv_cache_groups.py) allocates its own blocks for every token slot, from the
same pool, in group order. A sliding-window group of window w gives back, each time the request
is scheduled, the blocks that lie wholly below `num_computed_tokens - w + 1`: they are replaced
by the null block in its table (vLLM's remove_skipped_blocks). A request therefore holds about
w / block_size blocks per sliding-window group however long it grows, plus a whole chunk while
a prefill chunk is in flight.

Prefix caching, as vLLM 0.33 does it with its default `prefix_cache_retention_interval` 0
(None caches every sliding-window block too; R > 0 also the runs before every multiple of R):
- block keys are per group (the content key and the group id);
- full-attention groups cache every full block, as the single-group manager does;
- sliding-window groups cache only the ceil((w - 1) / block_size) blocks that end at the
  block boundary below `num_prompt_tokens - 1` (where a resend of the same prompt resumes)
  and, for a request whose lookup found a longer shared prefix in the full-attention groups
  than in the sliding-window ones (a "junction"), the blocks that end at that prefix, so that
  the next request sharing it hits;
- a hit is the longest prefix every group can serve: full attention scans from the left;
  a sliding-window group needs its last ceil((w - 1) / block_size) blocks before the hit's end
  cached, found by a scan from the right (or a cached run from the first block);
- admission (`full_sequence_must_fit`) caps a sliding-window group's need at
  ceil(min(w - 1 + max_in_flight_tokens, max_model_len) / block_size) + 1 blocks (the
  in-flight tokens: max_num_batched_tokens, twice that under async scheduling).

Chunked local attention (Llama 4, `chunked=True`: the window groups' span is the chunk size C)
runs on the same machinery with vLLM's ChunkedLocalAttentionManager rules: a local group gives
back every block wholly below the start of the next token's chunk, floor(n / C) x C; it caches
every full block, as full attention does (retention intervals do not apply); a hit of L tokens
takes null blocks below floor(L / C) x C and needs the blocks from there to L cached, scanned
from the left; admission caps a local group at ceil(min(C + max_in_flight_tokens, max_model_len)
/ block_size) blocks.

Blocks are hashed when scheduled, as vLLM does, except a steady decoder's (the scheduler does
not touch it every step, core/steady_decoders.py): it meets the coordinator only at its events,
a block boundary (a block for every group) or a window release, and its full blocks are hashed
when they leave the window or the request releases its blocks. Nobody else can hit a decoded
block (its content is the request's own), so the cache looks the same to every lookup.
"""

from __future__ import annotations

from simkv.core.block_hashing import BlockHasher
from simkv.core.block_pool import BlockPool, KVCacheBlock
from simkv.core.kv_cache_groups import admission_cap_blocks, reachable_window_blocks
from simkv.core.kv_cache_manager import ComputedBlocks, PrefixCacheStats, cdiv, _NO_HITS
from simkv.core.request import Request, RequestStatus


class KVCacheCoordinator:
    """The scheduler's KV-cache manager for models with sliding-window layers (same interface
    as KVCacheManager for what the scheduler uses).

    Per request: one block table per group. All tables have the same length (every group
    allocates up to the same token count), the sliding-window tables the same leading run of
    null blocks (every window group has the same window), and all groups have cached the same
    number of blocks: the request's state is kept once, not per group (vLLM keeps it per group).
    """

    num_forks = 0  # parallel sampling is not modelled with sliding-window layers
    num_cow_copies = 0
    num_false_prefix_hits = 0
    # KV offloading (core/kv_offload_hybrid.py): told of every block handed out and of every block a
    # request's tables gain
    offload_watch = None

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, windows: tuple[int, ...],
                 enable_caching: bool = True, watermark: float = 0.0, max_in_flight_tokens: int = 8192,
                 retention_interval: int | None = 0, hash_lookahead: int = 0, reprefillable: int = 0,
                 eagle_block_drop: bool = False, chunked: bool = False) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.null_block = self.block_pool.null_block
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        # (EAGLE family: a block's key covers the token after it, vLLM's lookahead block hashes)
        self.hasher = BlockHasher(block_size, lookahead=hash_lookahead, reprefillable=reprefillable)
        # EAGLE under a KV connector (legacy keys): the full-attention groups, which hold the draft
        # layer, find one block past the candidate hit and give it back (vLLM's eagle block drop)
        self.eagle_block_drop = eagle_block_drop
        # vLLM's prefix_cache_retention_interval: which sliding-window blocks are cached (None: all)
        self.retention_interval = retention_interval
        self.windows = tuple(windows)
        self.num_groups = len(windows)
        sliding = {w for w in windows if w}
        if len(sliding) != 1:
            raise ValueError("the KV-cache coordinator models one sliding-window size")
        self.window = w = sliding.pop()
        self.full_gids = [g for g, x in enumerate(windows) if not x]
        self.window_gids = [g for g, x in enumerate(windows) if x]
        self.chunked = chunked  # chunked local attention: the window groups' span is their chunk
        self.need = cdiv(w - 1, block_size)  # blocks a hit needs before its end (the next token's window)
        # admission (full_sequence_must_fit) counts a window group's blocks up to vLLM's cap
        self.admission_cap = admission_cap_blocks(w, chunked, max_in_flight_tokens, max_model_len, block_size)
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_frees = 0
        self._tables: dict[int, list[list[KVCacheBlock]]] = {}  # request index -> per group
        self._nulls: dict[int, int] = {}  # leading null blocks of the window groups' tables
        self._num_cached: dict[int, int] = {}  # blocks cached (or looked at for caching) per group
        self._junction: dict[int, int] = {}  # request index -> shared-prefix boundary (vLLM's shared_prefix_boundary)
        # Over finished requests, all groups: token slots their blocks held at the end (a window
        # group: only from its first block still held), and slots of their last blocks left empty.
        self.finished_slots = [0, 0]

    # ---- lookups -------------------------------------------------------------------------
    def _cached(self, request: Request, i: int, gids: list[int]) -> list[KVCacheBlock] | None:
        """Block i of every group in `gids` if all are cached, else None."""
        key = self.hasher.block_key(request, i) * self.num_groups
        get = self.block_pool.get_cached_block
        out = []
        for gid in gids:
            block = get(key + gid)
            if block is None:
                return None
            out.append(block)
        return out

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest prefix every group can serve from the cache (at least one token left to
        compute); `blocks` holds one list per group (null blocks below a window's reach)."""
        if not self.enable_caching:
            return _NO_HITS
        max_blocks = (request.num_tokens - 1) // self.block_size
        # (the eagle drop looks one block further, up to the request's last full block)
        scan = request.num_tokens // self.block_size if self.eagle_block_drop else max_blocks
        if not request.has_own_cached_blocks:  # blocks past the shared region cannot be cached
            max_blocks = min(max_blocks, self.hasher.num_shared_blocks(request))
            scan = min(scan, self.hasher.num_shared_blocks(request))
        per_group: list[list[KVCacheBlock]] = [[] for _ in self.windows]
        longest = max_blocks
        found: list[list[KVCacheBlock]] = []  # per full block: that block of every full-attention group
        if self.full_gids:
            for i in range(scan):
                blocks = self._cached(request, i, self.full_gids)
                if blocks is None:
                    break
                found.append(blocks)
            if self.eagle_block_drop and found:
                found.pop()
            longest = len(found)
        hit = self._window_hit(request, longest, per_group)
        if not self.full_gids:
            longest = hit
        for j, gid in enumerate(self.full_gids):
            per_group[gid] = [b[j] for b in found[:hit]]
        self._junction[request.index] = longest * self.block_size if longest > hit else 0
        if hit == 0:
            return _NO_HITS
        return ComputedBlocks(tuple(per_group), hit * self.block_size)

    def _window_hit(self, request: Request, max_blocks: int, per_group: list) -> int:
        if self.chunked:
            return self._chunk_hit(request, max_blocks, per_group)
        return self._sliding_hit(request, max_blocks, per_group)

    def _chunk_hit(self, request: Request, max_blocks: int, per_group: list) -> int:
        """Chunked local groups: null blocks below the chunk that `max_blocks` blocks end in,
        then the cached run from there (vLLM's ChunkedLocalAttentionManager)."""
        bs = self.block_size
        start = max_blocks * bs // self.window * self.window // bs
        run: list[list[KVCacheBlock]] = []
        for i in range(start, max_blocks):
            blocks = self._cached(request, i, self.window_gids)
            if blocks is None:
                break
            run.append(blocks)
        head = [self.null_block] * start
        for j, gid in enumerate(self.window_gids):
            per_group[gid] = head + [b[j] for b in run]
        return start + len(run)

    def _sliding_hit(self, request: Request, max_blocks: int, per_group: list) -> int:
        """Sliding-window groups: scan from block `max_blocks - 1` down for `need` consecutive
        cached blocks; without such a run, the cached run from block 0 (vLLM's rule)."""
        run: list[list[KVCacheBlock]] = []  # the current run, right to left
        start = 0
        for i in range(max_blocks - 1, -1, -1):
            blocks = self._cached(request, i, self.window_gids)
            if blocks is None:
                run = []
                continue
            run.append(blocks)
            if len(run) >= self.need:
                start = i
                break
        run.reverse()
        head = [self.null_block] * start
        for j, gid in enumerate(self.window_gids):
            per_group[gid] = head + [b[j] for b in run]
        return start + len(run)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    # ---- allocation ----------------------------------------------------------------------
    def num_blocks_of(self, request: Request) -> int:
        tables = self._tables.get(request.index)
        if not tables:
            return 0
        return len(tables[0]) * self.num_groups - self._nulls.get(request.index, 0) * len(self.window_gids)

    def _num_skipped_blocks(self, num_computed: int) -> int:
        if self.chunked:  # the tokens before the next token's chunk
            return num_computed // self.window * self.window // self.block_size
        return max(0, num_computed - self.window + 1) // self.block_size

    def _blocks_to_admit(self, num_tokens: int, hits, num_computed: int, cap: bool) -> int:
        """Blocks a waiting request (no blocks yet) needs over all groups for `num_tokens` slots
        (vLLM's get_num_blocks_to_allocate with the new prefix hits, per group)."""
        required = cdiv(num_tokens, self.block_size)
        skipped = self._num_skipped_blocks(num_computed)
        if not hits and not skipped:
            window_required = min(required, self.admission_cap) if cap else required
            return required * len(self.full_gids) + window_required * len(self.window_gids)
        null = self.null_block
        total = 0
        for gid, window in enumerate(self.windows):
            group_hits = hits[gid] if hits else ()
            need = min(required, self.admission_cap) if cap and window else required
            total += max(need - max(skipped if window else 0, len(group_hits)), 0)
            total += sum(b.ref_cnt == 0 and b is not null for b in group_hits[skipped if window else 0:])
        return total

    def allocate_slots(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                       computed: ComputedBlocks | None = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, has_scheduled_reqs: bool = True,
                       delay_cache: bool = False, reserved_blocks: int = 0,
                       num_processed_tokens: int | None = None,
                       num_external_tokens: int = 0) -> list[KVCacheBlock] | None:
        """vLLM's allocate_slots over the groups: free what left the windows, check the pool,
        take the prefix hits, allocate in group order, cache the full blocks. None: no room
        (the windows' blocks are given back all the same, as in vLLM). `num_processed_tokens`
        (async scheduling): the computed tokens whose step output was processed, which the
        windows' release goes by (None: all of them). `num_external_tokens` (P/D: a pull admitted
        with its prompt's KV coming from outside): those tokens count as computed, so the window
        groups take blocks only for the pulled tokens still inside their windows."""
        index = request.index
        tables = self._tables.get(index)
        release_at = num_computed_tokens if num_processed_tokens is None else num_processed_tokens
        if (tables is not None and computed is None and not full_sequence_must_fit
                and request.status == RequestStatus.RUNNING):
            # A running request (the common case, a decode): often it needs no block, frees none
            # and caches none this step.
            bs = self.block_size
            held = len(tables[0])
            need_slots = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
            if (need_slots <= held * bs and self._num_skipped_blocks(release_at) <= self._nulls.get(index, 0)
                    and reserved_blocks <= self.block_pool.free_block_queue.num_free_blocks
                    and (not self.enable_caching or delay_cache
                         or self.hasher.num_cacheable_blocks(request, min(num_computed_tokens + num_new_tokens,
                                                                request.num_tokens))
                         <= self._num_cached.get(index, 0))):
                return []
        pool = self.block_pool
        hits = computed.blocks if computed is not None and computed.num_tokens else None
        total = min(num_computed_tokens + (computed.num_tokens if hits else 0) + num_external_tokens,
                    self.max_model_len)
        watermark = self.watermark_blocks if has_scheduled_reqs and request.status != RequestStatus.RUNNING else 0
        need_slots = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        held = tables is not None
        if not held:
            if full_sequence_must_fit:
                full = min(request.num_tokens, self.max_model_len)
                if self._blocks_to_admit(full, hits, total, True) + watermark > pool.get_num_free_blocks():
                    return None
            if self._blocks_to_admit(need_slots, hits, total, False) + watermark > pool.get_num_free_blocks() - reserved_blocks:
                return None
            if num_external_tokens:  # (a pull: every group's hits first, then each group's blocks in turn)
                return self._allocate_pulled(request, hits, total, need_slots)
            tables = self._tables[index] = self._take_hits(index, hits, total) if hits else [[] for _ in self.windows]
        else:  # a request holding blocks (running, or a pulled one whose KV arrived): the window's
            # release, then its new blocks
            if full_sequence_must_fit and self.remaining_blocks(request, min(request.num_tokens, self.max_model_len)) \
                    + watermark > pool.get_num_free_blocks():
                return None
            self._release_window(index, tables, release_at)
            if max(cdiv(need_slots, self.block_size) - len(tables[0]), 0) * self.num_groups + watermark > \
                    pool.get_num_free_blocks() - reserved_blocks:
                return None
        n = cdiv(need_slots, self.block_size) - len(tables[0])
        new_blocks: list[KVCacheBlock] = []
        if n > 0:  # group by group from the head of the free queue: one pop for all of them
            new_blocks = pool.get_new_blocks(n * self.num_groups)
            for g, table in enumerate(tables):
                table += new_blocks[g * n:(g + 1) * n]
        if self.offload_watch is not None:
            self.offload_watch.handed_out(new_blocks)
            if held and request.status != RequestStatus.RUNNING:  # (its load ended: scheduled now)
                self.offload_watch.rescheduled(index, tables)
            self.offload_watch.learned(index, tables)
        if self.enable_caching and not delay_cache:
            self._cache_blocks(request, min(total + num_new_tokens, request.num_tokens))
        return new_blocks

    def _allocate_pulled(self, request: Request, hits, num_computed: int, need_slots: int) -> list[KVCacheBlock]:
        """A pull's blocks (vLLM's allocate_new_computed_blocks with external tokens): the local
        hits of every group are taken first; then each group in turn gets blocks up to
        `need_slots`, a window group none below its window (null blocks there)."""
        index = request.index
        tables = self._tables[index] = self._take_hits(index, hits or [[] for _ in self.windows], num_computed)
        required = cdiv(need_slots, self.block_size)
        new_blocks: list[KVCacheBlock] = []
        for table in tables:
            if required > len(table):
                blocks = self.block_pool.get_new_blocks(required - len(table))
                table += blocks
                new_blocks += blocks
        if self.offload_watch is not None:  # (the connector learns its table when it is scheduled)
            self.offload_watch.handed_out(new_blocks)
        return new_blocks

    def remaining_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks the request still needs, over all groups, to hold `num_tokens` slots (a window
        group up to its admission cap): vLLM's get_num_blocks_to_allocate for a request that
        holds blocks, with the admission cap (its `_request_remaining_blocks`)."""
        held = len(self._tables[request.index][0]) if request.index in self._tables else 0
        required = cdiv(num_tokens, self.block_size)
        return (max(required - held, 0) * len(self.full_gids)
                + max(min(required, self.admission_cap) - held, 0) * len(self.window_gids))

    def cache_shared_blocks(self, request: Request, num_tokens: int) -> None:
        """P/D: a pull's KV has arrived; its full blocks are cached now (vLLM's cache_blocks)."""
        if self.enable_caching and request.index in self._tables:
            self._cache_blocks(request, min(num_tokens, request.num_tokens))

    # ---- steady decoders (core/steady_decoders.py) --------------------------------------------
    def next_decode_event(self, request: Request) -> int:
        """The computed-token count at which a steady decoder next needs the coordinator: its
        next block boundary (before max_model_len) or its next window release, the earlier."""
        index = request.index
        bs = self.block_size
        if self.chunked:  # the first chunk start past the next block to give back
            release = cdiv((self._nulls.get(index, 0) + 1) * bs, self.window) * self.window
        else:
            release = (self._nulls.get(index, 0) + 1) * bs + self.window - 1
        held = len(self._tables[index][0]) * bs
        return release if held >= self.max_model_len else min(held, release)

    def decode_release(self, request: Request, num_computed_tokens: int) -> None:
        """A steady decoder at `num_computed_tokens` (async scheduling: those whose output was
        processed) is scheduled: the blocks that left its window are given back, hashed first
        (vLLM hashed them when their tokens were computed)."""
        index = request.index
        skipped = self._num_skipped_blocks(num_computed_tokens)
        if skipped <= self._nulls.get(index, 0):
            return
        if self.enable_caching:
            self._cache_blocks(request, skipped * self.block_size)
        self._release_window(index, self._tables[index], num_computed_tokens)

    def decode_block_need(self, request: Request, num_computed_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """Blocks a steady decoder's next token needs: one per group at a block boundary, else 0."""
        held = len(self._tables[request.index][0]) * self.block_size
        return self.num_groups if num_computed_tokens + 1 + num_lookahead_tokens > held else 0

    def decode_write(self, request: Request, num_computed_tokens: int = 0) -> None:
        """A steady decoder at a block boundary takes a block for every group, in group order
        from the head of the free queue (decode_block_need said so; the pool has them)."""
        blocks = self.block_pool.get_new_blocks(self.num_groups)
        tables = self._tables[request.index]
        for table, block in zip(tables, blocks):
            table.append(block)
        if self.offload_watch is not None:
            self.offload_watch.handed_out(blocks)
            self.offload_watch.learned(request.index, tables)

    def _take_hits(self, index: int, hits, num_computed: int) -> list[list[KVCacheBlock]]:
        """A waiting request's prefix hits become its tables (every group's hits are taken
        before any group allocates); window groups keep null blocks below the window."""
        skipped = self._num_skipped_blocks(num_computed)
        tables = []
        null = self.null_block
        watch = self.offload_watch
        for gid, window in enumerate(self.windows):
            group_hits = hits[gid]
            if window:
                real = group_hits[skipped:]
                self.block_pool.touch(real)
                tables.append([null] * skipped + list(real))
            else:
                real = group_hits
                self.block_pool.touch(group_hits)
                tables.append(list(group_hits))
            if watch is not None:
                watch.handed_out(real)
        self._nulls[index] = skipped
        self._num_cached[index] = len(hits[0])  # (the hit blocks: a pull's window tables may be longer)
        return tables

    def _release_window(self, index: int, tables: list[list[KVCacheBlock]], num_computed: int) -> None:
        """Give back the window groups' blocks that lie wholly outside the window of the next
        token (vLLM's remove_skipped_blocks: each group's, last block first, group by group)."""
        upto = min(self._num_skipped_blocks(num_computed), len(tables[0]))
        nulls = self._nulls.get(index, 0)
        if upto <= nulls:
            return
        null = self.null_block
        free_blocks = self.block_pool.free_blocks
        for gid in self.window_gids:
            table = tables[gid]
            freed = table[nulls:upto]
            freed.reverse()
            table[nulls:upto] = [null] * (upto - nulls)
            free_blocks(freed)
        self._nulls[index] = upto
        self.num_frees += 1

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the request's full blocks below `num_tokens` findable: all of them in full-attention
        groups; in sliding-window groups only the runs a later hit can end at."""
        index = request.index
        end = self.hasher.num_cacheable_blocks(request, num_tokens)
        start = self._num_cached.get(index, 0)
        if end <= start:
            return
        self._num_cached[index] = end
        tables = self._tables[index]
        key = self.hasher.block_key
        cache_block = self.block_pool.cache_block
        g = self.num_groups
        shared = self.hasher.num_shared_blocks(request)
        window_positions = self._window_positions(request, start, end)
        null = self.null_block
        key(request, end - 1)  # (the keys of blocks [0, end) are memoised from here on)
        keys = [k * g for k in request.block_hashes[start:end]]  # a block's key in group 0 (+ gid)
        for gid, window in enumerate(self.windows):
            table = tables[gid]
            for i in (window_positions if window else range(start, end)):
                block = table[i]
                if block is not null and block.block_hash is None:
                    cache_block(block, keys[i - start] + gid)
        if end > shared and (self.full_gids or any(i >= shared for i in window_positions)):
            request.has_own_cached_blocks = True  # (a preempted request may hit its own blocks)

    def cache_verified(self, request: Request, num_computed_tokens: int) -> None:
        """Speculative decoding: a request's sampled tokens arrived; its full blocks up to them
        are cached now (vLLM's update_from_output does), not at its next allocation."""
        if self.enable_caching and request.index in self._tables:
            self._cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    def _window_positions(self, request: Request, start: int, end: int):
        """The blocks in [start, end) a sliding-window group caches (vLLM's reachable_block_mask):
        under retention interval R > 0 the `need` blocks before every multiple of R; always the
        `need` blocks before `num_prompt_tokens - 1` and before the request's junction."""
        retention = self.retention_interval
        bs = self.block_size
        if retention is None or self.chunked:  # (chunked local groups cache densely)
            return range(start, end)
        junction = self._junction.get(request.index)
        prompt = request.num_prompt_tokens
        if self.eagle_block_drop:  # (vLLM's replay_boundaries under the eagle drop: a block lower)
            boundaries = {max((prompt - 1) // bs * bs - bs, 0), max(prompt // bs * bs - bs, 0)}
        else:
            boundaries = {prompt - 1}
        if junction:
            boundaries.add(junction)
        keep = reachable_window_blocks(start, end, self.need, bs, bs, retention, boundaries)
        return range(start, end) if keep is None else keep

    def free(self, request: Request, num_computed_tokens: int = 0, finished: bool = False,
             defer: list | None = None) -> None:
        """Release all of a request's blocks, group by group, each group's tail first. `defer`:
        the pool gets them back at `free_deferred`, in one release from the last group's tail to
        the first group's head (vLLM frees a deferred request's blocks as one reversed list)."""
        index = request.index
        if self.enable_caching and index in self._tables:  # (a steady decoder's blocks: now)
            self._cache_blocks(request, min(num_computed_tokens, request.num_tokens))
        tables = self._tables.pop(index, None)
        nulls = self._nulls.pop(index, 0)
        self._num_cached.pop(index, None)
        if self.offload_watch is not None:
            self.offload_watch.forget(index)
        if finished:
            self._junction.pop(index, None)
            computed = min(num_computed_tokens, self.max_model_len)
            bs = self.block_size
            self.finished_slots[0] += (computed * len(self.full_gids)
                                       + max(computed - nulls * bs, 0) * len(self.window_gids))
            self.finished_slots[1] += (-(-computed // bs) * bs - computed) * self.num_groups
        if not tables or not tables[0]:
            return
        if defer is not None:
            held = [tables[gid][nulls:] if window else tables[gid] for gid, window in enumerate(self.windows)]
            defer.append([block for blocks in reversed(held) for block in reversed(blocks)])
            return
        free_blocks = self.block_pool.free_blocks
        for gid, window in enumerate(self.windows):
            blocks = tables[gid][nulls:] if window else tables[gid]
            blocks.reverse()
            if blocks:
                free_blocks(blocks)
        self.num_frees += 1

    def free_deferred(self, blocks: list) -> None:
        """Give the pool the blocks of a deferred `free`."""
        if blocks:
            self.block_pool.free_blocks(blocks)
        self.num_frees += 1

    def window_tables(self, request: Request) -> list[list[KVCacheBlock]]:
        """The request's window groups' block tables (null blocks below the windows)."""
        tables = self._tables[request.index]
        return [tables[gid] for gid in self.window_gids]

    def junction(self, request: Request) -> int:
        """The request's shared-prefix junction (vLLM's shared_prefix_boundary; 0: none)."""
        return self._junction.get(request.index, 0)

    def allocator_stats(self) -> dict:
        return {"allocator": "paged", "kv_cache_groups": self.num_groups}

    def get_block_ids(self, request: Request) -> list[int]:
        """The first group's block table (sliding-window models run on cost models only)."""
        tables = self._tables.get(request.index)
        return [b.block_id for b in tables[0]] if tables else []

    def get_group_block_ids(self, request: Request) -> list[list[int]]:
        return [[b.block_id for b in t] for t in self._tables.get(request.index, [[] for _ in self.windows])]
