"""Autoscaling on a latency percentile (`--autoscale-metric ttft_p95=2`,
simkv/replay/autoscale_latency.py)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from simkv.clock import TICKS_PER_SECOND
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.replay.autoscale import AutoscaleError, AutoscaleSpec, Autoscaler, aims
from simkv.replay.autoscale_latency import BUCKETS, LatencyWatch, histogram_quantile, latency_metric
from tests.cli_runs import cli_fails, cli_ok
from tests.replay.test_autoscale import CONFIG, bursts


def _expected(q: float, kind: str, seconds, weights=None, bounds=None):
    """What histogram_quantile reads from these observations in vLLM's buckets for `kind` (or
    `bounds`), pytest.approx'd (None: no observation)."""
    bounds = bounds or BUCKETS[kind]
    counts = np.bincount(np.searchsorted(bounds, np.asarray(seconds, dtype=float), side="left"), weights=weights,
                         minlength=len(bounds) + 1).astype(int).tolist()
    value = histogram_quantile(q, bounds, counts)
    return None if value is None else pytest.approx(value, rel=1e-9)


def test_histogram_quantile_interpolates_within_the_bucket_as_prometheus_does():
    bounds = (1.0, 2.0, 4.0)
    assert histogram_quantile(0.5, bounds, [2, 2, 0, 0]) == pytest.approx(1.0)  # (rank 2: the first bucket's top)
    assert histogram_quantile(0.75, bounds, [2, 2, 0, 0]) == pytest.approx(1.5)
    assert histogram_quantile(0.25, bounds, [2, 2, 0, 0]) == pytest.approx(0.5)  # (from 0 in the first bucket)
    assert histogram_quantile(0.9, bounds, [0, 1, 0, 9]) == 4.0  # (in +Inf: the last finite bound)
    assert histogram_quantile(0.5, bounds, [0, 0, 4, 0]) == pytest.approx(3.0)  # (empty buckets below skipped)
    assert histogram_quantile(0.95, bounds, [0, 0, 0, 0]) is None  # (Prometheus: NaN)


def test_metric_names():
    assert latency_metric("ttft_p95") == ("ttft", 0.95)
    assert latency_metric("e2e_p99.9") == ("e2e", pytest.approx(0.999))
    assert latency_metric("ttft_p100") is None and latency_metric("ttft_p0") is None
    assert latency_metric("ttft95") is None and latency_metric("tpot_p95") is None
    assert latency_metric("itl_p90") == ("itl", 0.9)
    spec = AutoscaleSpec(1, 4, metric="ttft_p95=2,waiting=5")
    assert spec.targets == (("ttft_p95", 2.0), ("waiting", 5.0)) and spec.latency_targets == (("ttft_p95", 2.0),)
    assert AutoscaleSpec(1, 4, metric="e2e_p90", target=30).targets == (("e2e_p90", 30.0),)
    assert aims(spec.to_dict()) == "5 waiting each or p95 time to first token 2 s"
    assert spec.to_dict()["latency_window_s"] == 60.0 and "latency_window_s" not in AutoscaleSpec(1, 2).to_dict()
    for kwargs, message in (
            ({"metric": "ttft_p95"}, "a latency aims at a number of seconds; give it, e.g. ttft_p95=2"),
            ({"metric": "ttft_p100=2"}, "ttft_pQ, e2e_pQ"),
            ({"metric": "tpot_p95=0.1"}, "expected one of in_flight, running, waiting, kv_usage, gpu_util, ttft_pQ"),
            ({"metric": "e2e_p95=0"}, "must be a number > 0"),
            ({"metric": "ttft_p95=2", "latency_window_s": 0}, "--autoscale-latency-window-s must be a number")):
        with pytest.raises(AutoscaleError, match=message):
            AutoscaleSpec(1, 4, **kwargs)


