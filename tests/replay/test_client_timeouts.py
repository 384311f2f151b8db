"""Clients that give up (`--client-timeout`, `--client-ttft-timeout`), vLLM's aborts, and retries
(`--client-max-retries`, `--client-retry-backoff`): simkv/replay/client_timeouts.py.

The recorded cases come from the real vLLM 0.33 scheduler (synchronous and async), aborting the
requests simkv's clients gave up on with its finish_requests(FINISHED_ABORTED) and receiving
their retries as new requests (`scripts/oracle_fuzz.py --timeouts [--async-scheduling] --record`)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.core.scheduler import Scheduler
from simkv.replay.api import FleetSpec, replay
from simkv.traces.schema import read_trace, trace_from_frame, trace_to_frame, write_trace
from tests.cli_runs import cli_ok
from tests.core.helpers import (assert_as_recorded, assert_decode_runs_change_no_bytes, observed_as_recorded,
                                replay_recorded)

RECORDED = Path(__file__).parent / "data" / "timeout_vllm_cases.json"
AZURE = Path(__file__).resolve().parents[2] / "traces" / "azure_conv_slice.parquet"


def _trace(rows: list[tuple]) -> object:
    """(arrival s, prompt tokens, output tokens) rows."""
    frame = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"])
    return trace_from_frame(frame, "test")


def _replay(trace, **options):
    config = EngineConfig.from_flat(dict(num_gpu_blocks=100, max_num_seqs=4, max_model_len=1024) | options)
    return replay(trace, config, "unit")


def test_a_client_that_gives_up_has_its_request_aborted_and_freed() -> None:
    """Every step lasts 1 s. The request would finish after 100 steps; its client gives up at
    10.5 s, during the 11th step, and vLLM aborts it before that step's output: 11 steps ran,
    11 tokens were generated for nobody, and no block stays in use."""
    res = _replay(_trace([(0.0, 40, 100)]), client_timeout_s=10.5)
    s = res.summary
    assert res.requests["status"].tolist() == ["timed_out"]
    assert res.requests["attempts"].tolist() == [1]
    assert s["num_steps"] == 11 and s["num_finished"] == 0
    assert (s["client"]["aborted_by_deadline"], s["client"]["aborted"], s["client"]["abandoned_output_tokens"],
            s["client"]["timed_out_requests"]) == ({"ttft": 0, "e2e": 1}, 1, 11, 1)
    assert res.run.scheduler.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    assert np.isnan(res.requests["ttft_s"][0]) and s["ttft_s"]["p50"] is None


def test_a_retry_finds_the_blocks_its_abandoned_attempt_computed() -> None:
    """16-token chunks: the client's 2.5 s first-token deadline passes during the third step, so
    vLLM aborts the request before that step's output, at 3 s, when 48 prompt tokens (3 full
    blocks) have their KV; the blocks stay cached.
    The retry, sent 1 s after the give-up (3.5 s), hits those 48 tokens, computes the last 16
    (first token at 4.5 s) and decodes 4 more tokens. Its latencies count from the first send."""
    trace = _trace([(0.0, 64, 5)])
    options = dict(max_num_batched_tokens=16, client_ttft_timeout_s=2.5, client_retry_backoff_s=1.0)
    res = _replay(trace, client_max_retries=1, **options)
    row = res.requests.iloc[0]
    assert (row["status"], row["attempts"], row["prefix_hit_tokens"]) == ("finished", 2, 48)
    assert (row["first_token_time_s"], row["ttft_s"], row["finish_time_s"]) == (4.5, 4.5, 8.5)
    client = res.summary["client"]
    assert (client["retries"], client["aborted"], client["finished_after_retries"]) == (1, 1, 1)
    assert res.summary["prefix_cache_hits_tokens"] == 48
    without_retry = _replay(trace, client_max_retries=0, **options)
    assert without_retry.requests["status"].tolist() == ["timed_out"]
    assert without_retry.summary["num_steps"] == 3


def test_an_abort_during_a_step_keeps_that_steps_chunk() -> None:
    """vLLM counts a scheduled chunk as computed and caches its full blocks when it schedules it:
    a request aborted before the output of the step that ran its chunk leaves that chunk's blocks
    cached. 16 tokens a step, 0.75 s to the first token: the first attempt's client leaves during
    its first chunk; the first retry (1.25 s) hits that block (16 tokens), computes the second
    and is aborted too; the second retry (3 s) hits both (32 tokens)."""
    res = _replay(_trace([(0.0, 64, 2)]), max_num_batched_tokens=16, client_ttft_timeout_s=0.75,
                  client_max_retries=2, client_retry_backoff_s=0.5)
    assert res.requests["status"].tolist() == ["timed_out"]
    assert res.summary["prefix_cache_hits_tokens"] == 16 + 32


def test_a_token_at_the_deadline_is_in_time_and_one_after_it_is_not() -> None:
    """The prefill step ends at 1 s: a 1 s first-token deadline is met. A 3-token reply ends at
    3 s: with a 2.5 s deadline its client leaves during the last step, and vLLM takes the abort
    before that step's output, as its engine core does: 3 tokens computed, none delivered."""
    assert _replay(_trace([(0.0, 16, 3)]), client_ttft_timeout_s=1.0).requests["status"].tolist() == ["finished"]
    assert _replay(_trace([(0.0, 16, 3)]), client_timeout_s=3.0).requests["status"].tolist() == ["finished"]
    late = _replay(_trace([(0.0, 16, 3)]), client_timeout_s=2.5)
    assert late.requests["status"].tolist() == ["timed_out"]
    client = late.summary["client"]
    assert (client["aborted"], client["abandoned_output_tokens"], late.summary["num_steps"]) == (1, 3, 3)


