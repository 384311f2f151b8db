"""Drive the engine core directly, as the replay does, for tests."""

from __future__ import annotations

import numpy as np

from simkv.config import CacheConfig, EngineConfig, SchedulerConfig
from simkv.core.request import KV_SEND, Request
from simkv.core.scheduler import LivelockError, Scheduler


def make_config(num_gpu_blocks: int = 6250, block_size: int = 16, max_num_seqs: int = 256,
                max_num_batched_tokens: int = 8192, max_model_len: int = 4096, **kw) -> EngineConfig:
    cache_keys = {"enable_prefix_caching", "watermark", "num_lookahead_tokens", "prefix_caching_hash_bits",
                  "reserve_null_block", "allocator"}
    cache = {k: v for k, v in kw.items() if k in cache_keys}
    sched = {k: v for k, v in kw.items() if k not in cache_keys}
    return EngineConfig(CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, **cache),
                        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                        max_model_len=max_model_len, **sched))


def make_request(i: int, prompt: int, output: int, hashes=None, h: int = 0, salt=None, priority: int = 0,
                 arrival: float = 0.0, num_samples: int = 1, lora: str | None = None) -> Request:
    """`lora`: the adapter's name (a, b, c: ids 1 to 3, as scripts/oracle_offload.py --lora names them)."""
    from simkv.core.block_hashing import content_namespace

    ids = None if hashes is None else np.asarray(hashes, dtype=np.int64)
    return Request(f"r{i}", i, arrival, prompt, output, priority=priority,
                   cache_salt=content_namespace(salt, lora) if lora else salt,
                   shared_hash_ids=ids, hash_block_tokens=h, num_samples=num_samples,
                   lora_id="abc".index(lora) + 1 if lora else 0)


def _count(out, log, steps, peak, query, hit, prefill, decode):
    """One scheduled step added to the counts (and to `log`)."""
    log.append((out.step, out.num_prefill_tokens, out.num_decode_reqs, out.num_running))
    return (steps + 1, max(peak, out.num_running), query + out.prefix_query_tokens, hit + out.prefix_hit_tokens,
            prefill + out.num_prefill_tokens, decode + out.num_decode_reqs)


def drive(scheduler: Scheduler, use_runs: bool = True, check=None, max_steps: int = 1_000_000) -> dict:
    """Step (or jump over decode runs) until every request finished; collect vLLM-style counts."""
    steps = peak = query = hit = prefill = decode = 0
    log = []
    while scheduler.has_unfinished_requests():
        if use_runs:
            k = scheduler.decode_run_limit()
            if k >= 2:
                run = scheduler.advance_decode_run(k)
                if run is not None:
                    steps += run.num_steps
                    peak = max(peak, run.num_running)
                    decode += run.num_decodes * run.num_steps
                    for j in range(run.num_steps):
                        log.append((run.start_step + j, 0, run.num_decodes, run.num_running))
                    if check:
                        check(scheduler)
                    continue
        out = scheduler.schedule()
        assert not out.is_empty, "engine stuck"
        steps, peak, query, hit, prefill, decode = _count(out, log, steps, peak, query, hit, prefill, decode)
        scheduler.update_from_output(out)
        if check:
            check(scheduler)
        assert steps < max_steps
    return {"steps": steps, "peak_running": peak, "preemptions": scheduler.num_preemptions,
            "preempted_requests": scheduler.num_preempted_requests, "hits": hit, "queries": query,
            "prefill_tokens": prefill, "decode_tokens": decode, "log": log}



def drive_async(scheduler: Scheduler, check=None, max_steps: int = 1_000_000, arrivals=None) -> dict:
    """Async scheduling's order, as vLLM's two-deep batch queue makes it: step K+1 is scheduled
    before step K's output is processed (S0, S1, U0, S2, U1, ...). `arrivals`: (schedule call,
    request) pairs, added before that call."""
    steps = peak = query = hit = prefill = decode = calls = 0
    log = []
    pending = sorted(arrivals or [], key=lambda a: a[0])
    in_flight = None
    while scheduler.has_unfinished_requests() or in_flight is not None or pending:
        while pending and (pending[0][0] <= calls or not (scheduler.has_unfinished_requests() or in_flight)):
            scheduler.add_request(pending.pop(0)[1])
        queued = None
        if scheduler.has_unfinished_requests():
            calls += 1
            out = scheduler.schedule()
            if not out.is_empty:
                steps, peak, query, hit, prefill, decode = _count(out, log, steps, peak, query, hit, prefill, decode)
                if in_flight is None:
                    in_flight = out
                    continue
                queued = out
            else:
                assert in_flight is not None, "engine stuck"
        scheduler.update_from_output(in_flight)
        if check:
            check(scheduler)
        in_flight = queued
        assert steps < max_steps
    return {"steps": steps, "peak_running": peak, "preemptions": scheduler.num_preemptions,
            "preempted_requests": scheduler.num_preempted_requests, "hits": hit, "queries": query,
            "prefill_tokens": prefill, "decode_tokens": decode, "log": log}