def test_a_latency_recommends_in_proportion_to_the_replicas_it_has():
    """An HPA Value target: ceil(replicas * value / target), the tolerance around 1."""
    scaler = Autoscaler(AutoscaleSpec(1, 8, metric="ttft_p95=2"))
    assert scaler._recommend(3.0, 2.0, 2, per_replica=False) == 3
    assert scaler._recommend(2.1, 2.0, 4, per_replica=False) == 4  # (within 10 %)
    assert scaler._recommend(0.1, 2.0, 4, per_replica=False) == 1  # (ceil(0.2), MIN 1)
    assert scaler._recommend(20.0, 2.0, 4, per_replica=False) == 8  # (MAX)
    assert scaler._recommend(3.0, 2.0, 2, per_replica=True) == 2  # (a gauge: ceil(3 / 2), not 2 * 3 / 2)


def _request(index: int, arrival: float, **extra):
    return SimpleNamespace(index=index, arrival_time=arrival, **extra)


def test_the_window_reads_observations_strictly_before_the_decision():
    watch = LatencyWatch({"e2e"}, window_s=10.0, held={3: 50 * TICKS_PER_SECOND})
    at = lambda s: int(s * TICKS_PER_SECOND)  # noqa: E731
    watch.finished([_request(0, 0.0)], at(5.0))  # e2e 5 s, outside a window (10, 20)
    watch.finished([_request(1, 10.0)], at(11.0))  # 1 s
    watch.finished([_request(2, 10.0)], at(13.0))  # 3 s
    watch.finished([_request(4, 0.0)], at(20.0))  # at the decision: not yet seen
    assert watch.quantile("e2e", 0.5, at(20.0)) == pytest.approx(1.0)  # (two samples: 1 s, 3 s; rank 1)
    assert watch.quantile("e2e", 0.99, at(20.0)) == pytest.approx(2.5 + 2.5 * 0.98)  # (3 s in (2.5, 5])
    # a request held for a replica to start (scale to zero): vLLM's clock starts once it is ready
    watch.finished([_request(3, 40.0)], at(52.0))
    assert watch.quantile("e2e", 0.5, at(60.0)) == pytest.approx(1.75)  # (2 s, not 12 s: in (1.5, 2])


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}, {"pipeline_parallel_size": 2}])
def test_a_latency_target_scales_the_fleet_as_the_requests_table_says(options):
    """Each decision's value is the p95 of the TTFTs sampled in the minute before it, bucketed as
    vLLM's histogram buckets them: recomputed here from requests.parquet."""
    spec = AutoscaleSpec(1, 4, metric="ttft_p95=0.3", interval_s=15, cold_start_s=30, scale_down_window_s=120)
    config = EngineConfig.from_flat({"max_model_len": 4096, **options})
    result = replay(bursts(), config, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling = result.summary["fleet"]["autoscaling"]
    events = scaling["events"]
    assert [e["action"] for e in events][:1] == ["up"] and any(e["action"] == "down" for e in events)
    requests = result.requests
    first = requests["first_token_time_s"].to_numpy()
    ttft = first - requests["arrival_time_s"].to_numpy()
    decisions = scaling["decisions"]  # (every decision, 15 s apart, with what it read)
    assert np.allclose(np.diff(decisions["time_s"]), 15.0) and decisions["time_s"][0] == 15.0
    assert len(decisions["time_s"]) == len(decisions["ttft_p95"]) == len(decisions["wanted"]) > 50
    for t, value, have, wanted in zip(decisions["time_s"], decisions["ttft_p95"], decisions["replicas"],
                                      decisions["wanted"]):
        expected = _expected(0.95, "ttft", ttft[(first < t) & (first > t - 60.0)])
        assert value == expected
        if value is not None and abs(value / 0.3 - 1) > 0.1:  # (outside the tolerance: HPA's Value rule)
            assert wanted == min(4, max(1, math.ceil(have * value / 0.3 - 1e-9)))
    for event in events:
        i = decisions["time_s"].index(event["time_s"])
        assert event["values"]["ttft_p95"] == decisions["ttft_p95"][i]
    up = events[0]
    assert up["values"]["ttft_p95"] > 0.3 * 1.1 and up["replicas"] == min(4, math.ceil(up["values"]["ttft_p95"] / 0.3))
    again = replay(bursts(), config, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    assert again.summary["fleet"]["autoscaling"]["events"] == events


def test_e2e_latency_and_a_quiet_minute_recommend_nothing():
    """e2e_p90 observes finishes; a decision with no observation in its window changes nothing."""
    spec = AutoscaleSpec(1, 3, metric="e2e_p90=5", interval_s=15, cold_start_s=30, scale_down_window_s=60,
                         latency_window_s=15)
    result = replay(bursts(), CONFIG, fleet=FleetSpec(3, "least_outstanding", autoscale=spec))
    events = result.summary["fleet"]["autoscaling"]["events"]
    requests = result.requests
    finish = requests["finish_time_s"].to_numpy()
    e2e = finish - requests["arrival_time_s"].to_numpy()
    assert events
    for event in events:
        t = event["time_s"]
        assert event["values"]["e2e_p90"] == _expected(0.9, "e2e", e2e[(finish < t) & (finish > t - 15.0)])
    scaler = Autoscaler(AutoscaleSpec(1, 3, metric="e2e_p90=5"))
    scaler.watch([], held=None)
    scaler.ready_at = [0, 0, None]
    scaler._evaluate(15 * TICKS_PER_SECOND, [0, 0, 0])  # (nothing observed: two stay)
    assert scaler.events == [] and len(scaler.up(15 * TICKS_PER_SECOND)) == 2


def test_the_cli_takes_a_latency_metric_and_pd_pools_refuse_it(tmp_path):
    out = tmp_path / "r"
    result = cli_ok(["replay", "traces/req400.parquet", "--replicas", "3", "--autoscale", "1-3",
                     "--autoscale-metric", "ttft_p99=0.5", "--autoscale-latency-window-s", "30", "--out", str(out)])
    scaling = json.loads((out / "summary.json").read_text())["fleet"]["autoscaling"]
    assert scaling["metric"] == "ttft_p99" and scaling["target"] == 0.5 and scaling["latency_window_s"] == 30.0
    assert "(p99 time to first token 0.5 s, cold start 120 s)" in " ".join(result.replace("│", " ").split())
    assert scaling["decisions"]["time_s"] == [] and "at each decision" not in (out / "report.html").read_text()
    assert "a latency aims at a number of seconds" in cli_fails(
        ["replay", "traces/req400.parquet", "--autoscale", "1-2", "--autoscale-metric", "e2e_p95"])
    from simkv.replay.disaggregated import DisaggregationSpec

    for kwargs in ({"num_decode": 2, "decode_autoscale": AutoscaleSpec(1, 2, metric="ttft_p95=1")},
                   {"num_prefill": 2, "prefill_autoscale": AutoscaleSpec(1, 2, metric="e2e_p95=1")}):
        with pytest.raises(ConfigError, match="a P/D pool scales on the latency its own replicas measure"):
            DisaggregationSpec(**kwargs)


def test_a_prefill_pool_scales_on_its_own_time_to_first_token():
    """--prefill-autoscale 1-2:metric=ttft_p95=S: the prefill replicas' own TTFT histogram (from
    arrival to the one token they sample: requests.parquet's prefill_end_time_s)."""
    from simkv.replay.disaggregated import DisaggregationSpec

    spec = DisaggregationSpec(num_prefill=2, num_decode=2, prefill_autoscale=AutoscaleSpec(
        1, 2, metric="ttft_p95=0.2", interval_s=15, cold_start_s=30, scale_down_window_s=60))
    result = replay(bursts(), CONFIG, disaggregation=spec)
    scaling = result.summary["disaggregation"]["prefill"]["autoscaling"]
    assert any(e["action"] == "up" for e in scaling["events"])
    requests = result.requests
    first = requests["prefill_end_time_s"].to_numpy()
    ttft = first - requests["arrival_time_s"].to_numpy()
    decisions = scaling["decisions"]
    assert len(decisions["time_s"]) > 20
    for t, value in zip(decisions["time_s"], decisions["ttft_p95"]):
        assert value == _expected(0.95, "ttft", ttft[(first < t) & (first > t - 60.0)])


# HPA's behavior policies (--scale-up-policy, --scale-down-policy: simkv/replay/autoscale_policy.py)

def test_scaling_policies_parse_and_limit_as_hpa_computes_them():
    from simkv.replay.autoscale_policy import PolicyError, ScalingRules

    up = ScalingRules.parse("pods=4/15,percent=100/15", "--scale-up-policy")
    assert str(up) == "pods=4/15;percent=100/15" and up.longest_period_s == 15.0
    none = lambda period: (0, 0)  # noqa: E731
    assert up.limit(4, none, up=True) == 8 and up.limit(3, none, up=True) == 7  # (doubled; +4)
    assert up.limit(3, lambda period: (2, 0), up=True) == 5  # (it had 1 a period ago: 1 + 4)
    assert ScalingRules.parse("pods=4/15;percent=100/15;select=min", "f").limit(3, none, up=True) == 6
    assert ScalingRules.parse("disabled", "f").limit(3, none, up=True) == 3
    down = ScalingRules.parse("pods=1/60", "--scale-down-policy")
    assert down.limit(4, none, up=False) == 3 and down.limit(3, lambda period: (0, 1), up=False) == 3
    assert ScalingRules.parse("percent=10/60", "f").limit(4, none, up=False) == 3  # (4 x 0.9, rounded down)
    assert ScalingRules.parse("percent=100/15", "f").limit(4, none, up=False) == 0
    both = ScalingRules.parse("pods=1/60;percent=50/60", "f")
    assert both.limit(4, none, up=False) == 2 and ScalingRules.parse(
        "pods=1/60;percent=50/60;select=min", "f").limit(4, none, up=False) == 3
    for text in ("pods=1.5/60", "pods=1", "pods=0/60", "percent=10/0", "percent=10/3600", "replicas=1/60", "select=min",
                 ""):
        with pytest.raises(PolicyError, match="--scale-down-policy"):
            ScalingRules.parse(text, "--scale-down-policy")
    spec = AutoscaleSpec(1, 4, scale_down_policy="pods=1/60,percent=50/120")
    assert spec.to_dict()["scale_down_policy"] == "pods=1/60;percent=50/120"
    assert spec.to_dict()["scale_up_policy"] == "pods=4/15;percent=100/15"
    assert AutoscaleSpec.of("1-2", {"scale_up_policy": "disabled"}).scale_up_policy == "disabled"
    with pytest.raises(AutoscaleError, match="--scale-up-policy 'pods=x/15'"):
        AutoscaleSpec(1, 4, scale_up_policy="pods=x/15")


def _steps(events, action):
    return [(e["time_s"], e["replicas"]) for e in events if e["action"] == action]


def test_policies_pace_the_fleet():
    """pods=1/30 up: one replica at a time, 30 s apart at least; pods=1/60 down: likewise a
    minute apart; disabled down: the fleet never shrinks."""
    base = {"interval_s": 15, "cold_start_s": 30, "scale_down_window_s": 60, "target": 8}
    free = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=AutoscaleSpec(1, 4, **base)))
    free_events = free.summary["fleet"]["autoscaling"]["events"]
    assert _steps(free_events, "up")[0][1] == 4  # (unpaced: from one to four at once)
    spec = AutoscaleSpec(1, 4, scale_up_policy="pods=1/30", scale_down_policy="pods=1/60", **base)
    paced = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    events = paced.summary["fleet"]["autoscaling"]["events"]
    ups, downs = _steps(events, "up"), _steps(events, "down")
    assert len(ups) >= 2 and len(downs) >= 2
    replicas = 1
    for e in events:  # (one replica a step, each way)
        assert abs(e["replicas"] - replicas) == 1
        replicas = e["replicas"]
    assert all(b[0] - a[0] >= 30 for a, b in zip(ups, ups[1:]))
    assert all(b[0] - a[0] >= 60 for a, b in zip(downs, downs[1:]))
    held = AutoscaleSpec(1, 4, scale_down_policy="disabled", **base)
    kept = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=held))
    assert not _steps(kept.summary["fleet"]["autoscaling"]["events"], "down")
    assert kept.summary["fleet"]["autoscaling"]["gpu_hours"] > free.summary["fleet"]["autoscaling"]["gpu_hours"]