def test_waiting_requests_are_aborted_from_the_queue() -> None:
    """One request at a time: the second waits behind an 8-token reply and its client gives up
    at 5.5 s, before it is scheduled; the third arrives at 6.5 s and runs right after the first
    (which finishes at 8 s)."""
    trace = _trace([(0.0, 16, 8), (0.5, 16, 2), (6.5, 16, 2)])
    res = _replay(trace, max_num_seqs=1, client_ttft_timeout_s=5.0)
    assert res.requests["status"].tolist() == ["finished", "timed_out", "finished"]
    assert res.requests["first_token_time_s"][2] == 9.0
    assert res.summary["client"]["aborted"] == 1


def test_under_async_scheduling_an_abort_keeps_the_chunk_in_flight() -> None:
    """Async scheduling schedules a step while the one before it runs, and counts a chunk as
    computed (its full blocks cached) when it schedules it. 16-token chunks of a 72-token
    prompt; the 2.5 s first-token deadline passes during the third step (2-3 s), whose output
    vLLM processes after taking the abort, at 3 s; by then the fourth chunk, scheduled at 2 s,
    is in flight: 64 tokens are cached (synchronously 48). The retry, sent at 3.5 s, is
    scheduled when the fourth step ends (4 s), hits 64 tokens, computes the last 8 in one step
    (first token at 5 s) and decodes 4 more tokens, one a step."""
    trace = _trace([(0.0, 72, 5)])
    options = dict(max_num_batched_tokens=16, client_ttft_timeout_s=2.5, client_retry_backoff_s=1.0,
                   client_max_retries=1)
    res = _replay(trace, async_scheduling=True, **options)
    row = res.requests.iloc[0]
    assert (row["status"], row["attempts"], row["prefix_hit_tokens"]) == ("finished", 2, 64)
    assert (row["first_token_time_s"], row["finish_time_s"]) == (5.0, 9.0)
    assert _replay(trace, **options).requests["prefix_hit_tokens"][0] == 48


def test_under_async_scheduling_a_first_token_counts_when_its_step_output_is_processed() -> None:
    """The prefill step samples the first token and ends at 1 s; async scheduling counted the
    token when it scheduled the step, and scheduled a decode step after it: a 0.5 s deadline
    still aborts the request (after both steps ran), a 1 s deadline is met."""
    late = _replay(_trace([(0.0, 16, 3)]), client_ttft_timeout_s=0.5, async_scheduling=True)
    assert late.requests["status"].tolist() == ["timed_out"] and late.summary["num_steps"] == 2
    in_time = _replay(_trace([(0.0, 16, 3)]), client_ttft_timeout_s=1.0, async_scheduling=True)
    assert in_time.requests["first_token_time_s"].tolist() == [1.0]
    assert in_time.requests["status"].tolist() == ["finished"]


def _send_times(monkeypatch, trace, **options) -> dict[int, list[float]]:
    """Per trace row, the times its client sent its attempts."""
    from simkv.clock import TICKS_PER_SECOND
    from simkv.replay import client_timeouts

    sends: dict[int, list[float]] = {}
    send = client_timeouts.ClientDeadlines._send

    def logged(feed, request, row, tick, attempt):
        sends.setdefault(row, []).append(tick / TICKS_PER_SECOND)
        send(feed, request, row, tick, attempt)
    with monkeypatch.context() as m:
        m.setattr(client_timeouts.ClientDeadlines, "_send", logged)
        _replay(trace, max_num_seqs=1, client_ttft_timeout_s=2.0, client_max_retries=5, **options)
    return sends


