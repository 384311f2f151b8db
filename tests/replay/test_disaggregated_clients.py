"""Clients that give up under P/D disaggregation (simkv/replay/disaggregated_clients.py): where an
attempt is when its client gives up decides who aborts it and when the prefill replica's blocks go.

The small cases run on the unit cost model: every step lasts 1 s; blocks hold 16 tokens, and a
4-block prompt pulls 8 MB of llama-3-8b's KV (2 MiB a block)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.replay.disaggregated import DisaggregationSpec
from simkv.traces.schema import read_trace, trace_from_frame, trace_to_frame
from tests.cli_runs import cli_fails, cli_ok
from tests.core.helpers import assert_decode_runs_change_no_bytes

TRACES = Path(__file__).resolve().parents[2] / "traces"


def _trace(rows: list[tuple]):
    """(arrival s, prompt tokens, output tokens) rows."""
    return trace_from_frame(pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"]), "test")


def _replay(rows, spec: DisaggregationSpec, **options):
    config = EngineConfig.from_flat(dict(num_gpu_blocks=100, max_num_seqs=4, max_model_len=1024) | options)
    return replay(_trace(rows), config, "unit", disaggregation=spec)


def _prefill_steps(res) -> pd.DataFrame:
    steps = pd.DataFrame(res.steps)
    return steps[steps["pool"] == "prefill"].set_index("start_time_s")


def test_a_give_up_during_the_prefill_is_taken_by_the_prefill_replica() -> None:
    """16-token chunks on the prefill replica: the first-token deadline (3.5 s) passes during the
    prompt's fourth chunk, so the prefill replica aborts the attempt before that step's output
    (4 s), its 64 tokens computed and cached. The retry, sent at 4 s, hits 48 of them there, ends
    its prefill at 5 s, reaches the decode replica at 5.001 s, pulls for 0.27 ms and gets its first
    token a step later, 6.0013 s after the first send."""
    res = _replay([(0.0, 64, 3)], DisaggregationSpec(1, 1, prefill_options=(("max_num_batched_tokens", 16),)),
                  client_ttft_timeout_s=3.5, client_max_retries=1)
    row = res.requests.iloc[0]
    assert (row["status"], row["attempts"], row["prefill_end_time_s"]) == ("finished", 2, 5.0)
    assert row["ttft_s"] == pytest.approx(6.0013, abs=1e-4)
    assert _prefill_steps(res).loc[4.0, "prefix_hit_tokens"] == 48
    client = res.summary["client"]
    assert client["aborted_in"] == {"prefill": 1, "handoff": 0, "decode_queue": 0, "decode": 0}
    # (the step it was aborted in computed the rest of its prompt: aborted after its prefill)
    assert (client["aborted"], client["aborted_after_prefill"], client["finished_after_retries"]) == (1, 1, 1)


@pytest.mark.parametrize("lease_s, blocks_at_5s, blocks_at_12s", [(10.0, 6, 4), (0.0, 2, 2)])
def test_a_request_the_proxy_drops_holds_its_prefill_blocks_until_the_lease_ends(lease_s, blocks_at_5s,
                                                                                 blocks_at_12s) -> None:
    """The proxy's hop takes 2 s and clients give up after 2.5 s: every prefill (1 s) reaches the
    proxy in time, but its request would reach the decode pool after the deadline, so the proxy
    drops it. No decode replica reads the prompt's blocks: the prefill replica holds them until
    the lease runs out, 10 s after the prefill ended. A's 4 blocks are still held when B's prompt
    runs at 5 s (4 + 2 in use) and gone when C's runs at 12 s (B's 2 + C's 2)."""
    res = _replay([(0.0, 64, 5), (5.0, 32, 5), (12.0, 32, 5)],
                  DisaggregationSpec(1, 1, handoff_ms=2000.0, kv_abort_timeout_s=lease_s), client_timeout_s=2.5)
    assert res.requests["status"].tolist() == ["timed_out"] * 3
    assert (res.requests["decode_replica"] == -1).all()
    assert res.summary["client"]["aborted_in"]["handoff"] == 3
    assert res.summary["disaggregation"]["kv_abort_timeout_s"] == lease_s
    used = _prefill_steps(res)["num_blocks_used"]
    assert (used[0.0], used[5.0], used[12.0]) == (4, blocks_at_5s, blocks_at_12s)
    assert res.summary["num_steps"] == 0  # (the decode pool ran nothing)
    assert res.summary["duration_s"] == 15.0  # (C's drop, after the last step: the replay lasts until then)


