"""Async scheduling (vLLM's --async-scheduling): step K+1 is scheduled before step K's output
is processed. The totals below are real vLLM 0.33's AsyncScheduler (the oracle of
../shared/tools/vllm_oracle, run as `scripts/oracle_compare.py --async-scheduling` does), and
simkv matched them step for step and request for request (docs/vllm_comparison_async.md)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.config import ConfigError, EngineConfig
from simkv.core.request import RequestStatus
from simkv.core.scheduler import LivelockError, Scheduler
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame
from tests.core.helpers import drive, drive_async, make_config, make_request
from tests.core.test_properties import _check, scenarios
from tests.core.test_vllm_reference import req400

_KEYS = ("steps", "peak_running", "preemptions", "preempted_requests", "hits", "queries", "prefill_tokens",
         "decode_tokens")


@pytest.mark.parametrize("prefix_groups, options, expected, first_request", [
    (0, {}, (1118, 183, 27, 23, 4496, 215868, 211372, 71525), (0, 72)),
    (10, {}, (1175, 159, 43, 36, 438432, 667324, 228892, 71509), (0, 72)),
    (0, dict(max_num_batched_tokens=1024, long_prefill_token_threshold=256),
     (1174, 175, 30, 30, 2272, 218144, 211196, 71542), (1, 73)),
    (0, dict(enable_chunked_prefill=False), (1119, 183, 28, 25, 5136, 217243, 212107, 71524), (0, 72)),
])
def test_req400_matches_vllm_async(prefix_groups, options, expected, first_request):
    sched = Scheduler(make_config(async_scheduling=True, **options), 6250)
    reqs = req400(prefix_groups)
    for r in reqs:
        sched.add_request(r)
    out = drive_async(sched)
    assert tuple(out[k] for k in _KEYS) == expected
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    # vLLM: the steps in which request 0 (475 + 73 tokens) sampled its first and its last token
    assert (reqs[0].first_token_step, reqs[0].finish_step) == first_request


def _tiny(**kw):
    return make_config(num_gpu_blocks=kw.pop("num_gpu_blocks", 64), block_size=4, max_num_seqs=kw.pop("max_num_seqs", 4),
                       max_num_batched_tokens=64, max_model_len=kw.pop("max_model_len", 64), **kw)


def _tiny_run(async_scheduling: bool, **kw):
    """A (4 + 3 tokens) and C (4 + 12) run; B (8 + 1) arrives after step 0 and waits for what A
    holds. Block size 4. Returns (A, B, C, scheduler)."""
    num_gpu_blocks = kw.pop("num_gpu_blocks", 64)
    sched = Scheduler(_tiny(async_scheduling=async_scheduling, num_gpu_blocks=num_gpu_blocks, **kw), num_gpu_blocks)
    a, b, c = make_request(0, 4, 3), make_request(1, 8, 1), make_request(2, 4, 12)
    sched.add_request(a)
    sched.add_request(c)
    if async_scheduling:
        out = drive_async(sched, arrivals=[(1, b)])
    else:
        sched.update_from_output(sched.schedule())
        sched.add_request(b)
        out = drive(sched, use_runs=False)
    assert out["steps"] == 12 - (not async_scheduling)  # (drive does not count the step made above)
    assert all(r.status == RequestStatus.FINISHED for r in (a, b, c))
    assert (a.finish_step, c.finish_step, b.num_output_tokens) == (2, 11, 1)
    return a, b, c, sched


# Both scenarios below were run through real vLLM 0.33 (the oracle, step mode, B arriving at
# step 1): the same admission steps and preemptions.

def test_a_finished_request_holds_its_seat_one_step_longer():
    # max_num_seqs 2: B takes A's seat once A has finished. A samples its last token in step 2;
    # synchronously B starts in step 3; asynchronously step 3 is scheduled (C decodes in it)
    # before step 2's output is processed, so B starts in step 4.
    assert _tiny_run(False, max_num_seqs=2)[1].first_scheduled_step == 3
    assert _tiny_run(True, max_num_seqs=2)[1].first_scheduled_step == 4


def test_a_finished_request_frees_its_blocks_one_step_later():
    # 4 usable blocks (+ the null block): from step 1 A and C hold 2 each; B needs 2.
    _, b, _, sched = _tiny_run(False, num_gpu_blocks=5)
    assert (b.first_scheduled_step, b.finish_step, sched.num_preemptions) == (3, 3, 0)
    # Asynchronously B starts in step 4 and samples its only token there. Step 5 is scheduled
    # before that output is processed: C needs a third block, and the newest running request,
    # B, is preempted for it although its last token is in flight. It finishes all the same.
    _, b, _, sched = _tiny_run(True, num_gpu_blocks=5)
    assert (b.first_scheduled_step, b.finish_step, b.num_preemptions, sched.num_preemptions) == (4, 4, 1, 1)


def test_a_request_preempts_itself_while_a_finishing_one_holds_the_blocks():
    # Real vLLM 0.33 (oracle, step mode) on this case: 10 steps both ways; asynchronously A is
    # preempted once, in a schedule that then runs nothing, and recomputes 5 tokens in step 5.
    # 5 usable blocks of 4 tokens: B (8 + 5) holds 3 from step 1, A (4 + 10) 2 from step 1. B
    # samples its last token in step 4; step 5 is scheduled before that output is processed,
    # and A, whose next token starts its third block, finds none free: it is the newest
    # running request, so it is the victim.
    results = {}
    for mode in (False, True):
        sched = Scheduler(_tiny(async_scheduling=mode, num_gpu_blocks=6, max_model_len=16), 6)
        b, a = make_request(0, 8, 5), make_request(1, 4, 10)
        sched.add_request(b)
        sched.add_request(a)
        out = drive_async(sched) if mode else drive(sched, use_runs=False)
        results[mode] = (out["steps"], a.num_preemptions, b.finish_step, a.finish_step,
                         [x[1:3] for x in out["log"]][4:6])
    assert results[False] == (10, 0, 4, 9, [(0, 2), (0, 1)])
    assert results[True] == (10, 1, 4, 9, [(0, 2), (5, 0)])


def test_a_decoder_is_scheduled_in_the_step_after_its_prompt():
    # The token sampled at the prompt's end is in flight when the next step is scheduled; the
    # request decodes in that step anyway (vLLM: an output placeholder), and finishes on time.
    sched = Scheduler(_tiny(async_scheduling=True), 64)
    a = make_request(0, 10, 4)
    sched.add_request(a)
    out = drive_async(sched)
    assert [x[1:3] for x in out["log"]] == [(10, 0), (0, 1), (0, 1), (0, 1)]
    assert (a.first_token_step, a.finish_step, a.num_output_tokens) == (0, 3, 4)


def test_engine_sees_arrivals_one_step_later():
    # Steps of 1 s (unit cost model). B arrives at 0.5 s, during step 0. Synchronously it joins
    # step 1; asynchronously step 1 was scheduled at 0 s (while step 0 ran), so B joins step 2.
    import pandas as pd

    frame = pd.DataFrame({"request_id": ["a", "b"], "arrival_time_s": [0.0, 0.5], "prompt_tokens": [8, 8],
                          "output_tokens": [6, 3]})
    trace = trace_from_frame(frame)
    results = {}
    for mode in (False, True):
        config = EngineConfig.from_flat(dict(block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                             max_model_len=64, async_scheduling=mode))
        res = replay(trace, config, "unit")
        results[mode] = res.requests.set_index("request_id")
    assert results[False].loc["b", "ttft_s"] == pytest.approx(1.5)  # ends step 1 at 2 s
    assert results[True].loc["b", "ttft_s"] == pytest.approx(2.5)  # ends step 2 at 3 s
    assert results[True].loc["a", "ttft_s"] == results[False].loc["a", "ttft_s"] == pytest.approx(1.0)


def test_async_needs_recompute_preemption():
    with pytest.raises(ConfigError, match="async_scheduling .* needs preemption_mode 'recompute', got 'swap'"):
        make_config(async_scheduling=True, preemption_mode="swap")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_async_invariants_and_no_leaks(scenario):
    options, reqs, waves = scenario
    options = dict(options, async_scheduling=True, preemption_mode="recompute")
    sched = Scheduler(make_config(**options), options["num_gpu_blocks"])
    arrivals, call, i = [], 0, 0
    for wave in waves:
        for _ in range(wave):
            if i < len(reqs):
                arrivals.append((call, reqs[i]))
                i += 1
        call += wave
    arrivals += [(call, r) for r in reqs[i:]]
    try:
        drive_async(sched, check=_check, arrivals=arrivals)
    except LivelockError:
        assert options.get("preemption_victim") == "requester"  # as synchronously, only this policy
        return
    pool = sched.kv_cache_manager.block_pool
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    assert pool.get_num_used_blocks() == 0, "blocks leaked"
    assert not sched.kv_cache_manager.req_to_blocks and not sched._finishing
    for r in reqs:
        assert r.num_output_tokens == min(r.max_tokens, options["max_model_len"] - r.num_prompt_tokens)
        assert r.num_computed_tokens == r.num_tokens - 1


def _steps(async_scheduling: bool, cost_model: str = "roofline"):
    import pandas as pd

    trace = trace_from_frame(pd.DataFrame({"arrival_time_s": [0.0], "prompt_tokens": [16], "output_tokens": [6]}))
    config = EngineConfig.from_flat(dict(num_gpu_blocks=64, max_model_len=256, async_scheduling=async_scheduling))
    return replay(trace, config, cost_model).steps


def test_the_roofline_host_overheads_overlap_the_device():
    # One decoding request: each step's device time is far above the host's 1 ms + 5 us, so
    # asynchronously a step lasts the synchronous duration less the host's share.
    sync, asyn = _steps(False), _steps(True)
    assert len(sync["step"]) == len(asyn["step"]) == 6
    host = 1.0e-3 + 5.0e-6
    assert np.allclose(asyn["duration_s"], sync["duration_s"] - host, atol=2e-9)
    # A cost model that does not split host from device keeps its durations.
    assert np.array_equal(_steps(False, "linear")["duration_s"], _steps(True, "linear")["duration_s"])


def test_cli_refuses_async_on_the_gpu_backend(tmp_path):
    from click.testing import CliRunner

    from simkv.cli.main import main

    res = CliRunner().invoke(main, ["replay", "--backend", "gpu", "--async-scheduling", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--async-scheduling is simulated only" in res.output


@st.composite
def _timed_traces(draw):
    import pandas as pd

    n = draw(st.integers(1, 40))
    span = draw(st.sampled_from([0.0, 0.05, 0.5, 5.0]))
    rows = {"arrival_time_s": sorted(draw(st.floats(0, span)) for _ in range(n)),
            "prompt_tokens": [draw(st.integers(1, 300)) for _ in range(n)],
            "output_tokens": [draw(st.integers(1, 120)) for _ in range(n)]}
    if draw(st.booleans()):  # shared prompt content
        rows["block_hashes"] = [[draw(st.integers(0, 3))] * -(-p // 16) for p in rows["prompt_tokens"]]
        rows["hash_block_tokens"] = [16] * n
    options = dict(async_scheduling=True, max_model_len=512,
                   num_gpu_blocks=draw(st.integers(34, 120)), block_size=16,
                   max_num_seqs=draw(st.sampled_from([2, 8, 64])),
                   max_num_batched_tokens=draw(st.sampled_from([64, 512])),
                   enable_prefix_caching=draw(st.booleans()),
                   scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
                   model=draw(st.sampled_from(["llama-3-8b", "tiny-llama"])))
    return trace_from_frame(pd.DataFrame(rows)), options, draw(st.sampled_from(["roofline", "linear", "unit"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_timed_traces())
def test_async_decode_runs_change_nothing(case):
    """The engine's decode-run jumps under async scheduling give the same requests, steps and
    summary as stepping one by one (tiny-llama's roofline steps are host-bound: stepped)."""
    trace, options, cost_model = case
    config = EngineConfig.from_flat(options)
    a = replay(trace, config, cost_model, use_decode_runs=True)
    b = replay(trace, config, cost_model, use_decode_runs=False)
    import pandas as pd

    pd.testing.assert_frame_equal(a.requests, b.requests)
    for name, values in a.steps.items():
        assert np.array_equal(values, b.steps[name]), name
    for key in ("wall_time_s", "use_decode_runs"):
        a.summary.pop(key, None), b.summary.pop(key, None)
    assert a.summary == b.summary


def test_cli_warns_when_the_cost_model_has_no_host_share(tmp_path):
    from click.testing import CliRunner

    from simkv.cli.main import main

    args = ["replay", "traces/req400.parquet", "--async-scheduling", "--quiet", "--max-model-len", "4096"]
    res = CliRunner().invoke(main, args + ["--cost-model", "linear", "--out", str(tmp_path / "a")])
    assert res.exit_code == 0 and "no host time is overlapped" in res.output
    res = CliRunner().invoke(main, args + ["--out", str(tmp_path / "b")])  # roofline: overlapped, no warning
    assert res.exit_code == 0 and "warning" not in res.output
