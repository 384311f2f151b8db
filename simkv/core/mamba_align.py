"""Prefix caching for models with linear-attention layers: vLLM 0.33's hybrid KV-cache
coordinator over one full-attention group and the Mamba groups in `mamba_cache_mode "align"`
(the mode vLLM picks when prefix caching is on for such a model).

A linear-attention layer keeps one recurrent state per sequence, not a K/V entry per token, so
its group's block table holds a state, not tokens: entry i, when not the null block, is the state
after (i + 1) x block_size tokens (the Mamba block size equals the attention block size). The
rules, as vLLM's MambaManager applies them (prefix-hash granularity = block size):
- each step a request takes at most one new state block per Mamba group, at the index its
  scheduled tokens end in; the indices it skipped get the null block. A prefill chunk ending in a
  prompt's last block also takes a checkpoint block (one index lower) where the backend exports a
  state from inside a chunk (`prefill_checkpoints`: Mamba2's kernels, FlashInfer's GDN prefill);
- under speculative decoding with K drafts (vLLM's num_speculative_blocks) the running state is
  followed by K scratch blocks, taken with the request's first blocks, where the states after
  each draft are written: when the request's tokens cross a boundary the first scratch block
  becomes the running state and one new block joins the end; scratch blocks the tokens jumped
  past move to the end (vLLM's _relocate_speculative_block). The draft tokens count as
  scheduled tokens; the lookahead slots of the next drafts are the attention group's only;
- a state block is given back the step after the request's tokens moved past it (vLLM's
  remove_skipped_blocks with `num_computed_tokens - 1` skipped tokens): a running request holds
  one state block per group, two for the step after it crossed a block boundary;
- under `prefix_cache_retention_interval` 0 (vLLM's default) a Mamba group caches only the state
  at the block boundary below `num_prompt_tokens - 1` (where a resend resumes) and at the request's
  junction (the longer shared prefix its lookup found in the attention group); None caches every
  state block it holds, R > 0 also one per R tokens;
- a hit is the longest prefix the attention group serves (from the left) that ends where every
  Mamba group has a cached state (scanned from the right); a hit on a state cached in the current
  step waits for the next step (the state is written by that step's forward);
- the scheduler ends prefill chunks on block boundaries and stops them at the last cacheable
  boundary (mamba_block_aligned_split below).

The attention group behaves as the single-group manager does. Blocks are hashed when scheduled,
as vLLM does, except a steady decoder's attention blocks (nobody else can hit them): they are
hashed when the request releases its blocks.
"""

from __future__ import annotations

from simkv.core.block_hashing import BlockHasher
from simkv.core.block_pool import BlockPool, KVCacheBlock
from simkv.core.kv_cache_manager import ComputedBlocks, PrefixCacheStats, _NO_HITS, cdiv
from simkv.core.request import Request, RequestStatus