def test_retry_waits_double_up_to_their_cap(monkeypatch) -> None:
    """Row 0 holds the only seat until 200 s; row 1's client gives up 2 s after each send and
    waits 1, 2, then 3 s (the cap) before each retry."""
    sends = _send_times(monkeypatch, _trace([(0.0, 16, 200), (0.5, 16, 2)]), client_retry_backoff_s=1.0,
                        client_retry_max_backoff_s=3.0)
    assert sends[1] == [0.5, 3.5, 7.5, 12.5, 17.5, 22.5]


def test_retry_waits_are_jittered_the_same_way_every_time(monkeypatch) -> None:
    """With jitter 0.25 each wait is between 75 % and 100 % of the unjittered one, differs between
    requests, and is the same in every replay."""
    trace = _trace([(0.0, 16, 400)] + [(0.5 + 0.01 * k, 16, 2) for k in range(8)])
    runs = [_send_times(monkeypatch, trace, client_retry_jitter=0.25) for _ in range(2)]
    assert runs[0] == runs[1]
    waits = []
    for row in range(1, 9):
        times = runs[0][row]
        for attempt in range(1, len(times)):
            wait = times[attempt] - (times[attempt - 1] + 2.0)
            nominal = 0.5 * 2 ** (attempt - 1)
            assert 0.75 * nominal - 1e-9 <= wait <= nominal + 1e-9
            waits.append(wait / nominal)
    assert len(waits) == 40 and len(set(round(w, 9) for w in waits)) == 40


@pytest.fixture(scope="module")
def overloaded(tmp_path_factory) -> Path:
    """The Azure slice at 12.5 times its rate: one H100 serves about half of it."""
    frame = trace_to_frame(read_trace(AZURE))
    frame["arrival_time_s"] *= 0.08
    path = tmp_path_factory.mktemp("overloaded") / "fast.parquet"
    write_trace(frame, path)
    return path


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_runs_change_no_bytes_with_timeouts_and_retries(overloaded, tmp_path, async_scheduling) -> None:
    config = EngineConfig.from_flat(dict(client_ttft_timeout_s=10.0, client_timeout_s=60.25, client_max_retries=2,
                                         async_scheduling=async_scheduling))
    res = assert_decode_runs_change_no_bytes(read_trace(overloaded), config, tmp_path)
    client = res.summary["client"]
    assert client["retries"] > 1000 and client["timed_out_requests"] > 1000
    assert client["attempts"] == int(res.requests["attempts"].sum())
    assert res.summary["num_finished"] + client["timed_out_requests"] == 2000


# the overload scenarios below hold 256 sequences (vLLM's default on GPUs under 70 GiB), so that
# the queue, not the batch, keeps requests past their clients' deadlines
_QUEUED = dict(max_num_seqs=256)
_EAGLE = dict(speculative_method="eagle3", num_speculative_tokens=3, spec_position_acceptance_rates="0.8,0.6,0.45")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_decoding_with_clients_that_give_up(overloaded, async_scheduling) -> None:
    """EAGLE-3 drafts on the overloaded slice, clients that give up at 10 s for a first token or 20.25 s
    for all, and retry twice: the
    engine core's aborts under speculation are vLLM's (tests/core/test_spec_decode.py's recorded
    cases); here every attempt is accounted for, no block stays in use, drafts still cut TPOT, and
    a one-replica fleet replays as one engine."""
    options = dict(client_ttft_timeout_s=10.0, client_timeout_s=20.25, client_max_retries=2,
                   async_scheduling=async_scheduling) | _EAGLE | _QUEUED
    one, _ = _one_replica_fleet_as_one_engine(read_trace(overloaded), options)
    s, req = one.summary, one.requests
    client = s["client"]
    assert client["aborted"] > 1000 and client["retries"] > 1000
    assert s["num_finished"] + client["timed_out_requests"] == 2000
    assert client["attempts"] == int(req["attempts"].sum())
    # (the engine's count includes drafts accepted for attempts aborted later; a row shows its last attempt's)
    assert 0 < int(req["num_accepted_tokens"].sum()) <= s["speculative_decoding"]["num_accepted_tokens"]
    assert client["aborted_by_deadline"]["e2e"] > 0 and client["abandoned_output_tokens"] > 0
    assert one.run.scheduler.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    retried = req[(req["attempts"] > 1) & (req["status"] == "finished")]
    assert len(retried) == client["finished_after_retries"] > 0
    assert (retried["ttft_s"] > 10.0).all()  # (counted from the first send)
    plain = replay(read_trace(overloaded), EngineConfig.from_flat({k: v for k, v in options.items() if k not in _EAGLE}))
    assert s["tpot_s"]["p50"] < plain.summary["tpot_s"]["p50"]


