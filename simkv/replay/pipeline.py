"""Pipeline parallelism: vLLM's batch queue, and the stages' timing.

With `pipeline_parallel_size` P the model's layers are split over P stages, each on its own
tensor-parallel GPUs. vLLM 0.33's engine core (EngineCore.step_with_batch_queue) then keeps up
to P batches in flight, P + 1 under async scheduling: it schedules a new batch whenever the
queue has room, and waits for the oldest batch's output only when the queue is full or nothing
more can be scheduled. A schedule() call that runs nothing takes its place in the queue all the
same (it is no step and costs no time). What the scheduler does with the batches in flight is
the scheduler's (core/scheduler.py: decodes are chunks, and under async scheduling a request
that sampled waits P schedule() calls); this module runs the queue and times the stages.

Timing. A batch's step, as the backend times it for the whole model, is split in two: the
host's share (`host_seconds`: scheduling, input preparation; all of it if the backend does not
say), which the host does once per batch, one batch after another, before the first stage
starts; and the device's, which each stage runs for 1/P of (its layers are 1/P of the model's).
Between stages the batch's hidden states and residual (2 x hidden x 2 bytes per token, each of
the stage's TP GPUs sending 1/TP of them) cross the link at `pipeline_link_gbs` (default: the
GPU's interconnect, or `inter_node_gbs` where the boundary falls between nodes of
`gpus_per_node` GPUs). A stage starts a batch when it has finished the batch before and the stage
before has handed this one over; the first stage also waits, under async scheduling, for the
tokens its decodes were sampled in a batch still in flight (the last stage sends them back).
Under speculative decoding (async scheduling only) the drafter's passes run on the last stage
after the target's layers, and the drafts go back with the sampled tokens. A multimodal model's
vision encoder runs on the first stage, before its layers (vLLM's model runner encodes on the
first pipeline rank only), and its weights sit there (simkv/capacity.py).
The batch's output is processed when its last stage ends; its step is logged from its first
stage's start to then, so the steps of different batches overlap in time.
"""

from __future__ import annotations

from collections import deque

from simkv.clock import TICKS_PER_SECOND, to_ticks

_ACTIVATION_BYTES = 2  # bf16 hidden states
_PRUNE_AT = 4096  # token-ready entries kept before the past ones are dropped