def test_the_cli_and_pd_pools_take_policies(tmp_path):
    out = tmp_path / "r"
    cli_ok(["replay", "traces/req400.parquet", "--autoscale", "1-3", "--scale-up-policy", "pods=1/60",
            "--scale-down-policy", "percent=50/60,select=min", "--out", str(out)])
    scaling = json.loads((out / "summary.json").read_text())["fleet"]["autoscaling"]
    assert scaling["scale_up_policy"] == "pods=1/60" and scaling["scale_down_policy"] == "percent=50/60;select=min"
    assert "--scale-down-policy 'pods=1'" in cli_fails(["replay", "traces/req400.parquet", "--autoscale", "1-2",
                                                        "--scale-down-policy", "pods=1"])
    from simkv.replay.autoscale import parse_pool

    pool = parse_pool("1-3:scale_down_policy=pods=1/60;percent=10/60", {}, "--decode-autoscale")
    assert pool.scale_down_policy == "pods=1/60;percent=10/60"


def _gap_multiset(values, weights) -> dict:
    out: dict = {}
    for v, w in zip(np.asarray(values, dtype=float).tolist(), np.asarray(weights).tolist()):
        if w:
            key = round(v, 12)
            out[key] = out.get(key, 0) + int(w)
    return out


@pytest.mark.parametrize("options", [
    {}, {"async_scheduling": True}, {"num_gpu_blocks": 400},
    {"speculative_method": "ngram", "num_speculative_tokens": 3}])
