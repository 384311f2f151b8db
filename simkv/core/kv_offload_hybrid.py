"""KV offloading on models with sliding-window layers: vLLM's OffloadingConnector over the hybrid
KV-cache manager's groups (core/kv_cache_coordinator.py). No clock here, as in core/kv_offload.py,
whose tier, stores, loads and policies this extends.

Every KV-cache group has chunks of its own in the CPU tier: a chunk's key is its content key and
its group, and each takes one slot of the tier (a slot holds one block of one group's layers).
- **lookup** (vLLM's `_lookup_complete_chunks`): the full-attention groups first, each the run
  of chunks it holds from the local hit on; then the sliding-window groups, each the last run of
  `ceil(w / chunk_tokens)` chunks it holds, scanned from the right (the first run wider when the
  hit ends inside a chunk, or the run from the local hit). Each group can only shorten the hit,
  and a sliding-window group's run is looked for again when a later group shortened it. With
  sliding-window layers the hit ends a token short of the request's tokens (its last one is
  computed again for its logits).
- **loads**: a full-attention group loads every chunk past the local hit, a sliding-window group
  only those from its first block inside the window at the hit's end (the blocks below are null).
- **stores**: a full-attention group offers every chunk; a sliding-window group only the chunks a
  later hit can end at (vLLM's `reachable_block_mask` with the chunk as alignment): by default
  (`prefix_cache_retention_interval` 0) the `ceil((w - 1) / block_size)` blocks before the chunk
  boundary below the prompt's last token and before the request's shared-prefix junction; R > 0
  also those before every multiple of R; None every chunk. The connector knows a request's blocks
  as it learnt them (a block the window gave back keeps its place), and forgets a window block
  that any request is handed (allocated, or hit in the prefix cache) in a later step: vLLM zeroes
  such a block id. A chunk is not offered if a block a hit needs is null or forgotten; a block
  given back but not reused is still read (the store fences it).
- **chunked local attention** (Llama 4, `chunked`): the same with vLLM's ChunkedLocalAttentionManager
  rules: a local group stores every chunk, and a hit needs `ceil(C / chunk_tokens)` chunks in a
  row before its end.
- **EAGLE-family drafters**: the drafter's layer sits in the full-attention groups (vLLM flags
  them as holding it): such a group looks one chunk further and drops the last it finds (its
  drafter KV depends on the token after it), and while a request decodes it does not store its
  last complete chunk until the request finishes; its stores may thus lag the window groups' by
  a chunk.
Mamba groups: core/kv_offload_mamba.py.
"""

from __future__ import annotations

from simkv.core.kv_cache_groups import reachable_window_blocks
from simkv.core.kv_offload import KVOffload, OffloadJob, _OffloadState
from simkv.core.request import Request


