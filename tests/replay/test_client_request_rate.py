"""Clients that pause between their requests (`client_request_rate`, vLLM's multi-turn
benchmark's --request-rate): simkv/replay/sessions.py's SessionPacing."""

import numpy as np
import pandas as pd
import pytest

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import read_trace
from simkv.traces.synth_sessions import SessionShape, multi_turn
from tests.replay.engine_setups import KINDS, engine_setup


def _ticks(seconds) -> np.ndarray:
    return np.round(np.asarray(seconds, dtype=np.float64) * TICKS_PER_SECOND).astype(np.int64)


def test_one_client_pauses_by_its_own_draws():
    """One client, one conversation at a time: every request after the first is sent a tick after
    the previous one's finish plus a pause drawn from numpy's state seeded seed + 1, of mean
    1 / rate less the previous request's duration (no draw when that is not positive)."""
    trace = multi_turn(SessionShape(sessions=6, turns=5, think_time_s=0.0), seed=3)
    rate, seed = 0.25, 11
    result = replay(trace, EngineConfig.from_flat({"client_max_active_sessions": 1, "client_request_rate": rate,
                                                   "client_seed": seed}))
    requests = result.requests.sort_values("arrival_time_s")
    sent, finish = _ticks(requests["arrival_time_s"]), _ticks(requests["finish_time_s"])
    assert (sent[1:] >= finish[:-1]).all()  # (one at a time)
    rng = np.random.RandomState(seed + 1)
    draws = 0
    for i in range(1, len(sent)):
        mean = 1.0 / rate - (finish[i - 1] - sent[i - 1]) / TICKS_PER_SECOND
        pause = 0
        if mean > 0:
            pause = to_ticks(float(rng.exponential(mean)))
            draws += 1
        assert sent[i] == finish[i - 1] + 1 + pause, i
    assert draws > len(sent) // 2
    section = result.summary["session_pacing"]
    assert section["request_rate"] == rate and section["clients"] == 1 and section["mean_pause_s"] > 0


def test_each_client_keeps_about_its_rate():
    """Eight clients, each pausing for 1 / rate less the request's duration on average: the
    replay sends about 8 x rate requests per second (the engine keeps each request well under
    1 / rate)."""
    trace = multi_turn(SessionShape(sessions=64, turns=8, think_time_s=0.0), seed=5)
    rate = 0.2
    result = replay(trace, EngineConfig.from_flat({"client_max_active_sessions": 8, "client_request_rate": rate}))
    requests = result.requests
    assert (requests["e2e_s"] < 1 / rate).mean() > 0.9
    sent = np.sort(requests["arrival_time_s"].to_numpy())
    per_second = (len(sent) - 1) / (sent[-1] - sent[0])
    assert per_second == pytest.approx(8 * rate, rel=0.1)
    free = replay(trace, EngineConfig.from_flat({"client_max_active_sessions": 8})).requests
    assert free["arrival_time_s"].max() < 0.5 * sent[-1]  # (back to back without the pauses)


def test_the_pauses_follow_the_seed():
    trace = multi_turn(SessionShape(sessions=12, turns=4, think_time_s=0.0), seed=1)

    def sent(seed):
        config = EngineConfig.from_flat({"client_max_active_sessions": 4, "client_request_rate": 1.0,
                                         "client_seed": seed})
        return replay(trace, config).requests["arrival_time_s"].to_numpy()

    assert np.array_equal(sent(3), sent(3)) and not np.array_equal(sent(3), sent(4))


@pytest.mark.parametrize("kind", KINDS)
def test_paced_clients_replay_the_same_by_decode_runs_and_steps(kind):
    """Pauses only move when turns are due: every setup replays them the same stepped or by
    decode runs, with a concurrency limit and an early stop too."""
    trace = multi_turn(SessionShape(sessions=30, turns=4, think_time_s=0.0), seed=4)
    options, extra = engine_setup(kind, dict(num_gpu_blocks=2000, max_model_len=8192, client_max_active_sessions=6,
                                             client_max_concurrency=6, client_request_rate=2.0,
                                             client_early_stop=True))
    config = EngineConfig.from_flat(options)
    result = replay(trace, config, **extra)
    assert result.summary["session_pacing"]["mean_pause_s"] > 0
    assert (result.requests["status"] == "not_sent").sum() == result.summary["session_pacing"]["turns_not_sent"]
    stepped = replay(trace, config, use_decode_runs=False, **extra)
    pd.testing.assert_frame_equal(result.requests, stepped.requests)


def test_a_request_rate_needs_paced_sessions():
    with pytest.raises(ValueError, match="no session_id column"):
        replay(read_trace("traces/req400.parquet"), EngineConfig.from_flat({"client_request_rate": 1.0}))
    with pytest.raises(ConfigError, match="needs session pacing"):
        EngineConfig.from_flat({"client_request_rate": 1.0, "session_pacing": False})
    with pytest.raises(ConfigError, match="must be > 0"):
        EngineConfig.from_flat({"client_request_rate": 0.0})
    assert "client_seed" not in EngineConfig.from_flat({}).to_dict()