def test_a_cpu_tier_gives_retries_back_their_abandoned_prompts(tmp_path) -> None:
    """The agentic-coding sample compressed 50 times on a small GPU cache, clients that give up
    on a first token after 60 s and retry twice: with a 64 GiB CPU tier (vLLM's offloading
    connector; aborts as vLLM takes them there: tests/core/test_kv_offload.py's recorded cases)
    the retries load the prompts their aborted attempts computed instead of computing them
    again. Decode runs change no byte, and a one-replica fleet replays as one engine."""
    frame = trace_to_frame(read_trace(AZURE.parent / "kvcache_coding_sample.parquet"))
    frame["arrival_time_s"] *= 0.02
    trace = trace_from_frame(frame, "code50")
    options = dict(model="llama-3-70b", gpu="H100-SXM", tensor_parallel_size=4, max_model_len=131072,
                   async_scheduling=False, num_gpu_blocks=12000, client_ttft_timeout_s=60.0, client_max_retries=2)
    tier = options | dict(kv_offloading_size=64.0)
    res = assert_decode_runs_change_no_bytes(trace, EngineConfig.from_flat(tier), tmp_path)
    without = replay(trace, EngineConfig.from_flat(options))
    s, client = res.summary, res.summary["client"]
    assert client["retries"] > 10 and client["aborted"] > 10
    assert s["kv_offloading"]["loaded_tokens"] > 100_000
    assert s["num_prefill_tokens"] < 0.9 * without.summary["num_prefill_tokens"]
    assert res.run.scheduler.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    _one_replica_fleet_as_one_engine(trace, tier)


def test_timeouts_bound_the_queue_and_retries_add_load(overloaded) -> None:
    """Overloaded, clients that wait see TTFTs of up to 50 s; clients that give up at 10 s keep
    the queue short, and those that retry send more requests, which lengthens the run."""
    trace = read_trace(overloaded)
    waiting = replay(trace, EngineConfig.from_flat({}))
    patient = waiting.summary["ttft_s"]["p99"]
    give_up = replay(trace, EngineConfig.from_flat(dict(client_ttft_timeout_s=10.0)))
    retry = replay(trace, EngineConfig.from_flat(dict(client_ttft_timeout_s=10.0, client_max_retries=2)))
    assert patient > 40
    assert give_up.summary["peak_waiting"] < waiting.summary["peak_waiting"]
    assert give_up.summary["ttft_s"]["p99"] <= 10.0
    assert retry.summary["duration_s"] > give_up.summary["duration_s"]
    assert retry.summary["client"]["attempts"] > 2 * 2000