class PipelineStages:
    """The stages' clocks: when each is free, when the host is, and when each request's latest
    sampled token is back from the last stage."""

    def __init__(self, config, backend) -> None:
        hw = config.hardware
        self.num_stages = hw.pipeline_parallel_size
        spec = hw.model_spec()
        # each boundary's link (within a node or between nodes), GB/s
        self.link_gbs = [hw.stage_link_gbs(k) for k in range(self.num_stages - 1)]
        # hidden states and residual, each TP GPU sending its 1/TP share over its own link
        per_token = 2 * spec.hidden_size * _ACTIVATION_BYTES / hw.tensor_parallel_size
        self.link_seconds_per_token = [per_token / (gbs * 1e9) for gbs in self.link_gbs]
        # speculative decoding: the drafter runs on the last stage, after the target's layers
        # (simkv/backends/drafting.py), so it is timed apart from the target's step
        self.backend = backend
        drafter = getattr(backend, "drafter", None)
        self.drafter_seconds = drafter.seconds if drafter is not None else None
        self.execute = backend.inner.execute if drafter is not None else backend.execute
        self.dp_seconds = getattr(backend.inner if drafter is not None else backend, "dp_step_seconds", None)
        # prefetched weights (simkv/backends/weight_prefetch.py): each stage copies its own layers in,
        # its copies carrying on from batch to batch; the whole model's step comes from the roofline
        from simkv.backends.weight_prefetch import prefetch_backend, stage_schedules

        self.prefetch = prefetch_backend(backend)
        self.stage_prefetch = stage_schedules(config) if self.prefetch is not None else None
        if self.prefetch is not None:
            self.execute = self.prefetch.inner.execute
            self.dp_seconds = getattr(self.prefetch.inner, "dp_step_seconds", None)
        self.host_seconds = getattr(backend, "host_seconds", None)
        self.stage_free = [0] * self.num_stages
        self.host_free = 0
        self.token_ready: dict = {}  # request -> tick its latest sampled token is back
        self.stage_busy = 0  # ticks the stages ran batches, all of them together
        self.num_batches = 0
        self.num_empty_calls = 0  # schedule() calls that ran nothing, each a place in the queue

    def launch(self, out, now: int, encoder: int = 0) -> tuple[int, int]:
        """Schedule `out`'s batch at tick `now`: (its first stage's start, its last stage's end);
        `encoder`: the vision encoder's ticks, which the first stage runs before its layers."""
        seconds = self.execute(out)
        host = min(self.host_seconds(len(out.chunks)), seconds) if self.host_seconds is not None else 0.0
        draft = 0
        if self.drafter_seconds is not None:
            draft_s = self.drafter_seconds(out)
            self.backend.draft_seconds += draft_s
            draft = to_ticks(draft_s)
        return self._place(seconds, host, draft, out.lora_load_s, out.total_num_scheduled_tokens, out.chunks, now,
                           encoder)

    def launch_group(self, ran: list, num_dummy: int, now: int, encoder: int = 0) -> tuple[int, int]:
        """Data-parallel ranks' batches of one place in the queue (`ran`; `num_dummy` ranks run a
        dummy pass), through the stages together: the expert layers' collectives line the
        ranks' passes up stage by stage, so each stage lasts its slowest rank's share of the
        lockstep step (`dp_step_seconds`); every rank's host prepares its own batch, and each
        boundary's transfer is its largest batch's. `encoder`: the slowest rank's vision
        encoder, on the first stage."""
        backend, draft = self.backend, 0
        seconds = self.dp_seconds(ran, num_dummy)
        if self.drafter_seconds is not None:  # (the ranks draft on their last stages, in lockstep too)
            draft_s = backend.drafter.dp_seconds(ran, num_dummy)
            backend.draft_seconds += draft_s
            draft = to_ticks(draft_s)
        host = (min(max(self.host_seconds(len(out.chunks)) for out in ran), seconds)
                if self.host_seconds is not None else 0.0)
        return self._place(seconds, host, draft, max(out.lora_load_s for out in ran),
                           max(out.total_num_scheduled_tokens for out in ran),
                           [chunk for out in ran for chunk in out.chunks], now, encoder)

    def _place(self, seconds: float, host: float, draft: int, lora_load_s: float, tokens: int, chunks,
               now: int, encoder: int = 0) -> tuple[int, int]:
        """A batch of `seconds` (the whole model, `host` of it on the host) on the stages' clocks;
        the first stage runs `encoder` ticks (the vision encoder's) before its layers."""
        stage = to_ticks((seconds - host) / self.num_stages)
        t = max(now, self.host_free) + to_ticks(host + lora_load_s)
        self.host_free = t
        ready = self.token_ready
        if ready:
            for chunk in chunks:
                t = max(t, ready.get(chunk.request, 0))
        free = self.stage_free
        last = self.num_stages - 1
        self.stage_busy += stage * self.num_stages + draft + encoder
        self.num_batches += 1
        start = t = max(t, free[0])
        links = self.link_seconds_per_token
        prefetch = self.stage_prefetch
        for k in range(self.num_stages):
            if k:
                t = max(t + to_ticks(tokens * links[k - 1]), free[k])
            if k == 0:
                t += encoder  # (the vision encoder, before the first stage's layers)
            if prefetch is not None:  # (the stage's layers wait for their copies)
                schedule = prefetch[k]
                wait = to_ticks(schedule.run(t / TICKS_PER_SECOND, stage / TICKS_PER_SECOND / schedule.num_layers))
                self.prefetch.wait_seconds += wait / TICKS_PER_SECOND
                self.stage_busy += wait
                t += wait
            t += stage + (draft if k == last else 0)
            free[k] = t
        for chunk in chunks:
            if chunk.samples:
                ready[chunk.request] = t
        if len(ready) > _PRUNE_AT:
            self.token_ready = {r: tick for r, tick in ready.items() if tick > now}
        return start, t


