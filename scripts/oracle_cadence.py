"""vLLM 0.33's admission limit and prefill cadence, step by step against the real scheduler.

`max_num_active_seqs` caps the requests admitted into RUNNING below `max_num_seqs`;
`prefill_schedule_interval` N holds prefill back (new admissions with prompt to compute and the
running prompts' next chunks) until N executed steps have passed since the last step that
carried prefill, unless the last release step left requests waiting. vLLM's `Scheduler` (the
oracle venv, ../shared/tools/vllm_oracle) and simkv's run oracle_spec.py's random step-mode cases
(small pools, shared prompts, priorities, watermarks, chunked prefill on and off) with a random
admission limit (or none) and interval 1 to 8, speculative decoding in half of them; with
--async-scheduling, oracle_spec_async.py's (vLLM's AsyncScheduler two batches deep); with --hybrid
or --linear, oracle_hybrid.py's or oracle_linear.py's models (sliding-window or Mamba groups);
with --pd or --offload, oracle_pd.py's or oracle_offload.py's cases (a KV connector's pulls and
sends, or a CPU tier).
Every step's
scheduled tokens, running and waiting requests and blocks in use, every request's first-token
and finish step, the accepted drafts and the prefix-cache counts must be equal.

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_cadence.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 100
    .venv/bin/python scripts/oracle_cadence.py --async-scheduling --cases 100
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import oracle_spec  # noqa: E402  (its cases, vLLM side, simkv side and comparison)
import oracle_spec_async  # noqa: E402  (the same under async scheduling)
import oracle_vllm  # noqa: E402

_SPEC_KEYS = ("speculative_method", "num_speculative_tokens", "spec_acceptance_rate", "spec_seed",
              "spec_draft_model", "spec_tokens_per_batch_size")


def make_case(rng, aborts: bool = False, async_scheduling: bool = False, hybrid: bool = False,
              linear: bool = False) -> dict:
    if async_scheduling:  # (oracle_spec_async.py's: EAGLE or a draft model, vLLM's AsyncScheduler)
        case = oracle_spec_async.make_case(rng, hybrid=hybrid, linear=linear, aborts=aborts)
    elif hybrid:  # (oracle_hybrid.py's: KV-cache groups of a model with sliding-window layers)
        from oracle_hybrid import make_case as hybrid_case

        case = hybrid_case(rng, bool(rng.random() < 0.5))
    elif linear:  # (oracle_linear.py's: Mamba groups beside full attention)
        from oracle_linear import make_case as linear_case

        case = linear_case(rng, bool(rng.random() < 0.5))
    else:
        case = oracle_spec.make_case(rng, aborts)
    opts = case["opts"]
    if rng.random() < 0.5 and not (hybrid or linear):
        for key in _SPEC_KEYS:
            opts.pop(key, None)
    _add_settings(rng, opts)
    return case


def _add_settings(rng, opts: dict) -> None:
    """A random admission limit (in 60 % of the cases) and interval."""
    if rng.random() < 0.6:
        opts["max_num_active_seqs"] = int(rng.integers(1, opts["max_num_seqs"] + 1))
    opts["prefill_schedule_interval"] = int(rng.choice([1, 2, 2, 3, 4, 8]))


def run_vllm(case: dict) -> dict:
    """vLLM's side: its AsyncScheduler two batches deep (oracle_spec_async.py) or its Scheduler;
    P/D cases with oracle_pd.py's KV connector."""
    if case.get("pd"):
        import oracle_pd

        return oracle_pd.run_vllm_any(case)
    if case.get("offload"):
        import oracle_offload

        return oracle_offload.run_vllm_any(case)
    if case["opts"].get("async_scheduling"):
        return oracle_spec_async.run_vllm(case)
    return oracle_spec.run_vllm(case)


def pd_cases(rng, count: int, async_scheduling: bool) -> list[dict]:
    """oracle_pd.py's cases (pulls and sends through vLLM's KV connector) with the settings."""
    import oracle_pd

    cases = []
    for _ in range(count):
        case = oracle_pd.make_case(rng, bool(rng.random() < 0.5), async_scheduling=async_scheduling)
        case["pd"] = True
        _add_settings(rng, case["opts"])
        cases.append(case)
    return cases


def offload_cases(rng, count: int, async_scheduling: bool) -> list[dict]:
    """oracle_offload.py's cases (a CPU tier through vLLM's OffloadingConnector: loads wait set
    aside, lookups to retry are skipped) with the settings."""
    import oracle_offload

    cases = []
    for _ in range(count):
        case = oracle_offload.make_case(rng, async_scheduling, bool(rng.random() < 0.5), bool(rng.random() < 0.4))
        case["offload"] = True
        _add_settings(rng, case["opts"])
        cases.append(case)
    return cases


def compare_pd(cases: list[dict], theirs: list[dict]) -> None:
    import oracle_offload
    import oracle_pd

    failures = 0
    for i, (case, t) in enumerate(zip(cases, theirs)):
        module = oracle_offload if case.get("offload") else oracle_pd
        diff = module.differences(t, module.run_simkv(case))
        if diff:
            failures += 1
            print(f"case {i} {case['opts']}: " + "; ".join(diff))
    print(f"{len(cases) - failures} of {len(cases)} {'offloading' if cases and cases[0].get('offload') else 'P/D'} "
          f"cases equal "
          f"({sum(len(c['requests']) for c in cases)} requests, {sum(len(t['steps']) for t in theirs)} steps)")
    sys.exit(1 if failures else 0)


def main() -> None:
    a = oracle_vllm.oracle_args(__doc__.split("\n\n")[0], aborts_flag=True, parallel_flag=True, async_flag=True,
                                hybrid_flag=True, linear_flag=True, pd_flag=True)
    if oracle_vllm.serve_vllm_side(a, run_vllm):
        return
    import numpy as np
    rng = np.random.default_rng(a.seed)
    if a.pd or a.offload:
        cases = (pd_cases if a.pd else offload_cases)(rng, a.cases, a.async_scheduling)
        compare_pd(cases, oracle_vllm.vllm_results(__file__, cases, a))
        return
    cases = [make_case(rng, a.aborts, a.async_scheduling, a.hybrid, a.linear) for _ in range(a.cases)]
    oracle_vllm.parallel_cases(a, rng, cases)
    compare = oracle_spec_async.compare_cases if a.async_scheduling else oracle_spec.compare_cases
    compare(cases, oracle_vllm.vllm_results(__file__, cases, a))


if __name__ == "__main__":
    main()