def test_a_give_up_before_the_pull_frees_the_prefill_blocks_at_once() -> None:
    """The decode replica has 11 usable blocks: A (8 blocks) decodes, and B's prompt (4 blocks)
    cannot be admitted to pull. B's client gives up at 5.5 s; the decode replica aborts it from its
    queue and its connector tells the prefill replica, which frees B's blocks then: C's prompt at
    8 s runs with only its own 2 blocks in use there."""
    res = _replay([(0.0, 128, 40), (0.5, 64, 5), (8.0, 32, 5)],
                  DisaggregationSpec(1, 1, decode_options=(("num_gpu_blocks", 12),)),
                  client_ttft_timeout_s=5.0, max_model_len=176)
    assert res.requests["status"].tolist() == ["finished", "timed_out", "finished"]
    assert np.isnan(res.requests["kv_pull_start_s"][1])
    assert _prefill_steps(res).loc[8.0, "num_blocks_used"] == 2
    client = res.summary["client"]
    assert client["aborted_in"] == {"prefill": 0, "handoff": 0, "decode_queue": 1, "decode": 0}
    assert client["aborted_after_prefill"] == 1  # (its prompt was computed, at the prefill replica)


def test_a_give_up_during_the_pull_holds_both_ends_until_it_ends() -> None:
    """A 1 MB/s link: A's 8 MB pull runs from 1.001 s to 9.39 s. Its client gives up at 5 s (the
    idle decode replica, waiting for the pull, is woken then and aborts it); both replicas keep
    their blocks until the read ends. The retry, sent at 5.5 s, hits 48 of its prompt's tokens in
    the blocks the prefill replica still holds (4 + 1 new in use), and its own pull (all 4 blocks:
    the aborted pull's were not cached) waits for the link, whose last byte went 0.1 ms before 9.39 s."""
    res = _replay([(0.0, 64, 5)], DisaggregationSpec(1, 1, kv_link_gbps=0.001), client_ttft_timeout_s=5.0,
                  client_max_retries=1)
    row = res.requests.iloc[0]
    assert (row["status"], row["attempts"], row["prefill_end_time_s"]) == ("timed_out", 2, 6.5)
    first_pull_s = 9.389708 - 1.001
    assert row["kv_pull_end_s"] == pytest.approx(9.389708 + first_pull_s - 1e-4, abs=1e-5)  # (the link, 0.1 ms less)
    retry = _prefill_steps(res).loc[5.5]
    assert (retry["prefix_hit_tokens"], retry["num_blocks_used"]) == (48, 5)
    assert res.summary["client"]["aborted_in"] == {"prefill": 0, "handoff": 0, "decode_queue": 0, "decode": 2}
    decode = res.fleet_runs[0].scheduler
    assert decode.kv_cache_manager.block_pool.get_num_used_blocks() == 0 and not decode._aborted_loads


@pytest.fixture(scope="module")
def overloaded():
    """The Azure slice at 12.5 times its rate."""
    frame = trace_to_frame(read_trace(TRACES / "azure_conv_slice.parquet"))
    frame["arrival_time_s"] *= 0.08
    return trace_from_frame(frame, "fast")


@pytest.mark.parametrize("async_scheduling, spec, options", [
    (False, DisaggregationSpec(1, 1), dict(client_ttft_timeout_s=2.0, client_timeout_s=20.0, client_max_retries=2)),
    (False, DisaggregationSpec(3, 1, kv_link_gbps=0.5, kv_abort_timeout_s=5.0),
     dict(client_ttft_timeout_s=1.0, client_max_retries=3, client_retry_backoff_s=0.1)),
    (True, DisaggregationSpec(1, 2, decode_options=(("max_num_seqs", 8),)),
     dict(client_timeout_s=8.0, client_max_retries=2)),
    (True, DisaggregationSpec(2, 2, handoff_ms=400.0, kv_abort_timeout_s=3.0),
     dict(client_ttft_timeout_s=1.0, client_max_retries=3, client_retry_backoff_s=0.1)),
])
def test_decode_runs_change_no_bytes_and_every_request_is_accounted_for(overloaded, tmp_path, async_scheduling, spec,
                                                                      options) -> None:
    config = EngineConfig.from_flat(options | dict(async_scheduling=async_scheduling))
    res = assert_decode_runs_change_no_bytes(overloaded, config, tmp_path, disaggregation=spec)
    s, client = res.summary, res.summary["client"]
    assert client["timed_out_requests"] > 40 and client["retries"] > 600
    assert s["num_finished"] + client["timed_out_requests"] + s["num_rejected"] == len(overloaded)
    assert client["attempts"] == int(res.requests["attempts"].sum())
    assert sum(client["aborted_in"].values()) == client["aborted"]
    assert set(res.requests["status"]) == {"finished", "timed_out"}
    assert (res.requests["attempts"] <= client["max_retries"] + 1).all()


def test_deadlines_that_never_pass_change_nothing(overloaded) -> None:
    """Clients that would wait a day: the same replay as clients that wait forever, bar the
    client section and the attempts column."""
    spec = DisaggregationSpec(2, 1)
    base = replay(overloaded, EngineConfig.from_flat({}), "roofline", disaggregation=spec)
    waiting = replay(overloaded, EngineConfig.from_flat(dict(client_timeout_s=86400.0, client_max_retries=1)),
                     "roofline", disaggregation=spec)
    assert waiting.summary["client"]["aborted"] == 0
    pd.testing.assert_frame_equal(waiting.requests.drop(columns="attempts"), base.requests)
    for name in base.steps:
        assert np.array_equal(waiting.steps[name], base.steps[name]), name
    for summary in (base.summary, waiting.summary):
        summary.pop("wall_time_s"), summary.pop("request_rate_wall_req_s", None), summary.pop("client", None)
        summary["config"] = {k: v for k, v in summary["config"].items() if not k.startswith("client_")}
        summary["disaggregation"].pop("kv_abort_timeout_s", None)
    assert waiting.summary == base.summary


