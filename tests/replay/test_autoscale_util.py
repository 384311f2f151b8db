"""GPU utilisation as an autoscaler reads it (`--autoscale-metric gpu_util`,
simkv/replay/autoscale_util.py)."""

from __future__ import annotations

import numpy as np
import pytest

from simkv.clock import TICKS_PER_SECOND
from simkv.config import EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.replay.autoscale import AutoscaleError, AutoscaleSpec, aims
from simkv.replay.autoscale_util import WINDOW_S, BusyWindow
from tests.cli_runs import cli_fails
from tests.replay.test_autoscale import CONFIG, bursts


def _busy_share(steps, tick: int, window: int) -> float:
    """The share of [tick - window, tick) covered by the steps that ended strictly before tick,
    from the step table."""
    start = np.round(np.asarray(steps["start_time_s"]) * TICKS_PER_SECOND).astype(np.int64)
    end = start + np.round(np.asarray(steps["duration_s"]) * TICKS_PER_SECOND).astype(np.int64)
    done = end < tick
    overlap = np.minimum(end[done], tick) - np.maximum(start[done], tick - window)
    return min(1.0, float(np.clip(overlap, 0, None).sum()) / window)


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}])
def test_the_busy_share_is_that_of_the_step_table(options):
    """BusyWindow, read inside decode runs and at single steps, at instants a decision would
    read, covers what the step table's steps cover of the window before."""
    result = replay(bursts(), EngineConfig.from_flat({"max_model_len": 4096, **options}))
    busy = BusyWindow(result.run.steps)
    window = int(WINDOW_S * TICKS_PER_SECOND)
    shares = []
    for t in np.arange(5.0, result.summary["duration_s"] + 5.0, 7.0):
        tick = int(t * TICKS_PER_SECOND)
        share = busy.share(tick)
        assert share == pytest.approx(_busy_share(result.steps, tick, window), abs=2e-6)
        shares.append(share)
    assert max(shares) > 0.99 and min(shares) < 0.5  # (the burst saturates it; the quiet minute does not)


def test_gpu_utilisation_reads_the_replicas_busy_shares_and_saturates():
    """Each decision reads the sum of the busy shares of the replicas ready by then (each from
    its own steps). A replica running any request reads busy: one request every 2 s keeps the
    GPU near half busy, and a saturated replica reads 1, so aimed at 70 % the fleet grows by at
    most ceil(replicas / 0.7) a decision (in flight asked for all four at once)."""
    spec = AutoscaleSpec(1, 4, metric="gpu_util", interval_s=15, cold_start_s=45, scale_down_window_s=120)
    assert spec.target == 0.7 and aims(spec.to_dict()) == "70% GPU utilisation each"
    result = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=spec))
    scaling = result.summary["fleet"]["autoscaling"]
    decisions = scaling["decisions"]
    window = int(WINDOW_S * TICKS_PER_SECOND)
    assert [(e["time_s"], e["action"], e["replicas"]) for e in scaling["events"]] == [(90.0, "up", 2),
                                                                                     (270.0, "down", 1)]
    for t, value, have in zip(decisions["time_s"], decisions["gpu_util"], decisions["replicas"]):
        tick = int(t * TICKS_PER_SECOND)
        up = 2 if 90.0 + 45.0 <= t <= 270.0 else 1  # (slot 1 read once ready, until its drain)
        expected = sum(_busy_share(run.steps.columns(), tick, window) for run in result.fleet_runs[:up])
        assert value == pytest.approx(expected, abs=1e-5), t
        assert value <= have + 1e-9
    quiet = [v for t, v in zip(decisions["time_s"], decisions["gpu_util"]) if 30 <= t <= 60]
    assert min(quiet) > 0.4  # (a request every 2 s, 50-300 tokens each)
    # (at 90 s one busy replica asked for ceil(1 / 0.7) = 2; while the second started it read
    # nothing, and once up the burst was over)
    in_flight = AutoscaleSpec(1, 4, target=8, interval_s=15, cold_start_s=45, scale_down_window_s=120)
    other = replay(bursts(), CONFIG, fleet=FleetSpec(4, "least_outstanding", autoscale=in_flight))
    assert [e["replicas"] for e in other.summary["fleet"]["autoscaling"]["events"] if e["action"] == "up"] == [4]
    for kwargs, message in (({"metric": "gpu_util", "target": 1.5}, "gpu_util aims at a share of the time"),):
        with pytest.raises(AutoscaleError, match=message):
            AutoscaleSpec(1, 2, **kwargs)
    assert "not modelled with pipeline parallelism" in cli_fails(
        ["replay", "traces/req400.parquet", "--autoscale", "1-2", "--autoscale-metric", "gpu_util", "-pp", "2"])
