"""KV offloading's transfers on the clock (the engine core's side: simkv/core/kv_offload.py).

Each direction of the host link (`pcie_bandwidth_gbs`, each GPU's own: under tensor parallelism
every rank moves its share of a transfer at once, so a transfer takes its bytes over all GPUs
divided by their number, at that rate) carries one transfer at a time, in the
order the steps start them: a load (host to GPU) when the step that admitted it starts, a store
(GPU to host) when the next step starts, which under vLLM's engine is at once (it keeps
stepping while a connector has work), so here at the end of the step that computed the blocks.
A transfer's end takes effect at the first step boundary at or after it; an engine idle on a
load is woken then.

`OffloadFeed` wraps the engine's arrival feed (its own, or a fleet replica's: each replica has
its own tier and link) and adds the transfers' ends to the events the engine waits for.
"""

from __future__ import annotations

import heapq

from simkv.clock import TICKS_PER_SECOND


class OffloadFeed:
    def __init__(self, arrivals, scheduler, chunk_bytes: int, pcie_gbs: float, blocks_per_chunk: int = 1,
                 num_links: int = 1) -> None:
        self.arrivals = arrivals  # the feed wrapped: everything else is its
        self.scheduler = scheduler
        self.chunk_bytes = chunk_bytes  # (a job moves GPU blocks: a chunk's share each)
        self.blocks_per_chunk = blocks_per_chunk
        self._ticks_per_byte = TICKS_PER_SECOND / (pcie_gbs * 1e9 * num_links)  # (bytes over all GPUs)
        self._load_free = self._store_free = 0  # ticks at which each direction is free
        self._events: list[tuple[int, int, object]] = []  # (tick, job id, job)
        self.load_bytes = self.store_bytes = 0
        self.load_ticks = 0  # summed over loads: their start to their end, queueing included

    def __getattr__(self, name: str):
        if name == "arrivals":  # (not set yet)
            raise AttributeError(name)
        return getattr(self.arrivals, name)

    @property
    def exhausted(self) -> bool:
        return self.arrivals.exhausted and not self._events

    def next_arrival_ticks(self) -> int | None:
        nxt = self.arrivals.next_arrival_ticks()
        if self._events and (nxt is None or self._events[0][0] < nxt):
            return self._events[0][0]
        return nxt

    def next_transfer_ticks(self) -> int | None:
        """When the next transfer ends (a fleet replica's own wake-up: its router wakes it for arrivals)."""
        return self._events[0][0] if self._events else None

    def deliver_until(self, now: int) -> None:
        events = self._events
        while events and events[0][0] <= now:
            self.scheduler.offload_job_done(heapq.heappop(events)[2])
        self.arrivals.deliver_until(now)

    def holds_pending_work(self) -> bool:
        return bool(self._events) or self.arrivals.holds_pending_work()

    def offload_jobs_started(self, jobs: list, step_start: int, step_end: int) -> None:
        for job in jobs:
            num_bytes = job.num_blocks * self.chunk_bytes // self.blocks_per_chunk
            ticks = round(num_bytes * self._ticks_per_byte)
            if job.is_store:
                begin = max(step_end, self._store_free)
                end = self._store_free = begin + ticks
                self.store_bytes += num_bytes
            else:
                begin = max(step_start, self._load_free)
                end = self._load_free = begin + ticks
                self.load_bytes += num_bytes
                self.load_ticks += end - step_start
            heapq.heappush(self._events, (end, job.job_id, job))
