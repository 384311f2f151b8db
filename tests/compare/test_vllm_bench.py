"""`simkv compare SIM_DIR bench.json`: a run measured by vLLM's own benchmark client.

data/vllm_bench_azure25.json is a real `vllm bench serve` (vLLM 0.33) result file, recorded by
scripts/vllm_bench_roundtrip.py --head 25 --prompt-traces: the client replayed the export of the
Azure slice's first 25 requests against a stand-in server that streamed each token at the time
the simulation below gives it; the .prom files are that server's /metrics before and after."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_runs import cli_fails, cli_ok
from simkv.compare.vllm_bench import read_prometheus_counters

DATA = Path(__file__).parent / "data"
BENCH = DATA / "vllm_bench_azure25.json"
METRICS = [str(DATA / "vllm_bench_azure25_metrics_before.prom"), str(DATA / "vllm_bench_azure25_metrics_after.prom")]




@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory) -> Path:
    """The simulated replay the recording was made against (the roundtrip script's commands)."""
    tmp = tmp_path_factory.mktemp("bench")
    cli_ok(["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "25", "--out", str(tmp / "t.parquet")])
    cli_ok(["trace", "export", str(tmp / "t.parquet"), "--out", str(tmp / "x.jsonl"), "--block-size", "16"])
    cli_ok(["replay", str(tmp / "x.parquet"), "--block-size", "16", "--out", str(tmp / "sim"), "--quiet"])
    return tmp / "sim"


def _compare(sim_dir: Path, out: Path, *extra: str) -> dict:
    cli_ok(["compare", str(sim_dir), str(BENCH), "--out", str(out), "--quiet", *extra])
    return json.loads((out / "compare.json").read_text())


def test_measured_side_is_what_the_client_itself_reported(sim_dir, tmp_path):
    result = _compare(sim_dir, tmp_path / "c", "--server-metrics", *METRICS)
    bench = json.loads(BENCH.read_text())
    measured = {r["metric"]: r["measured"] for r in result["metrics"]}
    for ours, theirs in (("ttft_s.mean", "mean_ttft_ms"), ("ttft_s.p50", "median_ttft_ms"), ("ttft_s.p99", "p99_ttft_ms"),
                         ("itl_s.mean", "mean_itl_ms"), ("itl_s.p50", "median_itl_ms"), ("itl_s.p99", "p99_itl_ms")):
        assert measured[ours] == pytest.approx(bench[theirs] / 1e3, rel=1e-12)
    assert measured["duration_s"] == bench["duration"] and measured["num_finished"] == bench["completed"] == 25
    assert measured["request_throughput_req_s"] == pytest.approx(bench["request_throughput"], rel=1e-12)
    assert result["vllm_bench"]["vllm_aggregates"] == {"checked": 9, "max_rel_difference": 0.0, "agree": True}
    assert result["requests"]["matched_requests"] == 25
    assert measured["num_preemptions"] == 0 and measured["prefix_cache_hit_rate"] == 0.0
    assert result["vllm_bench"]["server_metrics"]["prefix_cache_queries"] == 18975  # the 25 prompts' tokens
    assert result["steps"] == {"available": False, "reason": "vLLM's benchmark client records no engine steps"}


def test_round_trip_through_the_real_client_keeps_the_simulated_times(sim_dir, tmp_path):
    """The stand-in server streamed the simulation's token times: what the client measured is the
    simulation up to the client's and HTTP's own delays (if this fails after a change to the
    engine or the roofline, the recording is stale: re-record it with the roundtrip script)."""
    result = _compare(sim_dir, tmp_path / "c")
    err = {r["metric"]: r["rel_error"] for r in result["metrics"]}
    assert abs(err["duration_s"]) < 0.002 and abs(err["output_throughput_tok_s"]) < 0.002
    assert abs(err["e2e_s.p50"]) < 0.01 and abs(err["itl_s.mean"]) < 0.002
    lag = result["vllm_bench"]["client_send_lag_s"]
    assert 0 <= lag["median"] < 0.005
    md = (tmp_path / "c" / "compare.md").read_text()
    assert "## Measured by `vllm bench serve`" in md and "not compared: vLLM's benchmark client" in md
    assert "no server counters given" in md
    html = (tmp_path / "c" / "report.html").read_text()
    assert html.count("<svg") == 5 and "Step duration" not in html  # no steps: request charts only


def test_bad_benchmark_files_are_refused_with_the_reason(sim_dir, tmp_path):
    bench = json.loads(BENCH.read_text())
    cases = {
        "short.json": ({k: (v[:24] if isinstance(v, list) else v) for k, v in bench.items()},
                       "the benchmark sent 24 requests, the simulated run replayed 25"),
        "lens.json": (bench | {"input_lens": [bench["input_lens"][0] + 1] + bench["input_lens"][1:]},
                      "request 0 has"),
        "summary.json": ({k: v for k, v in bench.items() if k != "itls"}, "--save-detailed"),
        "other.json": ({"hello": 1}, "not a `vllm bench serve --save-result` file"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(json.dumps(content))
        out = cli_fails(["compare", str(sim_dir), str(tmp_path / name), "--out", str(tmp_path / "o")])
        assert message in out, (name, out)
    (tmp_path / "appended.json").write_text(json.dumps(bench) + "\n" + json.dumps(bench))
    assert "--append-result" in cli_fails(["compare", str(sim_dir), str(tmp_path / "appended.json"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()  # nothing written
    swapped = cli_fails(["compare", str(sim_dir), str(BENCH), "--server-metrics", METRICS[1], METRICS[0],
                      "--out", str(tmp_path / "o")])
    assert "swapped, or the server restarted between them" in swapped
    (tmp_path / "m.prom").write_text("# HELP x\nprocess_cpu_seconds_total 3.0\n")
    assert "is it a vLLM server's /metrics" in cli_fails(
        ["compare", str(sim_dir), str(BENCH), "--server-metrics", str(tmp_path / "m.prom"), METRICS[1],
         "--out", str(tmp_path / "o")])
    assert "--server-metrics goes with a `vllm bench serve` result" in cli_fails(
        ["compare", str(sim_dir), str(sim_dir), "--server-metrics", *METRICS, "--out", str(tmp_path / "o")])


def test_prometheus_counters_sum_engines_and_catch_swapped_snapshots(tmp_path):
    text = ('# TYPE vllm:prefix_cache_hits_total counter\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 20\n'
            'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400\n'
            'vllm:num_preemptions_total 3\n')
    (tmp_path / "after.prom").write_text(text)
    assert read_prometheus_counters(tmp_path / "after.prom") == {
        "prefix_cache_queries": 400.0, "prefix_cache_hits": 120.0, "num_preemptions": 3.0}
    from simkv.compare.vllm_bench import server_counters

    (tmp_path / "before.prom").write_text(text.replace(" 100.0", " 0").replace(" 400", " 100"))
    assert server_counters(tmp_path / "before.prom", tmp_path / "after.prom") == {
        "prefix_cache_queries": 300.0, "prefix_cache_hits": 100.0, "num_preemptions": 0.0}
    with pytest.raises(ValueError, match="swapped, or the server restarted"):
        server_counters(tmp_path / "after.prom", tmp_path / "before.prom")
    (tmp_path / "bad.prom").write_text("vllm:num_preemptions_total{engine=\"0\"} many\n")
    with pytest.raises(ValueError, match="line 1: cannot read the value of 'vllm:num_preemptions_total'"):
        read_prometheus_counters(tmp_path / "bad.prom")


def test_any_benchmark_result_imports_as_the_traffic_it_sent(tmp_path):
    """`simkv trace import vllm-bench`: arrivals at the sends, ids bench-<i>; compare matches by id,
    also when sends were reordered (a --max-concurrency semaphore) or a request failed."""
    bench = json.loads(BENCH.read_text())
    start = bench["start_times"]
    bench["start_times"] = [start[0], start[2], start[1]] + start[3:]  # request 1 sent after request 2
    bench["errors"][5] = "Internal Server Error"
    bench["output_lens"][5] = 0
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    out = cli_ok(["trace", "import", "vllm-bench", str(path), "--out", str(tmp_path / "t.parquet")])
    assert "kept 24; dropped 1 (1 with a failed request (no output length))" in out
    from simkv.traces.schema import read_trace

    trace = read_trace(tmp_path / "t.parquet")
    assert list(trace.request_id[:3]) == ["bench-0", "bench-2", "bench-1"] and "bench-5" not in set(trace.request_id)
    assert trace.arrival_time_s[1] == pytest.approx(start[1] - start[0])
    cli_ok(["replay", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "sim"), "--quiet"])
    cli_ok(["compare", str(tmp_path / "sim"), str(path), "--out", str(tmp_path / "c"), "--quiet"])
    result = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert result["requests"]["matched_requests"] == 24
    measured = {r["metric"]: r["measured"] for r in result["metrics"]}
    assert measured["num_finished"] == 24
    # the per-request pairs are the same requests: ttft of bench-2 is compared with bench-2's
    import pandas as pd

    sim = pd.read_parquet(tmp_path / "sim" / "requests.parquet").set_index("request_id")
    assert sim.loc["bench-2", "prompt_tokens"] == bench["input_lens"][2]
    other = tmp_path / "other.json"
    other.write_text(json.dumps(bench | {k: v[:20] for k, v in bench.items() if isinstance(v, list)}))
    assert "is not one of this benchmark's 20 requests" in cli_fails(
        ["compare", str(tmp_path / "sim"), str(other), "--out", str(tmp_path / "o")])
