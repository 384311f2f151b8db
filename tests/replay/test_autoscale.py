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
    report = (tmp_path / "r" / "report.html").read_text()
    assert "autoscaling" in text and "Autoscaled replicas" in report
    assert "Autoscaled replicas: metrics at each decision" in report and "in_flight / target" in report
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
    assert "give --autoscale MIN-MAX (or" in cli_fails(["replay", str(trace), "--cold-start-s", "30"])
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


@pytest.mark.parametrize("retries", [0, 1])
def test_clients_that_give_up_while_a_fleet_scaled_to_zero_starts(retries):
    """MIN 0 and clients with a 5 s TTFT time-out: those sent early in the 20 s cold start give up
    before any replica is ready, and vLLM never schedules them (their retries, 0.5 s later, wait
    and give up too); those sent within 5 s of the ready instant are served. Decode runs change
    no byte."""
    arrivals = np.arange(0.0, 30.0, 0.5)
    n = len(arrivals)
    trace = trace_from_frame(pd.DataFrame({"arrival_time_s": arrivals, "prompt_tokens": [500] * n,
                                           "output_tokens": [50] * n}))
    spec = AutoscaleSpec(0, 2, target=8, interval_s=15, cold_start_s=20, scale_down_window_s=60)
    config = EngineConfig.from_flat({"max_model_len": 4096, "client_ttft_timeout_s": 5.0,
                                     "client_max_retries": retries})
    runs = [replay(trace, config, fleet=FleetSpec(2, "least_outstanding", autoscale=spec), use_decode_runs=flag)
            for flag in (True, False)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    requests = runs[0].requests
    gave_up = requests["arrival_time_s"] + 5.0 * (retries + 1) + 0.5 * retries <= 20.0  # (ready at 20 s)
    assert gave_up.any() and (requests.loc[gave_up, "status"] == "timed_out").all()
    assert requests.loc[gave_up, "first_scheduled_time_s"].isna().all()  # (never scheduled: no compute)
    assert (requests.loc[requests["arrival_time_s"] > 15.0, "status"] == "finished").all()
    assert runs[0].summary["client"]["timed_out_requests"] == gave_up.sum()


def _ticks(seconds) -> np.ndarray:
    from simkv.clock import TICKS_PER_SECOND

    return np.rint(np.asarray(seconds, dtype=np.float64) * TICKS_PER_SECOND).astype(np.int64)


def _gauges_from_steps(steps: dict, tick: int) -> tuple[int, int, int]:
    """What vLLM's engine reported after its last step that ended strictly before `tick`, read
    from the step table: running less those the step finished, waiting, blocks used at its end."""
    ends = _ticks(steps["start_time_s"]) + _ticks(steps["duration_s"])
    before = np.flatnonzero(ends < tick)
    if not len(before):
        return 0, 0, 0
    j = before[-1]
    return (int(steps["num_running"][j] - steps["num_finished"][j]), int(steps["num_waiting"][j]),
            int(steps["num_blocks_used_end"][j]))


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}, {"pipeline_parallel_size": 2}])
def test_engine_gauges_are_those_of_the_last_step_ended_before(options):
    """StepLog.gauges_before, read inside decode runs as well as at single steps, agrees with
    the step table it expands to, at each step's end and a tick after it (synchronous,
    asynchronous scheduling, pipeline stages)."""
    config = EngineConfig.from_flat({"max_model_len": 4096, "max_num_seqs": 24} | options)
    result = replay(bursts(), config)
    steps = result.steps
    log = result.run.steps
    runs = len(steps["step"]) > len(log._rows)  # (decode runs: fewer segments than steps; none under PP)
    assert runs == ("pipeline_parallel_size" not in options)
    ends = _ticks(steps["start_time_s"]) + _ticks(steps["duration_s"])
    picks = np.sort(np.concatenate([ends[::7], ends[::7] + 1, ends[3::11] - 1, [0, 1, int(ends[-1]) + 5]]))
    seen_waiting = seen_partial_run = False
    for tick in picks:
        got = log.gauges_before(int(tick))
        assert got == _gauges_from_steps(steps, int(tick)), tick
        seen_waiting |= got[1] > 0
    for row in log._rows:  # (some pick fell inside a decode run, after its first step)
        inside = picks[(picks > row[4]) & (picks < row[4] + sum(row[5:7]) * row[1])]
        seen_partial_run |= row[1] > 2 and len(inside) > 0
    assert seen_waiting and seen_partial_run == runs


