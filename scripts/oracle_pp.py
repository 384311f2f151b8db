"""Pipeline parallelism, step by step against the real vLLM scheduler and its batch queue.

With `pipeline_parallel_size` P vLLM 0.33's engine core keeps P batches in flight
(EngineCore.step_with_batch_queue), P + 1 under async scheduling (its V2 model runner): it
schedules a new batch whenever the queue has room, and processes the oldest batch's output when
the queue is full or nothing more can be scheduled. A schedule() call that runs nothing takes its
place in the queue all the same. Without async scheduling a request whose step is in flight has
nothing to schedule (its sampled token has not come back) while a long prompt's next chunk may go
into the next batch; with it, a request that sampled waits P schedule() calls (vLLM's decode
stagger). vLLM's `Scheduler` (`AsyncScheduler` with --async-scheduling; the oracle venv,
../shared/tools/vllm_oracle) and simkv's run oracle_spec.py's random step-mode cases without
speculation (small pools that preempt, shared prompts, priorities, watermarks, chunked prefill
on and off) at P from 2 to 4, both driven by the same batch-queue loop; with --speculative,
oracle_spec_async.py's cases (EAGLE or a draft model, async scheduling); with --hybrid or
--chunked, oracle_hybrid.py's KV-cache groups of sliding-window models or chunked local
attention; with --linear or --align, oracle_linear.py's Mamba groups (without and with prefix
caching; with --speculative, MTP under async scheduling). Every step's scheduled tokens, running and waiting requests and blocks in use,
every request's first-token and finish step, the prefix-cache counts and the drafts accepted
must be equal.

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_pp.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 100
    .venv/bin/python scripts/oracle_pp.py --async-scheduling --cases 100
    .venv/bin/python scripts/oracle_pp.py --aborts --cases 100   # with a front end's aborts
    .venv/bin/python scripts/oracle_pp.py --speculative --cases 100
    .venv/bin/python scripts/oracle_pp.py --speculative --ngram-misses   # ngram (vLLM's V2 runner), matches drawn
    .venv/bin/python scripts/oracle_pp.py --hybrid [--async-scheduling] --cases 100   # or --chunked
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
import oracle_spec  # noqa: E402  (its cases and comparison)
import oracle_spec_async  # noqa: E402  (its cases with drafts, and the simkv side's totals)
import oracle_vllm  # noqa: E402

_SPEC_KEYS = ("speculative_method", "num_speculative_tokens", "spec_acceptance_rate", "spec_seed",
              "spec_draft_model", "spec_tokens_per_batch_size", "spec_ngram_match_rate")


def make_case(rng, aborts: bool = False, async_scheduling: bool = False, speculative: bool = False,
              hybrid: bool = False, chunked: bool = False, linear: bool = False, align: bool = False) -> dict:
    """oracle_spec.py's case without drafts at P 2 to 4; `speculative` (async scheduling):
    oracle_spec_async.py's, EAGLE or a draft model in every case; `hybrid` (`chunked`):
    oracle_hybrid.py's KV-cache groups of a model with sliding-window layers (chunked local
    attention), EAGLE in some cases under async scheduling."""
    if linear or align:  # (oracle_linear.py's Mamba groups; with drafts oracle_spec_async.py's: MTP, async)
        from oracle_linear import make_case as linear_case

        case = (oracle_spec_async.make_case(rng, linear=linear, align=align) if speculative
                else linear_case(rng, False, align))
        case["opts"]["pipeline_parallel_size"] = 2  # (the tiny Gated DeltaNet models have 2 to 4 layers)
        case["opts"]["async_scheduling"] = async_scheduling or speculative
        if aborts:
            case["aborts"] = oracle_vllm.random_aborts(rng, case["requests"])
        return case
    if hybrid:
        from oracle_hybrid import make_case as hybrid_case

        pp = int(rng.choice([2, 2, 3, 4]))
        case = hybrid_case(rng, async_scheduling, methods=("eagle",), async_scheduling=async_scheduling,
                           chunked=chunked, pipeline_parallel_size=pp)
        if aborts:
            case["aborts"] = oracle_vllm.random_aborts(rng, case["requests"])
        return case
    if speculative:
        case = oracle_spec_async.make_case(rng, aborts=aborts)
    else:
        case = oracle_spec.make_case(rng, aborts)
        for key in _SPEC_KEYS:
            case["opts"].pop(key, None)
    opts = case["opts"]
    opts["pipeline_parallel_size"] = int(rng.choice([2, 2, 3, 4]))
    opts["async_scheduling"] = async_scheduling or speculative
    return case


def batch_queue_loop(requests, depth: int, deliver, schedule, process, has, max_steps: int = 5000) -> dict:
    """vLLM's step_with_batch_queue, as tests/core/helpers.py's drive_steps_pipeline runs simkv:
    `deliver(arrived, step)` adds the requests arrived by then (by the steps so far) and takes
    the aborts due before the step; `schedule(step)` returns the step's row, or None when the
    call ran nothing (an empty batch: it takes a place in the queue, and is no step);
    `process(step)` handles a step's output; `has()` says whether requests are unfinished. Idle
    steps (nothing to run, nothing in flight) are rows of zeros."""
    pending = sorted(requests, key=lambda r: (r["arrival_step"], r["row"]))
    rows = []
    queue: deque = deque()
    idle_calls = 0
    while len(rows) < max_steps:
        arrived = []
        while pending and pending[0]["arrival_step"] <= len(rows):
            arrived.append(pending.pop(0))
        deliver(arrived, len(rows))
        if has():
            row = schedule(len(rows))
            if row is not None:
                rows.append(row)
            queue.appendleft(len(rows) - 1 if row is not None else None)
            if len(queue) < depth and (row is not None or has()):
                continue
        elif not queue:
            if not pending:
                return {"steps": rows}
            rows.append([0, 0, 0, 0])  # idle
            continue
        step = queue.pop()
        if step is not None:
            process(step)
            idle_calls = 0
        elif not any(s is not None for s in queue):
            idle_calls += 1
            if idle_calls > 2 * depth:
                return {"steps": rows, "error": "stuck"}
    return {"steps": rows, "error": "max steps"}


# ---- vLLM side (runs in the oracle's venv) --------------------------------------------------------
def run_vllm(case: dict) -> dict:
    o = case["opts"] | {"group_windows": case.get("group_windows"),  # (--hybrid and --linear cases have groups)
                        "group_chunked": case.get("group_chunked", False),
                        "group_linear": case.get("group_linear"),
                        "mamba_cache_mode": case.get("mamba_cache_mode"),
                        "mamba_prefill_checkpoints": case.get("mamba_prefill_checkpoints")}
    async_scheduling = bool(o.get("async_scheduling"))
    sched, vllm_config = oracle_vllm.build_scheduler(o, o.get("scheduler_reserve_full_isl", True),
                                                     async_scheduling=async_scheduling)
    accept = oracle_vllm.acceptance(o)
    accepted_total = [0]
    pp = o["pipeline_parallel_size"]
    if async_scheduling:
        assert sched.pp_size == pp and sched.decode_stagger == pp and sched.use_v2_model_runner
    assert vllm_config.max_concurrent_batches == pp + async_scheduling
    hasher = oracle_vllm.block_hasher(vllm_config, o["block_size"])
    pool = sched.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1
    first_token, finish = {}, {}
    prefix = [0, 0]  # tokens queried, hit
    outputs = {}  # step -> (scheduler output, its requests' (samples, padded))
    ids_of = oracle_vllm.sample_ids(case["requests"])
    aborts = case.get("aborts", [])
    detail = {} if case.get("detail") else None

    def deliver(arrived, step):
        for r in arrived:
            for rid in ids_of[r["row"]]:
                sched.add_request(oracle_vllm.vllm_request(r, rid, hasher))
        oracle_vllm.take_aborts(sched, aborts, step, "before")

    def schedule(step):
        row = oracle_vllm.schedule_async_step(sched, step, outputs, usable)
        if row is not None and detail is not None:  # (debugging: each step's scheduled tokens by request)
            detail[step] = dict(outputs[step][0].num_scheduled_tokens) | {"call": sched.current_step}
        return row

    def process(step):
        so, meta = outputs.pop(step)
        accepted_total[0] += oracle_vllm.process_async_output(sched, so, meta, accept, step, aborts, prefix,
                                                              first_token, finish)

    depth = pp + async_scheduling
    result = batch_queue_loop(case["requests"], depth, deliver, schedule, process, sched.has_unfinished_requests)
    result["requests"] = oracle_vllm.row_steps(case["requests"], ids_of, first_token, finish)
    result["accepted"] = accepted_total[0]
    result["prefix"] = prefix
    if detail is not None:
        result["detail"] = {str(k): v for k, v in detail.items()}
    return result


# ---- simkv side -----------------------------------------------------------------------------------
def run_simkv(case: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.core.helpers import drive_steps_pipeline

    return oracle_spec_async.with_totals(drive_steps_pipeline(case))


def main() -> None:
    a = oracle_vllm.oracle_args(__doc__.split("\n\n")[0], aborts_flag=True, async_flag=True, speculative_flag=True,
                                hybrid_flag=True, chunked_flag=True, linear_flag=True, align_flag=True,
                                mtp_modules_flag=True, ngram_misses_flag=True)
    if oracle_vllm.serve_vllm_side(a, run_vllm):
        return
    import numpy as np
    rng = np.random.default_rng(a.seed)
    cases = [make_case(rng, a.aborts, a.async_scheduling, a.speculative, a.hybrid or a.chunked, a.chunked, a.linear,
                       a.align) for _ in range(a.cases)]
    if a.suffix or a.model_runner == "v1":
        raise SystemExit("pipeline stages run drafts under async scheduling only, which vLLM's V1 runner refuses "
                         "with a host proposer (suffix decoding, ngram) and with pipeline stages")
    if a.ngram_misses:  # (drawn after the cases: without the flag a seed gives the same cases)
        for case in cases:
            if case["opts"].get("speculative_method"):
                oracle_vllm.ngram_miss_drafter(rng, case["opts"])
    oracle_vllm.option_cases(a, cases)
    oracle_spec_async.compare_cases(cases, oracle_vllm.vllm_results(__file__, cases, a), run_simkv)


if __name__ == "__main__":
    main()
