"""A client that keeps at most N requests in flight (`--client-max-concurrency`, vllm bench
serve's --max-concurrency): simkv/replay/sessions.py's Pacing."""

import json

import numpy as np
import pandas as pd
import pytest

from simkv.clock import TICKS_PER_SECOND
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.traces.schema import read_trace
from tests.cli_runs import cli_fails, cli_ok
from tests.replay.engine_setups import KINDS, engine_setup

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


def _released_at(requests: pd.DataFrame, sc: dict) -> np.ndarray:
    """When each row's client was done with it: its finish; its last deadline (given up on for
    good: every attempt timed out on its first token, the back-offs between them); or when the
    front end refused it for good (refused at each attempt: only the back-offs)."""
    arrival = requests["arrival_time_s"].to_numpy()
    attempts = requests["attempts"].to_numpy() if "attempts" in requests else np.ones(len(requests), np.int64)
    backoffs = np.array([sum(sc.get("client_retry_backoff_s", 0.5) * 2 ** k for k in range(a - 1)) for a in attempts])
    status = requests["status"].to_numpy()
    released = np.where(status == "finished", requests["finish_time_s"].to_numpy(), arrival + backoffs)
    timed_out = status == "timed_out"
    released[timed_out] += attempts[timed_out] * sc.get("client_ttft_timeout_s", 0.0)
    return released


def _check_closed_loop(requests: pd.DataFrame, sc: dict, limit: int, exact: bool = True) -> None:
    """All rows sent at once: exactly `limit` in flight, and after the first `limit` each send a
    tick after the next release (a finish, a last deadline or a refusal for good). Not `exact`:
    each a tick after a release of its own, not always the next (a replica busy with a step
    answers the HTTP 503s of requests sent meanwhile at its next step boundary, dated when they
    were sent: a finish elsewhere before that boundary may have taken the last rows)."""
    released = np.sort(_released_at(requests, sc))
    sent = np.sort(requests["arrival_time_s"].to_numpy())
    # in flight at each send: rows sent by then, less those released before (a refusal is instant)
    in_flight = np.arange(1, len(sent) + 1) - np.searchsorted(released, sent, side="left")
    assert in_flight.max() == limit
    later = sent[limit:]
    if exact:
        assert np.allclose(later, released[:len(later)] + TICK, rtol=0, atol=1e-9)
        return
    slots = list(np.round((released + TICK) * TICKS_PER_SECOND).astype(np.int64))
    for tick in np.round(later * TICKS_PER_SECOND).astype(np.int64):  # (a slot of its own each)
        slots.remove(tick)


GIVE_UPS = {  # (A100's 2,048-token steps: a queue builds; each case has releases of every kind it names)
    "time-outs": {"client_ttft_timeout_s": 0.5, "client_max_retries": 1},
    "time-outs, no retries": {"client_ttft_timeout_s": 0.5},
    "refusals (HTTP 503), no retries": {"max_num_queued_reqs": 16},
    "refusals (HTTP 503), retried": {"max_num_queued_reqs": 16, "client_max_retries": 1},
}


@pytest.mark.parametrize("case", sorted(GIVE_UPS))
def test_requests_given_up_on_free_their_slot_when_their_client_is_done(case):
    """A client that gives up keeps its slot through its back-offs and frees it at its last
    deadline; a request refused for good frees it when refused."""
    sc = GIVE_UPS[case]
    result = _replay("traces/req400.parquet", client_max_concurrency=64, gpu="A100-80GB", **sc)
    requests = result.requests
    status = set(requests["status"])
    assert "finished" in status and status & {"timed_out", "rejected"}
    if sc.get("client_max_retries"):
        assert (requests["attempts"] > 1).any()
    _check_closed_loop(requests, sc, 64)