# P/D cases (scripts/oracle_pd.py): roles of a request, as the case files write them
PD_PLAIN, PD_SEND, PD_PULL = 0, 1, 2


def _deliver(pending: list, upto: int, sched: Scheduler, requests: list, roles: bool = False) -> None:
    """A step-mode case's requests arriving by step `upto` (`pending` is in arrival order): to the
    scheduler, and (request, case row) to `requests`; `roles`: with their P/D role."""
    from simkv.core.request import KV_PULL, KV_SEND

    while pending and pending[0]["arrival_step"] <= upto:
        r = pending.pop(0)
        req = make_request(r["row"], r["prompt"], r["output"], r.get("block_hashes"),
                           8 if r.get("block_hashes") else 0, priority=r["priority"], arrival=float(r["arrival_step"]),
                           num_samples=r.get("n", 1), lora=r.get("lora"))  # (n > 1: fanned out by the scheduler)
        if roles:
            req.kv_role = {PD_PULL: KV_PULL, PD_SEND: KV_SEND}.get(r["role"], 0)
        if r.get("mm"):  # (images: scripts/oracle_spec.py --images)
            req.mm_items = tuple(tuple(item) for item in r["mm"])
        requests.append((req, r))
        sched.add_request(req)


def _ec_store(sched: Scheduler, case: dict) -> None:
    """Encoder disaggregation (scripts/oracle_spec.py --ec-store, --encode-only): the items in the
    embedding store from the start, whether the engine stores what it encodes, and an encode
    instance's chunking."""
    if case.get("ec_store") is not None:
        sched.ec_store = set(case["ec_store"])
        sched.ec_producer = bool(case.get("ec_producer"))
    if case.get("encode_only"):  # (--encode-only: vLLM's mm_encoder_only chunks prompts whatever the option)
        sched.enable_chunked_prefill = True


def _pd_scheduler(case: dict):
    """A P/D case's scheduler (with the connector) and its requests in arrival order."""
    opts = dict(case["opts"])
    reserve = opts.pop("reserve_full_isl")
    sched = Scheduler(EngineConfig.from_flat(opts | {"scheduler_reserve_full_isl": reserve}), opts["num_gpu_blocks"],
                      kv_connector=True)
    return sched, sorted(case["requests"], key=lambda r: (r["arrival_step"], r["row"]))


def drive_pd(case: dict, max_steps: int = 5000) -> dict:
    """Step a scheduler through a P/D case as scripts/oracle_pd.py drives vLLM's: arrivals by step;
    a pull admitted in step k ends in the output of step k + latency - 1, a send is released
    `latency` steps after its finish. Returns per-step [scheduled tokens, running, waiting, blocks
    used] and per-request [first token step, finish step]."""
    sched, pending = _pd_scheduler(case)
    requests, rows = [], []
    due_recv: dict[int, list] = {}
    due_send: dict[int, list] = {}
    aborts = _aborts_by_step(case)
    for k in range(max_steps):
        _deliver(pending, k, sched, requests, roles=True)
        _abort(sched, requests, aborts, k, "before")
        out = sched.schedule()
        for req in out.kv_loads or ():
            latency = next(r["latency"] for q, r in requests if q is req)
            due_recv.setdefault(k + latency - 1, []).append(req)
        rows.append([out.total_num_scheduled_tokens, out.num_running, out.num_waiting, out.num_blocks_used])
        _abort(sched, requests, aborts, k, "output", out)
        for req in sched.update_from_output(out):
            r = next(r for q, r in requests if q is req)
            if r["role"] == PD_SEND:
                due_send.setdefault(k + r["latency"], []).append(req)
        for req in sorted(due_recv.pop(k, ()), key=lambda q: q.index):  # (row order, as oracle_pd.py gives vLLM)
            sched.finished_recving(req)
        for req in sorted(due_send.pop(k, ()), key=lambda q: q.index):
            sched.finished_sending(req)
        if not pending and not sched.has_unfinished_requests() and not due_send:
            break
    else:  # (as the oracle's loop reports it: a configuration in which nothing can move)
        return {"steps": rows, "error": "max steps", "scheduler": sched, "requests": _request_steps(requests, aborts)}
    while rows and not any(rows[-1]):
        rows.pop()
    return {"steps": rows, "requests": _request_steps(requests, aborts), "aborted": len(aborts["first"]),
            "scheduler": sched}


