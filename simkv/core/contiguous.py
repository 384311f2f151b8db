"""Contiguous pre-allocation: what engines did before paging, behind the KV-cache manager's interface.

Each admitted request reserves one contiguous region of `max_model_len` slots, first fit over a
free list that coalesces neighbours on release. A running request never needs more, so it is
never preempted; admission fails when no free region is long enough, even if enough slots are
free in total (external fragmentation). No prefix caching.
"""

from __future__ import annotations

from bisect import bisect_left

from simkv.core.kv_cache_manager import ComputedBlocks, PrefixCacheStats
from simkv.core.request import Request


class ContiguousSlots:
    """The slot pool, with the block pool's counting interface (in blocks of block_size slots)."""

    def __init__(self, num_slots: int, block_size: int) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self.starts: list[int] = [0]  # free regions, sorted by start
        self.lengths: list[int] = [num_slots]
        self.num_free_slots = num_slots
        self.num_evictions = 0
        self.num_usable_blocks = num_slots // block_size
        self.free_block_queue = self  # advance_decode_run reads num_free_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.num_free_slots // self.block_size

    def get_num_free_blocks(self) -> int:
        return self.num_free_blocks

    def get_num_used_blocks(self) -> int:
        return (self.num_slots - self.num_free_slots) // self.block_size

    def first_fit(self, size: int) -> int | None:
        for i, length in enumerate(self.lengths):
            if length >= size:
                start = self.starts[i]
                if length == size:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += size
                    self.lengths[i] -= size
                self.num_free_slots -= size
                return start
        return None

    def release(self, start: int, size: int) -> None:
        i = bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.lengths.insert(i, size)
        self.num_free_slots += size
        if i + 1 < len(self.starts) and self.starts[i] + self.lengths[i] == self.starts[i + 1]:
            self.lengths[i] += self.lengths.pop(i + 1)
            del self.starts[i + 1]
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == self.starts[i]:
            self.lengths[i - 1] += self.lengths.pop(i)
            del self.starts[i]

    def unusable_free_slots(self, size: int) -> int:
        """Free slots lying in regions too short for one reservation of `size`."""
        return sum(length for length in self.lengths if length < size)

    def check_invariants(self) -> None:
        assert sum(self.lengths) == self.num_free_slots
        for i in range(1, len(self.starts)):
            assert self.starts[i - 1] + self.lengths[i - 1] < self.starts[i], "overlapping or uncoalesced"


class ContiguousKVCacheManager:
    """Same calls as KVCacheManager; a request's "blocks" are its whole reservation."""

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reservation = -(-max_model_len // block_size) * block_size
        self.block_pool = ContiguousSlots(num_gpu_blocks * block_size, block_size)
        self.enable_caching = False
        self.prefix_cache_stats = PrefixCacheStats()
        self.regions: dict[int, int] = {}  # request index -> start slot
        self.req_to_blocks: dict[int, range] = {}  # request index -> its reservation's block ids
        self.num_frees = 0
        self.reserved_unwritten_slots = 0
        self.reserved_slots = 0
        self.max_unusable_free_slots = 0

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        return ComputedBlocks()

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        pass

    def num_blocks_of(self, request: Request) -> int:
        return self.reservation // self.block_size if request.index in self.regions else 0

    def allocate_slots(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                       computed: ComputedBlocks | None = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, has_scheduled_reqs: bool = True) -> list | None:
        if request.index in self.regions:
            return []
        start = self.block_pool.first_fit(self.reservation)
        if start is None:
            pool = self.block_pool
            self.max_unusable_free_slots = max(self.max_unusable_free_slots, pool.unusable_free_slots(self.reservation))
            return None
        self.regions[request.index] = start
        first = start // self.block_size
        self.req_to_blocks[request.index] = range(first, first + self.reservation // self.block_size)
        return []

    num_forks = 0
    num_cow_copies = 0

    def decode_block_need(self, request: Request, num_computed_tokens: int, num_lookahead_tokens: int) -> bool:
        return False  # a reservation holds max_model_len slots

    def decode_write(self, request: Request, num_computed_tokens: int) -> None:
        raise AssertionError("a contiguous reservation never needs another block")

    def append_block(self, request: Request) -> None:
        raise AssertionError("a contiguous reservation never needs another block")

    def fork(self, parent: Request, child: Request) -> None:
        raise ValueError("parallel sampling (n > 1) is not supported with allocator=contiguous")

    def free(self, request: Request, num_computed_tokens: int, finished: bool) -> None:
        start = self.regions.pop(request.index, None)
        if start is None:
            return
        del self.req_to_blocks[request.index]
        self.block_pool.release(start, self.reservation)
        self.num_frees += 1
        if finished:
            stored = min(num_computed_tokens + 1, self.max_model_len)
            self.reserved_slots += self.reservation
            self.reserved_unwritten_slots += self.reservation - stored

    def get_block_ids(self, request: Request) -> list[int]:
        return list(self.req_to_blocks.get(request.index, ()))

    def allocator_stats(self) -> dict:
        pool = self.block_pool
        return {
            "allocator": "contiguous",
            "reservation_slots": self.reservation,
            "reservation_waste_pct": 100.0 * self.reserved_unwritten_slots / self.reserved_slots if self.reserved_slots else 0.0,
            "external_fragmentation_peak_pct": 100.0 * self.max_unusable_free_slots / pool.num_slots,
        }