class _GroupsState(_OffloadState):
    """The connector's view of one request over the groups: `next_stored` is the groups' chunks
    offered so far, `eagle_next` that of the groups holding an EAGLE-family drafter's layer."""

    __slots__ = ("eagle_next",)

    def __init__(self, request: Request) -> None:
        super().__init__(request)
        self.eagle_next = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HybridKVOffload(KVOffload):
    """KVOffload for a KVCacheCoordinator's groups (`windows`: each group's window, 0 = full
    attention; one window size). The coordinator (`offload_watch`) reports every block it hands
    out and every block a request's tables gain; `view(request)` is what a store needs of them."""

    def __init__(self, num_chunks: int, block_size: int, hasher, windows: tuple[int, ...],
                 retention_interval: int | None, coordinator, chunked: bool = False, **kwargs) -> None:
        super().__init__(num_chunks, block_size, hasher, **kwargs)
        self.windows = tuple(windows)
        self.num_groups = len(windows)
        self.full_gids = [g for g, w in enumerate(windows) if not w]
        self.window_gids = [g for g, w in enumerate(windows) if w]
        self.lookup_order = self.full_gids + self.window_gids
        self.window = w = max(windows)
        self.window_chunks = _cdiv(w, self.chunk_tokens)  # (vLLM's sliding_window_size_in_chunks)
        self.need = _cdiv(w - 1, block_size)  # blocks a hit needs before its end
        self.retention_interval = retention_interval
        # chunked local attention (Llama 4): the window groups' span is their attention chunk; they
        # store every chunk, and a hit needs ceil(C / chunk) chunks in a row before its end
        self.chunked = chunked
        self.kv = coordinator
        self._watch(coordinator)
        self._handed_out: dict[int, int] = {}  # block id -> the last step (`self.step`) it was handed out in
        # request index -> its window groups' block tables as the connector learnt them (blocks the
        # window gave back in place) and the step each position was learnt in
        self._known: dict[int, tuple[list[list], list[int]]] = {}

    def _watch(self, coordinator) -> None:
        """The coordinator reports to this tier the blocks it hands out and the tables it grows."""
        coordinator.offload_watch = self

    @staticmethod
    def _new_state(request: Request) -> _GroupsState:
        return _GroupsState(request)

    def _gkey(self, request: Request, c: int, gid: int) -> tuple[int, int]:
        """Chunk `c`'s (end position, key) in group `gid`."""
        return ((c + 1) * self.chunk_tokens,
                self.hasher.block_key(request, (c + 1) * self.blocks_per_chunk - 1) * self.num_groups + gid)

    def _chunk_keys(self, request: Request, start: int, end: int, gid: int) -> list[int]:
        """The keys of chunks [start, end) in group `gid` (their last blocks' keys, memoised at once)."""
        g = self.num_groups
        return [h * g + gid for h in self._chunk_hashes(request, start, end)]

    # ---- the coordinator's reports ------------------------------------------------------------
    def handed_out(self, blocks) -> None:
        """Blocks allocated or hit in this step."""
        handed_out, step = self._handed_out, self.step
        for block in blocks:
            handed_out[block.block_id] = step

    def learned(self, index: int, tables: list[list]) -> None:
        """The request's tables (one per group) were created or grew in this step."""
        known = self._known.get(index)
        if known is None:
            known = self._known[index] = ([[] for _ in self.window_gids], [])
        rows, steps = known
        n = len(steps)
        grown = len(tables[0]) - n
        if grown > 0:
            for row, gid in zip(rows, self.window_gids):
                row += tables[gid][n:]
            steps += [self.step] * grown

    def rescheduled(self, index: int, tables: list[list]) -> None:
        """A request that holds blocks (its load ended) is scheduled: its blocks count as
        allocated in this step, and the connector learns its tables afresh (vLLM lists it among
        the step's new requests, with its whole block table)."""
        self.handed_out([block for table in tables for block in table if block.block_id])
        self.forget(index)

    def forget(self, index: int) -> None:
        """The request let its blocks go (a finish's view keeps what it knew)."""
        self._known.pop(index, None)

    def view(self, request: Request):
        """What a store needs: the table's length, the window groups' known blocks with the step
        each was learnt in, and the shared-prefix junction."""
        known = self._known.get(request.index)
        return (len(known[1]) if known else 0, known, self.kv.junction(request))

    # ---- admission ----------------------------------------------------------------------------
    def lookup(self, request: Request, num_local: int) -> int | None:
        state = self._state(request)
        state.next_stored = state.eagle_next = 0
        if state.jobs:
            self.num_lookup_retries += 1
            return None
        tpc = self.chunk_tokens
        num_keys = request.num_tokens // tpc
        max_hit = self._max_hit(request)
        start = num_local // tpc
        hit, defer = 0, False
        verified: set[int] = set()  # (EAGLE groups that dropped their last chunk at the current hit)
        groups = self.lookup_order
        while groups:
            current, groups = groups, ()
            looked_window = False
            for gid in current:
                max_hit = min(max_hit, num_keys * tpc)
                if max_hit - num_local < tpc:
                    return 0
                eagle = self.eagle and not self.windows[gid] and gid not in verified
                query = min(max_hit + tpc, num_keys * tpc) if eagle else max_hit  # (one chunk more, dropped)
                num_chunks = min(_cdiv(query, tpc), num_keys)
                if self.windows[gid]:
                    found = self._window_run(request, gid, start, num_chunks,
                                             self._load_window(min(max_hit, num_chunks * tpc)))
                else:
                    found = self._prefix_run(request, gid, start, num_chunks)
                if found == 0:
                    return 0
                if found is None:
                    defer = True
                else:
                    if eagle:
                        found -= 1
                        verified.add(gid)
                    max_hit = min(max_hit, tpc * (start + found))
                new_hit = max_hit - num_local
                if new_hit < tpc:
                    return 0
                if new_hit < hit:
                    if not (self.eagle and not self.windows[gid]):
                        verified.clear()
                    if defer:  # (the shorter hit may not reach the chunk being stored: all again)
                        defer = False
                        groups = self.lookup_order
                    elif looked_window and not groups:
                        groups = self.window_gids
                looked_window |= bool(self.windows[gid])
                hit = new_hit
        if defer:
            self.num_lookup_retries += 1
            return None
        if self._being_loaded and not self._being_loaded.isdisjoint(self._load_keys(request, num_local, hit)):
            self.num_lookup_retries += 1
            return None
        return hit

    def _max_hit(self, request: Request) -> int:
        """The longest hit: with window layers a token short of the request's tokens (its last one
        is computed again for its logits)."""
        return request.num_tokens - (1 if self.window_gids else 0)

    def _prefix_run(self, request: Request, gid: int, start: int, end: int) -> int | None:
        """Chunks from `start` the tier holds, in a row; None if one of them is still being stored."""
        count, pending = self.manager.held_run(self._chunk_keys(request, start, end, gid))
        return None if pending else count

    def _window_run(self, request: Request, gid: int, start: int, end: int, first_run: int) -> int | None:
        """The end (counted from `start`) of the last run of window_chunks chunks held in [start,
        end), scanned from the right, the first run at the right `first_run` long; without one, the
        run held from `start`. None if the run found has a chunk still being stored."""
        lookup, g = self.manager.lookup, self.num_groups
        hashes = self._chunk_hashes(request, start, end)  # (group keys made as the scan reaches them)
        required, run, pending = first_run, 0, False
        for i in range(end - start - 1, -1, -1):
            found = lookup(hashes[i] * g + gid)
            if found:
                run += 1
                pending |= found == 2
            else:
                run, pending, required = 0, False, self.window_chunks
            if run == required:
                return None if pending else i + required
        return None if pending else run

    def _load_window(self, num_tokens: int) -> int:
        """Chunks a window group loads for a hit ending at `num_tokens` (a hit ending inside a
        chunk keeps the window that ends there, which may reach one chunk further left)."""
        if self.chunked:
            return self.window_chunks
        return max(self.window_chunks, _cdiv(self.window - 1 + (-num_tokens % self.chunk_tokens), self.chunk_tokens))

    def _load_keys(self, request: Request, num_local: int, num_hit: int) -> list[int]:
        """The keys a hit of `num_hit` tokens past `num_local` reads (a window group: its last ones)."""
        end = num_local + num_hit
        start, stop = num_local // self.chunk_tokens, _cdiv(end, self.chunk_tokens)
        keys = []
        for gid, window in enumerate(self.windows):
            first = max(start, stop - self._load_window(end)) if window else start
            keys += self._chunk_keys(request, first, stop, gid)
        return keys

    def start_load(self, request: Request, num_local: int, num_external: int) -> OffloadJob:
        """The load of an admitted hit: a full-attention group's blocks past the local hit, a window
        group's from its first block inside the window (its blocks below are null)."""
        state = self._state(request)
        bs, bpc = self.block_size, self.blocks_per_chunk
        num_cached = num_local + num_external
        num_gpu_blocks = _cdiv(num_cached, bs)
        end = _cdiv(num_cached, self.chunk_tokens)
        rows = self.kv.window_tables(request)
        keys, num_blocks = [], 0
        for gid, window in enumerate(self.windows):
            first = num_local // bs
            if window:  # (its first block past the local hit that is not null)
                row = rows[self.window_gids.index(gid)]
                while first < num_gpu_blocks and not row[first].block_id:
                    first += 1
            if num_gpu_blocks > first:
                keys += [self._gkey(request, c, gid) for c in range(first // bpc, end)]
                num_blocks += num_gpu_blocks - first
        state.eagle_next = end
        return self._load(request, state, keys, end, num_blocks, num_external)

    # ---- stores -------------------------------------------------------------------------------
    def _offer(self, request: Request, num_tokens: int, view, finished: bool) -> None:
        """`view`: the request's blocks as the connector knows them (`view()`)."""
        state = self._state(request)
        table_len, known, junction = view
        bpc = self.blocks_per_chunk
        num_chunks = min(num_tokens // self.chunk_tokens, table_len // bpc)
        start = state.next_stored
        # (an EAGLE group's last complete chunk waits while the request decodes: rejected drafts
        # may rewrite its drafter KV)
        eagle_chunks = num_chunks
        if self.eagle and num_tokens > request.num_prompt_tokens and not finished:
            eagle_chunks = max(0, min(num_tokens // self.chunk_tokens - 1, table_len // bpc))
        if num_chunks <= start and (not self.eagle or eagle_chunks <= state.eagle_next):
            self._set_retry(state, False)
            return
        keys = []
        chunk_of: dict[int, int] = {}  # (a window group's key -> its chunk)
        valid_of: dict[int, list[bool]] = {}  # (a window group's blocks from chunk `start` on)
        mask = self._reachable(request, start * bpc, num_chunks * bpc, num_chunks, junction, finished) \
            if self.window_gids and num_chunks > start else None
        for gid, window in enumerate(self.windows):
            if not window:
                first, end = (state.eagle_next, eagle_chunks) if self.eagle else (start, num_chunks)
                tpc = self.chunk_tokens
                keys += [((c + 1) * tpc, key) for c, key in zip(range(first, end),
                                                                 self._chunk_keys(request, first, end, gid))]
                continue
            if num_chunks <= start:
                continue
            valid = valid_of[gid] = self._valid_blocks(known, gid, start * bpc, num_chunks * bpc)
            for c in range(start, num_chunks):
                blocks = range((c - start) * bpc, (c - start + 1) * bpc)
                if not valid[blocks[-1]]:
                    continue
                if mask is not None and not any(mask[b] for b in blocks):
                    continue  # (no later hit can end at it)
                if any(not valid[b] and (mask is None or mask[b]) for b in blocks):
                    continue  # (a block a hit needs is gone)
                key = self._gkey(request, c, gid)
                keys.append(key)
                chunk_of[key[1]] = c
        if not keys:
            self._advance(state, num_chunks, eagle_chunks)
            self._set_retry(state, False)
            return
        g = self.num_groups

        def blocks_of(stored: list[int]) -> int:  # (a window chunk: the blocks the connector still has the ids of)
            return sum(bpc if key not in chunk_of else
                       sum(valid_of[key % g][(chunk_of[key] - start) * bpc:(chunk_of[key] - start + 1) * bpc])
                       for key in stored)

        if self._store(request, state, keys, num_chunks, blocks_of):
            self._advance(state, num_chunks, eagle_chunks)

    @staticmethod
    def _advance(state: _GroupsState, num_chunks: int, eagle_chunks: int) -> None:
        """The groups offered their chunks up to `num_chunks` (EAGLE groups up to `eagle_chunks`)."""
        state.next_stored = max(state.next_stored, num_chunks)
        state.eagle_next = max(state.eagle_next, eagle_chunks)

    def _valid_blocks(self, known, gid: int, start: int, end: int) -> list[bool]:
        """Whether the connector still has the id of each of a window group's blocks [start, end):
        not null, and handed to nobody since the step it was learnt in."""
        rows, steps = known
        row = rows[self.window_gids.index(gid)]
        handed_out = self._handed_out
        return [bool(row[j].block_id) and handed_out.get(row[j].block_id, -1) <= steps[j] for j in range(start, end)]

    def _reachable(self, request: Request, start: int, end: int, num_chunks: int, junction: int,
                   finished: bool) -> list[bool] | None:
        """Which blocks in [start, end) of a window group a later hit can end at (vLLM's
        SlidingWindowManager.reachable_block_mask, aligned to the chunk); None: every one."""
        if self.chunked:  # (vLLM's ChunkedLocalAttentionManager keeps them all)
            return None
        tpc, retention = self.chunk_tokens, self.retention_interval
        final_end = None
        if retention is None:  # (the request's final segment keeps its tail)
            prompt_chunks = request.num_prompt_tokens // tpc
            horizon = num_chunks if finished else prompt_chunks if num_chunks <= prompt_chunks else None
            final_end = None if horizon is None else horizon * self.blocks_per_chunk
        boundaries = [request.num_prompt_tokens - 1] + ([junction] if junction else [])
        keep = reachable_window_blocks(start, end, self.need, self.block_size, tpc, retention, boundaries, final_end)
        if keep is None:
            return None
        mask = [False] * (end - start)
        for i in keep:
            mask[i - start] = True
        return mask