def drive_pd_async(case: dict, max_steps: int = 5000) -> dict:
    """drive_pd under async scheduling, as scripts/oracle_pd.py --async-scheduling drives vLLM's
    AsyncScheduler: its batch queue, two deep, empty batches included (they carry the
    connector's output). A pull admitted by batch b ends in the output of batch b + latency - 1;
    a send finished in batch b's output is released in that of b + latency."""
    from collections import deque

    sched, pending = _pd_scheduler(case)
    rows, queue = [], deque()
    requests = []
    row_of: dict[int, dict] = {}  # id(request) -> its case row
    due_recv: dict[int, list] = {}
    due_send: dict[int, list] = {}
    unreported = False  # finished requests vLLM reports with the next schedule() (has_requests)
    num_batches = 0
    error = None
    aborts = _aborts_by_step(case)

    def has_requests() -> bool:
        return sched.has_unfinished_requests() or bool(sched.kv_held) or unreported

    while True:
        if len(rows) >= max_steps or num_batches >= 4 * max_steps:  # (the oracle's limits)
            error = "max steps"
            break
        _deliver(pending, len(rows), sched, requests, roles=True)
        row_of.update((id(q), r) for q, r in requests[len(row_of):])
        _abort(sched, requests, aborts, len(rows), "before")
        if has_requests():
            unreported = False
            out = sched.schedule()
            b = num_batches
            num_batches += 1
            for req in out.kv_loads or ():
                due_recv.setdefault(b + row_of[id(req)]["latency"] - 1, []).append(req)
            ran = not out.is_empty
            if ran:
                rows.append([out.total_num_scheduled_tokens, out.num_running, out.num_waiting, out.num_blocks_used])
            queue.appendleft((b, out if ran else None))
            if len(queue) < 2 and (ran or has_requests()):
                continue
        elif not queue:
            if not pending:
                break
            rows.append([0, 0, 0, 0])  # idle
            sched.current_step += 1
            continue
        b, out = queue.pop()
        if out is not None:
            _abort(sched, requests, aborts, out.step, "output")
            for req in sched.update_from_output(out):
                unreported = True
                r = row_of[id(req)]
                if r["role"] == PD_SEND:
                    due_send.setdefault(b + r["latency"], []).append(req)
        for req in sorted(due_recv.pop(b, ()), key=lambda q: q.index):  # (row order, as the oracle gives vLLM)
            sched.finished_recving(req)
        for req in sorted(due_send.pop(b, ()), key=lambda q: q.index):
            sched.finished_sending(req)
    result = {"steps": rows, "requests": {str(r["row"]): [-1, -1] for r in case["requests"]}, "scheduler": sched}
    result["requests"] |= _request_steps(requests, aborts)
    result["aborted"] = len(aborts["first"])
    if error:
        result["error"] = error
    return result


def drive_steps(case: dict, max_steps: int = 5000) -> dict:
    """Step a scheduler through a case of flat engine options and requests arriving by step (the
    step-mode oracles' format: scripts/oracle_spec.py). Returns per-step [scheduled tokens,
    running, waiting, blocks used] and per-request [first token step, finish step]."""
    opts = case["opts"]
    sched = Scheduler(EngineConfig.from_flat(opts), opts["num_gpu_blocks"])
    _ec_store(sched, case)
    pending = sorted(case["requests"], key=lambda r: (r["arrival_step"], r["row"]))
    requests, rows = [], []
    aborts = _aborts_by_step(case)
    for _ in range(max_steps):
        k = sched.current_step
        _deliver(pending, len(rows), sched, requests)
        _abort(sched, requests, aborts, len(rows), "before")
        if sched.has_unfinished_requests():
            try:
                out = sched.schedule()
            except LivelockError:  # (preempting without end: vLLM's run then reaches its max steps)
                return {"steps": rows, "error": "livelock", "scheduler": sched,
                        "requests": _request_steps(requests, aborts)}
            rows.append([out.total_num_scheduled_tokens, out.num_running, out.num_waiting, out.num_blocks_used])
            _abort(sched, requests, aborts, len(rows) - 1, "output", out)
            sched.update_from_output(out)
        else:
            rows.append([0, 0, 0, 0])
            sched.current_step = k + 1
        if not pending and not sched.has_unfinished_requests():
            break
    else:  # (vLLM livelocks too on some tiny pools: the oracle's run then ends the same way)
        return {"steps": rows, "error": "max steps", "scheduler": sched, "requests": _request_steps(requests, aborts)}
    while rows and not any(rows[-1]):
        rows.pop()
    return {"steps": rows, "requests": _request_steps(requests, aborts), "aborted": len(aborts["first"]),
            "scheduler": sched, "objects": {r["row"]: q for q, r in requests}}


def assert_mutations_break(monkeypatch, mutations: list, cases: list, as_recorded) -> None:
    """Each mutation (class, attribute, mutant, at least) must break at least that many of
    `cases`: `as_recorded(case)` false, or the mutated engine failing outright."""
    for cls, name, mutant, at_least in mutations:
        with monkeypatch.context() as m:
            m.setattr(cls, name, mutant)
            broken = 0
            for case in cases:
                try:
                    broken += not as_recorded(case)
                except Exception:  # (a mutated engine may trip over its own state)
                    broken += 1
        assert broken >= at_least, (name, broken)


