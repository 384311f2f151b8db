"""KV-cache manager: each request's block list, prefix-cache lookups and `allocate_slots`.

Invariants:
- a request's block table is append-only while it runs; it is released whole (tail first)
  when the request finishes or is preempted.
- after scheduling, a request holds cdiv(num_computed_tokens + num_new_tokens + lookahead,
  block_size) blocks (capped at max_model_len); nothing is reserved for future output.
- only full blocks are cached; a prefix hit never covers the last token of the sequence.
- a model with linear-attention layers (prefix caching off): a request also holds one state
  block per linear-attention KV-cache group, from its first allocation until it is released.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simkv.core.block_hashing import BlockHasher, WeakBlockHasher
from simkv.core.block_pool import BlockPool, KVCacheBlock
from simkv.core.request import Request, RequestStatus


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's prefix-cache counters: queries and hits in tokens, new and resumed apart."""

    queries_new: int = 0
    hits_new: int = 0
    queries_preempted: int = 0
    hits_preempted: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.queries_preempted += num_tokens
            self.hits_preempted += num_hits
        else:
            self.queries_new += num_tokens
            self.hits_new += num_hits

    @property
    def queries(self) -> int:
        return self.queries_new + self.queries_preempted

    @property
    def hits(self) -> int:
        return self.hits_new + self.hits_preempted


@dataclass(slots=True)
class ComputedBlocks:
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_tokens: int = 0
    num_false: int = 0  # weak hash only: blocks among them holding other content (counted if admitted)


_NO_HITS = ComputedBlocks()  # shared, never mutated