def _check_paced_turns_under_a_limit(result, trace, limit: int) -> None:
    """Paced sessions under a limit: a turn goes no sooner than its previous turn's finish plus
    its think time (or its trace time); never more than `limit` in flight, and exactly `limit`
    when a due turn waits: it is then sent a tick after a release, while `limit` were in flight."""
    req = result.requests.set_index("request_id")
    assert set(req["status"]) == {"finished"}
    think = dict(zip(trace.request_id, trace.think_time_s if trace.think_time_s is not None
                     else np.zeros(len(trace))))
    trace_at = dict(zip(trace.request_id, trace.arrival_time_s))
    session = dict(zip(trace.request_id, trace.session_id))
    previous, last = {}, {}
    for rid in trace.request_id:  # (rows in arrival order: each turn after its session's previous)
        if session[rid] in last:
            previous[rid] = last[session[rid]]
        last[session[rid]] = rid
    sent = req["arrival_time_s"]
    finish = req["finish_time_s"]
    order = np.sort(sent.to_numpy())
    ends = np.sort(finish.to_numpy())
    held = 0
    for rid in req.index:
        due = trace_at[rid]
        if rid in previous:
            due = max(due, finish[previous[rid]] + max(think[rid], TICK))
        assert sent[rid] >= due - 1e-9
        in_flight = np.searchsorted(order, sent[rid], side="right") - np.searchsorted(ends, sent[rid], side="left")
        assert in_flight <= limit
        if sent[rid] > due + 1e-9:  # (held for a slot: freed a tick before, with every slot taken)
            held += 1
            freed = sent[rid] - TICK
            assert np.isclose(ends, freed, rtol=0, atol=1e-9).any()
            busy = np.searchsorted(order, freed, side="right") - np.searchsorted(ends, freed - 1e-9, side="left")
            assert busy == limit
    assert held == result.summary["client_concurrency"]["requests_held"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_paced_sessions_under_a_limit(kind, tmp_path):
    """Conversations paced on their replies, at most N requests of them in flight (vLLM's
    multi-turn benchmark's --num-clients): a turn waits for its reply, then for a slot."""
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=60, turns=4, think_time_s=1.0), seed=6)
    options, extra = engine_setup(kind, dict(num_gpu_blocks=2000, max_model_len=8192, client_max_concurrency=12))
    config = EngineConfig.from_flat(options)
    result = replay(trace, config, **extra)
    _check_paced_turns_under_a_limit(result, trace, 12)
    assert result.summary["session_pacing"]["turns_held"] > 0
    stepped = replay(trace, config, use_decode_runs=False, **extra)
    pd.testing.assert_frame_equal(result.requests, stepped.requests)
    free = replay(trace, EngineConfig.from_flat(options | {"client_max_concurrency": 10_000}), **extra)
    assert "client_concurrency" in free.summary and free.summary["client_concurrency"]["requests_held"] == 0
    paced = replay(trace, EngineConfig.from_flat({k: v for k, v in options.items() if k != "client_max_concurrency"}),
                   **extra)
    pd.testing.assert_frame_equal(free.requests, paced.requests)


def test_a_conversation_given_up_on_ends_and_frees_its_slot():
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=60, turns=4, think_time_s=1.0), seed=6)
    result = replay(trace, EngineConfig.from_flat(dict(gpu="A100-80GB", max_model_len=8192, client_max_concurrency=24,
                                                       client_ttft_timeout_s=0.3)))
    status = result.requests["status"].value_counts()
    assert status["timed_out"] > 0 and status["abandoned"] > 0 and status["finished"] > 0
    assert result.summary["client"]["abandoned_turns"] == status["abandoned"]
    assert "client_concurrency" in result.summary and "session_pacing" in result.summary


def test_a_limit_must_be_positive():
    with pytest.raises(ConfigError, match="client_max_concurrency must be >= 1"):
        EngineConfig.from_flat({"client_max_concurrency": 0})