def test_paced_conversations_end_where_their_turn_timed_out_and_decode_runs_change_no_bytes(tmp_path) -> None:
    """1,200 four-turn conversations at 90 a second on one prefill and one decode replica, a proxy
    hop of 950 ms and clients that give up on a first token after 1 s (and retry twice): attempts
    are aborted at the prefill replica and dropped in the hop, and a turn given up on for good ends
    its conversation (its later turns `abandoned`), wherever that happened."""
    from simkv.traces.arrivals import ArrivalProcess
    from simkv.traces.synth_sessions import SessionShape, multi_turn

    trace = multi_turn(SessionShape(sessions=1200, turns=4), seed=3, arrival=ArrivalProcess("poisson", 90.0))
    config = EngineConfig.from_flat(dict(client_ttft_timeout_s=1.0, client_timeout_s=20.25, client_max_retries=2))
    spec = DisaggregationSpec(1, 1, handoff_ms=950.0, kv_abort_timeout_s=20.0)
    res = assert_decode_runs_change_no_bytes(trace, config, tmp_path, disaggregation=spec)
    client, status = res.summary["client"], res.requests["status"].value_counts()
    assert client["aborted_in"]["prefill"] > 1000 and client["aborted_in"]["handoff"] > 1000
    assert client["abandoned_turns"] == status["abandoned"] > 1000
    assert status["finished"] + status["timed_out"] + status["abandoned"] == len(trace)
    assert res.summary["session_pacing"]["sessions"] == 1200


def test_a_data_parallel_decode_pool_aborts_on_its_ranks() -> None:
    """deepseek-v2-lite with a decode pool of two data-parallel ranks (4 seats each) behind four
    prefill replicas, the Azure slice's first 600 requests at 50 times its rate: attempts are
    aborted in every place, and every request is accounted for; deadlines that never pass change
    nothing."""
    frame = trace_to_frame(read_trace(TRACES / "azure_conv_slice.parquet")).head(600)
    frame["arrival_time_s"] *= 0.02
    trace = trace_from_frame(frame, "fast")
    spec = DisaggregationSpec(4, 1, decode_options=(("data_parallel_size", 2), ("max_num_seqs", 4)))
    base = dict(model="deepseek-v2-lite")
    res = replay(trace, EngineConfig.from_flat(base | dict(client_ttft_timeout_s=0.5, client_max_retries=2)),
                 "roofline", disaggregation=spec)
    s, client = res.summary, res.summary["client"]
    assert s["num_finished"] + client["timed_out_requests"] == len(trace)
    assert client["aborted_in"]["decode_queue"] > 50 and client["aborted_in"]["decode"] > 50
    assert sum(client["aborted_in"].values()) == client["aborted"]
    assert len(res.fleet_runs) == 2 and set(res.requests["decode_replica"]) == {0, 1}
    never = replay(trace, EngineConfig.from_flat(base | dict(client_timeout_s=86400.0)), "roofline",
                   disaggregation=spec)
    waiting = replay(trace, EngineConfig.from_flat(base), "roofline", disaggregation=spec)
    pd.testing.assert_frame_equal(never.requests.drop(columns="attempts"), waiting.requests)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="client_timeout_s differ"):
        DisaggregationSpec(1, 1, decode_options=(("client_timeout_s", 5.0),)).pool_configs(
            EngineConfig.from_flat(dict(client_timeout_s=30.0)))
    with pytest.raises(ConfigError, match="kv_abort_timeout_s must be >= 0"):
        DisaggregationSpec(1, 1, kv_abort_timeout_s=-1.0)


def test_the_cli_replays_pd_with_clients_that_give_up(tmp_path) -> None:
    out = tmp_path / "o"
    text = cli_ok(["replay", str(TRACES / "req400.parquet"), "--prefill-replicas", "1", "--decode-replicas", "1",
                   "--client-ttft-timeout", "0.05", "--client-max-retries", "1", "--kv-abort-timeout-s", "30",
                   "--out", str(out)])
    assert "client time-outs" in text and "at a prefill replica" in " ".join(text.split())
    import json
    summary = json.loads((out / "summary.json").read_text())
    assert summary["client"]["aborted"] > 0 and summary["disaggregation"]["kv_abort_timeout_s"] == 30.0
    bad = cli_fails(["replay", str(TRACES / "req400.parquet"), "--prefill-replicas", "1", "--client-timeout", "5",
                     "--kv-abort-timeout-s", "-2", "--out", str(tmp_path / "bad")])
    assert "kv_abort_timeout_s must be >= 0" in bad and not (tmp_path / "bad").exists()