def test_the_fleet_scales_on_the_engines_gauges():
    """--autoscale-metric waiting/kv_usage: each decision's value is the sum of the ready
    replicas' gauges after their last step before it, read back from the step table."""
    config = EngineConfig.from_flat({"max_model_len": 4096, "max_num_seqs": 16})
    for metric, target, column in (("waiting", 5.0, 1), ("running", 8.0, 0), ("kv_usage", 0.02, 2)):
        spec = AutoscaleSpec(1, 4, target=target, cold_start_s=30, scale_down_window_s=120, metric=metric)
        result = replay(bursts(), config, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
        scaling = result.summary["fleet"]["autoscaling"]
        assert scaling["metric"] == metric and scaling["target"] == target
        events = [e for e in scaling["events"] if e["action"] in ("up", "down")]
        assert any(e["action"] == "up" for e in events) and any(e["action"] == "down" for e in events)
        replica = result.steps["replica"]
        usable = result.run.scheduler.kv_cache_manager.block_pool.num_usable_blocks
        for event in events[:6]:
            tick = int(_ticks(event["time_s"]))
            ready = [r for r in range(4) if (replica == r).any()]
            total = 0.0
            for r in ready:
                mine = {k: np.asarray(v)[replica == r] for k, v in result.steps.items()}
                gauge = _gauges_from_steps(mine, tick)[column]
                total += gauge / usable if metric == "kv_usage" else gauge
            # (a replica that had not started has no steps before then, and reads 0 as it should)
            assert event["values"] == {metric: pytest.approx(total)}, (metric, event)
        if metric == "waiting":  # (the first scale-up: the queue passed what one replica aims at)
            first = next(e for e in events if e["action"] == "up")
            assert first["values"]["waiting"] > target * 1.1


def test_hpa_tolerance_and_scale_up_rate():
    """A sum within 10 % of what the replicas aim at changes nothing; a scale-up adds at most
    max(4, 100 %) of the replicas had 15 s before."""
    from simkv.replay.autoscale import Autoscaler

    scaler = Autoscaler(AutoscaleSpec(1, 20, target=10))
    assert scaler._recommend(21, 10, 2) == 2 and scaler._recommend(23, 10, 2) == 3
    assert scaler._recommend(17, 10, 2) == 2 and scaler._recommend(0, 10, 2) == 1  # (within [MIN, MAX])
    assert Autoscaler(AutoscaleSpec(1, 20, target=10, tolerance=0))._recommend(21, 10, 2) == 3
    assert scaler._recommend(1.2, 0.6, 1) == 2  # (1.2 / 0.6 in floating point is 2.0000000000000004)
    scaler = Autoscaler(AutoscaleSpec(1, 20, target=1, interval_s=5))
    loads = [40] + [0] * 19
    second = int(_ticks(1.0))
    live = []
    for t in (5, 10, 15, 20, 25, 30, 35):
        scaler._evaluate(t * second, loads)
        live.append(sum(at is not None for at in scaler.ready_at))
    assert live == [5, 5, 5, 10, 10, 10, 20]  # (1 + 4, then doubled every 15 s)
    with pytest.raises(AutoscaleError, match="--autoscale-metric 'queue': expected one of"):
        AutoscaleSpec(1, 2, metric="queue")
    with pytest.raises(AutoscaleError, match="kv_usage aims at a share"):
        AutoscaleSpec(1, 2, metric="kv_usage", target=50)
    with pytest.raises(AutoscaleError, match="--autoscale-tolerance must be in"):
        AutoscaleSpec(1, 2, tolerance=1.5)
    assert AutoscaleSpec(1, 2, metric="waiting").target == 5.0
    assert AutoscaleSpec.of("1-2", {"autoscale_metric": "kv-usage", "autoscale_target": "0.7"}).metric == "kv_usage"


def test_the_cli_takes_the_metric(tmp_path):
    from simkv.traces import write_trace

    trace = tmp_path / "b.parquet"
    write_trace(bursts(), trace)
    text = cli_ok(["replay", str(trace), "--autoscale", "1-3", "--autoscale-metric", "kv_usage", "--autoscale-target",
                   "0.4", "--cold-start-s", "30", "--router", "least_outstanding", "--max-model-len", "4096",
                   "--out", str(tmp_path / "r")])
    assert "KV-cache" in text  # (the autoscaling line names the metric)
    scaling = json.loads((tmp_path / "r" / "summary.json").read_text())["fleet"]["autoscaling"]
    assert scaling["metric"] == "kv_usage" and scaling["tolerance"] == 0.1
    (tmp_path / "f.yaml").write_text("autoscale: 1-3\nautoscale_metric: waiting\nautoscale_tolerance: 0\n")
    cli_ok(["replay", str(trace), "--config", str(tmp_path / "f.yaml"), "--max-model-len", "4096", "--out",
            str(tmp_path / "c"), "--quiet"])
    scaling = json.loads((tmp_path / "c" / "summary.json").read_text())["fleet"]["autoscaling"]
    assert (scaling["metric"], scaling["target"], scaling["tolerance"]) == ("waiting", 5.0, 0.0)
    assert "kv_usage aims at a share" in cli_fails(["replay", str(trace), "--autoscale", "1-3", "--autoscale-metric",
                                                    "kv_usage", "--autoscale-target", "70"])
    assert "queue" in cli_fails(["replay", str(trace), "--autoscale", "1-3", "--autoscale-metric", "queue"])
    cli_ok(["goodput", str(trace), "--autoscale", "1-3", "--autoscale-metric", "waiting=2,kv_usage=0.3",
            "--cold-start-s", "30", "--goodput", "ttft:2000", "--max-model-len", "4096", "--cost-model", "linear",
            "--tolerance", "0.2", "--out", str(tmp_path / "g"), "--quiet"])
    assert "(2 waiting or 30% KV-cache usage each, cold start 30 s)" in (tmp_path / "g" / "goodput.md").read_text()
    import pyarrow.parquet as pq

    cli_ok(["sweep", str(trace), "--set", "router=least_outstanding", "--set", "autoscale=1-3", "--set",
            "max_model_len=4096", "--set", "cold_start_s=30", "--grid", "autoscale_metric=in_flight,running",
            "--out", str(tmp_path / "s"), "--quiet"])
    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert [row["status"] for row in rows] == ["ok"] * 2 and all(row["gpu_hours"] > 0 for row in rows)
    cell = json.loads((tmp_path / "s" / "cells" / rows[1]["cell_id"] / "summary.json").read_text())
    assert cell["fleet"]["autoscaling"]["metric"] == "running"


def test_several_metrics_each_recommend_and_the_largest_wins():
    """waiting=5,running=4: each metric recommends with its own target; the decision takes the
    largest, and a decision's values name both sums."""
    spec = AutoscaleSpec(1, 4, cold_start_s=30, scale_down_window_s=120, metric="waiting=5, running=4")
    assert spec.metric == "waiting=5;running=4" and spec.target is None
    assert spec.targets == (("waiting", 5.0), ("running", 4.0))
    config = EngineConfig.from_flat({"max_model_len": 4096, "max_num_seqs": 16})
    result = replay(bursts(), config, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling = result.summary["fleet"]["autoscaling"]
    assert scaling["metric"] == "waiting=5;running=4"
    from simkv.replay.autoscale import Autoscaler, describe

    ups = [e for e in scaling["events"] if e["action"] == "up"]
    assert ups and all(set(e["values"]) == {"waiting", "running"} for e in ups)
    assert "5 waiting or 4 running each" in describe(scaling)
    for running, waiting, replicas in ((4, 12, 3), (9, 0, 3), (2, 1, 1), (30, 30, 4)):
        scaler = Autoscaler(spec)  # (one replica up, whose engine last reported these gauges)
        scaler.gauges = [(lambda tick, g=(running, waiting, 0): g, 100)] * 4
        scaler._evaluate(int(_ticks(15.0)), [0] * 4)
        assert sum(at is not None for at in scaler.ready_at) == replicas, (running, waiting)
    for metric, message in (("waiting,running", "give each its target"), ("waiting=5,waiting=2", "waiting twice"),
                            ("kv_usage=2", "in \\(0, 1\\]"), ("running=x", "is not a number")):
        with pytest.raises(AutoscaleError, match=message):
            AutoscaleSpec(1, 2, metric=metric)
    with pytest.raises(AutoscaleError, match="drop --autoscale-target"):
        AutoscaleSpec(1, 2, metric="waiting=5", target=3)
    assert AutoscaleSpec(1, 2, metric="kv_usage=0.7") == AutoscaleSpec(1, 2, metric="kv_usage", target=0.7)
    listed = AutoscaleSpec.of("1-2", {"autoscale_metric": ["waiting=5", "kv_usage=0.7"]})  # (a config file's list)
    assert listed.metric == "waiting=5;kv_usage=0.7"


def test_pd_pools_scale_each_on_its_own_metric():
    """--prefill-autoscale / --decode-autoscale: each pool scales on its own gauges; no request
    reaches a replica before it is ready; both pools' GPU-hours add up; the same inputs, the
    same run."""
    from simkv.replay.disaggregated import DisaggregationSpec

    spec = DisaggregationSpec(
        num_prefill=3, num_decode=3,
        prefill_autoscale=AutoscaleSpec(1, 3, cold_start_s=30, scale_down_window_s=120, metric="waiting", target=2),
        decode_autoscale=AutoscaleSpec(1, 3, cold_start_s=30, scale_down_window_s=120, metric="kv_usage",
                                       target=0.02))
    config = EngineConfig.from_flat({"max_model_len": 4096, "max_num_seqs": 16})
    result = replay(bursts(), config, disaggregation=spec)
    pools, requests = result.summary["disaggregation"], result.requests
    duration = result.summary["duration_s"]
    total = 0.0
    for pool, metric in (("prefill", "waiting"), ("decode", "kv_usage")):
        scaling = pools[pool]["autoscaling"]
        assert scaling["metric"] == metric and pools[f"{pool}_autoscale"]["metric"] == metric
        first_up = next(e for e in scaling["events"] if e["action"] == "up")
        assert set(first_up["values"]) == {metric} and scaling["peak_ready"] == 3
        assert any(e["action"] == "down" for e in scaling["events"])
        # a replica started at the first scale-up takes its first request once ready, 30 s later
        by_replica = requests[requests[f"{pool}_replica"] > 0]
        reached = by_replica["arrival_time_s"] if pool == "prefill" else by_replica["prefill_end_time_s"]
        assert reached.min() >= first_up["time_s"] + 30.0
        rows = pools[pool]["replicas"]
        assert rows[0]["paid_s"] == pytest.approx(duration)
        assert sum(r["paid_s"] for r in rows) == pytest.approx(scaling["replica_seconds"])
        total += scaling["gpu_hours"]
    assert pools["autoscaling"]["gpu_hours"] == pytest.approx(total)
    again = replay(bursts(), config, disaggregation=spec)
    pd.testing.assert_frame_equal(requests, again.requests)
    assert again.summary["disaggregation"] == pools
    # one pool fixed: it is paid for all along
    fixed = DisaggregationSpec(num_prefill=2, num_decode=3, decode_autoscale=spec.decode_autoscale)
    summary = replay(bursts(), config, disaggregation=fixed).summary
    assert summary["disaggregation"]["autoscaling"]["gpu_hours"] == pytest.approx(
        summary["disaggregation"]["decode"]["autoscaling"]["gpu_hours"] + 2 * summary["duration_s"] / 3600)
    assert "autoscaling" not in summary["disaggregation"]["prefill"]


def test_pd_pool_scaling_is_checked():
    from simkv.config import ConfigError
    from simkv.replay.disaggregated import DisaggregationSpec

    for kwargs, message in (
            ({"num_decode": 2, "decode_autoscale": AutoscaleSpec(1, 3)}, "scales up to 3 replicas, the pool has 2"),
            ({"num_prefill": 2, "prefill_autoscale": AutoscaleSpec(0, 2)}, "scaling to zero"),
            ({"num_decode": 2, "decode_autoscale": AutoscaleSpec(1, 2), "decode_class_replicas": (("docs", (1,)),)},
             "a class's own replicas")):
        with pytest.raises(ConfigError, match=message):
            DisaggregationSpec(**kwargs)
    spec = DisaggregationSpec(num_decode=2, decode_autoscale=AutoscaleSpec(1, 2),
                              decode_options=(("data_parallel_size", 2),))
    with pytest.raises(ConfigError, match="data-parallel engine's ranks do not scale"):
        spec.pool_configs(EngineConfig.from_flat({"model": "qwen3-30b-a3b", "gpu": "H200", "max_model_len": 4096}))


def test_the_cli_scales_pd_pools(tmp_path):
    from simkv.traces import write_trace

    trace = tmp_path / "b.parquet"
    write_trace(bursts(), trace)
    text = cli_ok(["replay", str(trace), "--prefill-replicas", "1", "--decode-autoscale",
                   "1-3:metric=kv_usage,target=0.02", "--cold-start-s", "30", "--max-model-len", "4096",
                   "--max-num-seqs", "16", "--out", str(tmp_path / "r")])
    assert "decode pool autoscaling" in text
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    scaling = summary["disaggregation"]["decode"]["autoscaling"]
    assert (scaling["metric"], scaling["target"], scaling["cold_start_s"]) == ("kv_usage", 0.02, 30.0)
    assert summary["disaggregation"]["decode_replicas"] == 3  # (MAX, --decode-replicas left out)
    assert "Autoscaled decode replicas" in (tmp_path / "r" / "report.html").read_text()
    (tmp_path / "f.yaml").write_text("cold_start_s: 45\ndisaggregation:\n  prefill_autoscale: "
                                     "'1-2:metric=waiting=2;running=8,cold_start_s=20'\n")
    cli_ok(["replay", str(trace), "--config", str(tmp_path / "f.yaml"), "--max-model-len", "4096", "--out",
            str(tmp_path / "c"), "--quiet"])
    scaling = json.loads((tmp_path / "c" / "summary.json").read_text())["disaggregation"]["prefill"]["autoscaling"]
    assert (scaling["metric"], scaling["cold_start_s"]) == ("waiting=2;running=8", 20.0)
    for args, message in ((["--decode-autoscale", "1-3:colds=3"], "KEY one of metric, target"),
                          (["--decode-autoscale", "1-3", "--decode-replicas", "2"], "the pool has 2"),
                          (["--decode-autoscale", "1-3:metric=kv_usage,target=7"], "kv_usage aims at a share")):
        assert message in cli_fails(["replay", str(trace), "--max-model-len", "4096", *args])
    assert "goodput searches fixed pools" in cli_fails(["goodput", str(trace), "--goodput", "ttft:2000",
                                                        "--decode-autoscale", "1-2"])
    import pyarrow.parquet as pq

    cli_ok(["sweep", str(trace), "--set", "prefill_replicas=1", "--set", "max_model_len=4096", "--set",
            "cold_start_s=30", "--grid", "decode_autoscale=none,1-3:metric=kv_usage=0.02;running=8", "--out",
            str(tmp_path / "s"), "--quiet"])
    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert [row["status"] for row in rows] == ["ok"] * 2 and rows[0]["gpu_hours"] is None
    cell = json.loads((tmp_path / "s" / "cells" / rows[1]["cell_id"] / "summary.json").read_text())
    assert rows[1]["gpu_hours"] == cell["disaggregation"]["autoscaling"]["gpu_hours"] > 0
    assert cell["disaggregation"]["decode"]["autoscaling"]["metric"] == "kv_usage=0.02;running=8"


def test_a_scale_up_window_lets_a_spike_pass():
    """--scale-up-window-s: replicas start only as far as every wish over the window asked;
    a spike shorter than the window starts none, a sustained load starts them at its end."""
    from simkv.replay.autoscale import Autoscaler

    second = int(_ticks(1.0))
    for loads_by_time, started_at in (({10: 3}, None), ({10: 3, 15: 3, 20: 3}, 20)):
        scaler = Autoscaler(AutoscaleSpec(1, 4, target=1, interval_s=5, scale_up_window_s=10))
        live_after = {}
        for t in (5, 10, 15, 20, 25):
            scaler._evaluate(t * second, [loads_by_time.get(t, 0)] + [0] * 3)
            live_after[t] = sum(at is not None for at in scaler.ready_at)
        first = next((t for t, n in live_after.items() if n > 1), None)
        assert first == started_at, live_after
        if started_at is not None:
            assert live_after[started_at] == 3
    assert AutoscaleSpec.of("1-2", {"scale_up_window_s": "60"}).scale_up_window_s == 60.0
    with pytest.raises(AutoscaleError, match="--scale-up-window-s must be a number of seconds >= 0"):
        AutoscaleSpec(1, 2, scale_up_window_s=-1)


def test_a_replica_started_again_is_a_new_pod_with_an_empty_prefix_cache():
    """A slot drained and started again later is a new pod: its GPU prefix cache starts empty,
    so its first request misses the prefix every request shares, while replica 0, up all
    along, keeps hitting it; a prefix-aware router forgets what it had sent there."""
    def burst(start, n):
        return np.sort(np.random.default_rng(int(start)).uniform(start, start + 20.0, n))

    arrivals = np.concatenate([burst(0.0, 400), burst(300.0, 400)])
    n = len(arrivals)
    shared = list(range(1, 33))  # (a 512-token system prompt, in 16-token blocks)
    frame = pd.DataFrame({"arrival_time_s": arrivals, "prompt_tokens": [1024] * n, "output_tokens": [64] * n,
                          "block_hashes": [shared + [1000 * i + k for k in range(32)] for i in range(n)]})
    trace = trace_from_frame(frame, hash_block_tokens=16)
    spec = AutoscaleSpec(1, 2, target=4, interval_s=5, cold_start_s=10, scale_down_window_s=60)
    result = replay(trace, CONFIG, fleet=FleetSpec(2, "least_outstanding", autoscale=spec))
    scaling, requests = result.summary["fleet"]["autoscaling"], result.requests
    starts = [e["time_s"] for e in scaling["events"] if e["action"] == "up"]
    assert len(starts) == 2 and scaling["new_pods"] == 1  # (up in each burst, drained between)
    second_life = requests[(requests["replica"] == 1) & (requests["arrival_time_s"] >= starts[1])]
    first = second_life.sort_values("first_scheduled_time_s").iloc[0]
    assert first["prefix_hit_tokens"] == 0
    assert (second_life["prefix_hit_tokens"] == 512).mean() > 0.9  # (then it has cached the prompt again)
    on_zero = requests[(requests["replica"] == 0) & (requests["arrival_time_s"] >= starts[1])]
    assert (on_zero["prefix_hit_tokens"] == 512).all()
    from simkv.replay.router import Router

    router = Router("prefix_aware", 2, cache_tokens_per_replica=4096)
    keys = [1, 2, 3]
    router.indexes[1].insert(keys, 16)
    router.forget(1)
    assert router.indexes[1].matched_blocks(keys) == 0 and router.indexes[1].capacity_tokens == 4096