def test_from_the_cli(tmp_path):
    out = cli_ok(["replay", "traces/req400.parquet", "--out", str(tmp_path), "--client-max-concurrency", "16"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["client_max_concurrency"] == 16 and summary["peak_running"] <= 16
    assert "client concurrency limit" in out and "client concurrency limit" in (tmp_path / "report.html").read_text()
    assert "not modelled with encode instances" in cli_fails(
        ["replay", "traces/req400.parquet", "--out", str(tmp_path / "f"), "--client-max-concurrency", "4",
         "--model", "qwen2.5-vl-7b", "--encode-replicas", "1"])


@pytest.mark.parametrize("options", [{"async_scheduling": True},
                                     {"model": "llama-3-70b", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}])
def test_the_limit_holds_under_async_scheduling_and_pipeline_stages(options):
    requests = _replay("traces/req400.parquet", client_max_concurrency=4, **options).requests
    assert _in_flight(requests) == 4 and (requests["status"] == "finished").all()



SEVERAL = KINDS[1:]  # (a fleet, data-parallel ranks, a P/D pair)


@pytest.mark.parametrize("kind", SEVERAL)
def test_a_limit_in_front_of_several_engines(kind):
    """A fleet, data-parallel ranks or a P/D pair: a limit above what they run at once changes
    nothing; a small one keeps exactly that many in flight over all of them."""
    options, extra = engine_setup(kind, {})
    trace = read_trace("traces/azure_conv_slice.parquet")
    free = replay(trace, EngineConfig.from_flat(options), **extra)
    capped = replay(trace, EngineConfig.from_flat(options | {"client_max_concurrency": 1000}), **extra)
    pd.testing.assert_frame_equal(free.requests, capped.requests)
    assert capped.summary["client_concurrency"]["requests_held"] == 0
    small = replay(read_trace("traces/req400.parquet"), EngineConfig.from_flat(options | {"client_max_concurrency": 6}),
                   **extra)
    assert _in_flight(small.requests) == 6 and (small.requests["status"] == "finished").all()
    assert small.summary["client_concurrency"]["requests_held"] == 394


@pytest.mark.parametrize("kind", SEVERAL)
@pytest.mark.parametrize("case", ["time-outs", "refusals (HTTP 503), no retries"])
def test_given_up_requests_free_their_slot_in_front_of_several_engines(kind, case):
    """The same rule over a fleet, data-parallel ranks or a P/D pair; decode runs stop where a
    give-up elsewhere could send a request (stepping gives the same replay)."""
    options, extra = engine_setup(kind, {})
    sc = GIVE_UPS[case]
    if kind == "data-parallel ranks" and "client_ttft_timeout_s" in sc:
        sc = sc | {"client_ttft_timeout_s": 0.2}  # (its ranks prefill faster: a tighter deadline for some to miss)
    config = EngineConfig.from_flat(options | {"gpu": "A100-80GB", "client_max_concurrency": 64} | sc)
    trace = read_trace("traces/req400.parquet")
    result = replay(trace, config, **extra)
    status = set(result.requests["status"])
    assert "finished" in status and status & {"timed_out", "rejected"}
    _check_closed_loop(result.requests, sc, 64, exact=kind == "data-parallel ranks" or "max_num_queued_reqs" not in sc)
    stepped = replay(trace, config, use_decode_runs=False, **extra)
    pd.testing.assert_frame_equal(result.requests, stepped.requests)


def _check_active_sessions(result, trace, max_active: int, exact: bool = True) -> None:
    """At most `max_active` conversations in progress (first turn sent to last turn finished);
    one that starts later than its first turn's trace time starts a tick after another ended,
    while `max_active` were in progress (not `exact`: or later, waiting for a request slot)."""
    req = result.requests.set_index("request_id")
    assert set(req["status"]) == {"finished"}
    frame = pd.DataFrame({"request_id": trace.request_id, "session": trace.session_id,
                          "trace_at": trace.arrival_time_s})
    frame = frame.join(req[["arrival_time_s", "finish_time_s"]], on="request_id")
    sessions = frame.groupby("session", sort=False).agg(start=("arrival_time_s", "first"), end=("finish_time_s", "last"),
                                                        trace_at=("trace_at", "first"))
    starts, ends = np.sort(sessions["start"].to_numpy()), np.sort(sessions["end"].to_numpy())
    late = 0
    for start, trace_at in zip(sessions["start"], sessions["trace_at"]):
        assert np.searchsorted(starts, start, side="right") - np.searchsorted(ends, start, side="left") <= max_active
        if start > trace_at + 1e-9 and exact:
            late += 1
            freed = start - TICK
            assert np.isclose(ends, freed, rtol=0, atol=1e-9).any()
            assert np.searchsorted(starts, freed, side="right") - np.searchsorted(ends, freed - 1e-9, side="left") \
                == max_active
    assert result.summary["session_pacing"]["sessions_started_late"] > 0
    if exact:
        assert late == result.summary["session_pacing"]["sessions_started_late"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("clients", [None, 4])
def test_at_most_m_conversations_in_progress(kind, clients):
    """vLLM's multi-turn benchmark's --max-active-conversations (`client_max_active_sessions`):
    the next conversation starts a tick after one ends; with a concurrency limit too, its turns
    also wait for a slot."""
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=40, turns=4, think_time_s=1.0), seed=6)
    options, extra = engine_setup(kind, dict(num_gpu_blocks=2000, max_model_len=8192, client_max_active_sessions=8)
                                  | ({"client_max_concurrency": clients} if clients else {}))
    config = EngineConfig.from_flat(options)
    result = replay(trace, config, **extra)
    _check_active_sessions(result, trace, 8, exact=clients is None)
    if clients is not None:  # (never more than `clients` requests in flight, and some held for a slot)
        sent = np.sort(result.requests["arrival_time_s"].to_numpy())
        ends = np.sort(result.requests["finish_time_s"].to_numpy())
        assert (np.arange(1, len(sent) + 1) - np.searchsorted(ends, sent, side="left")).max() == clients
        assert result.summary["client_concurrency"]["requests_held"] > 0
    stepped = replay(trace, config, use_decode_runs=False, **extra)
    pd.testing.assert_frame_equal(result.requests, stepped.requests)


def test_an_active_sessions_limit_needs_sessions(tmp_path):
    with pytest.raises(ValueError, match="no session_id column"):
        _replay("traces/req400.parquet", client_max_active_sessions=4)
    with pytest.raises(ConfigError, match="needs session pacing"):
        EngineConfig.from_flat({"client_max_active_sessions": 4, "session_pacing": False})
    out = cli_ok(["replay", "traces/kvcache_coding_sessions.parquet", "--out", str(tmp_path),
                  "--client-max-active-sessions", "2", "--client-max-concurrency", "2"])
    assert "active sessions limit" in out and "client concurrency limit" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["client_max_active_sessions"] == 2
    assert summary["session_pacing"]["max_active_sessions"] == 2 and summary["peak_running"] <= 2


def _check_token_budget(requests: pd.DataFrame, budget: int) -> None:
    """Rows go in arrival order; at every send the rows in flight hold at most `budget` prompt +
    output tokens (a row larger than the budget alone), and a held row went a tick after a
    release, when it did not fit before, or with the row ahead of it (which it waited behind)."""
    sent, ends = requests["arrival_time_s"].to_numpy(), requests["finish_time_s"].to_numpy()
    weight = (requests["prompt_tokens"] + requests["output_tokens"]).to_numpy()
    assert (np.diff(sent) >= 0).all()
    held = 0
    for i in range(len(requests)):
        out = (sent <= sent[i]) & (ends > sent[i])
        assert weight[out].sum() <= budget or out.sum() == 1
        if sent[i] > 0:  # (req400: every row arrives at 0)
            held += 1
            freed = sent[i] - TICK
            assert np.isclose(ends, freed, rtol=0, atol=1e-9).any()
            before = (sent < sent[i]) & (ends >= freed - 1e-9)  # (in flight just before the release)
            assert weight[before].sum() + weight[i] > budget or sent[i] == sent[i - 1]
    assert held > 0


@pytest.mark.parametrize("budget", [3_000, 20_000])
def test_a_token_budget_holds_rows_until_they_fit(budget):
    result = _replay("traces/req400.parquet", client_max_inflight_tokens=budget)
    _check_token_budget(result.requests, budget)
    cc = result.summary["client_concurrency"]
    assert cc["max_inflight_tokens"] == budget and "max_concurrency" not in cc and cc["requests_held"] > 0


def test_a_row_larger_than_the_budget_goes_alone():
    requests = _replay("traces/req400.parquet", client_max_inflight_tokens=500, max_model_len=8192).requests
    weight = (requests["prompt_tokens"] + requests["output_tokens"]).to_numpy()
    assert (weight > 500).any()
    _check_token_budget(requests, 500)
    sent, ends = requests["arrival_time_s"].to_numpy(), requests["finish_time_s"].to_numpy()
    for i in np.flatnonzero(weight > 500):  # (sent once every earlier row was done; the next after it)
        assert ((sent < ends[i]) & (ends > sent[i])).sum() == 1


@pytest.mark.parametrize("kind", KINDS)
def test_both_limits_on_every_way_of_serving(kind):
    options, extra = engine_setup(kind, {"client_max_concurrency": 8, "client_max_inflight_tokens": 6_000})
    config = EngineConfig.from_flat(options)
    trace = read_trace("traces/req400.parquet")
    result = replay(trace, config, **extra)
    assert _in_flight(result.requests) <= 8
    r = result.requests
    sent, ends = r["arrival_time_s"].to_numpy(), r["finish_time_s"].to_numpy()
    weight = (r["prompt_tokens"] + r["output_tokens"]).to_numpy()
    for i in range(len(r)):
        out = (sent <= sent[i]) & (ends > sent[i])
        assert weight[out].sum() <= 6_000 or out.sum() == 1
    stepped = replay(trace, config, use_decode_runs=False, **extra)
    pd.testing.assert_frame_equal(r, stepped.requests)


def test_a_token_budget_from_the_cli(tmp_path):
    out = cli_ok(["replay", "traces/req400.parquet", "--out", str(tmp_path), "--client-max-inflight-tokens", "20000"])
    assert "20,000 tokens in flight" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["client_max_inflight_tokens"] == 20_000
    with pytest.raises(ConfigError, match="client_max_inflight_tokens must be >= 1"):
        EngineConfig.from_flat({"client_max_inflight_tokens": 0})
