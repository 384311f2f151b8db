"""The encoder cache of a multimodal model (vLLM's EncoderCacheManager), in embeddings.

A request's multimodal items (images, audio clips: `Request.mm_items`, (offset, length, mm_hash)
each) sit in its prompt as `length` placeholder tokens that the vision or audio encoder fills with
as many embeddings. The encoder runs an item once, in the step whose prefill chunk first reaches
it, and its output waits in this cache until every chunk that covers the item has run; items of
equal mm_hash (the same image) share one entry across requests.

Capacity is counted in embeddings. An entry no request references any more stays cached
("freeable") and is evicted, oldest first, only when a new item needs its room. Every
bookkeeping step follows vLLM 0.33's manager, including which request references which entry,
so that eviction order and the scheduler's stops before an item that does not fit agree with it.
"""

from __future__ import annotations

from collections import OrderedDict

from simkv.core.request import Request


def encoder_budget(max_num_batched_tokens: int, mm_max_tokens_per_item: int) -> int:
    """vLLM's compute_mm_encoder_budget: a step's encoder budget and the cache's size, both in
    embeddings, max(max_num_batched_tokens, the most embeddings one item can have)."""
    return max(max_num_batched_tokens, mm_max_tokens_per_item)


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # embeddings not held by any entry
        self.num_freeable_slots = cache_size  # ... plus those of unreferenced entries
        self.cached: dict[int, set[Request]] = {}  # mm_hash -> the requests that reference it
        self.num_embeds_by_hash: dict[int, int] = {}
        # the items (indices into mm_items) each request references, and how many of them per hash
        # (a request may show one image twice)
        self.request_inputs: dict[Request, set[int]] = {}
        self.request_hash_refs: dict[Request, dict[int, int]] = {}
        self.freeable: OrderedDict[int, int] = OrderedDict()  # unreferenced entries, oldest first
        self.num_evicted_entries = 0
        self.num_evicted_embeds = 0

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether the item's output is cached (computed, or scheduled this step by another
        request); if so the request now references it."""
        mm_hash = request.mm_items[input_id][2]
        holders = self.cached.get(mm_hash)
        if holders is None:
            return False
        if not holders:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        holders.add(request)
        self._add_input(request, input_id, mm_hash)
        return True

    def can_allocate(self, num_embeds: int, compute_budget: int, num_embeds_to_schedule: int) -> bool:
        """Whether an item of `num_embeds` fits the step's encoder budget and, beside the
        `num_embeds_to_schedule` of the request's earlier items this step, the cache; evicts
        unreferenced entries, oldest first, to make room (even if the request is not scheduled
        in the end, as vLLM does)."""
        if num_embeds > compute_budget:
            return False
        need = num_embeds + num_embeds_to_schedule
        if need <= self.num_free_slots:
            return True
        if need > self.num_freeable_slots:
            return False
        while need > self.num_free_slots:
            mm_hash, embeds = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            del self.num_embeds_by_hash[mm_hash]
            self.num_free_slots += embeds
            self.num_evicted_entries += 1
            self.num_evicted_embeds += embeds
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """The item's output takes its room now (it is encoded in this step)."""
        _, num_embeds, mm_hash = request.mm_items[input_id]
        self.cached.setdefault(mm_hash, set()).add(request)
        self.num_embeds_by_hash.setdefault(mm_hash, num_embeds)
        self._add_input(request, input_id, mm_hash)
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds

    def _add_input(self, request: Request, input_id: int, mm_hash: int) -> None:
        inputs = self.request_inputs.setdefault(request, set())
        if input_id in inputs:
            return
        inputs.add(input_id)
        refs = self.request_hash_refs.setdefault(request, {})
        refs[mm_hash] = refs.get(mm_hash, 0) + 1

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """The request no longer needs the item; an entry left unreferenced becomes freeable."""
        mm_hash = request.mm_items[input_id][2]
        inputs = self.request_inputs.get(request)
        if inputs is not None and input_id in inputs:
            inputs.remove(input_id)
            refs = self.request_hash_refs[request]
            refs[mm_hash] -= 1
            if not refs[mm_hash]:
                del refs[mm_hash]
            if not inputs:
                del self.request_inputs[request]
                del self.request_hash_refs[request]
        holders = self.cached.get(mm_hash)
        if not holders or mm_hash in self.request_hash_refs.get(request, ()):
            return
        holders.discard(request)
        if not holders:
            embeds = self.num_embeds_by_hash[mm_hash]
            self.freeable[mm_hash] = embeds
            self.num_freeable_slots += embeds

    def free(self, request: Request) -> None:
        """Drop every reference the request holds (it finished, was preempted or aborted, or
        could not be admitted after all)."""
        for input_id in list(self.request_inputs.get(request, ())):
            self.free_encoder_input(request, input_id)

    def free_computed(self, request: Request, num_computed: int) -> None:
        """After a step: drop the request's references to items its computed tokens cover."""
        inputs = self.request_inputs.get(request)
        if not inputs:
            return
        items = request.mm_items
        for input_id in list(inputs):
            offset, length, _ = items[input_id]
            if offset + length <= num_computed:
                self.free_encoder_input(request, input_id)

    def reset(self) -> bool:
        """Forget every cached output, as a new engine's cache has none; only when no request
        references one. False, with nothing changed, otherwise (counters are kept)."""
        if self.request_inputs:
            return False
        self.cached.clear()
        self.num_embeds_by_hash.clear()
        self.freeable.clear()
        self.num_free_slots = self.num_freeable_slots = self.cache_size
        return True

    def num_cached_embeds(self) -> int:
        """Embeddings held by cached entries, referenced or not."""
        return self.cache_size - self.num_free_slots
