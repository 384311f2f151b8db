"""What held the waiting queue back (steps.parquet's `admission_limit`, summary.json's
`admission_limits`): the limit that ended each step's admissions (simkv/core/admission_limits.py)."""

import json

import numpy as np
import pandas as pd
import pytest

from simkv.config import CacheConfig, EngineConfig, SchedulerConfig
from simkv.core.admission_limits import ADMISSION_LIMITS
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame
from tests.cli_runs import cli_ok
from tests.core.helpers import assert_decode_runs_change_no_bytes


def config(num_gpu_blocks=400, block_size=16, **sched) -> EngineConfig:
    return EngineConfig(CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks),
                        SchedulerConfig(**{"max_model_len": 2048, "max_num_batched_tokens": 2048, "max_num_seqs": 64,
                                           **sched}))


def burst(n=40, prompt=200, output=60, gap=0.0):
    rows = [(i * gap, prompt + 7 * (i % 5), output + 3 * (i % 7)) for i in range(n)]
    return trace_from_frame(pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"]))


def held(res) -> pd.Series:
    """Steps that left requests waiting: the limit of each, by name."""
    steps = res.steps
    waiting = steps["num_waiting"] > 0
    return pd.Series(np.asarray(ADMISSION_LIMITS)[steps["admission_limit"][waiting]])


def test_a_full_running_queue_holds_the_rest_at_max_num_seqs():
    res = replay(burst(), config(max_num_seqs=4), "unit")
    assert set(held(res)) == {"max_num_seqs"}
    limits = res.summary["admission_limits"]
    assert list(limits["by_limit"]) == ["max_num_seqs"] and limits["by_limit"]["max_num_seqs"]["share"] == 1.0
    # request-seconds: each step's duration (1 s) times the requests it left waiting
    assert limits["waiting_request_s"] == pytest.approx(float(res.steps["num_waiting"].sum()))
    assert limits["steps_with_waiting"] == int((res.steps["num_waiting"] > 0).sum())


def test_a_small_pool_holds_them_at_the_kv_cache_and_its_preemptions():
    res = replay(burst(output=300), config(num_gpu_blocks=60, max_model_len=900), "unit")
    limits = held(res)
    assert {"kv_cache", "preemption"} <= set(limits)
    steps = res.steps
    codes = steps["admission_limit"]
    # a step labelled preemption preempted (vLLM admits nothing in such a step)
    assert (steps["num_preemptions"][codes == ADMISSION_LIMITS.index("preemption")] > 0).all()
    assert res.summary["num_preemptions"] > 0


def test_a_small_token_budget_holds_them_at_max_num_batched_tokens():
    res = replay(burst(prompt=600), config(num_gpu_blocks=4000, max_num_batched_tokens=256), "unit")
    assert held(res).value_counts().index[0] == "max_num_batched_tokens"
    assert "kv_cache" not in set(held(res))


def test_without_chunked_prefill_a_prompt_over_the_left_budget_waits_for_the_budget():
    res = replay(burst(prompt=600), config(num_gpu_blocks=4000, max_num_batched_tokens=1024,
                                           max_model_len=1024, enable_chunked_prefill=False), "unit")
    assert set(held(res)) == {"max_num_batched_tokens"}


def test_the_prefill_cadence_holds_new_prompts_between_its_prefill_steps():
    trace = burst(n=60, prompt=100, output=40, gap=0.5)
    res = replay(trace, config(num_gpu_blocks=4000, prefill_schedule_interval=4), "unit")
    assert "prefill_schedule_interval" in set(held(res))


def test_nothing_waiting_records_none_and_an_empty_breakdown():
    res = replay(burst(n=5, gap=1000.0), config(num_gpu_blocks=4000), "unit")
    assert (res.steps["admission_limit"] == 0).all()
    assert res.summary["admission_limits"] == {"waiting_request_s": 0.0, "steps_with_waiting": 0, "by_limit": {}}


def _azure_head(tmp_path, n=240, scale=0.05):
    path = tmp_path / "t.parquet"
    cli_ok(["trace", "transform", "traces/azure_conv_slice.parquet", "--head", str(n), "--time-scale", str(scale),
            "--out", str(path)])
    return path


@pytest.mark.parametrize("options", [
    [],
    ["--async-scheduling"],
    ["--num-gpu-blocks", "900"],
    ["--num-gpu-blocks", "900", "--async-scheduling"],
    ["--max-num-seqs", "16", "--max-num-batched-tokens", "1024"],
    ["--num-gpu-blocks", "1200", "--no-enable-chunked-prefill"],
    ["--num-gpu-blocks", "1200", "--watermark", "0.05", "--scheduling-policy", "priority"],
    ["--num-gpu-blocks", "1200", "--prefill-schedule-interval", "3"],
    ["--num-gpu-blocks", "1500", "--speculative-method", "ngram", "--num-speculative-tokens", "3"],
    ["--num-gpu-blocks", "1200", "--kv-offloading-size", "1"],
    ["--num-gpu-blocks", "1200", "-tp", "2", "-pp", "2", "--model", "llama-3-70b"],
    ["--replicas", "2", "--num-gpu-blocks", "700"],
    ["--prefill-replicas", "1", "--decode-replicas", "1", "--num-gpu-blocks", "900"],
    ["--prefill-replicas", "1", "--decode-replicas", "1", "--num-gpu-blocks", "900", "--kv-offloading-size", "1"],
    ["--model", "gemma-3-12b", "--max-model-len", "1800", "--num-gpu-blocks", "700", "--async-scheduling"],
    ["--model", "qwen3-next-80b-a3b", "--gpu", "H200", "-tp", "2", "--max-model-len", "8192", "--num-gpu-blocks", "90"],
    ["--model", "deepseek-v2-lite", "-dp", "2", "--max-model-len", "4096", "--num-gpu-blocks", "400"],
    ["--num-gpu-blocks", "1500", "--speculative-method", "eagle3", "--num-speculative-tokens", "3",
     "--async-scheduling"],
    ["--num-gpu-blocks", "1200", "--client-ttft-timeout", "2", "--client-max-retries", "1"],
])
def test_every_step_that_leaves_requests_waiting_names_its_limit(tmp_path, options):
    """Across engines (sync, async, drafts, a CPU tier, pipeline stages, fleets, P/D pools): a step
    that left requests waiting names a limit, a step that left none names none, and the summary's
    request-seconds and shares add up."""
    trace = _azure_head(tmp_path)
    out = tmp_path / "out"
    cli_ok(["replay", str(trace), "--out", str(out), *options])
    steps = pd.read_parquet(out / "steps.parquet")
    summary = json.loads((out / "summary.json").read_text())
    waiting = steps["num_waiting"].to_numpy() > 0
    names = steps["admission_limit"].astype(str).to_numpy()
    assert (names[waiting] != "none").all(), pd.Series(names[waiting]).value_counts()
    assert (names[~waiting] == "none").all()
    limits = summary["admission_limits"]
    assert waiting.any() and limits["steps_with_waiting"] == int(waiting.sum())
    weight = steps["duration_s"].to_numpy() * steps["num_waiting"].to_numpy()
    assert limits["waiting_request_s"] == pytest.approx(float(weight.sum()))
    assert sum(v["share"] for v in limits["by_limit"].values()) == pytest.approx(1.0)
    for name, v in limits["by_limit"].items():
        assert v["steps"] == int((names[waiting] == name).sum())
        assert v["waiting_request_s"] == pytest.approx(float(weight[names == name].sum()))
    if "disaggregation" in summary:  # (each pool's own breakdown beside the two pools' together)
        pools = summary["disaggregation"]
        assert (pools["prefill"]["admission_limits"]["steps_with_waiting"]
                + pools["decode"]["admission_limits"]["steps_with_waiting"]) == limits["steps_with_waiting"]


@pytest.mark.parametrize("sched", [{}, {"async_scheduling": True}])
def test_decode_runs_record_the_limits_stepping_records(tmp_path, sched):
    """A decode run's steps admit nothing: they carry the limit a stepped replay finds at each."""
    trace = burst(n=80, prompt=300, output=200, gap=0.02)
    res = assert_decode_runs_change_no_bytes(trace, config(num_gpu_blocks=150, **sched), tmp_path)
    assert len(res.summary["admission_limits"]["by_limit"]) >= 2


def test_the_report_names_the_limits(tmp_path):
    trace = _azure_head(tmp_path)
    output = cli_ok(["replay", str(trace), "--out", str(tmp_path / "o"), "--num-gpu-blocks", "900"])
    assert "waiting held by" in output and "kv_cache" in output
    html = (tmp_path / "o" / "report.html").read_text()
    assert "waiting held by" in html
    chart = html[html.index("Waiting, by what held it"):]
    chart = chart[:chart.index("</svg>")]
    assert ">kv_cache<" in chart  # (the chart's legend names the limits)


def test_adapters_without_a_slot_wait_at_max_loras(tmp_path):
    trace = _azure_head(tmp_path)
    cli_ok(["trace", "transform", str(trace), "--lora-adapters", "6", "--out", str(tmp_path / "l.parquet")])
    out = tmp_path / "out"
    cli_ok(["replay", str(tmp_path / "l.parquet"), "--out", str(out), "--enable-lora", "--max-loras", "1"])
    limits = json.loads((out / "summary.json").read_text())["admission_limits"]["by_limit"]
    assert "max_loras" in limits and limits["max_loras"]["share"] > 0.5


def test_images_over_the_encoder_budget_wait_at_the_encoder(tmp_path):
    trace = _azure_head(tmp_path, scale=0.1)
    cli_ok(["trace", "transform", str(trace), "--images", "1", "--image-tokens", "4096",
            "--out", str(tmp_path / "i.parquet")])
    out = tmp_path / "out"
    cli_ok(["replay", str(tmp_path / "i.parquet"), "--out", str(out), "--model", "qwen2.5-vl-7b",
            "--max-model-len", "16384", "--mm-max-tokens-per-item", "4096"])
    steps = pd.read_parquet(out / "steps.parquet")
    assert "encoder" in set(steps["admission_limit"].astype(str))


def test_each_request_names_what_held_it_longest():
    """requests.parquet's queue_held_by: of the steps that started after the request arrived and
    before its first step, the limit whose steps lasted longest (checked by brute force)."""
    res = replay(burst(n=60, output=300, gap=0.05), config(num_gpu_blocks=300, max_model_len=900, max_num_seqs=8),
                 "roofline")
    req, steps = res.requests, res.steps
    assert req["queue_held_by"].dtype == "category"
    names = np.asarray(ADMISSION_LIMITS)
    checked = 0
    for _, r in req.iterrows():
        inside = (steps["start_time_s"] >= r["arrival_time_s"]) & (steps["start_time_s"] < r["first_scheduled_time_s"])
        inside &= steps["num_waiting"] > 0
        by = pd.Series(steps["duration_s"][inside]).groupby(names[steps["admission_limit"][inside]]).sum()
        expected = by.idxmax() if len(by) and by.max() > 0 else "none"
        assert r["queue_held_by"] == expected, r["request_id"]
        checked += expected != "none"
    assert checked > 20 and "none" in set(req["queue_held_by"])