def test_inter_token_gaps_read_as_steps_end_are_those_of_token_gaps_parquet(options):
    """itl_pQ's observations (StepGaps), read a slice of time at a time, are the run's token gaps
    (results.itl_samples, token_gaps.parquet), each read once its step has ended."""
    from simkv.replay.autoscale_latency import StepGaps
    from simkv.replay.results import itl_samples

    config = EngineConfig.from_flat({"max_model_len": 4096, **options})
    result = replay(bursts(), config)
    run = result.run
    if "num_gpu_blocks" in options:
        assert result.summary["num_preemptions"] > 0 and run.scheduler.irregular_gaps  # (gaps across preemptions)
    gaps = StepGaps(run)
    read = []
    end = int(result.summary["duration_s"] * TICKS_PER_SECOND) + 2
    for tick in list(range(0, end, 7 * TICKS_PER_SECOND)) + [end]:
        batch = gaps.read_until(tick)
        assert all(t < tick for t, _, _ in batch)
        read += batch
    assert gaps.read_until(end + 1) == []
    values, weights = itl_samples(run)
    assert _gap_multiset([s for _, s, _ in read], [n for _, _, n in read]) == _gap_multiset(values, weights)


def test_an_itl_target_reads_every_replicas_gaps_of_the_last_window():
    from simkv.replay.autoscale_latency import StepGaps

    spec = AutoscaleSpec(1, 3, metric="itl_p95=0.03", interval_s=15, cold_start_s=30, scale_down_window_s=60)
    result = replay(bursts(), CONFIG, fleet=FleetSpec(3, "least_outstanding", autoscale=spec))
    scaling = result.summary["fleet"]["autoscaling"]
    assert any(e["action"] == "up" for e in scaling["events"]) and any(e["action"] == "down" for e in scaling["events"])
    samples = [s for run in result.fleet_runs for s in StepGaps(run).read_until(2**62)]
    ticks = np.array([t for t, _, _ in samples])
    seconds = np.array([s for _, s, _ in samples])
    times = np.array([n for _, _, n in samples])
    decisions = scaling["decisions"]
    for t, value in zip(decisions["time_s"], decisions["itl_p95"]):
        tick = int(t * TICKS_PER_SECOND)
        seen = (ticks < tick) & (ticks > tick - 60 * TICKS_PER_SECOND)
        assert value == _expected(0.95, "itl", seconds[seen], times[seen])
    pd_spec = AutoscaleSpec(1, 2, metric="itl_p95=0.03")
    from simkv.replay.disaggregated import DisaggregationSpec

    DisaggregationSpec(num_decode=2, decode_autoscale=pd_spec)  # (the decode pool's own latency: taken)


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}])
def test_an_itl_target_under_pipeline_stages_reads_the_gaps_between_step_ends(options):
    """Pipeline parallelism: a token's gap is from its previous token's step end to its own
    (results.itl_samples: P batches overlap, a step's duration is none); each decision's ITL p95
    is that of the gaps the scheduler counted, whose token's step ended within the window."""
    spec = AutoscaleSpec(1, 3, metric="itl_p95=0.03", interval_s=15, cold_start_s=30, scale_down_window_s=60)
    config = EngineConfig.from_flat({"max_model_len": 4096, "pipeline_parallel_size": 2, **options})
    result = replay(bursts(), config, fleet=FleetSpec(3, "least_outstanding", autoscale=spec))
    scaling = result.summary["fleet"]["autoscaling"]
    assert any(e["action"] == "up" for e in scaling["events"])
    ticks, seconds, times = [], [], []
    for run in result.fleet_runs:
        for (previous, step), n in run.scheduler.pipeline_gaps.items():
            end = run.steps.end_tick(step)
            ticks.append(end)
            seconds.append((end - (run.steps.end_tick(previous) if previous >= 0 else 0)) / TICKS_PER_SECOND)
            times.append(n)
    ticks, seconds, times = np.array(ticks), np.array(seconds), np.array(times)
    decisions = scaling["decisions"]
    assert sum(v is not None for v in decisions["itl_p95"]) > 20
    for t, value in zip(decisions["time_s"], decisions["itl_p95"]):
        tick = int(t * TICKS_PER_SECOND)
        seen = (ticks < tick) & (ticks > tick - 60 * TICKS_PER_SECOND)
        assert value == _expected(0.95, "itl", seconds[seen], times[seen])