def test_in_a_fleet_a_retry_is_routed_again_and_may_land_on_another_replica() -> None:
    """Two replicas, one request at a time each, every step 1 s, round-robin. Row 0 (100 tokens)
    runs on replica 0 until 100 s; row 1 on replica 1 until 2.5 s; row 2, routed to replica 0 at
    1 s, waits there and its client gives up at 6 s. The retry (6.5 s) goes round-robin to the
    idle replica 1: first token at 7.5 s (6.5 s from the first send), finished at 11.5 s. Replica 1
    then waits for row 0, whose client could still retry, and its clock stays at 11.5 s."""
    config = EngineConfig.from_flat(dict(num_gpu_blocks=100, max_num_seqs=1, max_model_len=1024,
                                         client_ttft_timeout_s=5.0, client_max_retries=1))
    res = replay(_trace([(0.0, 16, 100), (0.5, 16, 2), (1.0, 16, 5)]), config, "unit",
                 fleet=FleetSpec(2, "round_robin"))
    req = res.requests
    assert req["replica"].tolist() == [0, 1, 1] and req["attempts"].tolist() == [1, 1, 2]
    assert req["status"].tolist() == ["finished"] * 3
    assert (req["first_token_time_s"][2], req["finish_time_s"][2], req["ttft_s"][2]) == (7.5, 11.5, 6.5)
    assert [r["duration_s"] for r in res.summary["fleet"]["replicas"]] == [100.0, 11.5]
    client = res.summary["client"]
    assert (client["attempts"], client["aborted"], client["finished_after_retries"]) == (4, 1, 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_one_replica_fleet_replays_as_one_engine(overloaded, async_scheduling) -> None:
    """The fleet's clients (retries routed by the router) against one engine's, on the same
    overloaded trace: every request's values equal, with back-offs of 0 s too (a retry due
    before its attempt's abort is taken is routed when it is)."""
    trace = read_trace(overloaded)
    for options in (dict(client_ttft_timeout_s=10.0, client_max_retries=2),
                    dict(client_timeout_s=20.25, client_max_retries=1, client_retry_backoff_s=0.0)):
        one, _ = _one_replica_fleet_as_one_engine(trace, options | dict(async_scheduling=async_scheduling))
        assert one.summary["client"]["retries"] > 500


def _one_replica_fleet_as_one_engine(trace, options: dict):
    """Replay `trace` on one engine and on a fleet of one replica; assert every request's values
    equal. Returns the engine's result and the fleet's routing."""
    from simkv.backends.factory import make_backend
    from simkv.capacity import compute_capacity
    from simkv.replay.fleet import fleet_tables, run_fleet
    from simkv.replay.router import Router

    config = EngineConfig.from_flat(options)
    one = replay(trace, config)
    capacity = compute_capacity(config)
    runs, routing = run_fleet(trace, config, [make_backend("roofline", config)], capacity.num_gpu_blocks,
                              Router("round_robin", 1), capacity)
    requests = fleet_tables(runs, routing, trace)[0].drop(columns="replica")
    pd.testing.assert_frame_equal(requests, one.requests)
    return one, routing


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fleet_decode_runs_change_no_bytes_with_retries(overloaded, router, async_scheduling) -> None:
    """Three replicas at three times the overloaded rate: a replica's decode runs stop before any
    retry some replica's clients could send, so jumping over them changes nothing."""
    frame = trace_to_frame(read_trace(overloaded))
    frame["arrival_time_s"] /= 3
    trace = trace_from_frame(frame, "fast")
    config = EngineConfig.from_flat(dict(client_ttft_timeout_s=10.0, client_timeout_s=60.25, client_max_retries=2,
                                         async_scheduling=async_scheduling) | _QUEUED)
    runs = [replay(trace, config, fleet=FleetSpec(3, router), use_decode_runs=flag) for flag in (True, False)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    for key in runs[0].steps:
        np.testing.assert_array_equal(runs[0].steps[key], runs[1].steps[key])
    client = runs[0].summary["client"]
    assert client == runs[1].summary["client"] and client["retries"] > 300
    assert client["attempts"] == int(runs[0].requests["attempts"].sum())
    assert runs[0].summary["num_finished"] + client["timed_out_requests"] == len(trace)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_data_parallel_ranks_abort_and_their_balancer_routes_the_retries(async_scheduling) -> None:
    """deepseek-v2-lite on two data-parallel ranks, the Azure slice sent within 4 s: clients that
    give up after 10 s retry, each retry routed by vLLM's data-parallel load balancer; every
    request ends finished or timed out, the same way twice."""
    frame = trace_to_frame(read_trace(AZURE))
    frame["arrival_time_s"] *= 0.002
    trace = trace_from_frame(frame, "burst")
    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite", data_parallel_size=2, client_ttft_timeout_s=10.0,
                                         client_max_retries=2, async_scheduling=async_scheduling) | _QUEUED)
    res = replay(trace, config)
    client = res.summary["client"]
    assert client["retries"] > 300 and client["attempts"] == int(res.requests["attempts"].sum())
    assert res.summary["num_finished"] + client["timed_out_requests"] == len(trace)
    assert res.summary["data_parallel"]["data_parallel_size"] == 2
    assert set(res.requests["replica"]) == {0, 1}
    pd.testing.assert_frame_equal(replay(trace, config).requests, res.requests)


def test_goodput_never_counts_a_timed_out_request(overloaded) -> None:
    from simkv.replay.goodput import goodput_summary

    res = replay(read_trace(overloaded), EngineConfig.from_flat(dict(client_ttft_timeout_s=10.0)))
    good = goodput_summary(res.requests, {"e2el": 1e9}, res.summary["duration_s"])
    assert good["num_good"] == res.summary["num_finished"] < 2000


