"""A client that stops once its conversations run out (`client_early_stop`, vLLM's multi-turn
benchmark's default): simkv/replay/sessions.py's SessionPacing."""

import json

import numpy as np
import pandas as pd
import pytest

from simkv.clock import TICKS_PER_SECOND
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.replay.goodput import goodput_summary
from simkv.traces.schema import read_trace
from tests.cli_runs import cli_fails, cli_ok
from tests.replay.engine_setups import KINDS, engine_setup

HALF_TICK = 0.5 / TICKS_PER_SECOND  # (a row sent a tick after the stop is not sent)


def _conversation_spans(requests: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per conversation (a session of multi_turn's trace): its first send and its last finish."""
    conversation = requests["request_id"].str.rsplit("-", n=1).str[0]
    by = requests.groupby(conversation)
    return by["arrival_time_s"].min(), by["finish_time_s"].max()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("clients", [None, 4])
def test_the_client_stops_at_the_first_conversation_end_with_none_left_to_start(kind, clients):
    """Nothing before the stop changes: the rows sent by then are the rows the whole replay sent
    by then, at the same times, and those done by then are done the same; every later row is
    never sent (status not_sent) and the rows in flight finish."""
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=40, turns=4, think_time_s=1.0), seed=6)
    options, extra = engine_setup(kind, dict(num_gpu_blocks=2000, max_model_len=8192, client_max_active_sessions=8)
                                  | ({"client_max_concurrency": clients} if clients else {}))
    whole = replay(trace, EngineConfig.from_flat(options), **extra)
    config = EngineConfig.from_flat(options | {"client_early_stop": True})
    stopped = replay(trace, config, **extra)

    # the 9th conversation starts at the 1st end, ..., the 40th at the 32nd: the 33rd stops it
    _, ends = _conversation_spans(whole.requests)
    stop = np.sort(ends.to_numpy())[40 - 8]
    section = stopped.summary["session_pacing"]
    assert section["early_stop_s"] == pytest.approx(stop, abs=1e-9)

    a, b = whole.requests, stopped.requests
    sent_before = a["arrival_time_s"].to_numpy() <= stop + HALF_TICK
    not_sent = b["status"].to_numpy() == "not_sent"
    assert np.array_equal(~not_sent, sent_before) and 0 < not_sent.sum() < len(b)
    assert section["turns_not_sent"] == not_sent.sum()
    assert (b.loc[~not_sent, "status"] == "finished").all()
    assert np.array_equal(a.loc[sent_before, "arrival_time_s"], b.loc[~not_sent, "arrival_time_s"])
    done_before = sent_before & (a["finish_time_s"].to_numpy() <= stop + HALF_TICK)
    for column in ("first_token_time_s", "finish_time_s", "prefix_hit_tokens"):
        assert np.array_equal(a.loc[done_before, column], b.loc[done_before, column]), column
    assert stopped.summary["num_finished"] == (~not_sent).sum()
    assert stopped.summary["duration_s"] < whole.summary["duration_s"]

    stepped = replay(trace, config, use_decode_runs=False, **extra)
    pd.testing.assert_frame_equal(stopped.requests, stepped.requests)


def test_without_a_limit_on_conversations_the_first_end_stops_the_client():
    """Every conversation starts at its own time, so none is left to start from the outset: the
    first conversation to end stops the client, and later first turns are never sent either."""
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=30, turns=3, think_time_s=0.5), seed=2)
    result = replay(trace, EngineConfig.from_flat({"client_early_stop": True}))
    requests = result.requests
    finished = requests[requests["status"] == "finished"]
    session = requests["request_id"].str.rsplit("-", n=1).str[0]
    complete = ~session.isin(set(session[requests["status"] == "not_sent"]))  # (every turn sent)
    _, ends = _conversation_spans(requests[complete])
    stop = result.summary["session_pacing"]["early_stop_s"]
    assert stop == pytest.approx(ends.min(), abs=1e-9)
    assert (finished["arrival_time_s"] <= stop + HALF_TICK).all()
    assert set(requests["status"]) == {"finished", "not_sent"}


def test_goodput_counts_only_the_requests_sent():
    requests = pd.DataFrame({"status": ["finished", "finished", "not_sent", "not_sent"],
                             "ttft_s": [0.1, 0.5, np.nan, np.nan], "mean_itl_s": [0.01, 0.01, np.nan, np.nan],
                             "e2e_s": [1.0, 1.0, np.nan, np.nan]})
    summary = goodput_summary(requests, {"ttft": 200}, duration_s=2.0)
    assert summary["num_good"] == 1 and summary["slo_attainment"] == 0.5


def test_an_early_stop_needs_paced_sessions(tmp_path):
    with pytest.raises(ValueError, match="no session_id column"):
        replay(read_trace("traces/req400.parquet"), EngineConfig.from_flat({"client_early_stop": True}))
    with pytest.raises(ConfigError, match="needs session pacing"):
        EngineConfig.from_flat({"client_early_stop": True, "session_pacing": False})
    assert "client_early_stop" not in EngineConfig.from_flat({}).to_dict()
    out = cli_ok(["replay", "traces/kvcache_coding_sessions.parquet", "--out", str(tmp_path),
                  "--client-max-active-sessions", "2", "--client-early-stop", "--max-model-len", "65536"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["client_early_stop"] is True
    assert f"{summary['session_pacing']['turns_not_sent']:,} turns not sent" in out
    requests = pd.read_parquet(tmp_path / "requests.parquet")
    assert (requests["status"] == "not_sent").sum() == summary["session_pacing"]["turns_not_sent"] > 0
    assert "no session_id column" in cli_fails(["replay", "traces/req400.parquet", "--client-early-stop",
                                                "--out", str(tmp_path / "x")])
