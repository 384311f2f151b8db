"""The SimPy replay: time semantics, outputs, determinism, errors."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.cli.main import main
from simkv.config import CacheConfig, EngineConfig, SchedulerConfig
from simkv.replay.api import replay, save
from simkv.replay.engine import ReplayError
from simkv.traces.schema import trace_from_frame

REQUIRED_KEYS = {
    "backend", "config", "num_requests", "num_finished", "num_rejected", "duration_s", "num_steps",
    "peak_running", "mean_running", "peak_waiting", "num_gpu_blocks", "peak_blocks_used", "num_preemptions",
    "num_preempted_requests", "prefix_cache_queries_tokens", "prefix_cache_hits_tokens", "prefix_cache_hit_rate",
    "internal_fragmentation_pct", "ttft_s", "itl_s", "e2e_s", "queue_s", "output_throughput_tok_s",
    "request_throughput_req_s", "wall_time_s"}


def config(**kw):
    sched = {k: kw.pop(k) for k in list(kw) if k in SchedulerConfig.__dataclass_fields__}
    return EngineConfig(CacheConfig(num_gpu_blocks=kw.pop("num_gpu_blocks", 400), **kw),
                        SchedulerConfig(**{"max_model_len": 512, "max_num_batched_tokens": 512, **sched}))


def frame(rows):
    return trace_from_frame(pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"]))


def test_arrival_during_a_step_joins_the_next_step():
    # linear: step = 0.1 + 0.01 * tokens. A (10 tokens) runs 0.0-0.2; B arrives at 0.15.
    trace = frame([(0.0, 10, 3), (0.15, 10, 2)])
    res = replay(trace, config(), "linear", {"step_base_s": 0.1, "step_per_token_s": 0.01})
    steps = res.steps
    assert steps["start_time_s"][:3].tolist() == pytest.approx([0.0, 0.2, 0.41])
    assert steps["num_prefill_tokens"][:2].tolist() == [10, 10]  # B's prefill is in step 1
    req = res.requests.set_index("request_id")
    assert req.loc["0", "first_token_time_s"] == pytest.approx(0.2)  # end of the step that sampled it
    assert req.loc["0", "ttft_s"] == pytest.approx(0.2)
    assert req.loc["1", "first_token_time_s"] == pytest.approx(0.41)
    assert req.loc["1", "ttft_s"] == pytest.approx(0.41 - 0.15)


def test_arrival_exactly_at_a_step_end_joins_that_next_step():
    trace = frame([(0.0, 10, 3), (0.2, 10, 2)])
    res = replay(trace, config(), "linear", {"step_base_s": 0.1, "step_per_token_s": 0.01})
    assert res.steps["num_prefill_tokens"][1] == 10


def test_idle_engine_waits_for_the_next_arrival():
    trace = frame([(0.0, 10, 1), (5.0, 10, 1)])
    res = replay(trace, config(), "unit")
    assert res.steps["start_time_s"].tolist() == [0.0, 5.0]
    assert res.summary["duration_s"] == 6.0


def test_rejected_requests_are_counted():
    trace = frame([(0.0, 600, 3), (0.0, 10, 3)])
    res = replay(trace, config(), "unit")
    assert res.summary["num_rejected"] == 1 and res.summary["num_finished"] == 1
    assert res.requests["status"].tolist() == ["rejected", "finished"]


def test_summary_keys_and_counts():
    rng = np.random.default_rng(0)
    trace = frame([(float(t), int(p), int(o)) for t, p, o in
                   zip(np.sort(rng.uniform(0, 2, 60)), rng.integers(1, 300, 60), rng.integers(1, 80, 60))])
    res = replay(trace, config(num_gpu_blocks=120), "roofline")
    s = res.summary
    assert REQUIRED_KEYS <= set(s)
    assert s["num_finished"] == 60
    assert s["num_steps"] == len(res.steps["step"])
    # Every output token is sampled by a decode, by a first prefill, or at the end of a recompute.
    recomputes = len(res.run.scheduler.irregular_gaps)
    assert s["num_decode_tokens"] + 60 + recomputes == int(res.requests["output_tokens"].sum())
    assert s["peak_blocks_used"] <= s["num_gpu_blocks"] - 1
    assert 0 <= s["internal_fragmentation_pct"] < 100


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_runs_give_identical_files(tmp_path, async_scheduling):
    rng = np.random.default_rng(1)
    trace = frame([(float(t), int(p), int(o)) for t, p, o in
                   zip(np.sort(rng.uniform(0, 3, 80)), rng.integers(1, 400, 80), rng.integers(1, 200, 80))])
    for name, runs in (("a", True), ("b", False)):
        res = replay(trace, config(num_gpu_blocks=150, async_scheduling=async_scheduling), "roofline",
                     use_decode_runs=runs)
        res.summary["wall_time_s"] = 0.0
        save(res, tmp_path / name)
    for f in ("summary.json", "requests.parquet", "steps.parquet"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_cli_replay_is_deterministic(tmp_path):
    runner = CliRunner()
    for name in ("x", "y"):
        r = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(tmp_path / name), "--quiet",
                                 "--num-gpu-blocks", "6250", "--max-model-len", "4096", "--cost-model", "unit"])
        assert r.exit_code == 0, r.output
    for f in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "x" / f).read_bytes() == (tmp_path / "y" / f).read_bytes()
    s = json.loads((tmp_path / "x" / "summary.json").read_text())
    assert (s["num_steps"], s["peak_running"], s["num_preemptions"]) == (1117, 183, 27)


def test_cli_rejects_bad_trace_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_time_s,prompt_tokens\n0.0,5\n")
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["replay", str(bad), "--out", str(out)])
    assert r.exit_code != 0
    assert "output_tokens" in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_cli_vllm_error_texts(tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--no-enable-chunked-prefill",
                             "--max-num-batched-tokens", "2048", "--max-model-len", "4096", "--out", str(tmp_path)])
    assert r.exit_code != 0
    assert "max_num_batched_tokens (2048) is smaller than max_model_len (4096)" in r.output
    r = runner.invoke(main, ["replay", "traces/req400.parquet", "--num-gpu-blocks", "100",
                             "--max-model-len", "4096", "--out", str(tmp_path)])
    assert r.exit_code != 0
    assert "To serve at least one request with the model's max seq len (4096)" in r.output
    assert "estimated maximum model length is 1584" in r.output


def test_config_file_and_unknown_option(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("block_size: 32\nmax_num_seqs: 64\nnum_gpu_blocks: 3200\nmax_model_len: 4096\n")
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--config", str(cfg), "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["block_size"] == 32 and s["config"]["max_num_seqs"] == 64
    cfg.write_text("blok_size: 32\n")
    r = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--config", str(cfg), "--out", str(out)])
    assert r.exit_code != 0 and "unknown option 'blok_size'" in r.output


@pytest.mark.parametrize("text, message", [
    ("async_scheduling: maybe\n", "option 'async_scheduling' must be true or false, got 'maybe'"),
    ("max_num_seqs: 6.5\n", "option 'max_num_seqs' must be a whole number or null, got 6.5"),
    ("watermark: low\n", "option 'watermark' must be a number, got 'low'"),
    ("num_gpu_blocks: lots\n", "option 'num_gpu_blocks' must be a whole number or null, got 'lots'"),
])
def test_config_file_values_of_the_wrong_type_are_refused(tmp_path, text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--config", str(cfg), "--out", str(out)])
    assert r.exit_code == 2 and message in r.output and not out.exists()


def test_engine_that_cannot_progress_reports_instead_of_hanging():
    """A pool too small for one request (normally refused before the run by the capacity
    check, bypassed here) is reported with its cause."""
    from simkv.backends.cost_models import UnitCostModel
    from simkv.replay.engine import ReplayEngine, ReplayError

    trace = frame([(0.0, 100, 3)])
    engine = ReplayEngine(trace, config(), UnitCostModel(), num_gpu_blocks=4)
    with pytest.raises(ReplayError, match=r"cannot make progress at step 0: 0 running, 1 waiting .* 3 free blocks"):
        engine.run()


def test_replay_makes_no_reference_cycles():
    """`replay` pauses the cyclic collector, which is safe only if steps create no garbage
    cycles: with the collector off, a replay with preemptions, chunked prefill and released
    private blocks (chunks) must leave only its own engine's few end-of-run objects."""
    import gc

    from simkv.traces.schema import read_trace

    trace = read_trace("traces/req400_prefix10.parquet")
    config = EngineConfig.from_flat({"num_gpu_blocks": 600, "max_num_seqs": 64})
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        result = replay(trace, config)
        found = gc.collect()
        kinds = {type(o).__name__ for o in gc.garbage}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert result.summary["num_preemptions"] > 0 and result.summary["num_finished"] == len(trace)
    # what stays is SimPy's environment and processes of this replay (a cycle, once per run)
    assert found < 50, (found, kinds)
    assert not kinds & {"BlockChunk", "KVCacheBlock", "Request", "DecodeRun", "SchedulerOutput"}, kinds


def test_trace_beyond_the_clock_range_is_refused():
    trace = frame([(0.0, 10, 3), (60 * 86400.0, 10, 2)])  # a request 60 days in
    with pytest.raises(ReplayError, match="spans 60 days"):
        replay(trace, config(), "unit")


def test_cli_warns_when_prompts_are_rejected(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0.0,5000,3\n0.1,10,3\n")
    r = CliRunner().invoke(main, ["replay", str(trace), "--out", str(tmp_path / "o"), "--quiet", "--max-model-len", "4096"])
    assert r.exit_code == 0, r.output
    assert "warning: 1 of 2 requests were rejected" in r.output and "max_model_len = 4,096" in r.output
    r = CliRunner().invoke(main, ["replay", str(trace), "--out", str(tmp_path / "p"), "--quiet", "--max-model-len", "8192"])
    assert r.exit_code == 0 and "warning" not in r.output


def test_outputs_get_the_usual_file_mode(tmp_path):
    """Files are written under a temporary name, then renamed: with the umask's mode, not mkstemp's 0600."""
    import os
    import stat

    from simkv.atomic import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]