def test_without_timeouts_outputs_are_as_before() -> None:
    res = _replay(_trace([(0.0, 16, 3)]))
    assert "client" not in res.summary and "attempts" not in res.requests
    assert not any(k.startswith("client") for k in res.summary["config"])


@pytest.mark.parametrize("options, message", [
    (dict(client_timeout_s=0.0), "client_timeout_s must be > 0"),
    (dict(client_ttft_timeout_s=-1.0), "client_ttft_timeout_s must be > 0"),
    (dict(client_timeout_s=5.0, client_max_retries=-1), "client_max_retries must be >= 0"),
    (dict(client_timeout_s=5.0, client_retry_backoff_s=-1.0), "client_retry_backoff_s must be >= 0"),
    (dict(client_timeout_s=5.0, client_retry_max_backoff_s=0.0), "client_retry_max_backoff_s must be > 0"),
    (dict(client_timeout_s=5.0, client_retry_jitter=1.0), r"client_retry_jitter must be in \[0, 1\)"),
])
def test_bad_client_options(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


def test_retries_without_anything_to_retry_are_refused() -> None:
    """Retries alone (no time-out, no queue limit, no replica that fails) would retry nothing:
    the replay refuses them, naming what they retry."""
    with pytest.raises(ConfigError, match="give client_timeout_s or client_ttft_timeout_s"):
        _replay(_trace([(0.0, 16, 3)]), client_max_retries=2)


def _chat(retries: int):
    """Two conversations, one request at a time, every step 1 s. Turn a0 decodes until 20 s; b0,
    sent at 0.5 s, waits behind it and its client gives up at 5.5 s (and, retrying 0.5 s later,
    again at 11 s): conversation b ends, its turns b1 and b2 are never sent. a1 is sent a second
    after a0's reply (21 s), and finishes at 23 s."""
    frame = pd.DataFrame({"request_id": ["a0", "b0", "a1", "b1", "b2"],
                          "arrival_time_s": [0.0, 0.5, 1.0, 2.0, 3.0], "prompt_tokens": [16] * 5,
                          "output_tokens": [20, 2, 2, 2, 2], "session_id": ["a", "b", "a", "b", "b"],
                          "think_time_s": [0.0, 0.0, 1.0, 1.0, 1.0]})
    config = EngineConfig.from_flat(dict(num_gpu_blocks=100, max_num_seqs=1, max_model_len=1024,
                                         client_ttft_timeout_s=5.0, client_max_retries=retries))
    return replay(trace_from_frame(frame, "chat"), config, "unit")


@pytest.mark.parametrize("retries", [0, 1])
def test_a_conversation_whose_turn_timed_out_ends(retries: int) -> None:
    res = _chat(retries)
    req = res.requests.set_index("request_id")
    assert req["status"].tolist() == ["finished", "timed_out", "finished", "abandoned", "abandoned"]
    assert req["attempts"].tolist() == [1, 1 + retries, 1, 0, 0]
    assert (req.loc["a1", "arrival_time_s"], req.loc["a1", "first_token_time_s"], req.loc["a1", "finish_time_s"]) \
        == (21.0, 22.0, 23.0)
    client = res.summary["client"]
    assert (client["abandoned_turns"], client["timed_out_requests"], client["aborted"]) == (2, 1, 1 + retries)
    assert res.summary["num_finished"] == 2 and res.summary["session_pacing"]["turns_held"] == 1


def test_decode_runs_change_no_bytes_with_paced_sessions_and_retries(tmp_path) -> None:
    """Conversations at 30 a second, far past one engine's capacity, whose clients give up and retry."""
    from simkv.traces.arrivals import ArrivalProcess
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=1200, turns=4), seed=3, arrival=ArrivalProcess("poisson", 30.0))
    config = EngineConfig.from_flat(dict(client_ttft_timeout_s=10.0, client_timeout_s=40.25, client_max_retries=2)
                                    | _QUEUED)
    res = assert_decode_runs_change_no_bytes(trace, config, tmp_path)
    client = res.summary["client"]
    assert client["retries"] > 100 and client["abandoned_turns"] > 100
    status = res.requests["status"].value_counts()
    assert status["finished"] + status["timed_out"] + status["abandoned"] == len(trace)


def test_forked_parallel_sampling_is_refused() -> None:
    frame = pd.DataFrame({"arrival_time_s": [0.0, 1.0], "prompt_tokens": [16, 16], "output_tokens": [4, 4],
                          "n": [1, 2]})
    with pytest.raises(ValueError, match="forked parallel sampling"):
        replay(trace_from_frame(frame, "n"), EngineConfig.from_flat(dict(client_timeout_s=30.0,
                                                                         parallel_sampling="fork")), "unit")


