"""vLLM's API-server admission control (`--max-num-queued-reqs`, `--max-num-queued-tokens`,
simkv/replay/admission.py): a request is refused with HTTP 503 before it reaches the engine."""

import pandas as pd
import pytest

from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import FleetSpec, replay
from simkv.traces.schema import read_trace, trace_from_frame
from tests.cli_runs import cli_ok
from tests.core.helpers import assert_decode_runs_change_no_bytes


def _trace(arrivals, prompts, outputs, n=None):
    frame = {"arrival_time_s": arrivals, "prompt_tokens": prompts, "output_tokens": outputs}
    if n is not None:
        frame["n"] = n
    return trace_from_frame(pd.DataFrame(frame))


def test_unfinished_requests_cap_counts_sequences() -> None:
    """Five requests at once, at most 4 unfinished: the first two (of 1 and 2 sequences) get in,
    the third (2 sequences) would make 5 and is refused, the fourth (1) makes 4; at t = 10 s
    everything has finished and the fifth gets in."""
    trace = _trace([0, 0, 0, 0, 10], [20] * 5, [5] * 5, n=[1, 2, 2, 1, 2])
    res = replay(trace, EngineConfig.from_flat({"max_num_queued_reqs": 4}), "unit")
    assert res.requests["status"].tolist() == ["finished", "finished", "rejected", "finished", "finished"]
    assert res.summary["admission_control"] == {
        "max_num_queued_reqs": 4, "max_num_queued_tokens": None,
        "rejected": {"max_num_queued_reqs": 1, "max_num_queued_tokens": 0}}
    assert res.summary["num_rejected"] == 1


def test_queued_prompt_tokens_count_until_the_first_token() -> None:
    """Limit 100 prompt tokens: at t = 0 the first two (60 each) get in (0, then 60 queued), the
    third finds 120 and is refused. At t = 0.5 s both have their first token, so nothing is
    queued and the fourth gets in."""
    trace = _trace([0, 0, 0, 0.5], [60, 60, 60, 60], [400] * 4)
    res = replay(trace, EngineConfig.from_flat({"max_num_queued_tokens": 100}))
    assert res.requests["status"].tolist() == ["finished", "finished", "rejected", "finished"]
    assert res.summary["admission_control"]["rejected"] == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 1}
    assert res.requests["ttft_s"].iloc[0] < 0.5  # (the first tokens came before the fourth arrived)


def _overloaded():
    trace = read_trace("traces/azure_conv_slice.parquet")
    from dataclasses import replace

    return replace(trace, arrival_time_s=trace.arrival_time_s / 6.0)


def test_a_token_limit_sheds_load_and_bounds_ttft(tmp_path) -> None:
    trace = _overloaded()
    base = replay(trace, EngineConfig.from_flat({}))
    guarded = assert_decode_runs_change_no_bytes(trace, EngineConfig.from_flat({"max_num_queued_tokens": 8000}),
                                                 tmp_path)
    shed = guarded.summary["admission_control"]["rejected"]["max_num_queued_tokens"]
    assert shed > 0 and guarded.summary["num_rejected"] == shed + base.summary["num_rejected"]
    assert guarded.summary["ttft_s"]["p99"] < base.summary["ttft_s"]["p99"] / 2


def test_clients_retry_the_503s() -> None:
    """At most 2 unfinished requests; clients retry twice after 0.5 s, then 1 s. Four requests at
    t = 0: two get in (5 steps of 1 s each under the unit model: done at 5 s); the other two are
    refused at 0, 0.5 and 1.5 s and rejected for good. A fifth at t = 6 s gets in."""
    trace = _trace([0, 0, 0, 0, 6], [20] * 5, [5] * 5)
    res = replay(trace, EngineConfig.from_flat({"max_num_queued_reqs": 2, "client_max_retries": 2}), "unit")
    assert res.requests["status"].tolist() == ["finished", "finished", "rejected", "rejected", "finished"]
    assert res.summary["admission_control"]["rejected"]["max_num_queued_reqs"] == 6  # (3 attempts each)
    assert res.summary["client"]["attempts"] == 3 + 6 and res.summary["num_rejected"] == 2
    longer = replay(trace, EngineConfig.from_flat({"max_num_queued_reqs": 2, "client_max_retries": 4}), "unit")
    # retries at 0.5, 1.5, 3.5 and 7.5 s: at 7.5 s the first two have finished (at 5 s) and the
    # fifth (sent at 6 s) runs, so one of the two retries gets in and the other is refused for good
    assert longer.requests["status"].tolist() == ["finished", "finished", "finished", "rejected", "finished"]
    assert longer.requests["arrival_time_s"].iloc[2] == 0.0  # (latencies count from the first send)
    assert longer.requests["ttft_s"].iloc[2] > 7.5


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_each_replica_refuses_on_its_own_counts(router, tmp_path) -> None:
    """A fleet: every replica's front end counts its own requests; the refused ones leave the
    router's count of that replica; decode runs change no byte."""
    trace = _overloaded()
    config = EngineConfig.from_flat({"max_num_queued_tokens": 4000})
    res = assert_decode_runs_change_no_bytes(trace, config, tmp_path, fleet=FleetSpec(2, router))
    refused = res.summary["admission_control"]["rejected"]["max_num_queued_tokens"]
    assert refused > 0 and res.summary["num_rejected"] == refused
    rejected = res.requests["status"] == "rejected"
    assert set(res.requests.loc[rejected, "replica"]) <= {0, 1} and rejected.sum() == refused
    one = replay(trace, config)
    assert refused < one.summary["admission_control"]["rejected"]["max_num_queued_tokens"]


