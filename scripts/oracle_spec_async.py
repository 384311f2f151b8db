"""Speculative decoding under async scheduling, step by step against the real vLLM scheduler.

vLLM 0.33's `AsyncScheduler` with a speculative config (eagle or draft_model; ngram with
--ngram-misses or --method ngram, which vLLM's V2 model runner drafts on the device) is driven
as `EngineCore.step_with_batch_queue` drives it, two batches deep: step K+1 is scheduled before
step K's output is processed. Drafts stay on the device, so the scheduler sees placeholders: it
schedules 1 + K tokens for a decoding request whose previous step is still running, and takes
rejected drafts back from `num_computed_tokens` and `num_output_placeholders` when that step's
output arrives. The model runner's part is
played by hand: a step's output gives each request that sampled 1 + accepted tokens, with the
acceptances drawn by simkv's own `AcceptanceModel` at the output's position (both schedulers
see the same draws; padding rows of a request admitted from the queue are never accepted).
simkv's `Scheduler` with `async_scheduling` runs the same random cases (oracle_spec.py's:
small pools that preempt, shared prompt content, priorities, watermarks, chunked prefill on
and off, budgets that cut drafts, dynamic speculation lengths; with --hybrid, oracle_hybrid.py's
KV-cache groups of sliding-window models, EAGLE in every case; with --linear, oracle_linear.py's
Mamba groups beside full attention, MTP in every case; with --align, oracle_linear.py's align
cases: Mamba prefix caching, no drafts; with --align --linear, those with MTP in every case). Every step's scheduled tokens,
running and waiting requests and blocks in use, every request's first-token and finish step,
the accepted drafts and the prefix-cache counts must be equal.

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_spec_async.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 50
    .venv/bin/python scripts/oracle_spec_async.py --hybrid --cases 150 --seed 1
    .venv/bin/python scripts/oracle_spec_async.py --aborts --cases 50 --seed 3   # with a front end's aborts
    .venv/bin/python scripts/oracle_spec_async.py --parallel-drafting   # vLLM's parallel_drafting (EAGLE, draft model)
    .venv/bin/python scripts/oracle_spec_async.py --dflash   # a DFlash drafter in every case
    .venv/bin/python scripts/oracle_spec_async.py --ngram-misses   # ngram on vLLM's V2 runner: K drafts, a miss's rejected
    .venv/bin/python scripts/oracle_spec_async.py --images [--disable-chunked-mm-input] [--method eagle] [--mtp-modules 3]
        # image items in the prompts, vLLM's encoder budget and cache (oracle_spec.py --images)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
import oracle_vllm  # noqa: E402  (the vLLM side the step-mode oracles share)
from oracle_spec import case_differences, image_cases, method_cases  # noqa: E402


def make_case(rng, hybrid: bool = False, linear: bool = False, align: bool = False, aborts: bool = False) -> dict:
    """`make_async_case` with, if `aborts`, oracle_vllm.random_aborts' aborts."""
    case = make_async_case(rng, hybrid, linear, align)
    if aborts:
        case["aborts"] = oracle_vllm.random_aborts(rng, case["requests"])
    return case


def make_async_case(rng, hybrid: bool = False, linear: bool = False, align: bool = False) -> dict:
    """oracle_spec.py's case with EAGLE in place of ngram (ngram under async: --ngram-misses);
    `hybrid`: oracle_hybrid.py's (KV-cache groups of a model with sliding-window layers, the
    EAGLE layer among them), always speculating with EAGLE; `linear`: oracle_linear.py's (Mamba
    groups beside full attention), always with MTP; `align`: oracle_linear.py's with prefix caching
    (mamba_cache_mode "align"), no speculation (with `linear` too: MTP in every case)."""
    if align:  # (with `linear` too: MTP in every case)
        from oracle_linear import make_case as linear_case

        while True:
            case = linear_case(rng, linear, True)
            if not linear or case["opts"].get("speculative_method") == "mtp":
                case["opts"]["async_scheduling"] = True
                return case
    if linear:
        from oracle_linear import make_case as linear_case

        while True:
            case = linear_case(rng, True)
            if case["opts"].get("speculative_method") == "mtp":
                case["opts"]["async_scheduling"] = True
                return case
    if hybrid:
        from oracle_hybrid import make_case as hybrid_case

        while True:
            case = hybrid_case(rng, True, methods=("eagle",), async_scheduling=True)
            if case["opts"].get("speculative_method"):
                return case
    from oracle_spec import make_case as spec_case

    case = spec_case(rng)
    opts = case["opts"]
    if opts["speculative_method"] == "ngram":
        opts["speculative_method"] = "eagle"
    opts["async_scheduling"] = True
    return case