def test_custom_buckets_as_vllm_takes_them():
    """--autoscale-histogram-buckets (vLLM's --custom-histogram-buckets, also read from a
    --vllm-serve command): the latency query buckets its observations there instead."""
    fine = [0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1]
    text = json.dumps({"inter_token_latency": fine, "iteration_tokens": [1, 8]})
    spec = AutoscaleSpec(1, 3, metric="itl_p95=0.03", interval_s=15, cold_start_s=30, scale_down_window_s=60,
                         histogram_buckets=text)
    assert spec.histogram_buckets == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert spec.to_dict()["histogram_buckets"] == spec.histogram_buckets
    from simkv.replay.autoscale_latency import StepGaps

    result = replay(bursts(), CONFIG, fleet=FleetSpec(3, "least_outstanding", autoscale=spec))
    decisions = result.summary["fleet"]["autoscaling"]["decisions"]
    samples = [s for run in result.fleet_runs for s in StepGaps(run).read_until(2**62)]
    ticks = np.array([t for t, _, _ in samples])
    seconds = np.array([s for _, s, _ in samples])
    times = np.array([n for _, _, n in samples])
    for t, value in zip(decisions["time_s"], decisions["itl_p95"]):
        tick = int(t * TICKS_PER_SECOND)
        seen = (ticks < tick) & (ticks > tick - 60 * TICKS_PER_SECOND)
        assert value == _expected(0.95, "itl", seconds[seen], times[seen], bounds=tuple(fine))
    quiet = [v for v in decisions["itl_p95"] if v is not None and v < 0.01]
    assert quiet and len({round(v, 9) for v in quiet}) > 1  # (below 10 ms it reads the gaps, not 9.5 ms)
    for bad, message in (("[1]", "expected a JSON object"), ('{"ttft": [1]}', "unknown bucket family 'ttft'"),
                         ('{"request_latency": [2, 1]}', "must be strictly increasing"), ("{", "not a JSON object")):
        with pytest.raises(AutoscaleError, match=message):
            AutoscaleSpec(1, 2, histogram_buckets=bad)