def test_a_fleets_clients_retry_through_the_router(tmp_path) -> None:
    """A replica's 503 sends the client back to the router after its back-off; every refused
    attempt is one more attempt, and here every request gets in at last."""
    config = EngineConfig.from_flat({"max_num_queued_tokens": 2000, "client_max_retries": 3})
    res = assert_decode_runs_change_no_bytes(_overloaded(), config, tmp_path,
                                             fleet=FleetSpec(2, "least_outstanding"))
    refused = res.summary["admission_control"]["rejected"]["max_num_queued_tokens"]
    assert refused > 0 and res.summary["client"]["attempts"] == 2000 + refused
    assert res.summary["num_finished"] == 2000 and res.summary["client"]["finished_after_retries"] > 0


def test_data_parallel_ranks_share_one_front_end() -> None:
    """vLLM's API server counts over all ranks: at every lockstep step the ranks' requests
    together stay within max_num_queued_reqs, and a refused request is never routed."""
    config = EngineConfig.from_flat({"model": "qwen3-30b-a3b", "gpu": "H200", "data_parallel_size": 2,
                                     "max_num_queued_reqs": 40})
    res = replay(_overloaded(), config)
    refused = res.summary["admission_control"]["rejected"]["max_num_queued_reqs"]
    assert refused > 0 and res.summary["num_rejected"] == refused
    steps = pd.DataFrame({k: res.steps[k] for k in ("replica", "start_time_s", "num_running", "num_waiting")})
    per_step = (steps["num_running"] + steps["num_waiting"]).groupby(steps["start_time_s"]).sum()
    assert per_step.max() <= 40 and per_step.max() >= 35  # (the limit binds, over both ranks together)
    assert (res.requests.loc[res.requests["status"] == "rejected", "replica"] == -1).all()


@pytest.mark.parametrize("options, kwargs, message", [
    ({"max_num_queued_reqs": 8, "client_max_retries": 2, "model": "qwen3-30b-a3b", "gpu": "H200",
      "data_parallel_size": 2}, {}, "data-parallel ranks whose clients retry"),
])
def test_unsupported(options, kwargs, message) -> None:
    trace = _trace([0, 1], [20, 20], [5, 5])
    with pytest.raises(ValueError, match=message):
        replay(trace, EngineConfig.from_flat(options), **kwargs)


def test_bad_values_and_the_cli(tmp_path) -> None:
    with pytest.raises(ConfigError, match="max_num_queued_reqs must be >= 0"):
        EngineConfig.from_flat({"max_num_queued_reqs": -1})
    out = cli_ok(["replay", "traces/req400.parquet", "--max-num-queued-reqs", "3", "--out", str(tmp_path)])
    assert "admission control (HTTP 503)" in out and "by max_num_queued_reqs" in out
    assert "their prompts have at least max_model_len" not in out


def test_a_pd_prefill_pool_refuses_at_its_front_ends(tmp_path) -> None:
    """P/D: a request enters at a prefill replica's API server, which refuses it on that
    replica's counts; a refused request never reaches the decode pool, which still ends when
    the rest is served; decode runs change no byte; the decode pool takes no limit."""
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = _overloaded()
    config = EngineConfig.from_flat({})
    plain = replay(trace, config, disaggregation=DisaggregationSpec(2, 1))
    spec = DisaggregationSpec(2, 1, prefill_options=(("max_num_queued_tokens", 4000),))
    res = assert_decode_runs_change_no_bytes(trace, config, tmp_path, disaggregation=spec)
    refused = res.summary["admission_control"]["rejected"]["max_num_queued_tokens"]
    assert refused > 0 and res.summary["num_rejected"] == refused + plain.summary["num_rejected"]
    assert res.summary["num_finished"] == 2000 - res.summary["num_rejected"]
    assert res.summary["disaggregation"]["kv_transfer"]["num_pulls"] == res.summary["num_finished"]
    assert res.summary["ttft_s"]["p99"] < plain.summary["ttft_s"]["p99"]
    # the option for both pools is the prefill servers' (the decode servers' 503s are not modelled),
    # and clients that retry a 503 go back to the prefill router: every refused attempt is one more
    both = replay(trace, EngineConfig.from_flat({"max_num_queued_tokens": 4000}), disaggregation=DisaggregationSpec(2, 1))
    assert both.summary["admission_control"] == res.summary["admission_control"]
    retried = replay(trace, EngineConfig.from_flat({"max_num_queued_tokens": 4000, "client_max_retries": 3}),
                     disaggregation=DisaggregationSpec(2, 1))
    again = retried.summary["admission_control"]["rejected"]["max_num_queued_tokens"]
    assert again > 0 and retried.summary["client"]["attempts"] == 2000 + again
    assert retried.summary["num_rejected"] < res.summary["num_rejected"]
    with pytest.raises(ConfigError, match="decode pool: max_num_queued_tokens .*at the prefill servers"):
        replay(trace, config, disaggregation=DisaggregationSpec(1, 1, decode_options=(("max_num_queued_tokens", 9),)))
    out = cli_ok(["replay", "traces/req400.parquet", "--prefill-replicas", "1", "--decode-replicas", "1",
                  "--prefill-set", "max_num_queued_reqs=3", "--out", str(tmp_path / "cli")])
    assert "admission control (HTTP 503)" in out and "their prompts have at least max_model_len" not in out