def _aborts_by_step(case: dict) -> dict:
    """A step-mode case's aborts (the step-mode oracles' --aborts): {(step, "before" | "output"):
    rows}, "before": before the step is scheduled, "output": after it ran, before its output is
    processed (where vLLM's engine core takes a front end's aborts)."""
    out: dict = {"first": {}}  # (and "first": an aborted row -> its first token's step if delivered, else -1)
    for a in case.get("aborts", ()):
        out.setdefault((a["step"], a["when"]), []).append(a["row"])
    return out


def _abort(sched: Scheduler, requests: list, aborts: dict, step: int, when: str, out=None) -> None:
    """vLLM's finish_requests(FINISHED_ABORTED), one by one, for the requests of `aborts` at
    (`step`, `when`) still in the engine; `out`: the step that ran (a chunk's KV to its end exists)."""
    from simkv.core.request import RequestStatus

    rows = aborts.get((step, when), ())
    ends = {id(c.request): c.num_computed_tokens + c.num_new_tokens for c in out.chunks} if rows and out else {}
    for row in rows:
        request = next((q for q, r in requests if r["row"] == row), None)
        if request is None or request.status in (RequestStatus.FINISHED, RequestStatus.ABORTED):
            continue
        assert sched.abort_request(request, ends.get(id(request)))
        first = request.first_token_step  # (async: delivered once its step's output was processed)
        delivered = sched.token_delivered(first) if sched.overlapped else 0 <= first < step
        aborts["first"][row] = first if delivered else -1


def _request_steps(requests: list, aborts: dict) -> dict:
    """Per request [first token step, finish step]; an aborted request's first token only if a
    step before its abort delivered it, and no finish (vLLM reports neither otherwise)."""
    return {str(r["row"]): ([aborts["first"][r["row"]], -1] if r["row"] in aborts["first"]
                            else [q.first_token_step, q.finish_step]) for q, r in requests}


def drive_steps_async(case: dict, max_steps: int = 5000) -> dict:
    """drive_steps under async scheduling, in the batch queue's order as scripts/oracle_spec_async.py
    drives vLLM's AsyncScheduler: step K+1 is scheduled before step K's output is processed; a
    schedule() that runs nothing is not a step (the engine waits for the one in flight)."""
    opts = case["opts"]
    sched = Scheduler(EngineConfig.from_flat(opts), opts["num_gpu_blocks"])
    pending = sorted(case["requests"], key=lambda r: (r["arrival_step"], r["row"]))
    requests, rows = [], []
    in_flight = None
    error = None
    aborts = _aborts_by_step(case)

    def process(out):
        _abort(sched, requests, aborts, out.step, "output")
        sched.update_from_output(out)

    while True:
        if len(rows) >= max_steps:
            error = "max steps"
            break
        _deliver(pending, len(rows), sched, requests)
        _abort(sched, requests, aborts, len(rows), "before")
        try:
            out = sched.schedule() if sched.has_unfinished_requests() else None
        except LivelockError:  # (preempting without end: vLLM's run then reaches its max steps)
            error = "livelock"
            break
        if out is None or out.is_empty:
            if in_flight is None:
                if sched.has_unfinished_requests():
                    error = "stuck"
                    break
                if not pending:
                    break
                rows.append([0, 0, 0, 0])  # idle
                sched.current_step += 1
                continue
            process(in_flight)
            in_flight = None
            continue
        rows.append([out.total_num_scheduled_tokens, out.num_running, out.num_waiting, out.num_blocks_used])
        if in_flight is not None:
            process(in_flight)
        in_flight = out
    result = {"steps": rows, "requests": _request_steps(requests, aborts), "aborted": len(aborts["first"]),
              "scheduler": sched, "objects": {r["row"]: q for q, r in requests}}
    if error:
        result["error"] = error
    return result


