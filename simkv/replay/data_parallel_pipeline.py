"""Data-parallel ranks with pipeline stages (`-dp N -pp P`).

vLLM runs each rank's engine core with its batch queue (simkv/replay/pipeline.py: P batches in
flight, P + 1 under async scheduling), and the ranks' expert layers gather every rank's tokens,
so the ranks' passes line up stage by stage. The replay keeps one batch queue for the group:
each place in it asks every rank's scheduler for a batch; a rank with nothing to run runs a
dummy pass; the place's batches go through the stages together, each stage lasting its slowest
rank's share of the lockstep step (`PipelineStages.launch_group`). A place where no rank ran
anything is an empty call, as one engine's. The oldest place's outputs are processed, every
rank's, when its last stage ends. Each rank's scheduler is the one engine's under pipeline
parallelism (decodes are chunks, the in-flight batches' tokens are not scheduled again), which
the oracles check; the group's timing is a model (no oracle drives data-parallel ranks). A wave
ends as soon as no rank has requests (the lockstep processes run vLLM's dummy passes until the
wave's next sync step: data_parallel.PrefillCadence).
"""

from __future__ import annotations

from collections import deque

import simpy

from simkv.replay.data_parallel import (DPRouting, _has_requests, _process_outputs, _retire_offloaded, _schedule_all,
                                        _sleep, _start_transfers, _take_arrivals, encoder_ticks)
from simkv.replay.engine import ReplayEngine, ReplayError
from simkv.replay.pipeline import PipelineStages


def lockstep_pipelined(env: simpy.Environment, ranks: list[ReplayEngine], backend, routing: DPRouting):
    """The ranks' process under pipeline parallelism (run_batch_queue for the group)."""
    config = ranks[0].config
    stages = PipelineStages(config, backend)
    for rank in ranks:
        rank.pipeline = stages  # (one set of stage clocks: the summary's pipeline section is the group's)
    depth = config.hardware.pipeline_parallel_size + (1 if config.scheduler.async_scheduling else 0)
    queue: deque = deque()  # (outputs, first stage's start, last stage's end), or None: a call that ran nothing
    idle_calls = 0
    now = 0
    while True:
        _take_arrivals(ranks, routing, now)
        if _has_requests(ranks):
            outs, ran = _schedule_all(ranks, now)
            if ran:
                start, end = stages.launch_group(ran, len(ranks) - len(ran), now, encoder_ticks(ranks, outs))
                queue.appendleft((outs, start, end))
            else:
                start = end = now
                queue.appendleft(None)
                stages.num_empty_calls += 1
            _start_transfers(ranks, outs, start, end)
            if len(queue) < depth and (ran or _has_requests(ranks)):
                continue
        elif not queue:
            if _retire_offloaded(ranks):
                continue
            if all(rank.feed.exhausted for rank in ranks):
                return
            now = yield from _sleep(env, ranks, now)
            continue
        entry = queue.pop()
        if entry is None:
            if not any(queue) and any(rank.feed.holds_pending_work() for rank in ranks):
                idle_calls = 0  # (nothing in flight but a transfer: its end wakes the group)
                now = yield from _sleep(env, ranks, now)
            elif not any(queue):  # nothing in flight: a stagger's wait ends within P calls
                idle_calls += 1
                if idle_calls > 2 * depth:
                    step = ranks[0].scheduler.current_step
                    raise ReplayError(ranks[0]._stuck_message(step))
            continue
        idle_calls = 0
        outs, start, end = entry
        if end > env.now:
            yield env.timeout(end - env.now)
        now = _process_outputs(ranks, outs, start, end - start, False, routing)
