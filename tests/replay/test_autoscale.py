"""A fleet that scales with its load (`--autoscale MIN-MAX`, simkv/replay/autoscale.py)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from simkv.config import EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.replay.autoscale import AutoscaleError, AutoscaleSpec
from simkv.replay.router import RouterError
from simkv.traces import trace_from_frame
from tests.cli_runs import cli_fails, cli_ok

CONFIG = EngineConfig.from_flat({"max_model_len": 4096})


def bursts() -> object:
    """A quiet minute, a 60-second burst of 40 requests a second, then quiet again."""
    rng = np.random.default_rng(1)
    quiet = np.arange(0.0, 60.0, 2.0)
    burst = np.sort(rng.uniform(60.0, 120.0, 2400))
    tail = np.arange(120.0, 900.0, 2.0)
    arrivals = np.concatenate([quiet, burst, tail])
    n = len(arrivals)
    return trace_from_frame(pd.DataFrame({"arrival_time_s": arrivals, "prompt_tokens": rng.integers(200, 1500, n),
                                          "output_tokens": rng.integers(50, 300, n)}))


def test_the_fleet_grows_for_a_burst_and_shrinks_after_it():
    spec = AutoscaleSpec(1, 4, target=8, interval_s=15, cold_start_s=45, scale_down_window_s=120)
    result = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling = result.summary["fleet"]["autoscaling"]
    events = scaling["events"]
    first_up = next(e for e in events if e["action"] == "up")
    assert first_up["time_s"] == 75.0 and first_up["replicas"] == 4  # (the first decision in the burst)
    # no request goes to a replica before it is ready, 45 s after it was started
    requests = result.requests
    later = requests[requests["replica"] > 0]
    assert later["arrival_time_s"].min() >= 75.0 + 45.0
    assert (requests.loc[requests["arrival_time_s"] < 120.0, "replica"] == 0).all()
    # once the burst is served and the window has passed, back to one
    down = [e for e in events if e["action"] == "down"]
    assert down and down[-1]["replicas"] == 1 and down[0]["time_s"] >= first_up["time_s"] + 120.0
    assert scaling["timeline"][-1]["ready"] == 1
    # paid: replica 0 the whole replay, the others from their start to their drain's last finish
    duration = result.summary["duration_s"]
    assert duration < scaling["replica_seconds"] < 4 * duration
    assert scaling["gpu_hours"] == pytest.approx(scaling["replica_seconds"] / 3600)
    rows = result.summary["fleet"]["replicas"]
    assert rows[0]["paid_s"] == pytest.approx(duration)  # (up from the start to the end)
    assert sum(r["paid_s"] for r in rows) == pytest.approx(scaling["replica_seconds"])
    assert scaling["fixed_fleet_gpu_hours"] == pytest.approx(4 * duration / 3600)
    assert 1.0 < scaling["mean_ready"] < 4.0 and scaling["peak_ready"] == 4
    # the same inputs, the same fleet
    again = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    pd.testing.assert_frame_equal(requests, again.requests)
    assert again.summary["fleet"]["autoscaling"] == scaling


def test_a_cold_start_costs_the_burst_its_latency():
    fast = AutoscaleSpec(1, 4, target=8, cold_start_s=0)
    slow = AutoscaleSpec(1, 4, target=8, cold_start_s=60)
    ttft = {name: replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec)).summary["ttft_s"]
            for name, spec in (("fast", fast), ("slow", slow))}
    assert ttft["slow"]["p99"] > 2 * ttft["fast"]["p99"]


def test_settings_are_checked():
    for text, message in (("4-2", "0 <= MIN < MAX"), ("2-2", "0 <= MIN < MAX"), ("3", "expected MIN-MAX"),
                          ("a-b", "expected MIN-MAX")):
        with pytest.raises(AutoscaleError, match=message):
            AutoscaleSpec.parse(text)
    with pytest.raises(AutoscaleError, match="--cold-start-s must be a number of seconds >= 0"):
        AutoscaleSpec(1, 2, cold_start_s=-1)
    with pytest.raises(AutoscaleError, match="--autoscale-target must be a number > 0"):
        AutoscaleSpec(1, 2, target=0)
    with pytest.raises(RouterError, match="the fleet has 3 replicas"):
        FleetSpec(3, autoscale=AutoscaleSpec(1, 4))
    with pytest.raises(RouterError, match="not modelled in a fleet that scales"):
        FleetSpec(4, class_replicas=(("docs", (3,)),), autoscale=AutoscaleSpec(1, 4))


def test_the_cli_scales_and_says_so(tmp_path):
    trace = tmp_path / "b.parquet"
    from simkv.traces import write_trace

    write_trace(bursts(), trace)
    text = cli_ok(["replay", str(trace), "--autoscale", "1-3", "--cold-start-s", "30", "--autoscale-target", "8",
                   "--router", "least_outstanding", "--max-model-len", "4096", "--out", str(tmp_path / "r")])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["fleet"]["num_replicas"] == 3 and summary["fleet"]["autoscaling"]["cold_start_s"] == 30.0
    assert "autoscaling" in text and "Autoscaled replicas" in (tmp_path / "r" / "report.html").read_text()
    assert "paid" in text.split("per replica")[-1]  # (the replica table's column)
    (tmp_path / "f.yaml").write_text("autoscale: 1-3\ncold_start_s: 30\n")
    cli_ok(["replay", str(trace), "--config", str(tmp_path / "f.yaml"), "--max-model-len", "4096", "--out",
            str(tmp_path / "c"), "--quiet"])
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["fleet"]["autoscaling"]["cold_start_s"] == 30.0
    cli_ok(["goodput", str(trace), "--autoscale", "1-3", "--cold-start-s", "30", "--goodput", "ttft:2000",
            "--max-model-len", "4096", "--cost-model", "linear", "--tolerance", "0.2", "--out", str(tmp_path / "g"),
            "--quiet"])
    assert "An autoscaled fleet of 1-3 replicas" in (tmp_path / "g" / "goodput.md").read_text()
    cli_ok(["goodput", str(trace), "--autoscale", "1-3", "--cold-start-s", "30", "--goodput", "ttft:2000",
            "--max-model-len", "4096", "--cost-model", "linear", "--tolerance", "0.2", "--gpu-price", "H100-SXM=2",
            "--out", str(tmp_path / "p"), "--quiet"])
    record = json.loads((tmp_path / "p" / "goodput.json").read_text())
    best = next(p for p in record["probes"] if p["met"] and p["factor"] == record["bracket_factors"][0])
    cost = record["cost"]  # (the GPU-hours paid in the highest rate's replay, as a mean spend per hour)
    assert cost["usd_spent"] == pytest.approx(2 * best["gpu_hours_by_gpu"]["H100-SXM"])
    assert cost["usd_per_hour"] == pytest.approx(cost["usd_spent"] / (best["duration_s"] / 3600))
    assert 2 <= cost["usd_per_hour"] <= 3 * 2  # (between MIN and MAX replicas always up)
    assert "Cost: autoscaled," in (tmp_path / "p" / "goodput.md").read_text()
    assert "give --autoscale MIN-MAX too" in cli_fails(["replay", str(trace), "--cold-start-s", "30"])
    assert "the fleet has 2 replicas" in cli_fails(["replay", str(trace), "--autoscale", "1-3", "--replicas", "2"])
    assert "not P/D pools" in cli_fails(["replay", str(trace), "--autoscale", "1-3", "--prefill-replicas", "1"])


def test_a_sweep_grids_the_autoscaler(tmp_path):
    import pyarrow.parquet as pq

    from simkv.traces import write_trace

    trace = tmp_path / "b.parquet"
    write_trace(bursts(), trace)
    cli_ok(["sweep", str(trace), "--set", "router=least_outstanding", "--set", "replicas=3", "--set",
            "max_model_len=4096", "--set", "cold_start_s=30", "--grid", "autoscale=none,1-3", "--grid",
            "autoscale_target=4,8", "--out", str(tmp_path / "s"), "--quiet"])
    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert [row["status"] for row in rows] == ["ok"] * 4
    fixed, scaled = rows[:2], rows[2:]
    assert all(row["gpu_hours"] is None for row in fixed) and fixed[0]["ttft_p99_s"] == fixed[1]["ttft_p99_s"]
    assert all(row["gpu_hours"] > 0 and 1 <= row["mean_replicas_up"] <= 3 for row in scaled)
    assert scaled[0]["mean_replicas_up"] >= scaled[1]["mean_replicas_up"]  # (4 in flight each: no fewer replicas)
    # a cell replays what `simkv replay --autoscale` does
    cli_ok(["replay", str(trace), "--autoscale", "1-3", "--autoscale-target", "8", "--cold-start-s", "30",
            "--router", "least_outstanding", "--max-model-len", "4096", "--out", str(tmp_path / "r"), "--quiet"])
    by_hand = json.loads((tmp_path / "r" / "summary.json").read_text())["fleet"]["autoscaling"]
    assert by_hand["gpu_hours"] == scaled[1]["gpu_hours"]


def test_a_fleet_scaled_to_zero_wakes_for_a_request_and_it_waits_the_cold_start():
    """MIN 0: the first request starts a replica and waits for it; after a quiet spell longer
    than the window the fleet is back at zero, and the next request waits again."""
    arrivals = np.concatenate([np.arange(0.0, 20.0, 0.5), [400.0, 400.5]])
    n = len(arrivals)
    trace = trace_from_frame(pd.DataFrame({"arrival_time_s": arrivals, "prompt_tokens": [500] * n,
                                           "output_tokens": [50] * n}))
    spec = AutoscaleSpec(0, 2, target=8, interval_s=15, cold_start_s=20, scale_down_window_s=60)
    result = replay(trace, CONFIG, fleet=FleetSpec(2, "least_outstanding", autoscale=spec))
    scaling, requests = result.summary["fleet"]["autoscaling"], result.requests
    actions = [e["action"] for e in scaling["events"]]
    assert actions[0] == "activate" and actions.count("activate") == 2 and "down" in actions
    # nothing runs before a replica is ready: the first waits the whole cold start, the late pair too
    assert requests["first_scheduled_time_s"].iloc[0] == pytest.approx(20.0)
    assert requests["first_scheduled_time_s"].iloc[-2] == pytest.approx(420.0)
    assert (requests["ttft_s"].iloc[[0, -2]] >= 20.0).all()
    assert scaling["held_requests"] >= 3 and scaling["mean_hold_s"] > 0
    assert [p["ready"] for p in scaling["timeline"]][0] == 0
    # paid: from each start to the last finish of its work, nothing while at zero
    assert scaling["replica_seconds"] < 0.5 * result.summary["duration_s"]
    again = replay(trace, CONFIG, fleet=FleetSpec(2, "least_outstanding", autoscale=spec))
    pd.testing.assert_frame_equal(requests, again.requests)
    with pytest.raises(ValueError, match="scale to zero"):
        replay(trace, EngineConfig.from_flat({"max_model_len": 4096, "client_ttft_timeout_s": 5.0}),
               fleet=FleetSpec(2, autoscale=spec))