def prefill_checkpoint_position(num_tokens: int, block_size: int, eagle_block_drop: bool = False) -> int:
    """vLLM's get_mamba_prefill_checkpoint_position (a lookahead key of one token changes
    nothing): the last block boundary below `num_tokens` that leaves a token to compute; under
    EAGLE's block drop (a KV connector), a block below the last boundary at or below `num_tokens`,
    where the drop lands a hit."""
    if eagle_block_drop:
        return max(num_tokens // block_size * block_size - block_size, 0)
    return max((num_tokens - 1) // block_size * block_size, 0)


def checkpoint_exportable(start: int, end: int, position: int, block_size: int) -> bool:
    """vLLM's is_mamba_prefill_checkpoint_valid (hash granularity = block size, checkpoint offsets
    on block boundaries): whether a backend that exports states from inside a chunk can write the
    state at `position` while computing tokens [start, end)."""
    return (start % block_size == 0
            and cdiv(end, block_size) - 2 > (start - 1) // block_size
            and start + block_size <= position
            and start < position < end)


def mamba_block_aligned_split(start: int, num_new: int, num_tokens: int, num_prompt_tokens: int,
                              block_size: int, max_prefill_tokens: int, checkpoints: bool, junction: int,
                              eagle_block_drop: bool = False) -> int:
    """vLLM's Scheduler._mamba_block_aligned_split: the tokens of a prefill chunk that starts at
    `start` (computed tokens and prefix hits) once it is cut to end where a state must be written.
    A chunk short of the prefill's end ends on a block boundary (if the block fits the prefill
    budget, even when that leaves nothing); a chunk that started mid-block stops at the next
    boundary; no chunk runs past the last cacheable boundary (unless the backend exports it from
    inside the chunk) or past the request's junction, floored to a block. 0: nothing this step."""
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new
    bs = block_size
    end = start + num_new
    last_cache_position = prefill_checkpoint_position(num_tokens, bs, eagle_block_drop)
    internal = (checkpoints and end >= prefill_end
                and checkpoint_exportable(start, end, prefill_checkpoint_position(prefill_end, bs, eagle_block_drop),
                                          bs))
    if internal:
        last_cache_position = 0
    if end < prefill_end:
        aligned_end = end // bs * bs
        if aligned_end > start or bs <= max_prefill_tokens:
            end = aligned_end
    stops = [last_cache_position]
    if start % bs and not internal:
        stops.append((start // bs + 1) * bs)
    if start < junction < end:
        stops.append(start + (junction - start) // bs * bs)
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


class MambaAlignCoordinator:
    """The scheduler's KV-cache manager for a model with linear-attention layers under prefix
    caching (same interface as KVCacheCoordinator for what the scheduler uses).

    Per request: the attention group's block table, and one table of state entries shared by the
    Mamba groups (all of them take, cache and give back the same indices in the same steps): an
    entry is None (the null block) or a tuple of one block per Mamba group, in group order.
    """

    num_forks = 0  # parallel sampling is not modelled with linear-attention layers
    num_cow_copies = 0
    num_false_prefix_hits = 0

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, group_is_linear: tuple[bool, ...],
                 enable_caching: bool = True, watermark: float = 0.0, retention_interval: int | None = 0,
                 prefill_checkpoints: bool = False, num_speculative_blocks: int = 0, hash_lookahead: int = 0,
                 eagle_block_drop: bool = False) -> None:
        if sum(not x for x in group_is_linear) != 1 or all(not x for x in group_is_linear):
            raise ValueError("the Mamba-align coordinator models one attention group beside the Mamba groups")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.null_block = self.block_pool.null_block
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        # (EAGLE family and MTP: a block's key covers the token after it, vLLM's lookahead block hashes)
        self.hasher = BlockHasher(block_size, lookahead=hash_lookahead)
        # MTP under a KV connector (legacy keys): the attention group, which holds the draft layer,
        # finds one block past the candidate hit and gives it back (vLLM's eagle block drop); the
        # states' checkpoints and retained boundaries sit a block lower to match
        self.eagle_block_drop = eagle_block_drop
        self.num_spec = num_speculative_blocks  # scratch state blocks after the running state
        self.retention_interval = retention_interval
        self.prefill_checkpoints = prefill_checkpoints
        self.group_is_linear = tuple(group_is_linear)
        self.num_groups = len(group_is_linear)
        self.attn_gid = group_is_linear.index(False)
        self.mamba_gids = [g for g, x in enumerate(group_is_linear) if x]
        self.num_mamba = len(self.mamba_gids)
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_frees = 0
        self._attn: dict[int, list[KVCacheBlock]] = {}  # request index -> attention block table
        self._state: dict[int, list[tuple | None]] = {}  # request index -> state entries
        self._retired: dict[int, int] = {}  # entries below this index were given back (vLLM's _num_retired_blocks)
        self._allocated: set[int] = set()  # requests that took state blocks (vLLM's _allocated_block_reqs)
        # request index -> the checkpoint's entry index this step, and the entry of the state it holds
        # (a block lower under the eagle drop, unless the chunk ends on a boundary)
        self._checkpoint: dict[int, tuple[int, int]] = {}
        self._num_cached: dict[int, int] = {}  # full blocks cached (or looked at for caching)
        self._junction: dict[int, int] = {}  # request index -> shared-prefix boundary (vLLM's shared_prefix_boundary)
        self._cached_this_step: set[int] = set()  # content keys of states cached in this step
        # KV offloading (core/kv_offload_mamba.py sets it to a list): the states cached since the
        # connector last took them, (request, Mamba group, boundary tokens) in caching order
        # (vLLM's boundary_state_offloads)
        self.state_offers: list[tuple[Request, int, int]] | None = None

    def new_step_starts(self) -> None:
        self._cached_this_step.clear()

    # ---- lookups -------------------------------------------------------------------------
    def _cached(self, key: int, gids: list[int]) -> list[KVCacheBlock] | None:
        get = self.block_pool.get_cached_block
        out = []
        for gid in gids:
            block = get(key * self.num_groups + gid)
            if block is None:
                return None
            out.append(block)
        return out

    def _attention_hit(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The attention group's cached blocks from the left (at least one token left to compute;
        under the eagle drop, one block further, up to the last full block, then that one given
        back), and the number of blocks a hit may span."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        # (the drop's scan goes up to the last block with a key: a send whose prompt lost its last
        # token to the decode side keeps its whole prompt's keys, core/remote_kv.py)
        scan = max(request.num_tokens, request.num_shared_tokens) // self.block_size if self.eagle_block_drop \
            else max_blocks
        if not request.has_own_cached_blocks:
            max_blocks = min(max_blocks, self.hasher.num_shared_blocks(request))
            scan = min(scan, self.hasher.num_shared_blocks(request))
        get = self.block_pool.get_cached_block
        key = self.hasher.block_key
        g, attn_gid = self.num_groups, self.attn_gid
        attn: list[KVCacheBlock] = []
        for i in range(scan):
            block = get(key(request, i) * g + attn_gid)
            if block is None:
                break
            attn.append(block)
        if self.eagle_block_drop and attn:
            attn.pop()
        return attn, max_blocks

    def _state_hit(self, request: Request, num_blocks: int) -> tuple[int, list[KVCacheBlock] | None]:
        """The longest of the first `num_blocks` blocks whose state every Mamba group has cached,
        scanned from the right: (blocks it spans, its state blocks), or (0, None)."""
        key = self.hasher.block_key
        for i in range(num_blocks - 1, -1, -1):
            state = self._cached(key(request, i), self.mamba_gids)
            if state is not None:
                return i + 1, state
        return 0, None

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest prefix the attention group serves that ends on a state every Mamba group
        has cached (at least one token left to compute). `blocks` = (attention hits, state entry
        index, state blocks); the junction is noted for the split and the caching."""
        if not self.enable_caching:
            return _NO_HITS
        attn, _ = self._attention_hit(request)
        longest = len(attn)
        hit, state = self._state_hit(request, longest)
        self._junction[request.index] = longest * self.block_size if longest > hit else 0
        if hit == 0:
            return _NO_HITS
        return ComputedBlocks((attn[:hit], hit - 1, tuple(state)), hit * self.block_size)

    def get_computed_blocks_for_pull(self, request: Request) -> ComputedBlocks:
        """A P/D pull's local lookup, as vLLM makes it under a connector that restores states
        (NIXL: get_computed_blocks_for_connector): each group on its own. The attention group's
        hit is the local prefix (the pull brings the state at its end); the Mamba groups' own hit,
        if any, is kept in `blocks` (as a state the allocation counts but does not take). A Mamba
        hit longer than the attention group's: the reconciled lookup (get_computed_blocks)."""
        if not self.enable_caching:
            return _NO_HITS
        attn, max_blocks = self._attention_hit(request)
        own, state = self._state_hit(request, max_blocks)
        if own > len(attn):
            return self.get_computed_blocks(request)
        self._junction[request.index] = 0  # (vLLM's per-group lookups see no junction)
        if not attn:
            return _NO_HITS
        return ComputedBlocks((attn, own - 1, tuple(state) if state else ()), len(attn) * self.block_size)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def junction(self, request: Request) -> int:
        return self._junction.get(request.index, 0)

    # ---- allocation ----------------------------------------------------------------------
    def num_blocks_of(self, request: Request) -> int:
        attn = self._attn.get(request.index)
        if attn is None:
            return 0
        return len(attn) + self.num_mamba * sum(e is not None for e in self._state[request.index])

    def _state_need(self, index: int, num_tokens: int, num_hit_entries: int, start: int, prefill_end: int,
                    record: bool) -> int:
        """State blocks one Mamba group takes for `num_tokens` (vLLM's MambaManager
        get_num_blocks_to_allocate in align mode): the entry they end in, and the checkpoint's
        (recorded for the allocation when `record`). Can be negative, as vLLM's count is."""
        bs = self.block_size
        table = self._state.get(index, ())
        allocated = index in self._allocated
        num_new = cdiv(num_tokens, bs) + self.num_spec - num_hit_entries - len(table)
        position = prefill_checkpoint_position(num_tokens, bs, self.eagle_block_drop)
        at = cdiv(num_tokens, bs) - 2
        checkpoint = (self.prefill_checkpoints and num_tokens >= prefill_end
                      and checkpoint_exportable(start, num_tokens, position, bs)
                      and at >= 0 and (at >= len(table) or table[at] is None
                                       or (allocated and at >= len(table) - self.num_spec)))
        if record:
            if checkpoint:
                self._checkpoint[index] = (at, position // bs - 1)
            else:
                self._checkpoint.pop(index, None)
        if num_new > 0:  # (a request's first blocks include its scratch blocks)
            num_new = min(num_new, 1 + checkpoint + (0 if allocated else self.num_spec))
        return num_new

    def _deferred(self, request: Request, hits) -> bool:
        """A hit on a state cached in this step: vLLM's MambaManager asks for more blocks than
        the pool has, so the request waits for the next step."""
        return (bool(self._cached_this_step) and hits[1] >= 0
                and self.hasher.block_key(request, hits[1]) in self._cached_this_step)

    def allocate_slots(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                       computed: ComputedBlocks | None = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, has_scheduled_reqs: bool = True,
                       delay_cache: bool = False, reserved_blocks: int = 0,
                       num_processed_tokens: int | None = None,
                       num_external_tokens: int = 0) -> list[KVCacheBlock] | None:
        """vLLM's allocate_slots over the groups: give back the states the request moved past,
        check the pool, take the prefix hits, allocate group by group, cache. None: no room (or a
        hit on a state cached this step); what was given back stays given back, as in vLLM.
        `num_external_tokens` (P/D: a pull, its hits from get_computed_blocks_for_pull): those
        tokens count as computed; the attention group takes blocks for them, each Mamba group
        one state block, where they end."""
        index = request.index
        bs = self.block_size
        pool = self.block_pool
        hits = computed.blocks if computed is not None and computed.num_tokens else None
        attn = self._attn.get(index)
        if (attn is not None and hits is None and not full_sequence_must_fit
                and request.status == RequestStatus.RUNNING):
            # A running request in mid-block (the common case, a decode): nothing to give back,
            # take or cache this step.
            need_slots = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
            if (need_slots <= len(attn) * bs and index not in self._checkpoint
                    and cdiv(num_computed_tokens + num_new_tokens, bs) + self.num_spec <= len(self._state[index])
                    and not self._pending_release(index, num_computed_tokens)
                    and reserved_blocks <= pool.free_block_queue.num_free_blocks
                    and (not self.enable_caching
                         or self.hasher.num_hashed_blocks(request, num_computed_tokens + num_new_tokens)
                         <= self._num_cached.get(index, 0))):
                self._allocated.add(index)
                return []
        hit_tokens = computed.num_tokens if hits else 0
        total = min(num_computed_tokens + hit_tokens + num_external_tokens, self.max_model_len)
        watermark = self.watermark_blocks if has_scheduled_reqs and request.status != RequestStatus.RUNNING else 0
        prefill_end = self._prefill_end(request)
        num_hit_entries = hits[1] + 1 if hits else 0
        if hits and self._deferred(request, hits):
            self.num_frees += 1  # (not a lack of blocks: the next step's check differs)
            return None
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            need = self._blocks_to_allocate(index, full, full, hits, num_hit_entries, total, prefill_end, False)
            if need + watermark > pool.get_num_free_blocks():
                return None
        if attn is not None:
            self._release_states(index, total if num_processed_tokens is None else num_processed_tokens)
        need_slots = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        main_tokens = total + num_new_tokens
        need = self._blocks_to_allocate(index, need_slots, main_tokens, hits, num_hit_entries, total,
                                        prefill_end, True)
        if need + watermark > pool.get_num_free_blocks() - reserved_blocks:
            return None
        if attn is None:
            attn = self._attn[index] = []
            self._state[index] = []
            self._num_cached[index] = 0
            if num_external_tokens:  # (delay_cache: the pulled blocks are cached when they arrive)
                return self._allocate_pulled(index, hits, total) + self._allocate(index, need_slots, main_tokens)
            if hits:
                self._take_hits(index, hits)
        new_blocks = self._allocate(index, need_slots, main_tokens)
        if self.enable_caching and not delay_cache:
            self._cache_blocks(request, min(main_tokens, request.num_tokens))
        return new_blocks

    def _prefill_end(self, request: Request) -> int:
        """Where the request's prefill ends, for the checkpoint rule: a checkpoint only in the chunk
        that ends the prefill under retention 0; in every chunk otherwise, as each chunk's states
        may be kept (vLLM's coordinator passes 0)."""
        return max(request.num_prompt_tokens, request.num_tokens - 1) if self.retention_interval == 0 else 0

    def remaining_blocks(self, request: Request, num_tokens: int, main_tokens: int | None = None) -> int:
        """Blocks a request holding blocks still needs for `num_tokens` slots (`main_tokens` of them
        the target's, not a speculative step's): vLLM's get_num_blocks_to_allocate as P/D's
        reservations ask it (its `_request_remaining_blocks`)."""
        index = request.index
        main = num_tokens if main_tokens is None else main_tokens
        prefill_end = self._prefill_end(request)
        attn = len(self._attn.get(index, ()))
        state = self._state_need(index, main, 0, request.num_computed_tokens, prefill_end, False)
        return max(cdiv(num_tokens, self.block_size) - attn, 0) + state * self.num_mamba  # (as vLLM: may be < 0)

    def _blocks_to_allocate(self, index: int, num_tokens: int, main_tokens: int, hits, num_hit_entries: int,
                            start: int, prefill_end: int, record: bool) -> int:
        """vLLM's coordinator get_num_blocks_to_allocate: the attention group's blocks, each Mamba
        group's state blocks, and the hits that leave the free queue."""
        attn = self._attn.get(index)
        required = cdiv(num_tokens, self.block_size)
        if attn is not None:
            total = max(required - len(attn), 0)
        else:
            attn_hits = hits[0] if hits else ()
            total = max(required - len(attn_hits), 0) + sum(b.ref_cnt == 0 for b in attn_hits)
        state = self._state_need(index, main_tokens, num_hit_entries, start, prefill_end, record)
        total += state * self.num_mamba
        if hits and attn is None:
            total += sum(b.ref_cnt == 0 for b in hits[2])
        return total

    def _take_hits(self, index: int, hits) -> None:
        """A waiting request's prefix hits become its tables, group by group (vLLM touches every
        group's hits before any group allocates)."""
        attn_hits, entry, state = hits
        touch = self.block_pool.touch
        for gid in range(self.num_groups):
            if gid == self.attn_gid:
                touch(attn_hits)
            else:
                touch((state[self.mamba_gids.index(gid)],))
        self._attn[index].extend(attn_hits)
        self._state[index].extend([None] * entry + [state])
        self._num_cached[index] = len(attn_hits)

    def _allocate_pulled(self, index: int, hits, num_tokens: int) -> list[KVCacheBlock]:
        """A pull's tables (vLLM's allocate_new_computed_blocks with external tokens): the
        attention hits are taken (a Mamba group's hit lies below the state it needs and is not),
        then, group by group, the attention blocks up to `num_tokens` and one state block per
        Mamba group at the entry they end in (null entries below it)."""
        bs = self.block_size
        attn = self._attn[index]
        if hits:
            self.block_pool.touch(hits[0])
            attn.extend(hits[0])
            self._num_cached[index] = len(hits[0])
        table = self._state[index]
        table.extend([None] * ((num_tokens - 1) // bs))
        get = self.block_pool.get_new_blocks
        new_blocks: list[KVCacheBlock] = []
        states: list[KVCacheBlock] = []
        for gid in range(self.num_groups):
            if gid == self.attn_gid:
                n = cdiv(num_tokens, bs) - len(attn)
                if n > 0:
                    blocks = get(n)
                    attn += blocks
                    new_blocks += blocks
            else:
                blocks = get(1)
                states += blocks
                new_blocks += blocks
        table.append(tuple(states))
        return new_blocks

    def cache_shared_blocks(self, request: Request, num_tokens: int) -> None:
        """P/D: a pull's KV and states have arrived; its blocks are cached now (vLLM's cache_blocks)."""
        if self.enable_caching and request.index in self._attn:
            self._cache_blocks(request, min(num_tokens, request.num_tokens))

    def _allocate(self, index: int, need_slots: int, main_tokens: int) -> list[KVCacheBlock]:
        """Each group's new blocks, in group order from the head of the free queue: the attention
        group up to `need_slots`; a Mamba group the state entry `main_tokens` end in (nulls for the
        entries skipped) and the checkpoint's (vLLM's MambaManager.allocate_new_blocks)."""
        bs = self.block_size
        attn = self._attn[index]
        table = self._state[index]
        num_attn = max(cdiv(need_slots, bs) - len(attn), 0)
        k = self.num_spec
        required = cdiv(main_tokens, bs) + k
        checkpoint = index in self._checkpoint
        num_state = 0
        if required > len(table) or checkpoint:
            prev_len = len(table)
            skipped = required - k - 1
            if prev_len < skipped:
                table.extend([None] * (skipped - checkpoint - prev_len))
            if k and index in self._allocated:
                # scratch blocks the tokens moved past go to the end (one at the checkpoint's
                # index stays: the checkpoint is exported there)
                for i in range(prev_len - k, prev_len):
                    if i >= skipped - checkpoint:
                        break
                    table.append(table[i])
                    table[i] = None
            num_state = max(required - len(table), 0)
        self._allocated.add(index)
        if not num_attn and not num_state:
            return []
        get = self.block_pool.get_new_blocks
        new_blocks: list[KVCacheBlock] = []
        per_group: list[list[KVCacheBlock]] = []
        for gid in range(self.num_groups):
            if gid == self.attn_gid:
                if num_attn:
                    blocks = get(num_attn)
                    attn += blocks
                    new_blocks += blocks
            elif num_state:
                blocks = get(num_state)
                per_group.append(blocks)
                new_blocks += blocks
        if num_state:
            table.extend(zip(*per_group))
        if checkpoint:
            at, entry = self._checkpoint[index]
            if entry < at and table[entry] is None:  # (the eagle drop: vLLM keys the checkpoint block
                table[entry], table[at] = table[at], None  # by the lower boundary its state is at)
        return new_blocks

    def _pending_release(self, index: int, processed: int) -> bool:
        """Whether a state entry lies below the one `processed - 1` tokens end in (it is given
        back when the request is next scheduled)."""
        table = self._state[index]
        upto = min(max(processed - 1, 0) // self.block_size, len(table))
        return any(table[i] is not None for i in range(self._retired.get(index, 0), upto))

    def _release_states(self, index: int, processed: int) -> None:
        """vLLM's remove_skipped_blocks for the Mamba groups: the state entries wholly below the
        last processed token are given back, last first, group by group."""
        if processed - 1 <= 0:
            return
        table = self._state[index]
        first = self._retired.get(index, 0)
        last = min((processed - 1) // self.block_size, len(table))
        if first >= last:
            return
        freed = []
        for i in range(last - 1, first - 1, -1):
            if table[i] is not None:
                freed.append(table[i])
                table[i] = None
        if freed:
            free_blocks = self.block_pool.free_blocks
            for m in range(self.num_mamba):
                free_blocks([entry[m] for entry in freed])
            self.num_frees += 1
        self._retired[index] = last

    # ---- caching ---------------------------------------------------------------------------
    def _state_positions(self, request: Request, start: int, end: int):
        """The state entries in [start, end) a Mamba group caches (vLLM's reachable_block_mask):
        all under retention None; under R > 0 the last of every R tokens; always the ones at the
        block boundary below `num_prompt_tokens - 1` and at the junction."""
        retention = self.retention_interval
        bs = self.block_size
        if retention is None:
            return range(start, end)
        keep = set()
        if retention:
            per_segment = retention // bs
            if per_segment <= 1:
                return range(start, end)
            first = (start + per_segment) // per_segment * per_segment - 1
            keep.update(range(first, end, per_segment))
        prompt = request.num_prompt_tokens
        if self.eagle_block_drop:  # (vLLM's replay_boundaries under the eagle drop: a block lower)
            boundaries = sorted({max((prompt - 1) // bs * bs - bs, 0), max(prompt // bs * bs - bs, 0)})
        else:
            boundaries = [prompt - 1]
        junction = self._junction.get(request.index)
        if junction:
            boundaries.append(junction)
        for boundary in boundaries:
            i = boundary // bs - 1
            if start <= i < end:
                keep.add(i)
        return sorted(keep)

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the request's full blocks below `num_tokens` findable: every attention block, the
        reachable states of the Mamba groups."""
        index = request.index
        end = self.hasher.num_cacheable_blocks(request, num_tokens)
        start = self._num_cached[index]
        if end <= start:
            return
        self._num_cached[index] = end
        key = self.hasher.block_key
        cache_block = self.block_pool.cache_block
        g = self.num_groups
        key(request, end - 1)  # (the keys of blocks [0, end) are memoised from here on)
        keys = request.block_hashes
        attn = self._attn[index]
        table = self._state[index]
        attn_gid = self.attn_gid
        checkpoint = self._checkpoint.get(index)
        transient = checkpoint[1] if checkpoint is not None and not self._keeps_checkpoint(request, checkpoint[1]) \
            else -1
        # (vLLM caches group by group; one group's order within its blocks is all a pool sees)
        for gid in range(g):
            if gid == attn_gid:
                for i in range(start, end):
                    block = attn[i]
                    if block.block_hash is None:
                        cache_block(block, keys[i] * g + gid)
            else:
                m = self.mamba_gids.index(gid)
                offers = self.state_offers
                for i in self._state_positions(request, start, end):
                    entry = table[i] if i < len(table) else None
                    if entry is None or i == transient:
                        continue
                    if entry[m].block_hash is None:
                        cache_block(entry[m], keys[i] * g + gid)
                        self._cached_this_step.add(keys[i])
                    if offers is not None:
                        offers.append((request, m, (i + 1) * self.block_size))
        if end > self.hasher.num_shared_blocks(request):
            request.has_own_cached_blocks = True

    def _keeps_checkpoint(self, request: Request, entry: int) -> bool:
        """Whether this step's checkpoint state (at `entry`) stays cached: vLLM keeps it where a
        later request can resume (the prompt's checkpoint position, a retention segment's end, the
        junction) and otherwise drops its hash as the step writes it, even at a replay boundary of
        the eagle drop (vLLM's _cache_partial_tail_block)."""
        bs = self.block_size
        position = (entry + 1) * bs
        retention = self.retention_interval
        return (position == prefill_checkpoint_position(request.num_prompt_tokens, bs, self.eagle_block_drop)
                or retention is None or (retention > 0 and (retention // bs <= 1 or (entry + 1) % (retention // bs) == 0))
                or position == self._junction.get(request.index, 0))

    def cache_verified(self, request: Request, num_computed_tokens: int) -> None:
        """Speculative decoding: a request's sampled tokens arrived; its full blocks up to them
        are cached now (vLLM's update_from_output does), not at its next allocation, so a state it
        moves past in its next step is given back cached."""
        if self.enable_caching and request.index in self._attn:
            self._cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    # ---- steady decoders (core/steady_decoders.py) --------------------------------------------
    def decode_cache(self, request: Request, num_tokens: int) -> None:
        """A steady decoder's first `num_tokens` tokens are known: its full blocks up to them are
        cached now (KV offloading storing decode states: vLLM caches them when it schedules them)."""
        if self.enable_caching and request.index in self._attn:
            self._cache_blocks(request, num_tokens)

    def next_decode_event(self, request: Request) -> int:
        """The computed-token count at which a steady decoder next needs the coordinator: its
        next block boundary (before max_model_len) or the next release of a state it moved past."""
        index = request.index
        bs = self.block_size
        table = self._state[index]
        held = len(self._attn[index]) * bs
        boundary = held if held < self.max_model_len else 1 << 62
        for i in range(self._retired.get(index, 0), len(table) - 1):
            if table[i] is not None:
                return min(boundary, (i + 1) * bs + 1)
        return boundary

    def decode_release(self, request: Request, num_computed_tokens: int) -> None:
        """A steady decoder is scheduled: the states it moved past are given back, once its full
        blocks are hashed (vLLM hashed them when their tokens were computed)."""
        if self.enable_caching:
            self._cache_blocks(request, num_computed_tokens)
        self._release_states(request.index, num_computed_tokens)

    def decode_block_need(self, request: Request, num_computed_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """Blocks a steady decoder's next token needs: at a block boundary one per group, else 0."""
        held = len(self._attn[request.index]) * self.block_size
        return self.num_groups if num_computed_tokens + 1 > held else 0

    def decode_write(self, request: Request, num_computed_tokens: int = 0) -> None:
        """A steady decoder at a block boundary takes an attention block and a state block per
        Mamba group, in group order (decode_block_need said so; the pool has them)."""
        self._checkpoint.pop(request.index, None)
        self._allocate(request.index, num_computed_tokens + 1, num_computed_tokens + 1)

    # ---- release ---------------------------------------------------------------------------
    def free(self, request: Request, num_computed_tokens: int = 0, finished: bool = False,
             defer: list | None = None) -> None:
        """Release all of a request's blocks, group by group, each group's tail first. `defer`:
        the pool gets them back at `free_deferred`, in one release from the last group's tail to
        the first group's head (vLLM frees a deferred request's blocks as one reversed list)."""
        index = request.index
        if self.enable_caching and index in self._attn:  # (a steady decoder's blocks: now)
            self._cache_blocks(request, min(num_computed_tokens, request.num_tokens))
        if self.state_offers:  # (vLLM drops a request's offers not taken yet when it frees its blocks)
            self.state_offers[:] = [offer for offer in self.state_offers if offer[0] is not request]
        attn = self._attn.pop(index, None)
        table = self._state.pop(index, None)
        self._num_cached.pop(index, None)
        self._retired.pop(index, None)
        self._allocated.discard(index)
        self._checkpoint.pop(index, None)
        if finished:
            self._junction.pop(index, None)
        if attn is None:
            return
        if defer is not None:
            held = [attn if gid == self.attn_gid else
                    [entry[self.mamba_gids.index(gid)] for entry in table if entry is not None]
                    for gid in range(self.num_groups)]
            defer.append([block for blocks in reversed(held) for block in reversed(blocks)])
            return
        free_blocks = self.block_pool.free_blocks
        entries = [entry for entry in reversed(table) if entry is not None]
        for gid in range(self.num_groups):
            if gid == self.attn_gid:
                blocks = attn[::-1]
            else:
                m = self.mamba_gids.index(gid)
                blocks = [entry[m] for entry in entries]
            if blocks:
                free_blocks(blocks)
        self.num_frees += 1

    def free_deferred(self, blocks: list) -> None:
        """Give the pool the blocks of a deferred `free`."""
        if blocks:
            self.block_pool.free_blocks(blocks)
        self.num_frees += 1

    def allocator_stats(self) -> dict:
        return {"allocator": "paged", "kv_cache_groups": self.num_groups, "mamba_cache_mode": "align"}

    def num_attention_blocks(self, request: Request) -> int:
        return len(self._attn.get(request.index, ()))

    def get_block_ids(self, request: Request) -> list[int]:
        """The attention group's block table (linear-attention models run on cost models only)."""
        return [b.block_id for b in self._attn.get(request.index, ())]
