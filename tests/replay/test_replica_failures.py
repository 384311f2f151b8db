"""Replicas that fail and come back (`--replica-failure T:R`, simkv/replay/failures.py)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.replay.failures import FailureError, FailureSpec
from simkv.traces import trace_from_frame
from tests.cli_runs import cli_fails, cli_ok
from tests.replay.test_autoscale import bursts

FAIL_AT, RESTART = 90.0, 60.0


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat({"max_model_len": 4096, **options})


def _failed_fleet(config, trace=None, router="least_outstanding"):
    spec = FailureSpec.parse([f"{FAIL_AT:g}:1"], RESTART, 3)
    return replay(trace if trace is not None else bursts(), config, fleet=FleetSpec(3, router, failures=spec))


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}])
def test_a_failed_replica_loses_its_requests_and_takes_none_until_it_is_back(options):
    """Replica 1 fails in the burst: the requests it had then are failed (no retries), none it
    finished came after the failure, and the router sends it nothing until it is back."""
    result = _failed_fleet(_config(**options))
    requests, summary = result.requests, result.summary
    on1 = requests[requests["replica"] == 1]
    failed = requests[requests["status"] == "failed"]
    assert len(failed) > 5 and (failed["replica"] == 1).all() and (failed["arrival_time_s"] < FAIL_AT).all()
    done = on1[on1["status"] == "finished"]
    assert ((done["finish_time_s"] <= FAIL_AT) | (done["arrival_time_s"] >= FAIL_AT + RESTART)).all()
    assert not ((on1["arrival_time_s"] >= FAIL_AT) & (on1["arrival_time_s"] < FAIL_AT + RESTART)).any()
    assert (on1["arrival_time_s"] >= FAIL_AT + RESTART).any()  # (back: it takes requests again)
    section = summary["fleet"]["failures"]
    assert section["restart_s"] == RESTART and section["failures"] == [
        {"time_s": FAIL_AT, "replica": 1, "aborted": len(failed), "failed": len(failed)}]
    assert summary["client"]["failed_requests"] == len(failed) == summary["num_requests"] - summary["num_finished"]
    assert summary["client"]["aborted_by_deadline"]["failure"] == len(failed)
    again = _failed_fleet(_config(**options))
    pd.testing.assert_frame_equal(requests, again.requests)


def test_clients_retry_what_a_failed_replica_lost():
    """With --client-max-retries the lost requests are sent again through the router: every one
    finishes, elsewhere or once replica 1 is back, its latency counted from its first send."""
    lost = _failed_fleet(_config())
    retried = _failed_fleet(_config(client_max_retries=2, client_retry_backoff_s=1.0))
    requests = retried.requests
    rows = lost.requests.index[lost.requests["status"] == "failed"]
    assert (requests["status"] == "finished").all()
    again = requests.loc[rows]
    assert (again["replica"] != 1).any() and ((again["replica"] != 1) | (again["arrival_time_s"] >= FAIL_AT)).all()
    assert (again["first_token_time_s"] >= FAIL_AT + 1.0).all()  # (the retry's first token, after the back-off)
    client = retried.summary["client"]
    assert client["retries"] == client["finished_after_retries"] == len(rows)
    assert retried.summary["fleet"]["failures"]["failures"][0]["failed"] == 0


def _shared_prefix_trace() -> object:
    """Requests every 0.25 s over 240 s, each prompt a shared 40-block prefix and 8 blocks of its own."""
    rng = np.random.default_rng(3)
    n = 960
    hashes = [list(range(1, 41)) + list(range(1000 + 8 * i, 1008 + 8 * i)) for i in range(n)]
    return trace_from_frame(pd.DataFrame({
        "arrival_time_s": np.arange(n) * 0.25, "prompt_tokens": np.full(n, 48 * 16),
        "output_tokens": rng.integers(20, 60, n), "block_hashes": hashes, "hash_block_tokens": np.full(n, 16)}))


def test_a_replica_back_from_a_failure_starts_with_an_empty_prefix_cache():
    result = _failed_fleet(_config(), _shared_prefix_trace(), router="round_robin")
    requests = result.requests
    on1 = requests[(requests["replica"] == 1) & (requests["status"] == "finished")].sort_values("arrival_time_s")
    before, after = on1[on1["arrival_time_s"] < FAIL_AT], on1[on1["arrival_time_s"] >= FAIL_AT]
    assert (before["prefix_hit_tokens"].iloc[1:] >= 40 * 16).all()
    assert after["prefix_hit_tokens"].iloc[0] == 0 and (after["prefix_hit_tokens"].iloc[1:] >= 40 * 16).all()


def test_failures_are_checked():
    for args, message in (((["1:5"], None, 3), "not a replica of the fleet's 0-2"),
                          ((["10:1", "30:1"], 60, 3), "replica 1 is down until 70 s"),
                          ((["10:0"], 0.5, 2), "--restart-s must be a number of seconds >= 1"),
                          (([], 30, 2), "--restart-s: give --replica-failure")):
        with pytest.raises(FailureError, match=message):
            FailureSpec.parse(*args)
    spec = FailureSpec.parse(["10:0"], None, 2)
    assert spec.restart_s == 120.0
    with pytest.raises(FailureError, match="at 20 s every replica is down"):
        FleetSpec(2, failures=FailureSpec.parse(["10:0", "20:1"], 60, 2))
    from simkv.replay.autoscale import AutoscaleSpec

    FleetSpec(2, failures=FailureSpec.parse(["10:0", "20:1"], 60, 2), autoscale=AutoscaleSpec(1, 2))  # (it holds)
    with pytest.raises(ConfigError, match="client_max_retries retries requests that timed out"):
        replay(bursts(), _config(client_max_retries=1), fleet=FleetSpec(2))


def test_the_cli_fails_a_replica(tmp_path):
    text = cli_ok(["replay", "traces/req400.parquet", "--replicas", "3", "--replica-failure", "3:1", "--restart-s", "5",
                   "--client-max-retries", "1", "--out", str(tmp_path / "r")])
    assert "replica 1 at 3 s" in text
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["fleet"]["failures"]["failures"][0]["aborted"] > 0 and summary["num_finished"] == 400
    for args, message in ((["--replica-failure", "3:0"], "give --replicas 2 or more"),
                          (["--replicas", "2", "--replica-failure", "3"], "expected T:R"),
                          (["--replicas", "2", "--restart-s", "5"], "give --replica-failure"),
                          (["--prefill-replicas", "1", "--replica-failure", "3:0"], "not modelled yet for P/D")):
        assert message in cli_fails(["replay", "traces/req400.parquet", *args])


def test_an_autoscaled_slot_restarts_in_place_and_requests_wait_when_none_is_up():
    """In a fleet that scales, the failed slot's pod restarts in place: not ready until
    `restart_s` later, then a new pod. Slot 0 fails at 90 s, while the slots the burst started at
    75 s are still starting (ready at 105 s): with no slot up, the requests of those 15 s wait for
    them, as a fleet scaled to zero holds its requests."""
    from simkv.replay.autoscale import AutoscaleSpec

    spec = AutoscaleSpec(1, 4, target=8, interval_s=15, cold_start_s=30, scale_down_window_s=120)
    failures = FailureSpec.parse(["90:0"], RESTART, 4)
    result = replay(bursts(), _config(client_max_retries=1),
                    fleet=FleetSpec(4, "least_outstanding", autoscale=spec, failures=failures))
    requests, scaling = result.requests, result.summary["fleet"]["autoscaling"]
    assert {"time_s": 90.0, "action": "failure", "replica": 0} in scaling["events"]
    waited = requests[(requests["arrival_time_s"] >= 90.0) & (requests["arrival_time_s"] < 105.0)]
    assert len(waited) > 100 and (waited["first_scheduled_time_s"] >= 105.0).all()
    assert scaling["held_requests"] >= len(waited)
    on0 = requests[requests["replica"] == 0]
    assert not ((on0["first_scheduled_time_s"] >= 90.0) & (on0["first_scheduled_time_s"] < 90.0 + RESTART)).any()
    assert (on0["first_scheduled_time_s"] >= 90.0 + RESTART).any()  # (back, a new pod)
    assert scaling["new_pods"] >= 1 and (requests["status"] == "finished").all()
    lost = result.summary["fleet"]["failures"]["failures"][0]
    assert lost["aborted"] > 0 and lost["failed"] == 0


def test_failures_drawn_from_an_mtbf_are_seeded_and_keep_the_rules():
    """--replica-mtbf-s: each replica's failures a Poisson process (mean gap M, the next drawn
    once it is back), the same for the same seed; none falls while its replica is down, and a
    fixed fleet always has a replica up."""
    spec = FailureSpec.parse([], 10.0, 50, mtbf_s=1000.0, seed=7)
    many = spec.drawn(50, 100_000.0, fixed=False)
    assert abs(len(many) - 50 * 100_000 / 1010) < 0.1 * 50 * 100_000 / 1010
    assert many == spec.drawn(50, 100_000.0, fixed=False)
    assert many != FailureSpec.parse([], 10.0, 50, mtbf_s=1000.0, seed=8).drawn(50, 100_000.0, fixed=False)
    for r in range(50):
        times = [t for t, q in many if q == r]
        assert all(b - a >= 10.0 for a, b in zip(times, times[1:]))
    two = FailureSpec.parse(["50:0"], 30.0, 2, mtbf_s=40.0, seed=1)
    drawn = two.drawn(2, 2000.0, fixed=True)
    assert (50.0, 0) in drawn and len(drawn) > 10
    for t, r in drawn:  # (never both down)
        assert sum(1 for t0, _ in drawn if t0 <= t < t0 + 30.0) == 1
    FleetSpec(2, failures=two)  # (the given failures alone are checked there)
    result = replay(bursts(), _config(client_max_retries=2),
                    fleet=FleetSpec(3, "least_outstanding", failures=FailureSpec.parse([], 30.0, 3, mtbf_s=200.0)))
    section = result.summary["fleet"]["failures"]
    assert section["mtbf_s"] == 200.0 and section["given"] == 0 and len(section["failures"]) >= 3
    assert sum(f["aborted"] for f in section["failures"]) > 0 and (result.requests["status"] == "finished").all()
    with pytest.raises(FailureError, match="--replica-mtbf-s must be a number of seconds > 0"):
        FailureSpec.parse([], None, 2, mtbf_s=0.0)
    assert "give --replica-failure T:R or --replica-mtbf-s" in cli_fails(
        ["replay", "traces/req400.parquet", "--replicas", "2", "--failure-seed", "3"])


def test_a_sweep_grids_the_failures(tmp_path):
    import pyarrow.parquet as pq

    cli_ok(["sweep", "traces/req400.parquet", "--set", "replicas=3", "--set", "restart_s=5", "--set",
            "client_ttft_timeout_s=60", "--set", "client_max_retries=1", "--grid", "replica_failures=none,2:1,2:1;3:0",
            "--out", str(tmp_path / "s"), "--quiet"])
    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert [row["status"] for row in rows] == ["ok"] * 3
    lost = []
    for row in rows:
        cell = json.loads((tmp_path / "s" / "cells" / row["cell_id"] / "summary.json").read_text())
        lost.append([f["replica"] for f in (cell["fleet"].get("failures") or {}).get("failures", [])])
    assert lost == [[], [1], [1, 0]]
    assert rows[0]["requests_lost"] is None and 0 < rows[1]["requests_lost"] < rows[2]["requests_lost"]
    assert rows[1]["requests_failed"] == 0  # (one retry each, after a minute's time-out at most)


def test_a_sweeps_failure_free_baseline_runs_without_the_retries(tmp_path):
    """Retries set for the sweep's failing cells have nothing to retry in its replica_failures=none
    cell: it runs as a replay without them would (a replay alone refuses them)."""
    import pyarrow.parquet as pq

    cli_ok(["sweep", "traces/req400.parquet", "--set", "replicas=2", "--set", "client_max_retries=2",
            "--grid", "replica_failures=none,5:1", "--out", str(tmp_path / "s"), "--quiet"])
    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert [row["status"] for row in rows] == ["ok", "ok"]
    assert rows[1]["requests_lost"] > 0 and rows[1]["requests_failed"] == 0
    plain = replay(_trace400(), EngineConfig.from_flat({}), fleet=FleetSpec(2)).summary
    baseline = json.loads((tmp_path / "s" / "cells" / rows[0]["cell_id"] / "summary.json").read_text())
    assert baseline["duration_s"] == plain["duration_s"]
    for key in ("ttft_s", "e2e_s", "fleet", "num_finished"):
        assert baseline[key] == json.loads(json.dumps(plain[key])), key
    assert "--replica-failure" in cli_fails(["replay", "traces/req400.parquet", "--replicas", "2",
                                             "--client-max-retries", "2"])


def test_a_sweep_whose_retries_have_no_use_in_any_cell_is_refused(tmp_path):
    out = cli_fails(["sweep", "traces/req400.parquet", "--set", "replicas=2", "--set", "client_max_retries=2",
                     "--grid", "max_num_seqs=8,16", "--out", str(tmp_path / "s"), "--quiet"])
    assert "client_max_retries" in out and "no cell has anything to retry" in out
    assert not (tmp_path / "s" / "sweep.parquet").exists()


def _trace400():
    from simkv.traces.schema import read_trace

    return read_trace("traces/req400.parquet")


@pytest.mark.parametrize("retries", [0, 2])
@pytest.mark.parametrize("pacing", ["sessions", "concurrency"])
def test_failures_under_paced_requests(retries, pacing):
    """Conversations paced on their replies, or a client that keeps 24 requests in flight, on three
    replicas two of which fail: what is lost is retried, or fails for good and ends its
    conversation (its later turns never sent) or frees its client's slot; every row is accounted
    for, and decode runs (which stop before any turn or retry another replica could release)
    change no byte."""
    from tests.replay.test_client_timeouts import _conversations

    trace = _conversations(600, 20.0)
    options = {"client_max_retries": retries} if retries else {}
    if pacing == "concurrency":
        options |= {"session_pacing": False, "client_max_concurrency": 24}
    config = EngineConfig.from_flat(options)
    fleet = FleetSpec(3, "least_outstanding", failures=FailureSpec.parse(["10:1", "20:2"], 5.0, 3))
    runs = [replay(trace, config, fleet=fleet, use_decode_runs=flag) for flag in (True, False)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    summary, status = runs[0].summary, runs[0].requests["status"].value_counts()
    lost = summary["fleet"]["failures"]["requests_lost"]
    assert lost > 0 and status.sum() == len(trace)
    if retries:
        assert status.get("failed", 0) == 0 and summary["client"]["finished_after_retries"] > 0
    else:
        assert status["failed"] == lost
    ended = status.get("abandoned", 0)
    assert (ended > 0) == (pacing == "sessions" and not retries)
    assert set(status.index) <= {"finished", "failed", "abandoned"}


def test_requests_held_for_a_slot_that_fails_before_it_is_ready_wait_for_its_restart():
    """Scaled to zero, the first requests wait for slot 0's 20 s cold start; it fails at 10 s and
    restarts 30 s later: they wait for that (none reached the pod that failed, none is lost)."""
    from simkv.replay.autoscale import AutoscaleSpec

    arrivals = np.arange(0.0, 12.0, 0.5)
    n = len(arrivals)
    trace = trace_from_frame(pd.DataFrame({"arrival_time_s": arrivals, "prompt_tokens": [500] * n,
                                           "output_tokens": [50] * n}))
    spec = AutoscaleSpec(0, 2, target=64, interval_s=15, cold_start_s=20, scale_down_window_s=60)
    result = replay(trace, _config(), fleet=FleetSpec(2, "least_outstanding", autoscale=spec,
                                                      failures=FailureSpec.parse(["10:0"], 30.0, 2)))
    requests = result.requests
    assert (requests["status"] == "finished").all() and result.summary["fleet"]["failures"]["requests_lost"] == 0
    assert (requests["replica"] == 0).all() and requests["first_scheduled_time_s"].min() == pytest.approx(40.0)
