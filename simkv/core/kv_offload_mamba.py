"""KV offloading on models with linear-attention layers (Qwen3-Next, Qwen3.5, Mamba2 hybrids):
vLLM's OffloadingConnector over the Mamba-align coordinator's groups (core/mamba_align.py), one
full-attention group beside Mamba groups in `mamba_cache_mode "align"`. No clock here, as in
core/kv_offload.py; the tier, its policies and the lookup loop are core/kv_offload_hybrid.py's.

A Mamba group keeps one state a block, not K/V per token, so its chunks in the CPU tier are
states (a chunk's key: its last block's content key and the group):
- **lookup**: a Mamba group is a window of one chunk to vLLM's connector: the hit is the longest
  run of attention chunks from the local hit whose end has every Mamba group's state in the tier,
  scanned from the right. The hit ends a token short of the request's tokens, rounded down to a
  chunk (vLLM's mamba_align_size: a state exists only at a chunk's end).
- **loads**: the attention chunks past the local hit, and each Mamba group's state at the hit's
  end, into the one state block the allocation puts there (the entries below it are null).
- **stores**: the attention group offers its chunks as a full-attention group does; a Mamba group
  stores only the states the GPU prefix cache keeps (retention: the prompt's last boundary and
  the junction by default), each in a job of its own, when it is cached, if it ends a chunk within
  the tokens the connector offloads (the prompt's by default). vLLM's core hands them over
  (`boundary_state_offloads`) before the step's other stores; a request's offers not taken when
  it frees its blocks are dropped, and a state the tier has no room for is not offered again.
  Decode states (`prompt_only` off, a retention that keeps them): vLLM caches them as it
  schedules a decoder; the scheduler has its steady decoders cache theirs at the step that
  completes a chunk (Scheduler._cache_decode_states).
With MTP drafts the attention group holds the draft layer: a hit looks one chunk further and
drops it, and a decoding request stores its last complete chunk only when it finishes (as
core/kv_offload_hybrid.py's EAGLE groups). Not modelled: partial tails (vLLM's `prefix_match_unit`
below the block: simkv hashes whole blocks).
"""

from __future__ import annotations

from simkv.core.kv_offload_hybrid import HybridKVOffload
from simkv.core.request import Request


class MambaKVOffload(HybridKVOffload):
    """HybridKVOffload for a MambaAlignCoordinator (`coordinator`): the Mamba groups are windows
    of one chunk (`window_gids`, in the coordinator's order; the attention group is `full_gids[0]`);
    their states are stored as the coordinator caches them (its `state_offers`).
    `view(request)`: the attention blocks the request holds."""

    def __init__(self, num_chunks: int, block_size: int, hasher, coordinator, **kwargs) -> None:
        windows = tuple(1 if linear else 0 for linear in coordinator.group_is_linear)
        super().__init__(num_chunks, block_size, hasher, windows, coordinator.retention_interval, coordinator,
                         **kwargs)
        coordinator.state_offers = []

    def _watch(self, coordinator) -> None:
        """(The Mamba-align coordinator reports nothing but the states it caches.)"""

    def view(self, request: Request) -> int:
        return self.kv.num_attention_blocks(request)

    def _max_hit(self, request: Request) -> int:
        """A hit ends a token short of the request's tokens, on a chunk's end (vLLM's mamba_align_size)."""
        max_hit = request.num_tokens - 1
        return max_hit - max_hit % self.chunk_tokens

    def _load_window(self, num_tokens: int) -> int:
        return 1

    def start_load(self, request: Request, num_local: int, num_external: int):
        """The attention group's chunks past the local hit, then each Mamba group's state at the
        hit's end (the hit ends on a chunk's end)."""
        state = self._state(request)
        bs, bpc = self.block_size, self.blocks_per_chunk
        num_cached = num_local + num_external
        end = num_cached // self.chunk_tokens
        first = num_local // bs
        keys = []
        for gid, window in enumerate(self.windows):
            keys += [self._gkey(request, c, gid) for c in ((end - 1,) if window else range(first // bpc, end))]
        state.eagle_next = end
        return self._load(request, state, keys, end, num_cached // bs - first + len(self.window_gids), num_external)

    # ---- stores -------------------------------------------------------------------------------
    def build_stores(self, scheduled: list[tuple[Request, int]], num_blocks_of) -> None:
        """The states cached since the last schedule() first (vLLM's boundary-state hand-offs),
        then the attention chunks (and the finished requests) as HybridKVOffload stores them."""
        offers = self.kv.state_offers
        if offers:
            self._store_states(offers)
            offers.clear()
        super().build_stores(scheduled, num_blocks_of)

    def _store_states(self, offers: list[tuple[Request, int, int]]) -> None:
        """Each offered state that ends a chunk within the tokens the connector offloads, in a job
        of its own: by request (in the order they first offered), then group by group."""
        by_request: dict[Request, list[tuple[int, int]]] = {}
        for request, m, boundary in offers:
            by_request.setdefault(request, []).append((m, boundary))
        tpc, g = self.chunk_tokens, self.num_groups
        for request, entries in by_request.items():
            state = self._state(request)
            # (a state is cached within the request's known tokens: the connector's limit binds for
            # the prompt only; a steady decoder's num_tokens lags its decode)
            limit = min(request.num_tokens, request.num_prompt_tokens) if self.prompt_only else 1 << 62
            entries.sort(key=lambda entry: entry[0])  # (vLLM takes them group by group)
            for m, boundary in entries:
                if boundary > limit or boundary % tpc:
                    continue
                key = (boundary, self.hasher.block_key(request, boundary // self.block_size - 1) * g
                       + self.window_gids[m])
                stored = self.manager.prepare_store([key], state.access)
                if stored is None:  # (no room: this state is not offered again)
                    self.num_store_failures += 1
                    continue
                if stored:
                    self.step_stores.append(self._new_job(request, stored, True, state, 1))
                    self.num_stores += 1
                    self.num_stored_blocks += 1

    def _offer(self, request: Request, num_tokens: int, view, finished: bool) -> None:
        """The attention group's chunks up to `num_tokens` not offered yet (`view`: the attention
        blocks the request holds); with an MTP layer in the group, a decoding request's last
        complete chunk waits for its finish (rejected drafts may rewrite its drafter KV)."""
        state = self._state(request)
        tpc, bpc, gid = self.chunk_tokens, self.blocks_per_chunk, self.full_gids[0]
        num_chunks = min(num_tokens // tpc, view // bpc)
        if self.eagle and num_tokens > request.num_prompt_tokens and not finished:
            num_chunks = max(0, min(num_tokens // tpc - 1, view // bpc))
        start = state.next_stored
        if num_chunks <= start:
            self._set_retry(state, False)
            return
        keys = [((c + 1) * tpc, key) for c, key in zip(range(start, num_chunks),
                                                         self._chunk_keys(request, start, num_chunks, gid))]
        self._store(request, state, keys, num_chunks, lambda stored: len(stored) * bpc)