def test_a_vllm_serve_commands_buckets_reach_the_autoscaler(tmp_path):
    text = json.dumps({"time_to_first_token": [0.05, 0.1, 0.2, 0.4]})
    serve = f"vllm serve meta-llama/Meta-Llama-3-8B-Instruct --custom-histogram-buckets '{text}'"
    out = tmp_path / "r"
    cli_ok(["replay", "traces/req400.parquet", "--vllm-serve", serve, "--autoscale", "1-2", "--autoscale-metric",
            "ttft_p95=1", "--out", str(out), "--quiet"])
    scaling = json.loads((out / "summary.json").read_text())["fleet"]["autoscaling"]
    assert json.loads(scaling["histogram_buckets"]) == json.loads(text)
    cli_ok(["replay", "traces/req400.parquet", "--vllm-serve", serve, "--out", str(tmp_path / "plain"), "--quiet"])
    mine = json.dumps({"time_to_first_token": [0.5, 1.0]})
    cli_ok(["replay", "traces/req400.parquet", "--vllm-serve", serve, "--autoscale", "1-2", "--autoscale-metric",
            "ttft_p95=1", "--autoscale-histogram-buckets", mine, "--out", str(tmp_path / "own"), "--quiet"])
    scaling = json.loads((tmp_path / "own" / "summary.json").read_text())["fleet"]["autoscaling"]
    assert json.loads(scaling["histogram_buckets"]) == json.loads(mine)  # (simkv's flag over the server's)