def async_step_loop(requests, schedule, process, max_steps: int = 5000) -> dict:
    """The batch queue's order, shared by both sides: arrivals by step (the steps scheduled so
    far); `schedule()` returns the step's row, or None when it scheduled nothing (not a step:
    the engine waits for the one in flight); `process(step)` handles a step's output; `has()`
    says whether requests are unfinished. Idle steps (nothing to run, nothing in flight) are
    rows of zeros."""
    pending = sorted(requests, key=lambda r: (r["arrival_step"], r["row"]))
    rows = []
    in_flight = None
    while len(rows) < max_steps:
        arrived = []
        while pending and pending[0]["arrival_step"] <= len(rows):
            arrived.append(pending.pop(0))
        row = schedule(arrived, len(rows))
        if row is None:
            if in_flight is None:
                if not pending and not schedule.has():
                    return {"steps": rows}
                if schedule.has():
                    return {"steps": rows, "error": "stuck"}
                rows.append([0, 0, 0, 0])  # idle
                schedule.idle()
                continue
            process(in_flight)
            in_flight = None
            continue
        rows.append(row)
        step = len(rows) - 1
        if in_flight is not None:
            process(in_flight)
        in_flight = step
    return {"steps": rows, "error": "max steps"}


# ---- vLLM side (runs in the oracle's venv) --------------------------------------------------------
def run_vllm(case: dict) -> dict:
    o = case["opts"] | {"group_windows": case.get("group_windows"),  # (--hybrid and --linear cases have groups)
                        "group_linear": case.get("group_linear"),
                        "mamba_cache_mode": case.get("mamba_cache_mode"),
                        "mamba_prefill_checkpoints": case.get("mamba_prefill_checkpoints")}
    sched, vllm_config = oracle_vllm.build_scheduler(o, o.get("scheduler_reserve_full_isl", True),
                                                     async_scheduling=True)
    oracle_vllm.mm_budget(sched, vllm_config, case.get("mm"))  # (--images)
    hasher = oracle_vllm.block_hasher(vllm_config, o["block_size"])
    pool = sched.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1
    accept = oracle_vllm.acceptance(o)
    first_token, finish = {}, {}
    accepted_total = [0]
    prefix = [0, 0]  # tokens queried, hit
    outputs = {}  # step -> (scheduler output, {request id: (samples, padded)})

    ids_of = oracle_vllm.sample_ids(case["requests"])  # (--parallel: a row's n requests)

    aborts = case.get("aborts", [])

    def schedule(arrived, step):
        for r in arrived:
            for rid in ids_of[r["row"]]:
                sched.add_request(oracle_vllm.vllm_request(r, rid, hasher))
        oracle_vllm.take_aborts(sched, aborts, step, "before")
        if not sched.has_requests():
            return None
        return oracle_vllm.schedule_async_step(sched, step, outputs, usable)

    schedule.has = sched.has_requests
    schedule.idle = lambda: None

    def process(step):
        so, meta = outputs.pop(step)
        accepted_total[0] += oracle_vllm.process_async_output(sched, so, meta, accept, step, aborts, prefix,
                                                              first_token, finish)

    result = async_step_loop(case["requests"], schedule, process)
    result["requests"] = oracle_vllm.row_steps(case["requests"], ids_of, first_token, finish)
    result["accepted"] = accepted_total[0]
    result["prefix"] = prefix
    return result