def pipeline_summary(run, duration_s: float) -> dict:
    """summary.json's `pipeline` section: the stages, how busy a stage was over the replay on
    average (the last one also drafts under speculative decoding), its batches and the
    schedule() calls that ran nothing."""
    stages = run.pipeline
    if stages is None:
        return {}
    busy = stages.stage_busy / stages.num_stages / TICKS_PER_SECOND  # (a stage's, on average)
    return {"pipeline": {"pipeline_parallel_size": stages.num_stages, "stage_busy_s": busy,
                         "stage_busy_fraction": busy / duration_s if duration_s else 0.0,
                         "batches": stages.num_batches, "empty_schedule_calls": stages.num_empty_calls,
                         "link_gbs": stages.link_gbs}}  # (per boundary)


def pipeline_row(section: dict) -> tuple[str, str]:
    """The report row of summary.json's `pipeline` section."""
    busy = 100 * section["stage_busy_fraction"]
    links = ", ".join(f"{g:g}" for g in section["link_gbs"])
    return ("pipeline stages", f"{section['pipeline_parallel_size']}, busy {busy:.1f} % of the time on average; "
                               f"{section['batches']:,} batches, {section['empty_schedule_calls']:,} empty schedule() "
                               f"calls; links {links} GB/s")


def run_batch_queue(engine):
    """The engine process under pipeline parallelism (a SimPy generator over `engine`, a
    ReplayEngine): vLLM's step_with_batch_queue on the stages' clocks."""
    sched, feed = engine.scheduler, engine.feed
    config = engine.config
    stages = engine.pipeline = PipelineStages(config, engine.backend)
    depth = config.hardware.pipeline_parallel_size + (1 if config.scheduler.async_scheduling else 0)
    queue: deque = deque()  # (output, first stage's start, last stage's end), or None: a call that ran nothing
    idle_calls = 0
    while True:
        feed.deliver_until(engine.now)
        if feed.num_rejected != engine._num_rejected_reported:
            engine._report_rejected()
        if sched.has_unfinished_requests():
            out = engine._schedule()
            if out.is_empty:
                queue.appendleft(None)
                stages.num_empty_calls += 1
                if out.offload_jobs:  # (KV offloading: loads admitted by a call that ran nothing start now)
                    feed.offload_jobs_started(out.offload_jobs, engine.now, engine.now)
            else:
                start, end = stages.launch(out, engine.now, engine.encoder_ticks(out))
                queue.appendleft((out, start, end))
                if out.offload_jobs:  # (loads as its first stage starts, stores once its last has ended)
                    feed.offload_jobs_started(out.offload_jobs, start, end)
            if len(queue) < depth and (not out.is_empty or sched.has_unfinished_requests()):
                continue
        elif not queue:
            if engine._retire_offloaded():
                continue
            if feed.exhausted:
                return
            yield from engine._wait_for_arrival()
            continue
        entry = queue.pop()
        if entry is None:
            if not any(queue) and feed.holds_pending_work():  # (nothing in flight but a KV-offloading transfer)
                idle_calls = 0
                yield from engine._wait_for_arrival()
            elif not any(queue):  # nothing in flight: a stagger's wait ends within P calls
                idle_calls += 1
                if idle_calls > 2 * depth:
                    from simkv.replay.engine import ReplayError

                    raise ReplayError(engine._stuck_message(sched.current_step))
            continue
        idle_calls = 0
        out, start, end = entry
        yield from engine._complete((out, start, end - start))  # (its last stage ends no earlier than now)