class KVCacheManager:
    """Owns per-request block lists; answers `allocate_slots(...) -> blocks | None`."""

    #: Release a request's private blocks as one free-queue chunk (same queue order as one
    #: by one; tests switch it off to compare).
    release_private_as_chunk = True

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
        hash_bits: int = 63,
        reserve_null_block: bool = True,
        hash_lookahead: int = 0,
        reprefillable: int = 0,
        eagle_block_drop: bool = False,
        num_state_blocks: int = 0,
        num_state_groups: int = 0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, reserve_null_block)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.hasher = WeakBlockHasher(block_size, hash_bits) if hash_bits < 63 else BlockHasher(block_size, 63, hash_lookahead, reprefillable)
        self.num_false_prefix_hits = 0  # admitted hit blocks whose content differs (weak hash only)
        self.num_cow_copies = 0  # first writes into a partial block shared by forked sequences
        self.num_forks = 0  # forked sequences exist: only then can a partial block be shared
        self.req_to_blocks: dict[int, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[int, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_frees = 0  # bumps on every release: admission checks may change only then
        # EAGLE family without lookahead block keys (under a KV connector): a prefix hit gives
        # back its last block, whose KV the drafter needs recomputed (vLLM's eagle block drop).
        self.eagle_block_drop = eagle_block_drop
        # Linear-attention groups (vLLM's MambaManager, mamba_cache_mode "none"): a request takes
        # one state block per group with its first blocks and holds it until it lets all go.
        if num_state_blocks and enable_caching:
            raise ValueError("state blocks of linear-attention groups are modelled without prefix caching")
        self.num_state_blocks = num_state_blocks
        self.num_state_groups = num_state_groups  # (the groups those state blocks are spread over)
        self.req_to_state: dict[int, list[KVCacheBlock]] = {}

    # ---- lookups -------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of cached full blocks from the start, capped so that at least one
        token is left to compute. Only blocks this request could share are probed: its
        shared-content blocks, plus its own unique blocks once it has cached some."""
        if not self.enable_caching:
            return _NO_HITS
        max_blocks = (request.num_tokens - 1) // self.block_size
        if not request.has_own_cached_blocks:
            max_blocks = min(max_blocks, self.hasher.num_shared_blocks(request))
            if max_blocks <= 0:
                return _NO_HITS  # nothing it could share (no block hashes), nothing of its own cached
        blocks: list[KVCacheBlock] = []
        if max_blocks > 0:
            self.hasher.block_key(request, max_blocks - 1)  # (memoises the keys of blocks [0, max_blocks))
        keys = request.block_hashes
        get_cached = self.block_pool.get_cached_block
        for i in range(max_blocks):
            block = get_cached(keys[i])
            if block is None:
                break
            blocks.append(block)
        if self.eagle_block_drop and blocks:
            blocks.pop()
        num_false = 0
        if self.hasher.weak:
            true_key = self.hasher.true_key
            num_false = sum(b.content_id != true_key(request, i) for i, b in enumerate(blocks))
        return ComputedBlocks(blocks, len(blocks) * self.block_size, num_false)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    # ---- allocation ----------------------------------------------------------------------
    def num_blocks_of(self, request: Request) -> int:
        blocks = self.req_to_blocks.get(request.index)
        return len(blocks) + self.num_state_blocks if blocks is not None else 0

    def remaining_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks the request still needs to hold `num_tokens` slots. A linear-attention group's
        blocks are max_model_len tokens long in vLLM: `num_tokens` past max_model_len (a full
        sequence plus a speculative step's slots, as P/D's reservations count them) ask one
        more block of each."""
        blocks = self.req_to_blocks.get(request.index)
        if blocks is None:
            return cdiv(num_tokens, self.block_size) + (self.num_state_blocks if num_tokens else 0)
        more = max(0, cdiv(num_tokens, self.block_size) - len(blocks))
        if self.num_state_groups and num_tokens > self.max_model_len:
            more += self.num_state_groups * (cdiv(num_tokens, self.max_model_len) - 1)
        return more

    def allocate_slots(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
        delay_cache: bool = False,
        reserved_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request slots for `num_new_tokens` more tokens (plus lookahead).

        `num_computed_tokens` is the request's count before this step (the scheduler owns
        it); `computed` holds fresh prefix hits at admission. Returns the new blocks (on a
        first allocation without hits, the list is the request's block table itself), or
        None (and changes nothing) when the pool cannot cover them plus the watermark.
        `delay_cache`: P/D, the new tokens' KV is being pulled; its blocks are cached when it
        has arrived (`cache_shared_blocks`); `reserved_blocks` must stay free besides the
        watermark (what prefills in flight still need).
        """
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(request.index)
        if computed is None and req_blocks is not None and not self.num_forks and not full_sequence_must_fit:
            # A running request (no hits, nothing shared to copy): often its blocks suffice.
            need_slots = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
            if -(-need_slots // bs) <= len(req_blocks) and reserved_blocks <= self.block_pool.free_block_queue.num_free_blocks:
                if not delay_cache:
                    self.cache_shared_blocks(request, num_computed_tokens + num_new_tokens)
                return []
        pool = self.block_pool
        hit_blocks = computed.blocks if computed is not None else ()
        num_local = num_computed_tokens + (computed.num_tokens if computed is not None else 0)
        watermark = 0
        if has_scheduled_reqs and request.status != RequestStatus.RUNNING:
            watermark = self.watermark_blocks
        num_req_blocks = len(req_blocks) if req_blocks is not None else 0
        # (a first allocation also takes the request's state blocks)
        num_state = self.num_state_blocks if req_blocks is None else 0
        num_evictable = 0
        for block in hit_blocks:
            if block.ref_cnt == 0:
                num_evictable += 1
        num_free = pool.free_block_queue.num_free_blocks
        cow = self._shared_write_block(req_blocks, num_computed_tokens) if req_blocks else -1
        if cow >= 0:
            num_free -= 1  # the copy-on-write block
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            need = max(cdiv(full, bs) - len(hit_blocks) - num_req_blocks, 0) + num_evictable + num_state
            if need + watermark > num_free:
                return None
        need_slots = min(num_local + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = max(cdiv(need_slots, bs) - len(hit_blocks) - num_req_blocks, 0)
        if num_new_blocks + num_state + num_evictable + watermark > num_free - reserved_blocks:
            return None
        if num_state:  # (vLLM's groups allocate in order: the linear-attention groups come first)
            self.req_to_state[request.index] = pool.get_new_blocks(num_state)
        if hit_blocks:
            pool.touch(hit_blocks)
            self.num_false_prefix_hits += computed.num_false  # served: counted once, when admitted
        if cow >= 0:
            self._copy_on_write(req_blocks, cow)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if req_blocks is None:  # a first allocation: hits, then new blocks (without hits, that list itself)
            req_blocks = self.req_to_blocks[request.index] = hit_blocks + new_blocks if hit_blocks else new_blocks
            self.num_cached_block[request.index] = len(hit_blocks)
        else:
            if hit_blocks:
                req_blocks.extend(hit_blocks)
                self.num_cached_block[request.index] = len(req_blocks)
            req_blocks.extend(new_blocks)
        if not delay_cache:
            self.cache_shared_blocks(request, num_local + num_new_tokens)
        return new_blocks

    def cache_shared_blocks(self, request: Request, num_tokens: int) -> None:
        """The KV of the request's first `num_tokens` tokens is (being) written: its full
        shared-content blocks become findable now (an identical prompt admitted in the same step
        already hits); unique blocks wait for release. P/D: for pulled blocks, once they arrive."""
        if self.enable_caching and (request.num_shared_tokens or self.hasher.weak):
            end = self.hasher.num_cacheable_blocks(request, min(num_tokens, request.num_tokens))
            # (its shared prompt blocks, and the blocks of a reply the trace describes once written
            # and their tokens known, as vLLM caches every full block it can hash)
            hasher = self.hasher
            self._cache_full_blocks(request, min(end, max(hasher.num_shared_blocks(request),
                                                          hasher.num_content_blocks(request))))

    def _shared_write_block(self, req_blocks: list[KVCacheBlock], num_computed_tokens: int) -> int:
        """Index of the partly filled block the next token goes into, if other sequences still
        share it (it must be copied first), else -1."""
        if num_computed_tokens % self.block_size == 0:
            return -1
        i = num_computed_tokens // self.block_size
        return i if i < len(req_blocks) and req_blocks[i].ref_cnt > 1 else -1

    def _copy_on_write(self, req_blocks: list[KVCacheBlock], i: int) -> None:
        shared = req_blocks[i]
        req_blocks[i] = self.block_pool.get_new_block()
        shared.ref_cnt -= 1  # stays >= 1: another sequence still holds it
        self.num_cow_copies += 1

    def fork(self, parent: Request, child: Request) -> None:
        """Parallel sampling: the child sequence shares every block of the parent's prompt."""
        self.num_forks += 1
        blocks = self.req_to_blocks[parent.index]
        for block in blocks:
            block.ref_cnt += 1
        self.req_to_blocks[child.index] = list(blocks)
        self.num_cached_block[child.index] = self.num_cached_block[parent.index]
        child.block_hashes = parent.block_hashes[:parent.num_prompt_tokens // self.block_size]
        if self.hasher.weak:
            self.hasher.fork(parent, child)

    def decode_block_need(self, request: Request, num_computed_tokens: int, num_lookahead_tokens: int) -> bool:
        """Whether a steady decoder's next token needs a block: a copy of a shared partial
        block, or a new block at a boundary."""
        blocks = self.req_to_blocks[request.index]
        if self._shared_write_block(blocks, num_computed_tokens) >= 0:
            return True
        need = min(num_computed_tokens + 1 + num_lookahead_tokens, self.max_model_len)
        return cdiv(need, self.block_size) > len(blocks)

    def append_block(self, request: Request) -> None:
        """A steady decoder crossing a block boundary takes the head of the free queue. Its
        content is unique to it, so hashing waits until the request releases its blocks."""
        self.req_to_blocks[request.index].append(self.block_pool.get_new_block())

    def decode_write(self, request: Request, num_computed_tokens: int) -> None:
        """Give a steady decoder the block its next token needs (decode_block_need was True)."""
        blocks = self.req_to_blocks[request.index]
        cow = self._shared_write_block(blocks, num_computed_tokens)
        if cow >= 0:
            self._copy_on_write(blocks, cow)
        else:
            blocks.append(self.block_pool.get_new_block())

    def _cache_full_blocks(self, request: Request, end: int) -> None:
        """Hash and make findable the request's blocks [num_cached_block, end)."""
        index = request.index
        start = self.num_cached_block[index]
        if end <= start:
            return
        blocks = self.req_to_blocks[index]
        self.hasher.block_key(request, end - 1)  # (the keys of blocks [0, end) are memoised from here on)
        self.block_pool.cache_blocks(blocks, request.block_hashes, start, end)
        if self.hasher.weak:
            for i in range(start, end):
                blocks[i].content_id = self.hasher.true_key(request, i)
        self.num_cached_block[index] = end
        if end > self.hasher.num_shared_blocks(request):
            request.has_own_cached_blocks = True

    def free(self, request: Request, num_computed_tokens: int, finished: bool, defer: list | None = None) -> None:
        """Release all of a request's blocks, tail first (`defer`: the request lets them go now,
        but the pool gets them back only when the caller passes the entry appended to `defer`
        to `free_deferred`).

        Full blocks are hashed first where not yet done (unique content is hashed lazily).
        A preempted request's blocks become findable: it will look them up on resume. A
        finished request's shared prompt blocks are already cached, and the blocks of a reply
        the trace describes become findable now (a next turn's prompt repeats it); its unique
        full blocks get a hash that orders the free queue like vLLM's but sits in no map:
        nobody can hit them.
        """
        index = request.index
        blocks = self.req_to_blocks.get(index)
        if blocks is None:
            return
        unfindable = (0, 0)
        forget = self.hasher.weak and finished
        if self.hasher.weak:
            finished = False  # colliding keys can hit anything: keep every block findable
        if self.enable_caching:
            end = self.hasher.num_hashed_blocks(request, num_computed_tokens)
            if finished:  # (a reply the trace describes is findable from now on)
                self._cache_full_blocks(request, min(end, self.hasher.num_content_blocks(request)))
                cached = self.num_cached_block[index]
                if end > cached:  # reversed below: original [cached, end) -> [len-end, len-cached)
                    unfindable = (len(blocks) - end, len(blocks) - cached)
            else:
                self._cache_full_blocks(request, end)
        del self.req_to_blocks[index]
        del self.num_cached_block[index]
        if self.num_state_blocks:  # (caching is off: every block is private)
            blocks = self.req_to_state.pop(index) + blocks
        blocks.reverse()
        # Without forked sequences a request's unhashed blocks are its alone (nobody can find
        # them): they are released as one chunk. Finished: its unfindable full blocks.
        # Caching off: all of them. (Weak hashes keep every block findable: no chunk.)
        private = None
        if self.release_private_as_chunk and not self.num_forks:
            if not self.enable_caching:
                private = (0, len(blocks), False)
            elif unfindable[1] > unfindable[0]:
                private = (unfindable[0], unfindable[1], True)
                unfindable = (0, 0)
        if defer is not None:
            defer.append((blocks, unfindable, private))
        else:
            self.block_pool.free_blocks(blocks, unfindable, private)
            self.num_frees += 1
        if forget:
            self.hasher.forget(request)

    def free_deferred(self, entry: tuple) -> None:
        """Give the pool the blocks of a deferred `free`."""
        self.block_pool.free_blocks(*entry)
        self.num_frees += 1

    def allocator_stats(self) -> dict:
        return {"allocator": "paged"}

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.index, ())]
