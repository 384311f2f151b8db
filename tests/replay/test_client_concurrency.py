"""A client that keeps at most N requests in flight (`--client-max-concurrency`, vllm bench
serve's --max-concurrency): simkv/replay/sessions.py's ConcurrencyPacing."""

import json

import numpy as np
import pandas as pd
import pytest

from simkv.clock import TICKS_PER_SECOND
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.traces.schema import read_trace
from tests.cli_runs import cli_fails, cli_ok

TICK = 1 / TICKS_PER_SECOND


def _replay(trace_path: str, **options):
    return replay(read_trace(trace_path), EngineConfig.from_flat(options))


def _in_flight(requests: pd.DataFrame) -> int:
    """The most requests sent and not yet finished at any instant (a finish at t before a send at t)."""
    events = sorted([(t, 1) for t in requests["arrival_time_s"]] + [(t, -1) for t in requests["finish_time_s"]],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_a_limit_above_the_engines_own_peak_changes_nothing():
    free = _replay("traces/azure_conv_slice.parquet")
    capped = _replay("traces/azure_conv_slice.parquet", client_max_concurrency=64)
    assert free.summary["peak_running"] < 64
    pd.testing.assert_frame_equal(free.requests, capped.requests)
    assert free.steps.keys() == capped.steps.keys()
    for name in free.steps:
        assert np.array_equal(np.asarray(free.steps[name]), np.asarray(capped.steps[name])), name
    assert capped.summary["client_concurrency"] == {"max_concurrency": 64, "requests_held": 0, "mean_hold_s": 0.0}


@pytest.mark.parametrize("limit", [1, 4, 32])
def test_a_closed_loop_keeps_exactly_the_limit_in_flight(limit):
    """req400 sends every request at once: the client sends the first `limit`, then the next row
    one tick after each finish, in row order."""
    requests = _replay("traces/req400.parquet", client_max_concurrency=limit).requests
    assert _in_flight(requests) == limit
    sent = requests["arrival_time_s"].to_numpy()
    assert (sent[:limit] == 0).all() and (np.diff(sent) >= 0).all()
    finishes = np.sort(requests["finish_time_s"].to_numpy())
    # the k-th send after the first `limit` comes one tick after the k-th finish
    assert np.allclose(sent[limit:], finishes[:len(sent) - limit] + TICK, rtol=0, atol=1e-12)


def test_a_limit_holds_requests_back_and_the_engine_runs_fewer():
    free = _replay("traces/azure_conv_slice.parquet", model="llama-3-8b")
    capped = _replay("traces/azure_conv_slice.parquet", model="llama-3-8b", client_max_concurrency=8)
    assert capped.summary["peak_running"] == 8 < free.summary["peak_running"]
    held = capped.summary["client_concurrency"]
    assert held["requests_held"] > 0 and held["mean_hold_s"] > 0
    assert _in_flight(capped.requests) == 8
    assert capped.summary["duration_s"] > free.summary["duration_s"]


def test_rejected_requests_free_their_slot():
    """A prompt past max_model_len is refused at once: the next row goes a tick later."""
    requests = _replay("traces/req400.parquet", client_max_concurrency=2, max_model_len=600).requests
    rejected = requests["status"] == "rejected"
    assert rejected.any() and (requests.loc[~rejected, "status"] == "finished").all()
    assert _in_flight(requests.fillna({"finish_time_s": requests["arrival_time_s"]})) <= 2


@pytest.mark.parametrize("options, extra, match", [
    ({"client_max_concurrency": 4, "client_timeout_s": 5.0}, {}, "clients that give up"),
    ({"client_max_concurrency": 4, "max_num_queued_reqs": 8}, {}, "admission control"),
])
def test_what_a_limit_is_not_modelled_with(options, extra, match):
    with pytest.raises(ValueError, match=match):
        replay(read_trace("traces/req400.parquet"), EngineConfig.from_flat(options), **extra)


def test_sessions_need_no_pacing_under_a_limit():
    with pytest.raises(ValueError, match="--no-session-pacing"):
        _replay("traces/kvcache_coding_sessions.parquet", client_max_concurrency=4)
    _replay("traces/kvcache_coding_sessions.parquet", client_max_concurrency=4, session_pacing=False)


def test_a_limit_must_be_positive():
    with pytest.raises(ConfigError, match="client_max_concurrency must be >= 1"):
        EngineConfig.from_flat({"client_max_concurrency": 0})


def test_from_the_cli(tmp_path):
    out = cli_ok(["replay", "traces/req400.parquet", "--out", str(tmp_path), "--client-max-concurrency", "16"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["client_max_concurrency"] == 16 and summary["peak_running"] <= 16
    assert "client concurrency limit" in out and "client concurrency limit" in (tmp_path / "report.html").read_text()
    assert "not modelled with clients that give up" in cli_fails(
        ["replay", "traces/req400.parquet", "--out", str(tmp_path / "f"), "--client-max-concurrency", "4",
         "--client-timeout", "5"])


@pytest.mark.parametrize("options", [{"async_scheduling": True},
                                     {"model": "llama-3-70b", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}])
def test_the_limit_holds_under_async_scheduling_and_pipeline_stages(options):
    requests = _replay("traces/req400.parquet", client_max_concurrency=4, **options).requests
    assert _in_flight(requests) == 4 and (requests["status"] == "finished").all()



def _pd():
    from simkv.replay.disaggregated import DisaggregationSpec

    return DisaggregationSpec(num_prefill=1, num_decode=1)


FLEETS = {"fleet": ({}, lambda: {"fleet": FleetSpec(3, "least_outstanding")}),
          "data-parallel ranks": ({"model": "deepseek-v2-lite", "data_parallel_size": 2}, dict),
          "P/D": ({}, lambda: {"disaggregation": _pd()})}


@pytest.mark.parametrize("kind", sorted(FLEETS))
def test_a_limit_in_front_of_several_engines(kind):
    """A fleet, data-parallel ranks or a P/D pair: a limit above what they run at once changes
    nothing; a small one keeps exactly that many in flight over all of them."""
    options, extra = FLEETS[kind]
    trace = read_trace("traces/azure_conv_slice.parquet")
    free = replay(trace, EngineConfig.from_flat(options), **extra())
    capped = replay(trace, EngineConfig.from_flat(options | {"client_max_concurrency": 1000}), **extra())
    pd.testing.assert_frame_equal(free.requests, capped.requests)
    assert capped.summary["client_concurrency"]["requests_held"] == 0
    small = replay(read_trace("traces/req400.parquet"), EngineConfig.from_flat(options | {"client_max_concurrency": 6}),
                   **extra())
    assert _in_flight(small.requests) == 6 and (small.requests["status"] == "finished").all()
    assert small.summary["client_concurrency"]["requests_held"] == 394