def test_a_metrics_delay_reads_each_metric_as_it_was_that_long_before():
    """--autoscale-metrics-delay-s D: a decision at T reads the requests in flight and the engine
    gauges at T - D (here recomputed from requests.parquet and steps.parquet), and the latency
    windows end there."""
    from tests.replay.test_autoscale import _gauges_from_steps, _ticks

    spec = AutoscaleSpec(1, 4, metric="in_flight=8,waiting=4", interval_s=15, cold_start_s=30,
                         scale_down_window_s=10_000, metrics_delay_s=20)
    result = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling = result.summary["fleet"]["autoscaling"]
    assert scaling["metrics_delay_s"] == 20.0 and not any(e["action"] == "down" for e in scaling["events"])
    requests = result.requests
    arrival, finish = _ticks(requests["arrival_time_s"]), _ticks(requests["finish_time_s"])
    replica = requests["replica"].to_numpy()
    steps = result.steps
    decisions = scaling["decisions"]
    first_up = next(e["time_s"] for e in scaling["events"] if e["action"] == "up")
    assert first_up >= 75.0  # (the burst begins at 60 s: read 20 s late, seen at the 75 s sample at the soonest)
    checked = 0
    for t, have, in_flight, waiting in zip(decisions["time_s"], decisions["replicas"], decisions["in_flight"],
                                           decisions["waiting"]):
        seen = _ticks(t) - _ticks(20.0)
        live = replica < have  # (no scale-down: the live slots are the lowest)
        assert in_flight == int(np.sum(live & (arrival < seen) & (finish >= seen)))
        if have == 1:  # (one replica, up all along: its gauges at T - D)
            assert waiting == _gauges_from_steps(steps, seen)[1]
            checked += 1
    assert checked > 3
    plain = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=AutoscaleSpec(
        1, 4, metric="in_flight=8,waiting=4", interval_s=15, cold_start_s=30, scale_down_window_s=10_000)))
    assert next(e["time_s"] for e in plain.summary["fleet"]["autoscaling"]["events"] if e["action"] == "up") < first_up
    with pytest.raises(AutoscaleError, match="--autoscale-metrics-delay-s must be a number of seconds >= 0"):
        AutoscaleSpec(1, 2, metrics_delay_s=-1)