# ---- simkv side -----------------------------------------------------------------------------------
def run_simkv(case: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.core.helpers import drive_steps_async

    return with_totals(drive_steps_async(case))  # (--images: the rows' "mm" items, tests/core/helpers.py)


def with_totals(result: dict) -> dict:
    """A step-mode drive's result with its scheduler's totals in place of the scheduler: drafts
    accepted, preemptions, prefix-cache counts (queried, hit)."""
    sched = result.pop("scheduler")
    result["accepted"] = sched.spec_stats["num_accepted_tokens"]
    result["preemptions"] = sched.num_preemptions
    stats = sched.kv_cache_manager.prefix_cache_stats
    result["prefix"] = [stats.queries, stats.hits]
    return result


def main() -> None:
    a = oracle_vllm.oracle_args(__doc__.split("\n\n")[0], hybrid_flag=True, linear_flag=True,
                                  align_flag=True, aborts_flag=True, parallel_flag=True, parallel_drafting_flag=True, dflash_flag=True,
                                  mtp_modules_flag=True, images_flag=True, ngram_misses_flag=True)
    if oracle_vllm.serve_vllm_side(a, run_vllm):
        return
    import numpy as np
    rng = np.random.default_rng(a.seed)
    cases = [make_case(rng, a.hybrid, a.linear, a.align, a.aborts) for _ in range(a.cases)]
    if a.suffix or a.model_runner == "v1":
        raise SystemExit("vLLM refuses async scheduling with a host proposer (suffix decoding, ngram on its V1 runner)")
    if a.ngram_misses:  # (drawn after the cases: without the flag a seed gives the same cases)
        for case in cases:
            if case["opts"].get("speculative_method"):
                oracle_vllm.ngram_miss_drafter(rng, case["opts"])
    method_cases(a, cases)  # (--method; before the drafter flags, which may replace it)
    oracle_vllm.option_cases(a, cases)
    oracle_vllm.parallel_cases(a, rng, cases)
    image_cases(a, cases)  # (--images: after the options, whose token budget sizes the items)
    compare_cases(cases, oracle_vllm.vllm_results(__file__, cases, a))


def compare_cases(cases: list[dict], theirs: list[dict], run=None) -> None:
    """Each case's differences (`run`: simkv's side, this script's by default; a run that ends in
    another error than vLLM's differs, but for a livelock simkv stops where vLLM's run goes on to
    its max steps), then the totals; exits 1 if any case differs."""
    failures = 0
    totals = dict(requests=0, steps=0, accepted=0, preemptions=0, hits=0, aborted=0, livelocks=0, stuck=0)
    for i, (case, t) in enumerate(zip(cases, theirs)):
        ours = (run or run_simkv)(case)
        totals["requests"] += len(case["requests"])
        totals["steps"] += len(t["steps"])
        totals["accepted"] += t["accepted"]
        totals["preemptions"] += ours["preemptions"]
        totals["hits"] += t["prefix"][1]
        totals["aborted"] += ours["aborted"]
        totals["livelocks"] += ours.get("error") == "livelock"
        totals["stuck"] += ours.get("error") == "stuck"
        diff = case_differences(t, ours)
        livelocked = ours.get("error") == "livelock" and t.get("error") == "max steps"
        if ours.get("error") != t.get("error") and not livelocked:
            diff.append(f"error: vLLM {t.get('error')}, simkv {ours.get('error')}")
        if diff:
            failures += 1
            print(f"case {i} {case['opts']}: " + "; ".join(diff))
    print(f"{len(cases) - failures} of {len(cases)} cases equal "
          f"({totals['requests']} requests, {totals['steps']} steps, {totals['accepted']} drafts accepted, "
          f"{totals['preemptions']} preemptions, {totals['hits']} prefix-hit tokens"
          + (f", {totals['aborted']} requests aborted" if totals["aborted"] else "")
          + (f"; {totals['livelocks']} livelocked in both, equal until simkv stopped" if totals["livelocks"] else "")
          + (f"; {totals['stuck']} stuck in both (a prompt that never fits a step), equal until then"
             if totals["stuck"] else "")
          + ")")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