def _conversations(sessions: int, rate: float):
    from simkv.traces.arrivals import ArrivalProcess
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    return multi_turn(SessionShape(sessions=sessions, turns=4), seed=3, arrival=ArrivalProcess("poisson", rate))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_one_replica_fleet_paces_conversations_as_one_engine(async_scheduling) -> None:
    """The router's session pacing, its routed retries and its ended conversations against one
    engine's, past capacity: every request's values equal."""
    one, routing = _one_replica_fleet_as_one_engine(_conversations(1200, 30.0), dict(
        client_ttft_timeout_s=10.0, client_timeout_s=40.25, client_max_retries=2, async_scheduling=async_scheduling)
        | _QUEUED)
    assert one.summary["client"]["abandoned_turns"] == len(routing.clients.abandoned) > 100


def test_fleet_decode_runs_change_no_bytes_with_paced_conversations() -> None:
    """Three replicas, conversations at 90 a second: decode runs stop before any turn or retry
    some replica could release, so jumping over them changes nothing."""
    trace = _conversations(3600, 90.0)
    config = EngineConfig.from_flat(dict(client_ttft_timeout_s=10.0, client_timeout_s=40.25, client_max_retries=2)
                                    | _QUEUED)
    fleet = FleetSpec(3, "least_outstanding")
    runs = [replay(trace, config, fleet=fleet, use_decode_runs=flag) for flag in (True, False)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    client = runs[0].summary["client"]
    assert client == runs[1].summary["client"] and client["retries"] > 500 and client["abandoned_turns"] > 100
    status = runs[0].requests["status"].value_counts()
    assert status["finished"] + status["timed_out"] + status["abandoned"] == len(trace) == status.sum()


def test_data_parallel_ranks_pace_conversations_with_clients_that_give_up() -> None:
    from simkv.traces.arrivals import ArrivalProcess
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=3000, turns=4, think_time_s=1.0), seed=3,
                       arrival=ArrivalProcess("poisson", 3000.0))
    config = EngineConfig.from_flat(dict(model="deepseek-v2-lite", data_parallel_size=2, client_ttft_timeout_s=10.0,
                                         client_max_retries=2) | _QUEUED)
    res = replay(trace, config)
    client = res.summary["client"]
    assert client["retries"] > 500 and client["abandoned_turns"] > 50
    status = res.requests["status"].value_counts()
    assert status["finished"] + status["timed_out"] + status["abandoned"] == len(trace) == status.sum()


def test_cli_reports_the_clients(overloaded, tmp_path) -> None:
    out = cli_ok(["replay", str(overloaded), "--client-ttft-timeout", "10", "--client-max-retries", "1",
                  "--client-retry-backoff", "2", "--out", str(tmp_path / "o")])
    assert "client time-outs" in out and "timed out" in out
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["config"]["client_ttft_timeout_s"] == 10.0 and summary["config"]["client_max_retries"] == 1
    assert summary["client"]["retry_backoff_s"] == 2.0
    assert "client time-outs" in (tmp_path / "o" / "report.html").read_text()
    requests = pd.read_parquet(tmp_path / "o" / "requests.parquet")
    assert set(requests["status"]) == {"finished", "timed_out"} and requests["attempts"].max() == 2


def test_goodput_checks_fleets_whose_clients_give_up(tmp_path) -> None:
    """`simkv goodput --target-rate` replays fleets of the replicas it found, with the clients'
    time-outs and retries: a timed-out request is never good there either."""
    trace = tmp_path / "head.parquet"
    cli_ok(["trace", "transform", str(AZURE), "--head", "300", "--out", str(trace)])
    cli_ok(["goodput", str(trace), "--goodput", "ttft:2000", "--max-num-seqs", "32", "--cost-model", "linear",
            "--attainment", "0.95", "--tolerance", "0.05", "--target-rate", "40", "--client-ttft-timeout", "2",
            "--client-max-retries", "1", "--out", str(tmp_path / "g")])
    record = json.loads((tmp_path / "g" / "goodput.json").read_text())
    assert record["config"]["client_ttft_timeout_s"] == 2.0 and record["config"]["client_max_retries"] == 1
    probes = record["fleet_check"]["probes"]
    assert any(p["met"] for p in probes) and any(not p["met"] for p in probes)