def drive_steps_pipeline(case: dict, max_steps: int = 5000) -> dict:
    """drive_steps under pipeline parallelism, in the order of vLLM's batch queue
    (EngineCore.step_with_batch_queue, as scripts/oracle_pp.py drives vLLM): pp_size batches
    deep, one more under async scheduling. A schedule() call that runs nothing takes its place
    in the queue all the same, and is no step; the oldest batch's output is processed when the
    queue is full or nothing more can be scheduled."""
    from collections import deque

    opts = case["opts"]
    sched = Scheduler(EngineConfig.from_flat(opts), opts["num_gpu_blocks"])
    depth = opts["pipeline_parallel_size"] + (1 if opts.get("async_scheduling") else 0)
    pending = sorted(case["requests"], key=lambda r: (r["arrival_step"], r["row"]))
    requests, rows = [], []
    queue: deque = deque()
    error = None
    idle_calls = 0
    aborts = _aborts_by_step(case)
    while True:
        if len(rows) >= max_steps:
            error = "max steps"
            break
        _deliver(pending, len(rows), sched, requests)
        _abort(sched, requests, aborts, len(rows), "before")
        if sched.has_unfinished_requests():
            try:
                out = sched.schedule()
            except LivelockError:
                error = "livelock"
                break
            if out.is_empty:
                queue.appendleft(None)
            else:
                rows.append([out.total_num_scheduled_tokens, out.num_running, out.num_waiting, out.num_blocks_used])
                queue.appendleft(out)
            if len(queue) < depth and (not out.is_empty or sched.has_unfinished_requests()):
                continue
        elif not queue:
            if not pending:
                break
            rows.append([0, 0, 0, 0])  # idle
            sched.current_step += 1
            continue
        out = queue.pop()
        if out is not None:
            _abort(sched, requests, aborts, out.step, "output")
            sched.update_from_output(out)
            idle_calls = 0
        elif not any(queue):
            idle_calls += 1  # (nothing in flight, nothing scheduled: a stagger's wait ends within pp_size calls)
            if idle_calls > 2 * depth:
                error = "stuck"
                break
    result = {"steps": rows, "requests": _request_steps(requests, aborts), "aborted": len(aborts["first"]),
              "scheduler": sched, "objects": {r["row"]: q for q, r in requests}}
    if error:
        result["error"] = error
    return result


def count_failing(check, cases) -> int:
    """How many of `cases` fail `check` (raise an AssertionError): what a mutation breaks."""
    failing = 0
    for case in cases:
        try:
            check(case)
        except AssertionError:
            failing += 1
    return failing


def k_drafts_at_every_match(self, index: int, position: int, k: int) -> int:
    """A mutant of AcceptanceModel.num_proposed: K drafts at every match, not the drawn lengths."""
    return k if self.always_matches or self.proposes(index, position) else 0


def assert_same_steps_as_vllm(recorded: dict) -> dict:
    """A recorded step-mode oracle case ({"case", "vllm"}): simkv's steps and requests equal vLLM's
    (drive_steps' result is returned for further checks)."""
    ours = drive_steps(recorded["case"])
    theirs = recorded["vllm"]["steps"]
    while theirs and not any(theirs[-1]):  # (vLLM's engine steps once more to report the last finish)
        theirs.pop()
    assert ours["steps"] == theirs
    assert ours["requests"] == recorded["vllm"]["requests"]
    return ours


def assert_same_async_spec_steps_as_vllm(recorded: dict) -> dict:
    """A recorded case of scripts/oracle_spec_async.py ({"case", "vllm"}): simkv's steps, requests,
    accepted drafts and prefix-cache counts under async scheduling equal vLLM's."""
    ours = drive_steps_async(recorded["case"])
    theirs = recorded["vllm"]
    steps = list(theirs["steps"])
    while steps and not any(steps[-1]):
        steps.pop()
    assert ours["steps"] == steps
    assert ours["requests"] == theirs["requests"]
    sched = ours["scheduler"]
    assert sched.spec_stats["num_accepted_tokens"] == theirs["accepted"]
    stats = sched.kv_cache_manager.prefix_cache_stats
    assert [stats.queries, stats.hits] == theirs["prefix"]
    return ours


def make_step(chunks=(), decodes=0, context=0):
    """A SchedulerOutput of prefill `chunks` and `decodes` summarised decodes attending `context`
    tokens in all, for timing it on a cost model."""
    from simkv.core.outputs import SchedulerOutput

    return SchedulerOutput(step=0, chunks=list(chunks), num_decode_reqs=decodes, decode_context_tokens=context,
                           decodes=None, preempted=[], num_running=len(chunks) + decodes, num_waiting=0,
                           num_blocks_used=0, prefix_query_tokens=0, prefix_hit_tokens=0)


def assert_same_async_replay_as_vllm(case: dict, tmp_path) -> EngineConfig:
    """A recorded case of scripts/oracle_hybrid_async.py ({"opts", "trace", "vllm"}): a replay under
    async scheduling with 1 s steps gives vLLM's steps (scheduled tokens, running, waiting, blocks
    in use), step count, preemptions, prefix hits and first-token and finish times. Returns the
    case's config."""
    import pandas as pd

    from simkv.replay.api import replay
    from simkv.traces.schema import read_trace, write_trace

    theirs = case["vllm"]
    write_trace(pd.DataFrame(case["trace"]), tmp_path / "trace.parquet")
    config = EngineConfig.from_flat(case["opts"] | {"async_scheduling": True})
    res = replay(read_trace(tmp_path / "trace.parquet"), config, "linear", {"step_base_s": 1.0, "step_per_token_s": 0.0})
    st = res.steps
    ours = [list(x) for x in zip((st["num_prefill_tokens"] + st["num_decode_tokens"]).tolist(), st["num_running"].tolist(),
                                 st["num_waiting"].tolist(), st["num_blocks_used"].tolist())]
    assert ours == theirs["steps"]
    s = res.summary
    assert (s["num_steps"], s["num_preemptions"], s["prefix_cache_hits_tokens"]) == \
        (theirs["num_steps"], theirs["preemptions"], theirs["prefix_hit_tokens"])
    times = res.requests[["first_token_time_s", "finish_time_s"]].to_numpy().tolist()
    assert {str(i): t for i, t in enumerate(times) if str(i) in theirs["requests"]} == theirs["requests"]
    return config