def test_pd_pools_read_their_requests_in_flight_late_too():
    """A prefill request is in flight from its arrival to its prefill's end, a decode one from
    its handoff to its finish: each pool's decisions read them D seconds late."""
    from simkv.replay.disaggregated import DisaggregationSpec
    from tests.replay.test_autoscale import _ticks

    def scaling():
        return AutoscaleSpec(1, 2, interval_s=15, cold_start_s=30, scale_down_window_s=10_000, target=4,
                             metrics_delay_s=20)

    spec = DisaggregationSpec(num_prefill=2, num_decode=2, prefill_autoscale=scaling(), decode_autoscale=scaling())
    result = replay(bursts(), CONFIG, disaggregation=spec)
    requests = result.requests
    arrival, prefill_end = _ticks(requests["arrival_time_s"]), _ticks(requests["prefill_end_time_s"])
    handoff, finish = prefill_end + _ticks(spec.handoff_ms / 1e3), _ticks(requests["finish_time_s"])
    for pool, replica, start, end in (("prefill", requests["prefill_replica"].to_numpy(), arrival, prefill_end),
                                      ("decode", requests["decode_replica"].to_numpy(), handoff, finish)):
        section = result.summary["disaggregation"][pool]["autoscaling"]
        assert section["metrics_delay_s"] == 20.0 and section["events"][0]["time_s"] >= 75.0
        decisions = section["decisions"]
        assert max(decisions["in_flight"]) > 8
        for t, have, in_flight in zip(decisions["time_s"], decisions["replicas"], decisions["in_flight"]):
            seen = _ticks(t) - _ticks(20.0)
            assert in_flight == int(np.sum((replica < have) & (start < seen) & (end >= seen))), (pool, t)


def test_an_average_value_latency_target_asks_for_value_over_target_whatever_the_replicas():
    """--autoscale-latency-target-type AverageValue (KEDA's default metricType): HPA reads the
    latency as a sum over the replicas: it wants ceil(value / target), within the tolerance of
    what the replicas it has aim at."""
    spec = AutoscaleSpec(1, 4, metric="ttft_p95=0.3", interval_s=15, cold_start_s=30, scale_down_window_s=120,
                         latency_target_type="averagevalue")
    assert spec.latency_target_type == "AverageValue" and spec.to_dict()["latency_target_type"] == "AverageValue"
    result = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling = result.summary["fleet"]["autoscaling"]
    decisions = scaling["decisions"]
    checked = 0
    for value, have, wanted in zip(decisions["ttft_p95"], decisions["replicas"], decisions["wanted"]):
        if value is None:
            continue
        if abs(value / (0.3 * have) - 1) > 0.1:
            assert wanted == min(4, max(1, math.ceil(value / 0.3 - 1e-9)))
            checked += 1
        else:
            assert wanted == have
    assert checked > 10
    assert any(have > 1 for have in decisions["replicas"])
    # p95 0.45 s with 3 replicas up: Value wants 3 x 1.5 (all 4), AverageValue 1.5 (2)
    for kind, wanted in (("Value", 4), ("AverageValue", 2)):
        scaler = Autoscaler(AutoscaleSpec(1, 4, metric="ttft_p95=0.3", latency_target_type=kind))
        scaler.ready_at = [0, 0, 0, None]
        scaler.latency = SimpleNamespace(quantile=lambda kind, q, tick: 0.45)
        scaler._evaluate(15 * TICKS_PER_SECOND, [0] * 4)
        assert scaler.decisions["wanted"] == [wanted]
    assert "each (AverageValue)" in aims(scaling)
    with pytest.raises(AutoscaleError, match="expected Value or AverageValue"):
        AutoscaleSpec(1, 2, metric="ttft_p95=1", latency_target_type="Utilization")
