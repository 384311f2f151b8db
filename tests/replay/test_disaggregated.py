"""P/D disaggregation in the replay: a prefill pool, a decode pool, KV pulls over links."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from simkv.replay.api import replay, save
from simkv.replay.disaggregated import DisaggregationSpec
from simkv.traces.schema import trace_from_frame

STEP = 0.01  # linear cost model without a per-token term: every step lasts 10 ms
LINEAR = {"step_base_s": STEP, "step_per_token_s": 0.0}


def config(num_gpu_blocks=300, **sched):
    return EngineConfig(CacheConfig(num_gpu_blocks=num_gpu_blocks),
                        SchedulerConfig(**{"max_model_len": 2048, "max_num_batched_tokens": 512, **sched}))


def frame(rows, hashes=None):
    data = pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"])
    if hashes is not None:
        data["block_hashes"] = hashes
        data["hash_block_tokens"] = 16
    return trace_from_frame(data)


def loaded_trace(n=150, seed=0, shared=False):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 600, n)
    hashes = [list(range(-(-int(p) // 16))) for p in prompts] if shared else None
    return frame(list(zip(np.sort(rng.uniform(0, 4, n)), prompts, rng.integers(1, 120, n))), hashes)


def test_one_request_through_both_pools_by_hand():
    """Prefill step [0, 10 ms]; handoff 1 ms later; the idle decode replica admits it at once and
    pulls 4 blocks (64 tokens) at 1 GB/s, plus 0.1 ms; the pull's end wakes it: the last prompt
    token again (first token), then two decode steps."""
    cfg = config()
    spec = DisaggregationSpec(1, 1, kv_link_gbps=1.0, kv_link_latency_ms=0.1, handoff_ms=1.0)
    res = replay(frame([(0.0, 64, 3)]), cfg, "linear", LINEAR, disaggregation=spec)
    row = res.requests.iloc[0]
    pull_bytes = 4 * 16 * compute_capacity(cfg).kv_bytes_per_token
    pull_end = 0.011 + pull_bytes / 1e9 + 0.0001
    assert row["kv_pull_bytes"] == pull_bytes
    expected = {"prefill_end_time_s": 0.010, "kv_pull_start_s": 0.011, "kv_pull_end_s": pull_end,
                "first_token_time_s": pull_end + STEP, "finish_time_s": pull_end + 3 * STEP}
    for name, value in expected.items():
        assert row[name] == pytest.approx(value, abs=1e-9), name
    assert row["ttft_s"] == pytest.approx(pull_end + STEP, abs=1e-9)
    kv = res.summary["disaggregation"]["kv_transfer"]
    assert kv["num_pulls"] == 1 and kv["pulled_bytes"] == pull_bytes
    steps = pd.DataFrame(res.steps)
    assert list(steps["pool"]) == ["prefill", "decode", "decode", "decode"]
    assert list(steps["num_prefill_tokens"]) == [64, 1, 0, 0]


def test_one_request_through_both_pools_under_async_scheduling():
    """The same request with the pools scheduling asynchronously (vLLM's default): a lone
    request's times do not change (each step's output is processed at its end, before the
    next step that needs it); the pull starts when the step that admitted it starts."""
    spec = DisaggregationSpec(1, 1, kv_link_gbps=1.0, kv_link_latency_ms=0.1, handoff_ms=1.0)
    sync = replay(frame([(0.0, 64, 3)]), config(), "linear", LINEAR, disaggregation=spec).requests.iloc[0]
    res = replay(frame([(0.0, 64, 3)]), config(async_scheduling=True), "linear", LINEAR, disaggregation=spec)
    row = res.requests.iloc[0]
    for name in ("prefill_end_time_s", "kv_pull_start_s", "kv_pull_end_s", "first_token_time_s", "finish_time_s"):
        assert row[name] == pytest.approx(sync[name], abs=1e-9), name
    assert res.summary["config"]["async_scheduling"]


def test_pulls_into_one_replica_queue_on_its_link():
    """Two prompts that end their prefill in the same step reach the decode replica together; it
    admits both in one step, and the second pull starts when the first has been sent."""
    cfg = config()
    spec = DisaggregationSpec(1, 1, kv_link_gbps=2.0, kv_link_latency_ms=0.0)
    res = replay(frame([(0.0, 64, 2), (0.0, 32, 2)]), cfg, "linear", LINEAR, disaggregation=spec)
    per_block = 16 * compute_capacity(cfg).kv_bytes_per_token / 2e9
    start, end = res.requests["kv_pull_start_s"].to_numpy(), res.requests["kv_pull_end_s"].to_numpy()
    assert start[0] == start[1] == pytest.approx(0.011)
    assert end[0] == pytest.approx(0.011 + 4 * per_block) and end[1] == pytest.approx(0.011 + 6 * per_block)


def test_pulls_from_one_prefill_replica_queue_on_its_link():
    """One prefill replica, two decode replicas: the two pulls go to different decode replicas
    but leave through the same prefill link, one after the other."""
    cfg = config()
    spec = DisaggregationSpec(1, 2, decode_router="round_robin", kv_link_gbps=2.0, kv_link_latency_ms=0.0)
    res = replay(frame([(0.0, 64, 2), (0.0, 32, 2)]), cfg, "linear", LINEAR, disaggregation=spec)
    per_block = 16 * compute_capacity(cfg).kv_bytes_per_token / 2e9
    assert list(res.requests["decode_replica"]) == [0, 1]
    end = res.requests["kv_pull_end_s"].to_numpy()
    assert end[0] == pytest.approx(0.011 + 4 * per_block) and end[1] == pytest.approx(0.011 + 6 * per_block)


def test_the_decode_side_pulls_only_what_its_prefix_cache_lacks():
    """The second request shares the first one's first 3 blocks of 16 tokens; it reaches the
    decode replica after the first finished there, so it pulls only its 2 other blocks."""
    cfg = config()
    trace = frame([(0.0, 64, 2), (1.0, 80, 2)], hashes=[[1, 2, 3, 4], [1, 2, 3, 9, 10]])
    res = replay(trace, cfg, "linear", LINEAR, disaggregation=DisaggregationSpec(1, 1))
    per_block = 16 * compute_capacity(cfg).kv_bytes_per_token
    assert list(res.requests["kv_pull_bytes"]) == [4 * per_block, 2 * per_block]
    assert res.summary["disaggregation"]["decode"]["prefix_cache_hits_tokens"] == 48


def _identical(a, b):
    pd.testing.assert_frame_equal(a.requests, b.requests)
    for name, values in a.steps.items():
        assert np.array_equal(values, b.steps[name]), name


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_prefill=st.integers(1, 3), num_decode=st.integers(1, 3),
       decode_blocks=st.sampled_from([70, 300]), shared=st.booleans(),
       routers=st.sampled_from([("round_robin", "least_outstanding"), ("least_outstanding", "prefix_aware")]),
       async_scheduling=st.booleans())
def test_decode_runs_change_nothing_and_every_request_is_served(seed, num_prefill, num_decode, decode_blocks, shared,
                                                                routers, async_scheduling):
    """Jumps over decode runs are exact here too (they stop before any handoff could arrive), and
    the bookkeeping holds: every request finishes, every pull ends before its first token, the
    decode pool ends with every block free. Synchronously and under async scheduling."""
    trace = loaded_trace(120, seed, shared)
    spec = DisaggregationSpec(num_prefill, num_decode, decode_options=(("num_gpu_blocks", decode_blocks),),
                              prefill_router=routers[0], decode_router=routers[1])
    cfg = config(max_model_len=1024, async_scheduling=async_scheduling)
    a = replay(trace, cfg, "roofline", disaggregation=spec)
    b = replay(trace, cfg, "roofline", disaggregation=spec, use_decode_runs=False)
    _identical(a, b)
    r = a.requests
    assert (r["status"] == "finished").all()
    assert (r["prefill_end_time_s"] + spec.handoff_ms / 1e3 <= r["kv_pull_start_s"] + 1e-9).all()
    assert (r["kv_pull_end_s"] < r["first_token_time_s"]).all()
    for run in a.fleet_runs:
        assert run.scheduler.kv_cache_manager.block_pool.get_num_used_blocks() == 0
    assert a.summary["disaggregation"]["decode"]["num_steps"] == a.summary["num_steps"]
    pools = a.summary["disaggregation"]
    assert a.steps["num_preemptions"].sum() == pools["decode"]["num_preemptions"] + pools["prefill"]["num_preemptions"]


def test_same_inputs_same_outputs(tmp_path):
    trace, spec = loaded_trace(100, 3), DisaggregationSpec(2, 2)
    for name in ("a", "b"):
        save(replay(trace, config(), disaggregation=spec), tmp_path / name)
    for name in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_pool_options_and_bad_setups():
    spec = DisaggregationSpec(1, 1, prefill_options=(("max_num_batched_tokens", 4096),),
                              decode_options=(("max_num_seqs", 64),))
    prefill, decode = spec.pool_configs(config())
    # (max_num_seqs defaulted again for each pool, as each pool's vLLM server does: 1,024 on an H100,
    # at most the pool's token budget)
    assert (prefill.scheduler.max_num_batched_tokens, prefill.scheduler.max_num_seqs) == (4096, 1024)
    assert (decode.scheduler.max_num_batched_tokens, decode.scheduler.max_num_seqs) == (512, 64)
    small = DisaggregationSpec(1, 1, decode_options=(("max_num_batched_tokens", 128),)).pool_configs(config())[1]
    assert (small.scheduler.max_num_batched_tokens, small.scheduler.max_num_seqs) == (128, 128)
    with pytest.raises(ConfigError, match="decode pool: unknown option 'max_seqs'"):
        DisaggregationSpec(1, 1, decode_options=(("max_seqs", 4),)).pool_configs(config())
    with pytest.raises(ConfigError, match="max_model_len differ"):
        DisaggregationSpec(1, 1, decode_options=(("max_model_len", 1024),)).pool_configs(config())
    with pytest.raises(ConfigError, match="the pools' block_size differ"):
        DisaggregationSpec(1, 1, prefill_options=(("block_size", 32),)).pool_configs(config())
    prefill, decode = DisaggregationSpec(1, 1, decode_options=(("gpu", "H200"),)).pool_configs(config())
    assert (prefill.hardware.gpu, decode.hardware.gpu) == ("H100-SXM", "H200")  # pools may differ in hardware
    with pytest.raises(ConfigError, match="handoff_ms must be > 0"):
        DisaggregationSpec(1, 1, handoff_ms=0)
    with pytest.raises(ConfigError, match="decode replicas must be a whole number"):
        DisaggregationSpec(1, 0)


def test_cli_flags_config_file_and_report(tmp_path):
    trace = tmp_path / "t.parquet"
    from simkv.traces.schema import write_trace

    write_trace(loaded_trace(60, 1), trace)
    cfg = tmp_path / "pd.yaml"
    cfg.write_text("max_model_len: 2048\nnum_gpu_blocks: 300\ndisaggregation:\n  prefill_replicas: 2\n"
                   "  decode: {max_num_seqs: 16}\n  kv_link_gbps: 25\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["replay", str(trace), "--out", str(out), "--config", str(cfg),
                                       "--decode-replicas", "3", "--decode-set", "max_num_batched_tokens=1024"])
    assert result.exit_code == 0, result.output
    assert "P/D pools" in result.output
    d = json.loads((out / "summary.json").read_text())["disaggregation"]
    assert (d["prefill_replicas"], d["decode_replicas"], d["kv_link_gbps"]) == (2, 3, 25.0)
    assert d["decode_options"] == {"max_num_batched_tokens": 1024, "max_num_seqs": 16}
    assert d["decode"]["config"]["max_num_seqs"] == 16 and len(d["decode"]["replicas"]) == 3
    page = (out / "report.html").read_text()
    assert "decode 2" in page and "P/D disaggregation: 2 prefill replicas" in page
    steps = pd.read_parquet(out / "steps.parquet")
    assert set(steps["pool"]) == {"prefill", "decode"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("disaggregation:\n  prefill_replica: 2\n")
    result = CliRunner().invoke(main, ["replay", str(trace), "--out", str(out), "--config", str(bad)])
    assert result.exit_code == 2 and "unknown key(s) prefill_replica" in result.output
    result = CliRunner().invoke(main, ["replay", str(trace), "--out", str(out), "--decode-replicas", "2",
                                       "--replicas", "2"])
    assert result.exit_code == 2 and "drop --replicas/--router" in result.output


def _goodput(tmp_path, *args):
    """`simkv goodput` on a small trace with two SLOs: (exit code, output, goodput.json or None)."""
    from simkv.traces.schema import write_trace

    trace, out = tmp_path / "t.parquet", tmp_path / "gp"
    if not trace.exists():
        write_trace(loaded_trace(80, 2), trace)
    result = CliRunner().invoke(main, ["goodput", str(trace), "--goodput", "ttft:2000", "--goodput", "tpot:100",
                                       "--max-model-len", "2048", "--quiet", "--out", str(out), *args])
    record = json.loads((out / "goodput.json").read_text()) if result.exit_code == 0 else None
    return result.exit_code, result.output, record


def test_goodput_searches_one_split(tmp_path):
    code, output, record = _goodput(tmp_path, "--prefill-replicas", "1", "--decode-replicas", "2")
    assert code == 0, output
    assert record["disaggregation"]["decode_replicas"] == 2 and record["probes"]
    assert "P/D disaggregation: 1 prefill + 2 decode replicas" in (tmp_path / "gp" / "goodput.md").read_text()
    code, output, _ = _goodput(tmp_path, "--prefill-replicas", "1", "--grid", "max_num_seqs=8,16")
    assert code == 2 and "searches one setup" in output


def test_goodput_compares_every_split_of_n_engines(tmp_path):
    code, output, record = _goodput(tmp_path, "--pd-splits", "3", "--kv-link-gbps", "10")
    assert code == 0, output
    assert [r["setup"] for r in record["setups"]] == ["colocated", "1 prefill + 2 decode", "2 prefill + 1 decode"]
    assert record["disaggregation"]["kv_link_gbps"] == 10.0
    rates = {r["setup"]: r["max_rate_req_s"] for r in record["setups"]}
    assert record["best"] == max(rates, key=lambda k: rates[k] or 0)
    code, output, _ = _goodput(tmp_path, "--pd-splits", "3", "--prefill-replicas", "1")
    assert code == 2 and "tries every split itself" in output


def test_sweep_cells_may_split_into_pools(tmp_path):
    from simkv.traces.schema import write_trace

    trace = tmp_path / "t.parquet"
    write_trace(loaded_trace(60, 4), trace)
    out = tmp_path / "sweep"
    result = CliRunner().invoke(main, ["sweep", str(trace), "--grid", "decode_replicas=1,2", "--set", "prefill_replicas=1",
                                       "--set", "kv_link_gbps=5", "--set", "max_model_len=2048", "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = pd.read_parquet(out / "sweep.parquet")
    assert list(table["status"]) == ["ok", "ok"]
    for cell, decode in zip(table["cell_id"], (1, 2)):
        d = json.loads((out / "cells" / cell / "summary.json").read_text())["disaggregation"]
        assert (d["prefill_replicas"], d["decode_replicas"], d["kv_link_gbps"]) == (1, decode, 5.0)
    result = CliRunner().invoke(main, ["sweep", str(trace), "--grid", "decode_replicas=2", "--set", "replicas=2",
                                       "--set", "max_model_len=2048", "--out", str(tmp_path / "bad")])
    assert "sets its pools itself" in result.output


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_lora_adapters_in_both_pools(async_scheduling):
    """LoRA under P/D: each pool's engines hold `max_loras` adapter slots and pass over the
    requests whose adapter has none (a pull, before its transfer; a pulled request, keeping its
    blocks); every request is served, decode runs change nothing, and each pool's summary says
    how often its requests waited for a slot and what its adapter loads cost."""
    from simkv.traces.lora import assign_adapters

    trace = assign_adapters(loaded_trace(120, 11, shared=True), 6, 1.0, seed=1)
    spec = DisaggregationSpec(1, 1, decode_options=(("num_gpu_blocks", 300),))
    cfg = config(max_model_len=1024, async_scheduling=async_scheduling, enable_lora=True, max_loras=2)
    a = replay(trace, cfg, "roofline", disaggregation=spec)
    b = replay(trace, cfg, "roofline", disaggregation=spec, use_decode_runs=False)
    _identical(a, b)
    assert (a.requests["status"] == "finished").all()
    pools = a.summary["disaggregation"]
    for name in ("prefill", "decode"):
        lora = pools[name]["lora"]
        assert lora["max_loras"] == 2
    assert pools["decode"]["lora"]["deferrals"] > 0 and pools["prefill"]["lora"]["slot_loads"] > 0
