"""Session pacing: a trace's session_id turns wait for their previous turn's reply (+ think time)."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.traces import TraceError, trace_from_frame
from simkv.traces.synth_sessions import SessionShape, multi_turn
from tests.core.helpers import assert_decode_runs_change_no_bytes, assert_decode_runs_change_nothing
from tests.replay.engine_setups import KINDS, engine_setup

CONFIG = EngineConfig.from_flat(dict(block_size=16, num_gpu_blocks=400, max_model_len=2048))


def _chat(think: list[float] | None = None, arrivals=(0.0, 1.0, 2.0, 0.5)) -> pd.DataFrame:
    """Session a: three turns (arrivals 0, 1, 2 s: sooner than their replies come); b: one turn."""
    frame = pd.DataFrame({"arrival_time_s": list(arrivals), "prompt_tokens": [100, 200, 300, 50],
                          "output_tokens": [20, 20, 20, 5], "session_id": ["a", "a", "a", "b"],
                          "request_id": ["a0", "a1", "a2", "b0"]})
    if think is not None:
        frame["think_time_s"] = think
    return frame


def test_a_turn_waits_for_the_previous_reply_and_its_think_time() -> None:
    res = replay(trace_from_frame(_chat(think=[0.0, 3.0, 0.5, 0.0])), CONFIG, "unit")
    req = res.requests.set_index("request_id")
    # unit steps (1 s each): a0 arrives at 0 and finishes after its 20 steps
    assert req.loc["a1", "arrival_time_s"] == req.loc["a0", "finish_time_s"] + 3.0
    assert req.loc["a2", "arrival_time_s"] == req.loc["a1", "finish_time_s"] + 0.5
    assert req.loc["b0", "arrival_time_s"] == 0.5  # (no earlier turn: the trace's time)
    assert (req["ttft_s"] > 0).all()
    assert res.summary["session_pacing"] == {"sessions": 2, "turns_held": 2,
                                             "mean_hold_s": pytest.approx((req.loc["a1", "arrival_time_s"] - 1.0
                                                                           + req.loc["a2", "arrival_time_s"] - 2.0) / 2)}


def test_a_turn_due_later_than_the_reply_keeps_its_trace_time() -> None:
    res = replay(trace_from_frame(_chat(arrivals=(0.0, 100.0, 200.0, 0.5))), CONFIG, "unit")
    assert res.requests["arrival_time_s"].tolist() == [0.0, 0.5, 100.0, 200.0]
    assert res.summary["session_pacing"]["turns_held"] == 0


def test_without_pacing_the_trace_times_stand() -> None:
    config = EngineConfig.from_flat(dict(block_size=16, num_gpu_blocks=400, max_model_len=2048, session_pacing=False))
    res = replay(trace_from_frame(_chat()), config, "unit")
    assert sorted(res.requests["arrival_time_s"].tolist()) == [0.0, 0.5, 1.0, 2.0]
    assert "session_pacing" not in res.summary


def test_a_rejected_turn_releases_the_next() -> None:
    frame = _chat(think=[0.0, 0.0, 1.0, 0.0])
    frame.loc[1, "prompt_tokens"] = 5000  # longer than max_model_len: rejected when it arrives
    res = replay(trace_from_frame(frame), CONFIG, "unit")
    req = res.requests.set_index("request_id")
    assert req.loc["a1", "status"] == "rejected"
    # a1 is sent a tick after a0's reply (think time 0: a client answers no sooner), rejected then
    assert req.loc["a1", "arrival_time_s"] == req.loc["a0", "finish_time_s"] + 2.0 ** -40
    assert req.loc["a2", "arrival_time_s"] == pytest.approx(req.loc["a0", "finish_time_s"] + 1.0, abs=1e-11)
    assert req.loc["a2", "status"] == "finished"


@pytest.mark.parametrize("extra", [{}, {"async_scheduling": True}, {"kv_offloading_size": 0.05}])
def test_decode_runs_change_nothing_under_pacing(extra: dict) -> None:
    trace = multi_turn(SessionShape(sessions=40, turns=4, think_time_s=2.0), seed=5)
    config = EngineConfig.from_flat(dict(num_gpu_blocks=600, max_model_len=8192) | extra)
    res = assert_decode_runs_change_nothing(trace, config)
    assert res.summary["session_pacing"]["turns_held"] > 0


def test_paced_replies_are_found_at_any_speed() -> None:
    """Every turn arrives after its previous reply: compressing the trace (think times too) cannot
    make a turn miss its reply, where the open-loop replay of the compressed trace does."""
    from simkv.traces.transform import Edits, transform

    trace = multi_turn(SessionShape(sessions=60, turns=5), seed=1)
    fast = transform(trace, Edits(time_scale=0.05))
    config = EngineConfig.from_flat(dict(max_model_len=8192))
    open_loop = EngineConfig.from_flat(dict(max_model_len=8192, session_pacing=False))
    paced = [replay(t, config).summary["prefix_cache_hits_tokens"] for t in (trace, fast)]
    assert paced[0] == paced[1]
    assert replay(fast, open_loop).summary["prefix_cache_hits_tokens"] < paced[1]


def _assert_paced(res, sessions: int, turns: int) -> None:
    req = res.requests.set_index("request_id")
    assert res.summary["session_pacing"]["turns_held"] > 0
    for s in range(sessions):  # a turn is sent after its previous turn finished, wherever it ran
        for t in range(1, turns):
            if f"s{s}-t{t}" in req.index and req.loc[f"s{s}-t{t - 1}", "status"] == "finished":
                assert req.loc[f"s{s}-t{t}", "arrival_time_s"] > req.loc[f"s{s}-t{t - 1}", "finish_time_s"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_data_parallel_ranks_pace_sessions(async_scheduling) -> None:
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = multi_turn(SessionShape(sessions=30, turns=4, think_time_s=0.5), seed=9)
    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite", data_parallel_size=2, max_model_len=8192,
                                         async_scheduling=async_scheduling))
    res = replay(trace, config, "roofline")
    _assert_paced(res, 30, 4)
    again = replay(trace, config, "roofline")  # (deterministic)
    assert again.requests.equals(res.requests)
    # a P/D decode pool that is one data-parallel engine
    spec = DisaggregationSpec(1, 1, decode_options=(("data_parallel_size", 2),))
    pd_res = replay(trace, EngineConfig.from_flat(dict(model="deepseek-v2-lite", max_model_len=8192,
                                                       async_scheduling=async_scheduling)),
                    "roofline", disaggregation=spec)
    _assert_paced(pd_res, 30, 4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_data_parallel_ranks_pace_sessions_of_fanned_out_turns(async_scheduling) -> None:
    """Turns for 3 samples each on 2 ranks: the members of a turn spread over the ranks, and the
    next turn is sent once the last of them has finished, wherever it ran."""
    from simkv.traces.transform import Edits, transform

    trace = transform(multi_turn(SessionShape(sessions=20, turns=3, think_time_s=0.5), seed=4), Edits(samples=3))
    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite", data_parallel_size=2, max_model_len=8192,
                                         async_scheduling=async_scheduling))
    res = replay(trace, config, "roofline")
    _assert_paced(res, 20, 3)
    assert res.summary["parallel_sampling"]["mean_ranks_per_sampled_request"] > 1.5  # (the balancer's loads decide)
    assert res.summary["num_finished"] == len(trace)
    assert replay(trace, config, "roofline").requests.equals(res.requests)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pd_paces_sessions_on_the_decode_side_and_decode_runs_change_nothing(async_scheduling, tmp_path) -> None:
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = multi_turn(SessionShape(sessions=40, turns=4, think_time_s=0.5), seed=8)
    config = EngineConfig.from_flat(dict(num_gpu_blocks=600, max_model_len=8192, async_scheduling=async_scheduling))
    res = assert_decode_runs_change_no_bytes(trace, config, tmp_path, disaggregation=DisaggregationSpec(2, 2))
    _assert_paced(res, 40, 4)  # (the decode side finished the previous turn)


def test_think_time_needs_sessions_and_is_checked() -> None:
    frame = _chat(think=[0.0, 1.0, 1.0, 0.0]).drop(columns=["session_id"])
    with pytest.raises(TraceError, match="'think_time_s' needs a 'session_id'"):
        trace_from_frame(frame)
    with pytest.raises(TraceError, match="column 'think_time_s', row 1: negative"):
        trace_from_frame(_chat(think=[0.0, -1.0, 1.0, 0.0]))


def test_cli_flag_and_synth_columns(tmp_path) -> None:
    runner = CliRunner()
    path = tmp_path / "chat.parquet"
    r = runner.invoke(main, ["trace", "synth", "multi-turn", "--sessions", "5", "--turns", "3", "--out", str(path)])
    assert r.exit_code == 0, r.output
    for flag, paced in (("--session-pacing", True), ("--no-session-pacing", False)):
        out = tmp_path / flag
        r = runner.invoke(main, ["replay", str(path), "--out", str(out), flag, "--cost-model", "unit"])
        assert r.exit_code == 0, r.output
        summary = json.loads((out / "summary.json").read_text())
        assert ("session_pacing" in summary) == paced and summary["config"]["session_pacing"] == paced
    assert np.isfinite(pd.read_parquet(tmp_path / "--session-pacing" / "requests.parquet")["ttft_s"]).all()


@pytest.mark.parametrize("router, async_scheduling", [("round_robin", False), ("prefix_aware", False),
                                                      ("least_outstanding", True)])
def test_a_fleet_paces_sessions_and_decode_runs_change_nothing(router, async_scheduling, tmp_path) -> None:

    trace = multi_turn(SessionShape(sessions=60, turns=4, think_time_s=1.0), seed=6)
    config = EngineConfig.from_flat(dict(num_gpu_blocks=600, max_model_len=8192, async_scheduling=async_scheduling))
    res = assert_decode_runs_change_no_bytes(trace, config, tmp_path, fleet=FleetSpec(3, router))
    _assert_paced(res, 60, 4)


def test_a_fleet_of_one_paces_as_one_engine() -> None:
    from simkv.backends.factory import make_backend
    from simkv.capacity import compute_capacity
    from simkv.replay.fleet import run_fleet
    from simkv.replay.router import Router

    trace = multi_turn(SessionShape(sessions=30, turns=4, think_time_s=0.5), seed=2)
    config = EngineConfig.from_flat(dict(num_gpu_blocks=600, max_model_len=8192))
    one = replay(trace, config, "roofline")
    capacity = compute_capacity(config)
    runs, routing = run_fleet(trace, config, [make_backend("roofline", config)], capacity.num_gpu_blocks,
                              Router("round_robin", 1), capacity)
    assert runs[0].steps.num_steps == one.summary["num_steps"]
    assert np.array_equal(np.asarray(routing.rows.arrival_s), one.requests["arrival_time_s"].to_numpy())


def _refused_turns_release_the_next(res, trace) -> int:
    """Every turn after a turn the front end refused (HTTP 503) for good is sent when the refused
    turn was sent, plus its think time, or at its trace time if later. Returns how many turns
    followed a refused one."""
    req = res.requests.set_index("request_id")
    think = dict(zip(trace.request_id, trace.think_time_s))
    trace_at = dict(zip(trace.request_id, trace.arrival_time_s))
    followed = 0
    for rid in req.index:
        s, t = rid.rsplit("-t", 1)
        before = f"{s}-t{int(t) - 1}"
        if int(t) == 0 or req.loc[before, "status"] != "rejected":
            continue
        followed += 1
        due = req.loc[before, "arrival_time_s"] + think[rid]
        assert req.loc[rid, "arrival_time_s"] == pytest.approx(max(due, trace_at[rid]), abs=1e-9)
    assert set(req["status"]) == {"finished", "rejected"}  # (none abandoned: a refusal ends nothing)
    return followed


@pytest.mark.parametrize("kind", KINDS)
def test_a_turn_the_front_end_refuses_releases_the_next(kind, tmp_path) -> None:
    """vLLM's admission control (max_num_queued_reqs) under session pacing: a turn refused with
    HTTP 503 is done with, as a rejected turn is, and its conversation goes on."""
    trace = multi_turn(SessionShape(sessions=200, turns=4, think_time_s=1.0), seed=6)
    options, extra = engine_setup(kind, dict(num_gpu_blocks=600, max_model_len=8192, max_num_queued_reqs=16))
    config = EngineConfig.from_flat(options)
    res = (assert_decode_runs_change_no_bytes(trace, config, tmp_path, **extra) if kind == "fleet"
           else replay(trace, config, **extra))
    assert _refused_turns_release_the_next(res, trace) > 50
    assert res.summary["session_pacing"]["turns_held"] > 0