def test_abort_request_leaves_finished_requests_alone() -> None:
    from tests.core.helpers import drive, make_config, make_request

    sched = Scheduler(make_config(num_gpu_blocks=50), 50)
    done, waiting = make_request(0, 20, 2), make_request(1, 20, 2)
    sched.add_request(done)
    drive(sched)
    sched.add_request(waiting)
    assert not sched.abort_request(done)
    assert sched.abort_request(waiting) and not sched.has_unfinished_requests()
    assert not sched.abort_request(waiting)


CASES = json.loads(RECORDED.read_text())["cases"] if RECORDED.exists() else []
SYNC = [c for c in CASES if not c["async_scheduling"]]
ASYNC = [c for c in CASES if c["async_scheduling"]]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_recorded_vllm_cases(index: int) -> None:
    case = CASES[index]
    assert_as_recorded(observed_as_recorded(replay_recorded(case)), case["vllm"])


def test_recorded_cases_exist_and_depend_on_the_aborts(monkeypatch) -> None:
    """The recorded cases must be there, abort requests, and break when the aborts of deadlines
    that pass during a step are taken after its output instead of before (as vLLM's engine core
    takes them), or when a retry could not find its abandoned attempt's blocks."""
    from simkv.replay import client_timeouts

    assert len(SYNC) >= 10 and len(ASYNC) >= 10
    assert sum(replay_recorded(c).summary["client"]["aborted"] > 0 for c in CASES) >= 20

    def broken(cases) -> int:
        return sum(observed_as_recorded(replay_recorded(c))["steps"] != c["vllm"]["steps"] for c in cases)

    with monkeypatch.context() as m:
        m.setattr(client_timeouts.ClientTimeoutFeed, "expire_during_step", lambda self, now, out: None)
        assert broken(SYNC) >= 5 and broken(ASYNC) >= 5
    with monkeypatch.context() as m:
        make_retry = client_timeouts.ClientTimeoutFeed.make_retry

        def forgetful(self, row, attempt, tick):
            request = make_retry(self, row, attempt, tick)
            request.has_own_cached_blocks = False
            return request
        m.setattr(client_timeouts.ClientTimeoutFeed, "make_retry", forgetful)
        assert broken(SYNC) >= 1 and broken(ASYNC) >= 1


def test_recorded_async_cases_depend_on_when_tokens_count(monkeypatch) -> None:
    """Async scheduling counts a token when its step is scheduled: the recorded async cases break
    when a first token counts as delivered then (not when its step's output is processed), or
    when an aborted decoder's token in flight counts as cached (vLLM caches a block at
    allocation, when that token was not yet known)."""
    from simkv.core.async_scheduling import AsyncScheduling

    def broken() -> int:
        return sum(observed_as_recorded(replay_recorded(c))["steps"] != c["vllm"]["steps"] for c in ASYNC)

    with monkeypatch.context() as m:
        m.setattr(AsyncScheduling, "token_delivered", lambda self, step: step >= 0)
        assert broken() >= 5
    extent = AsyncScheduling._async_abort_extent
    with monkeypatch.context() as m:
        m.setattr(AsyncScheduling, "_async_abort_extent", lambda self, request: (extent(self, request)[0],) * 2)
        assert broken() >= 2


def test_a_fanned_out_request_is_aborted_whole_and_retried_whole() -> None:
    """A request for 3 sequences (vLLM v1 fans it out into 3 requests): every step lasts 1 s, the
    first two take the 2 seats (the second hits the first's 2 full prompt blocks, 32 tokens), so
    the third waits. The client gives up on the whole request at 4.5 s (its E2E deadline); vLLM
    aborts all three members, the waiting one too, and nothing stays in use. The retry, sent at
    5 s, fans out again and its first two members hit the 32 tokens the first attempt left."""
    frame = pd.DataFrame({"arrival_time_s": [0.0], "prompt_tokens": [48], "output_tokens": [6], "n": [3]})
    trace = trace_from_frame(frame, "n3")
    res = _replay(trace, max_num_seqs=2, client_timeout_s=4.5, client_max_retries=1)
    client = res.summary["client"]
    assert res.requests["status"].tolist() == ["timed_out"] and res.requests["attempts"].tolist() == [2]
    assert (client["aborted"], client["retries"]) == (2, 1)
    assert res.run.scheduler.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    assert res.summary["prefix_cache_hits_tokens"] == 32 + 2 * 32
    with pytest.raises(ValueError, match="forked parallel sampling"):
        _replay(trace, client_timeout_s=4.5, parallel_sampling="fork")
