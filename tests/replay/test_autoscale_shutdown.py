"""Scale-downs that end their replicas (`--shutdown-timeout`, simkv/replay/autoscale.py): a
replica drained at a decision ends min(preStop + timeout, grace) seconds later, and loses what
it still has in flight then."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from simkv.replay.api import FleetSpec, replay
from simkv.replay.autoscale import AutoscaleError, AutoscaleSpec
from simkv.traces import trace_from_frame
from tests.cli_runs import cli_fails
from tests.replay.test_autoscale import CONFIG

SCALING = dict(target=8, interval_s=15, cold_start_s=45, scale_down_window_s=60)


def ebb():
    """Two minutes at 20 requests a second, then six at 3: the fleet grows, then sheds a
    replica while its requests are still running."""
    rng = np.random.default_rng(2)
    arrivals = np.concatenate([np.sort(rng.uniform(0, 120, 2400)), np.sort(rng.uniform(120, 480, 1080))])
    n = len(arrivals)
    return trace_from_frame(pd.DataFrame({"arrival_time_s": arrivals, "prompt_tokens": rng.integers(200, 1500, n),
                                          "output_tokens": rng.integers(100, 1200, n)}))


def _replay(config=CONFIG, **shutdown):
    spec = AutoscaleSpec(1, 4, **SCALING, **shutdown)
    return replay(ebb(), config, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))


@pytest.fixture(scope="module")
def drained():
    """The fleet draining to the end, and its scale-downs: (tick of the decision, slots drained)."""
    result = _replay()
    downs = [e for e in result.summary["fleet"]["autoscaling"]["events"] if e["action"] == "down"]
    assert downs and all(e["in_flight"] > 0 for e in downs)  # (requests were running when it shed)
    return result, downs


@pytest.mark.parametrize("timeout_s, grace_s, prestop_s", [(0, 30, 0), (2, 30, 0), (30, 3, 0), (1, 30, 2), (5, 30, 0)])
def test_what_a_drained_replica_still_runs_at_its_end_is_lost(drained, timeout_s, grace_s, prestop_s):
    """Against the replay that drains to the end (identical up to the end): every request of a
    drained replica that finished there after min(preStop + timeout, grace) is lost, the others
    finish as they did."""
    full, downs = drained
    end = min(prestop_s + timeout_s, grace_s)
    result = _replay(shutdown_timeout_s=timeout_s, termination_grace_s=grace_s, prestop_s=prestop_s)
    before = full.requests
    events = result.summary["fleet"]["autoscaling"]["events"]
    assert [e for e in events if e["action"] == "down"] == downs
    expected = set()
    for down in downs:  # (the slots above what it kept, that were still taking requests)
        t = down["time_s"]
        on = before[(before["replica"] >= down["replicas"]) & (before["arrival_time_s"] < t)]
        expected |= set(on.index[on["finish_time_s"] > t + end])
    lost = set(result.requests.index[result.requests["status"] == "failed"])
    assert lost == expected and lost
    scaling = result.summary["fleet"]["autoscaling"]
    assert scaling["shutdown_requests_lost"] == scaling["shutdown_requests_failed"] == len(lost)
    assert result.summary["client"]["aborted_by_deadline"]["shutdown"] == len(lost)
    kept = before.index.difference(sorted(expected))
    early = kept[before.loc[kept, "arrival_time_s"] < min(e["time_s"] for e in downs) + end]
    pd.testing.assert_series_equal(result.requests.loc[early, "finish_time_s"], before.loc[early, "finish_time_s"])
    assert scaling["gpu_hours"] < full.summary["fleet"]["autoscaling"]["gpu_hours"]  # (ended sooner: paid less)


def test_retries_save_what_a_scale_down_loses():
    config = dataclasses.replace(CONFIG, scheduler=dataclasses.replace(CONFIG.scheduler, client_max_retries=2))
    result = _replay(config, shutdown_timeout_s=0)
    scaling = result.summary["fleet"]["autoscaling"]
    assert scaling["shutdown_requests_lost"] > 0 and scaling["shutdown_requests_failed"] == 0
    assert (result.requests["status"] == "finished").all()
    assert result.summary["client"]["finished_after_retries"] == scaling["shutdown_requests_lost"]


def test_a_drain_long_enough_changes_nothing(drained):
    """A bound no request reaches: the replay is the one that drains to the end, byte for byte
    (the autoscaler decides at its own instants instead of at arrivals: the same decisions)."""
    full, _ = drained
    result = _replay(shutdown_timeout_s=3600, termination_grace_s=3600)
    assert set(result.requests.columns) - set(full.requests.columns) == {"attempts"}  # (its clients: lost or not)
    pd.testing.assert_frame_equal(result.requests[full.requests.columns], full.requests)
    assert result.steps.keys() == full.steps.keys()
    for key, steps in full.steps.items():
        np.testing.assert_array_equal(result.steps[key], steps, err_msg=key)
    assert result.summary["fleet"]["autoscaling"]["shutdown_requests_lost"] == 0


def test_the_same_inputs_give_the_same_losses():
    a, b = (_replay(shutdown_timeout_s=1) for _ in range(2))
    pd.testing.assert_frame_equal(a.requests, b.requests)
    assert a.summary["fleet"]["autoscaling"]["events"] == b.summary["fleet"]["autoscaling"]["events"]


def test_bad_shutdown_settings_are_refused():
    with pytest.raises(AutoscaleError, match="--shutdown-timeout must be a number of seconds >= 0"):
        AutoscaleSpec(1, 4, shutdown_timeout_s=-1)
    with pytest.raises(AutoscaleError, match="give --shutdown-timeout too"):
        AutoscaleSpec(1, 4, termination_grace_s=60)
    assert "--shutdown-timeout sets the autoscaler" in cli_fails(
        ["replay", "traces/req400.parquet", "--shutdown-timeout", "0"])
    assert "not modelled yet for a P/D pool" in cli_fails(
        ["replay", "traces/req400.parquet", "--prefill-replicas", "2", "--decode-replicas", "2",
         "--prefill-autoscale", "1-2", "--shutdown-timeout", "0"])


def test_a_vllm_serve_command_gives_its_shutdown_timeout(tmp_path):
    import json

    from tests.cli_runs import cli_ok

    cli_ok(["replay", "traces/req400.parquet", "--autoscale", "1-2", "--vllm-serve",
            "vllm serve meta-llama/Llama-3.1-8B-Instruct --shutdown-timeout 45", "--out", str(tmp_path / "r")])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["fleet"]["autoscaling"]["shutdown_timeout_s"] == 45.0
    assert summary["fleet"]["autoscaling"]["termination_grace_s"] == 30.0


def test_a_sweep_grids_the_shutdown_timeout(tmp_path):
    import pyarrow.parquet as pq

    from simkv.traces.schema import write_trace
    from tests.cli_runs import cli_ok

    write_trace(ebb(), str(tmp_path / "ebb.parquet"))
    cli_ok(["sweep", str(tmp_path / "ebb.parquet"), "--set", "autoscale=1-4", "--set", "autoscale_target=8",
            "--set", "cold_start_s=45", "--set", "scale_down_window_s=60", "--set", "router=least_outstanding",
            "--grid", "shutdown_timeout=none,0", "--out", str(tmp_path / "s"), "--workers", "1", "--quiet"])
    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    direct = _replay(shutdown_timeout_s=0).summary["fleet"]["autoscaling"]
    assert [(r["shutdown_requests_lost"], r["shutdown_requests_failed"]) for r in rows] == [
        (None, None), (direct["shutdown_requests_lost"], direct["shutdown_requests_failed"])]
    assert rows[1]["shutdown_requests_lost"] > 0


def test_scale_down_ends_under_paced_conversations():
    """Conversations paced on their replies: a scale-down that ends its replica at once ends the
    conversations whose turns it lost (no retries); decode runs change no byte."""
    from tests.replay.test_client_timeouts import _conversations

    spec = AutoscaleSpec(1, 3, target=4, interval_s=5, cold_start_s=5, scale_down_window_s=10, shutdown_timeout_s=0)
    fleet = FleetSpec(3, "least_outstanding", autoscale=spec)
    runs = [replay(_conversations(400, 20.0), CONFIG, fleet=fleet, use_decode_runs=flag) for flag in (True, False)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    status = runs[0].requests["status"].value_counts()
    lost = runs[0].summary["fleet"]["autoscaling"]["shutdown_requests_lost"]
    assert lost > 0 and status["failed"] == lost and status["abandoned"] > 0
    assert status.sum() == len(runs[0].requests)


def test_a_fleet_scaled_to_zero_whose_pods_are_all_ending_starts_a_new_one_after_the_first_end():
    """Scaled to zero while both slots' pods still drain toward their ends (8 s and 12 s): a
    request that arrives at 4 s starts a new pod in the slot that ends first, its 10 s cold start
    from that end (its GPUs free then); the old pod is paid until its end."""
    from simkv.clock import TICKS_PER_SECOND as S
    from simkv.replay.autoscale import Autoscaler

    scaler = Autoscaler(AutoscaleSpec(0, 2, cold_start_s=10, shutdown_timeout_s=5))
    scaler.ready_at, scaler.draining_since = [0, 0], [3 * S, 3 * S]
    scaler.kill_at, scaler.paid = [12 * S, 8 * S], [[(0, None)], [(0, None)]]
    slots, ready = scaler.hold_slots(4 * S, 4 * S, loads=[2, 3])
    assert slots == (1,) and ready == 18 * S and scaler.ready_at[1] == 18 * S
    assert scaler.paid[1] == [(0, 8 * S), (4 * S, None)] and scaler.kill_at[1] is None
    assert scaler.draining_since == [3 * S, None]  # (slot 0 still drains toward its end)


def test_scale_down_ends_in_a_fleet_that_scales_to_zero():
    """MIN 0 with vLLM's default shutdown: decode runs change no byte, every row accounted for."""
    spec = AutoscaleSpec(0, 4, **SCALING, shutdown_timeout_s=0)
    runs = [replay(ebb(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec), use_decode_runs=flag)
            for flag in (True, False)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    scaling = runs[0].summary["fleet"]["autoscaling"]
    status = runs[0].requests["status"].value_counts()
    assert scaling["shutdown_requests_lost"] > 0 and status["failed"] == scaling["shutdown_requests_failed"]
    assert status.sum() == len(runs[0].requests)
