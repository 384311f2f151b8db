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
  ceil(min(w - 1 + max_num_batched_tokens, max_model_len) / block_size) + 1 blocks.

Unlike KVCacheManager (single group), blocks are hashed when scheduled, as vLLM does, not
lazily; there are no steady decoders under it (the scheduler steps every request).
"""

from __future__ import annotations

from simkv.core.block_hashing import BlockHasher
from simkv.core.block_pool import BlockPool, KVCacheBlock
from simkv.core.kv_cache_manager import ComputedBlocks, PrefixCacheStats, cdiv, _NO_HITS
from simkv.core.request import Request, RequestStatus


class _Group:
    """One KV-cache group's block tables (vLLM's SingleTypeKVCacheManager)."""

    __slots__ = ("gid", "window", "need", "admission_cap", "req_to_blocks", "num_cached_block")

    def __init__(self, gid: int, window: int, block_size: int, admission_cap: int) -> None:
        self.gid = gid
        self.window = window
        # sliding window: blocks a hit needs before its end (the window of the next token)
        self.need = cdiv(window - 1, block_size) if window else 0
        self.admission_cap = admission_cap  # sliding window only
        self.req_to_blocks: dict[int, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[int, int] = {}

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) if self.window else 0


class KVCacheCoordinator:
    """The scheduler's KV-cache manager for models with sliding-window layers (same interface
    as KVCacheManager for what the scheduler uses)."""

    num_forks = 0  # parallel sampling is not modelled with sliding-window layers
    num_cow_copies = 0
    num_false_prefix_hits = 0

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, windows: tuple[int, ...],
                 enable_caching: bool = True, watermark: float = 0.0, max_num_batched_tokens: int = 8192,
                 retention_interval: int | None = 0) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.null_block = self.block_pool.null_block
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.hasher = BlockHasher(block_size)
        # vLLM's prefix_cache_retention_interval: which sliding-window blocks are cached (None: all)
        self.retention_interval = retention_interval
        self.groups = []
        for gid, w in enumerate(windows):
            cap = cdiv(min(w - 1 + max_num_batched_tokens, max_model_len), block_size) + 1 if w else 0
            self.groups.append(_Group(gid, w, block_size, cap))
        self.num_groups = len(windows)
        self.full_groups = [g for g in self.groups if not g.window]
        self.window_groups = [g for g in self.groups if g.window]
        if len({g.window for g in self.window_groups}) > 1:
            raise ValueError("the KV-cache coordinator models one sliding-window size")
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_frees = 0
        self._junction: dict[int, int] = {}  # request index -> shared-prefix boundary (vLLM's shared_prefix_boundary)

    # ---- lookups -------------------------------------------------------------------------
    def _key(self, request: Request, i: int, gid: int) -> int:
        return self.hasher.block_key(request, i) * self.num_groups + gid

    def _cached(self, request: Request, i: int, groups: list[_Group]) -> list[KVCacheBlock] | None:
        """Block i of every group in `groups` if all are cached, else None."""
        key = self.hasher.block_key(request, i) * self.num_groups
        get = self.block_pool.get_cached_block
        out = []
        for g in groups:
            block = get(key + g.gid)
            if block is None:
                return None
            out.append(block)
        return out

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest prefix every group can serve from the cache (at least one token left to
        compute); `blocks` holds one list per group (null blocks below a window's reach)."""
        if not self.enable_caching:
            return _NO_HITS
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if not request.has_own_cached_blocks:  # blocks past the shared region cannot be cached
            max_blocks = min(max_blocks, self.hasher.num_shared_blocks(request))
        per_group: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        longest = hit = max_blocks
        if self.full_groups:
            found = []
            for i in range(max_blocks):
                blocks = self._cached(request, i, self.full_groups)
                if blocks is None:
                    break
                found.append(blocks)
            hit = longest = len(found)
            for j, g in enumerate(self.full_groups):
                per_group[g.gid] = [b[j] for b in found]
        if self.window_groups:
            hit = self._window_hit(request, hit, per_group)
            if not self.full_groups:
                longest = hit
            for g in self.full_groups:
                del per_group[g.gid][hit:]
        self._junction[request.index] = longest * bs if longest > hit else 0
        if hit == 0:
            return _NO_HITS
        return ComputedBlocks(tuple(per_group), hit * bs)

    def _window_hit(self, request: Request, max_blocks: int, per_group: list) -> int:
        """Sliding-window groups: scan from block `max_blocks - 1` down for `need` consecutive
        cached blocks; without such a run, the cached run from block 0 (vLLM's rule)."""
        groups = self.window_groups
        need = groups[0].need
        run: list[list[KVCacheBlock]] = []  # the current run, right to left
        start = 0
        for i in range(max_blocks - 1, -1, -1):
            blocks = self._cached(request, i, groups)
            if blocks is None:
                run = []
                continue
            run.append(blocks)
            if len(run) >= need:
                start = i
                break
        run.reverse()
        null = self.null_block
        for j, g in enumerate(groups):
            per_group[g.gid] = [null] * start + [b[j] for b in run]
        return start + len(run)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    # ---- allocation ----------------------------------------------------------------------
    def num_blocks_of(self, request: Request) -> int:
        null = self.null_block
        return sum(sum(b is not null for b in g.req_to_blocks.get(request.index, ())) for g in self.groups)

    def _blocks_to_allocate(self, g: _Group, request: Request, num_tokens: int, hits, num_computed: int,
                            cap: bool = False) -> int:
        required = cdiv(num_tokens, self.block_size)
        if cap and g.window:
            required = min(required, g.admission_cap)
        blocks = g.req_to_blocks.get(request.index)
        held = len(blocks) if blocks is not None else 0
        if not hits:
            return max(required - held, 0)
        skipped = g.num_skipped_tokens(num_computed) // self.block_size
        new = max(required - max(skipped, len(hits) + held), 0)
        null = self.null_block
        return new + sum(b.ref_cnt == 0 and b is not null for b in hits[max(0, skipped - held):])

    def allocate_slots(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                       computed: ComputedBlocks | None = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, has_scheduled_reqs: bool = True,
                       delay_cache: bool = False, reserved_blocks: int = 0) -> list[KVCacheBlock] | None:
        """vLLM's allocate_slots over the groups: free what left the windows, check the pool,
        take the prefix hits, allocate in group order, cache the full blocks. None: no room
        (the windows' blocks are given back all the same, as in vLLM)."""
        hits = computed.blocks if computed is not None and computed.num_tokens else None
        total = min(num_computed_tokens + (computed.num_tokens if hits else 0), self.max_model_len)
        watermark = self.watermark_blocks if has_scheduled_reqs and request.status != RequestStatus.RUNNING else 0
        pool = self.block_pool
        groups = self.groups
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            need = sum(self._blocks_to_allocate(g, request, full, hits[g.gid] if hits else None, total, cap=True)
                       for g in groups)
            if need + watermark > pool.get_num_free_blocks():
                return None
        need_slots = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        for g in self.window_groups:
            self._remove_skipped(g, request, total)
        need = sum(self._blocks_to_allocate(g, request, need_slots, hits[g.gid] if hits else None, total)
                   for g in groups)
        if need + watermark > pool.get_num_free_blocks() - reserved_blocks:
            return None
        index = request.index
        if hits:
            null = self.null_block
            for g in groups:  # every group's hits are taken before any group allocates
                skipped = g.num_skipped_tokens(total) // self.block_size
                real = hits[g.gid][skipped:]
                pool.touch(real)
                g.req_to_blocks[index] = table = [null] * skipped + list(real)
                g.num_cached_block[index] = len(table)
        new_blocks: list[KVCacheBlock] = []
        num_required = cdiv(need_slots, self.block_size)
        for g in groups:
            table = g.req_to_blocks.get(index)
            if table is None:
                table = g.req_to_blocks[index] = []
            n = num_required - len(table)
            if n > 0:
                got = pool.get_new_blocks(n)
                table.extend(got)
                new_blocks += got
        if self.enable_caching and not delay_cache:
            self._cache_blocks(request, min(total + num_new_tokens, request.num_tokens))
        return new_blocks

    def _remove_skipped(self, g: _Group, request: Request, num_computed: int) -> None:
        """Give back the group's blocks that lie wholly outside the window of the next token."""
        skipped = g.num_skipped_tokens(num_computed) // self.block_size
        if skipped <= 0:
            return
        table = g.req_to_blocks.get(request.index)
        if not table:
            return
        null = self.null_block
        freed = []
        for i in range(min(skipped, len(table)) - 1, -1, -1):
            block = table[i]
            if block is null:
                break
            freed.append(block)
            table[i] = null
        if freed:
            self.block_pool.free_blocks(freed)
            self.num_frees += 1

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the request's full blocks below `num_tokens` findable: all of them in full-attention
        groups; in sliding-window groups only the runs a later hit can end at."""
        bs = self.block_size
        index = request.index
        end = num_tokens // bs
        shared = self.hasher.num_shared_blocks(request)
        for g in self.groups:
            start = g.num_cached_block.get(index, 0)
            if end <= start:
                continue
            table = g.req_to_blocks[index]
            positions = self._window_positions(g, request, start, end) if g.window else range(start, end)
            null = self.null_block
            for i in positions:
                block = table[i]
                if block is not null and block.block_hash is None:
                    self.block_pool.cache_block(block, self._key(request, i, g.gid))
                    if i >= shared:
                        request.has_own_cached_blocks = True
            g.num_cached_block[index] = end

    def _window_positions(self, g: _Group, request: Request, start: int, end: int):
        """The blocks in [start, end) a sliding-window group caches (vLLM's reachable_block_mask):
        under retention interval R > 0 the `need` blocks before every multiple of R; always the
        `need` blocks before `num_prompt_tokens - 1` and before the request's junction."""
        retention = self.retention_interval
        bs = self.block_size
        if retention is None:
            return range(start, end)
        keep = set()
        if retention:
            per_segment = retention // bs
            if g.need >= per_segment:
                return range(start, end)
            keep.update(i for i in range(start, end) if i % per_segment >= per_segment - g.need)
        index = request.index
        reach = [request.num_prompt_tokens - 1]
        if self._junction.get(index):
            reach.append(self._junction[index])
        for boundary in reach:
            stop = boundary // bs
            keep.update(range(max(start, stop - g.need), min(end, stop)))
        return sorted(keep)

    def free(self, request: Request, num_computed_tokens: int = 0, finished: bool = False) -> None:
        """Release all of a request's blocks, group by group, each group's tail first."""
        index = request.index
        null = self.null_block
        released = False
        for g in self.groups:
            table = g.req_to_blocks.pop(index, None)
            g.num_cached_block.pop(index, None)
            if not table:
                continue
            first = 0
            while first < len(table) and table[first] is null:
                first += 1
            blocks = table[first:]
            blocks.reverse()
            if blocks:
                self.block_pool.free_blocks(blocks)
                released = True
        if finished:
            self._junction.pop(index, None)
        if released:
            self.num_frees += 1

    def allocator_stats(self) -> dict:
        return {"allocator": "paged", "kv_cache_groups": len(self.groups)}

    def get_block_ids(self, request: Request) -> list[int]:
        """The first group's block table (sliding-window models run on cost models only)."""
        return [b.block_id for b in self.groups[0].req_to_blocks.get(request.index, ())]

    def get_group_block_ids(self, request: Request) -> list[list[int]]:
        return [[b.block_id for b in g.req_to_blocks.get(request.index, ())] for g in self.groups]