def decode_contexts(config: EngineConfig, request: Request, num_gpu_blocks: int = 200) -> list[int]:
    """The attended context (decode_context_tokens) of every step with a decode, one request alone."""
    sched = Scheduler(config, num_gpu_blocks)
    sched.add_request(request)
    contexts = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out.num_decode_reqs:
            contexts.append(out.decode_context_tokens)
        sched.update_from_output(out)
    return contexts


def assert_decode_runs_change_nothing(trace, config: EngineConfig, cost_model: str = "roofline"):
    """A replay that jumps over decode runs gives the requests and steps of one that steps every
    decode; returns the first."""
    import pandas as pd

    from simkv.replay.api import replay

    a = replay(trace, config, cost_model)
    b = replay(trace, config, cost_model, use_decode_runs=False)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    for name, values in a.steps.items():
        assert np.array_equal(values, b.steps[name]), name
    return a


def assert_decode_runs_change_no_bytes(trace, config: EngineConfig, tmp_path, **replay_options):
    """A replay (a fleet's, a P/D one: `replay_options`) with decode-run jumps writes the same
    summary.json, requests.parquet and steps.parquet bytes as one stepping every decode (wall
    time aside); returns the first replay."""
    from simkv.replay.api import replay, save

    results = []
    for name, runs in (("a", True), ("b", False)):
        res = replay(trace, config, "roofline", use_decode_runs=runs, **replay_options)
        res.summary["wall_time_s"] = 0.0
        save(res, tmp_path / name)
        results.append(res)
    for f in ("summary.json", "requests.parquet", "steps.parquet"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    return results[0]


def _offload_options(case: dict) -> dict:
    """The connector settings of an offloading case (scripts/oracle_offload.py --chunks, --policy)."""
    if not {"blocks_per_chunk", "policy", "store_threshold"} & case.keys():
        return {}
    return {"kv_offloading_size": 1.0,
            "kv_offloading_block_size": case.get("blocks_per_chunk", 1) * case["opts"]["block_size"],
            "kv_offloading_prompt_only": case.get("prompt_only", True), "kv_offloading_policy": case.get("policy", "lru"),
            "kv_offloading_store_threshold": case.get("store_threshold", 0),
            "kv_offloading_max_tracker_size": case.get("max_tracker_size", 64_000)}


def _pd_latencies(case: dict) -> dict[int, int]:
    """P/D cases (scripts/oracle_offload.py --pd): each row's transfer latency, by row."""
    return {r["row"]: r["latency"] for r in case["requests"]} if case.get("pd") else {}


def _due_transfers(out, b: int, case: dict, due: dict, transfers: list, row: int, latency: dict) -> None:
    """The transfers step (or batch) `b` started, due in later outputs as scripts/oracle_offload.py
    has them end: P/D pulls (--pd) in that of b + latency - 1, then loads in that of
    b + load_latency - 1 and stores in that of b + store_latency, in the order made."""
    for req in out.kv_loads or ():
        due.setdefault(b + latency[req.index] - 1, []).append(req)
    for job in out.offload_jobs or ():
        due.setdefault(b + (case["store_latency"] if job.is_store else case["load_latency"] - 1), []).append(job)
        transfers.append([row, job.request.index, job.num_blocks, int(job.is_store)])


def _sends_due(finished, b: int, latency: dict, due_send: dict) -> None:
    """P/D: the sends that finished in step (or batch) `b`'s output are released in that of
    b + latency."""
    for req in finished:
        if req.kv_role == KV_SEND:
            due_send.setdefault(b + latency[req.index], []).append(req)


def _transfers_done(sched, done, sent) -> None:
    """Transfers ended in a step's output, in the order started (a request: a pull's read); then
    the sends released, in row order."""
    for item in done:
        if isinstance(item, Request):
            sched.finished_recving(item)
        else:
            sched.offload_job_done(item)
    for req in sorted(sent, key=lambda q: q.index):
        sched.finished_sending(req)


def drive_offload(case: dict, max_steps: int = 5000) -> dict:
    """Step a scheduler with a CPU offload tier through a case as scripts/oracle_offload.py drives
    vLLM's: a store job started by step k ends in the output of k + store_latency, a load in that
    of k + load_latency - 1. Returns per-step rows, per-request [first token step, finish step]
    and the transfers [step, row, blocks, is store]."""
    opts = dict(case["opts"])
    reserve = opts.pop("reserve_full_isl")
    sched = Scheduler(EngineConfig.from_flat(opts | {"scheduler_reserve_full_isl": reserve} | _offload_options(case)),
                      opts["num_gpu_blocks"], kv_connector=True, num_offload_chunks=case["num_offload_chunks"])
    pending = sorted(case["requests"], key=lambda r: (r["arrival_step"], r["row"]))
    requests, rows, transfers = [], [], []
    due: dict[int, list] = {}
    error = None
    aborts = _aborts_by_step(case)
    latency = _pd_latencies(case)
    due_send: dict[int, list] = {}  # (P/D: sends released in a step's output)
    for k in range(max_steps):
        _deliver(pending, k, sched, requests, roles=bool(latency))
        _abort(sched, requests, aborts, k, "before")
        out = sched.schedule()
        _due_transfers(out, k, case, due, transfers, k, latency)
        rows.append([out.total_num_scheduled_tokens, out.num_running, out.num_waiting, out.num_blocks_used])
        _abort(sched, requests, aborts, k, "output", out)
        _sends_due(sched.update_from_output(out), k, latency, due_send)
        _transfers_done(sched, due.pop(k, ()), due_send.pop(k, ()))
        if (not pending and not sched.has_unfinished_requests() and not due and not due_send
                and not (sched.offload is not None and sched.offload.has_finished_requests)):
            break  # (vLLM's engine schedules once more after its last finish: the connector stores then)
    else:
        error = "max steps"
    while rows and not any(rows[-1]):
        rows.pop()
    result = {"steps": rows, "requests": _request_steps(requests, aborts), "aborted": len(aborts["first"]),
              "transfers": transfers, "scheduler": sched}
    if error:
        result["error"] = error
    return result


def drive_offload_async(case: dict, max_steps: int = 5000) -> dict:
    """drive_offload under async scheduling, as scripts/oracle_offload.py --async-scheduling drives
    vLLM's AsyncScheduler (drive_pd_async's batch queue; vLLM keeps scheduling batches while the
    connector has transfers in flight): a store job made by batch b ends in the output of batch
    b + store_latency, a load in that of b + load_latency - 1. With pipeline stages (--pp) the
    queue is P batches deep, P + 1 under async scheduling."""
    from collections import deque

    opts = dict(case["opts"])
    reserve = opts.pop("reserve_full_isl")
    sched = Scheduler(EngineConfig.from_flat(opts | {"scheduler_reserve_full_isl": reserve} | _offload_options(case)),
                      opts["num_gpu_blocks"], kv_connector=True, num_offload_chunks=case["num_offload_chunks"])
    pending = sorted(case["requests"], key=lambda r: (r["arrival_step"], r["row"]))
    rows, queue, requests, transfers = [], deque(), [], []
    due: dict[int, list] = {}
    unreported = False
    depth = sched.config.max_concurrent_batches
    num_batches = 0
    error = None
    aborts = _aborts_by_step(case)

    latency = _pd_latencies(case)
    due_send: dict[int, list] = {}

    def has_requests() -> bool:
        offload = sched.offload  # (None: P/D without a tier, scripts/oracle_offload.py --pd --no-tier)
        return (sched.has_unfinished_requests() or unreported or bool(sched.kv_held)
                or (offload is not None and (offload.has_pending_jobs() or offload.has_finished_requests)))

    while True:
        if len(rows) >= max_steps or num_batches >= 4 * max_steps:
            error = "max steps"
            break
        _deliver(pending, len(rows), sched, requests, roles=bool(latency))
        _abort(sched, requests, aborts, len(rows), "before")
        if has_requests():
            unreported = False
            out = sched.schedule()
            b = num_batches
            num_batches += 1
            _due_transfers(out, b, case, due, transfers, len(rows), latency)
            ran = not out.is_empty
            if ran:
                rows.append([out.total_num_scheduled_tokens, out.num_running, out.num_waiting, out.num_blocks_used])
            queue.appendleft((b, out if ran else None))
            if len(queue) < depth and (ran or has_requests()):
                continue
        elif not queue:
            if not pending:
                break
            rows.append([0, 0, 0, 0])  # idle
            sched.current_step += 1
            continue
        b, out = queue.pop()
        if out is not None:
            _abort(sched, requests, aborts, out.step, "output")
        if out is not None:
            finished = sched.update_from_output(out)
            unreported |= bool(finished)
            _sends_due(finished, b, latency, due_send)
        _transfers_done(sched, due.pop(b, ()), due_send.pop(b, ()))
    result = {"steps": rows, "requests": {str(r["row"]): [-1, -1] for r in case["requests"]}, "scheduler": sched,
              "transfers": transfers}
    result["requests"] |= _request_steps(requests, aborts)
    result["aborted"] = len(aborts["first"])
    if error:
        result["error"] = error
    return result


ONE_SECOND_STEPS = {"step_base_s": 1.0, "step_per_token_s": 0.0}


def replay_recorded(case: dict, trace: dict | None = None, opts: dict | None = None):
    """A case recorded by scripts/oracle_fuzz.py --record (its trace, or `trace`, with its options
    and `opts` over them), replayed as the oracle stepped it: one second a step."""
    import pandas as pd

    from simkv.replay.api import replay
    from simkv.traces.schema import trace_from_frame

    config = EngineConfig.from_flat(case["opts"] | {"async_scheduling": case["async_scheduling"]} | (opts or {}))
    return replay(trace_from_frame(pd.DataFrame(trace or case["trace"])), config, "linear", ONE_SECOND_STEPS)


def observed_as_recorded(res) -> dict:
    """A replay's values in a recorded case's form: steps (scheduled tokens, running, waiting,
    blocks used), prefix hits and each request's first-token and finish times."""
    st = res.steps
    steps = [list(t) for t in zip((st["num_prefill_tokens"] + st["num_decode_tokens"]).tolist(),
                                  st["num_running"].tolist(), st["num_waiting"].tolist(),
                                  st["num_blocks_used"].tolist())]
    times = [[a, b] for a, b in zip(res.requests["first_token_time_s"].tolist(),
                                    res.requests["finish_time_s"].tolist())]
    return dict(num_steps=res.summary["num_steps"], prefix_hits=res.summary["prefix_cache_hits_tokens"],
                steps=steps, times=times)


def assert_as_recorded(ours: dict, theirs: dict) -> None:
    """Every step, the prefix hits, and every request's times (where vLLM finished it) equal."""
    import pytest

    assert ours["num_steps"] == theirs["num_steps"]
    assert ours["prefix_hits"] == theirs["prefix_hits"]
    assert ours["steps"] == theirs["steps"]
    for row, (mine, vllm) in enumerate(zip(ours["times"], theirs["times"])):
        if vllm is not None:
            assert mine == pytest.approx(vllm, abs=1e-6), f"request {row}"


def drive_lora_worker(case: dict, worker=None) -> list[dict]:
    """A recorded case of scripts/oracle_lora_worker.py through simkv's adapter caches (`worker`,
    or an AdapterResidency of the case's sizes): per step, the disk reads and slot copies and both
    caches' order after it."""
    from simkv.backends.lora_adapters import AdapterResidency

    if worker is None:
        worker = AdapterResidency(case["max_loras"], case["max_cpu_loras"], 1.0, 0.0)
    steps = []
    for adapters in case["steps"]:
        reads, copies = worker.num_disk_loads, worker.num_slot_loads
        worker.activate(adapters)
        steps.append({"reads": worker.num_disk_loads - reads, "copies": worker.num_slot_loads - copies,
                      "cpu": list(worker.cpu), "gpu": list(worker.gpu)})
    return steps


def offload_driver(case: dict):
    """How scripts/oracle_offload.py steps a case: a batch queue under async scheduling or
    pipeline stages (drive_offload_async), else one step at a time (drive_offload)."""
    opts = case["opts"]
    return drive_offload_async if opts.get("async_scheduling") or opts.get("pipeline_parallel_size", 1) > 1 \
        else drive_offload


def offload_as_recorded(recorded: dict) -> dict | None:
    """A recorded case of scripts/oracle_offload.py replayed: simkv's result if every step, every
    request's first-token and finish step, and every transfer equal vLLM's, else None."""
    theirs, case = recorded["vllm"], recorded["case"]
    ours = offload_driver(case)(case)
    steps = list(theirs["steps"])
    while steps and not any(steps[-1]):
        steps.pop()
    same = (ours["steps"], ours["requests"], ours["transfers"], ours.get("error")) == (
        steps, theirs["requests"], theirs["transfers"], theirs.get("error"))
    return ours if same else None


def assert_offload_as_recorded(recorded: dict) -> None:
    """A recorded case of scripts/oracle_offload.py (or oracle_cadence.py --offload): every step,
    every request's first-token and finish step, and every transfer equal vLLM's."""
    theirs = recorded["vllm"]
    ours = offload_driver(recorded["case"])(recorded["case"])
    ours.pop("scheduler")
    assert ours.get("error") == theirs.get("error")
    steps = list(theirs["steps"])
    while steps and not any(steps[-1]):
        steps.pop()
    assert ours["steps"] == steps
    assert ours["requests"] == theirs["requests"]
    assert ours["transfers"] == theirs["transfers"]
