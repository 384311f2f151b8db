"""`simkv goodput --gpu-price GPU=USD`: what a setup costs at its highest rate within the SLOs."""
from __future__ import annotations

import json

import pytest

from simkv.config import EngineConfig
from simkv.replay.api import FleetSpec
from simkv.replay.disaggregated import DisaggregationSpec
from simkv.studies.serving_cost import PriceError, SetupGPUs, parse_prices, serving_cost
from simkv.traces.schema import read_trace
from tests.cli_runs import cli_fails, cli_ok

SLO = ["--goodput", "ttft:1000", "--goodput", "tpot:40", "--cost-model", "linear", "--attainment", "0.95",
       "--tolerance", "0.05"]


def test_prices_are_read_per_gpu_and_bad_ones_named():
    assert parse_prices(["H100-SXM=2.49", "H200=3.5"]) == {"H100-SXM": 2.49, "H200": 3.5}
    for bad, message in (("H100-SXM", "expected GPU=USD_PER_GPU_HOUR"), ("H999=1", "unknown GPU 'H999'"),
                         ("H200=cheap", "'cheap' is not a number"), ("H200=0", "must be > 0")):
        with pytest.raises(PriceError, match=message):
            parse_prices([bad])
    with pytest.raises(PriceError, match="H200 is priced twice"):
        parse_prices(["H200=1", "H200=2"])


def test_a_setups_gpus_count_tp_dp_replicas_and_both_pools():
    config = EngineConfig.from_flat({"model": "llama-3-70b", "gpu": "H200", "tensor_parallel_size": 4})
    assert SetupGPUs.of(config) == SetupGPUs("H200", 4)
    assert SetupGPUs.of(config, FleetSpec(3, "round_robin")) == SetupGPUs("H200", 12)
    spec = DisaggregationSpec(num_prefill=2, num_decode=1, decode_options=(("tensor_parallel_size", 8),))
    assert SetupGPUs.of(config, disaggregation=spec) == SetupGPUs("H200", 2 * 4 + 8)
    dsv3 = EngineConfig.from_flat({"model": "deepseek-v3", "gpu": "H200", "data_parallel_size": 8})
    assert SetupGPUs.of(dsv3) == SetupGPUs("H200", 8)


def test_a_setup_of_several_gpus_is_priced_kind_by_kind():
    config = EngineConfig.from_flat({"model": "llama-3-70b", "gpu": "H100-SXM", "tensor_parallel_size": 4})
    fleet = FleetSpec(4, "least_outstanding", replica_sets=(((2, 3), (("gpu", "H200"), ("tensor_parallel_size", 2))),))
    gpus = SetupGPUs.of(config, fleet)
    assert gpus == SetupGPUs("H100-SXM+H200", 12, (("H100-SXM", 8), ("H200", 4)))
    same = FleetSpec(2, "round_robin", replica_sets=(((1,), (("max_num_seqs", 8),)),))
    assert SetupGPUs.of(config, same) == SetupGPUs("H100-SXM", 8)  # (one kind: not mixed)
    pools = DisaggregationSpec(num_prefill=2, num_decode=1, decode_options=(("gpu", "H200"),))
    assert SetupGPUs.of(config, disaggregation=pools) == SetupGPUs("H100-SXM+H200", 12, (("H100-SXM", 8),
                                                                                           ("H200", 4)))
    cost = serving_cost(gpus, {"H100-SXM": 2.0, "H200": 3.0}, 10.0, 250.0)
    assert cost["usd_per_hour"] == 8 * 2.0 + 4 * 3.0 and cost["usd_per_gpu_hour"] is None
    assert cost["kinds"] == [{"gpu": "H100-SXM", "gpus": 8, "usd_per_gpu_hour": 2.0},
                             {"gpu": "H200", "gpus": 4, "usd_per_gpu_hour": 3.0}]
    assert serving_cost(gpus, {"H100-SXM": 2.0}, 10.0, 250.0) is None and gpus.unpriced({"H100-SXM": 2.0}) == ["H200"]


def test_cost_at_the_highest_rate():
    cost = serving_cost(SetupGPUs("H100-SXM", 2), {"H100-SXM": 3.0}, 10.0, 250.0)
    assert cost["usd_per_hour"] == 6.0
    assert cost["usd_per_1k_requests"] == pytest.approx(6.0 / 36_000 * 1e3)  # 36,000 requests an hour
    assert cost["usd_per_1m_output_tokens"] == pytest.approx(6.0 / 9e6 * 1e6)  # 9M output tokens an hour
    assert serving_cost(SetupGPUs("H200", 1), {"H100-SXM": 3.0}, 10.0, 250.0) is None
    assert serving_cost(SetupGPUs("H100-SXM", 1), {"H100-SXM": 3.0}, None, 250.0)["usd_per_1m_output_tokens"] is None


def test_goodput_prices_one_search_and_a_grid(tmp_path):
    trace = tmp_path / "head.parquet"
    cli_ok(["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "300", "--out", str(trace)])
    mean_out = float(read_trace(str(trace)).output_tokens.mean())
    cli_ok(["goodput", str(trace), *SLO, "--replicas", "2", "--gpu-price", "H100-SXM=2.0", "--out",
            str(tmp_path / "one"), "--quiet"])
    record = json.loads((tmp_path / "one" / "goodput.json").read_text())
    rate = record["max_rate_req_s"]
    assert record["cost"]["gpus"] == 2 and record["cost"]["usd_per_hour"] == 4.0
    assert record["cost"]["usd_per_1m_output_tokens"] == pytest.approx(4.0 / (3600 * rate * mean_out) * 1e6)
    assert "Cost: 2 x H100-SXM at $2/h = $4.00/h" in (tmp_path / "one" / "goodput.md").read_text()

    cli_ok(["goodput", str(trace), *SLO, "--grid", "gpu=H100-SXM,H200,L40S", "--grid", "tensor_parallel_size=1,2",
            "--gpu-price", "H100-SXM=2.0", "--gpu-price", "H200=2.2", "--out", str(tmp_path / "grid"), "--quiet"])
    grid = json.loads((tmp_path / "grid" / "goodput.json").read_text())
    costed = [c for c in grid["cells"] if c.get("cost")]
    assert [c["swept"]["gpu"] for c in costed] == ["H100-SXM", "H100-SXM", "H200", "H200"]
    assert all(c["cost"]["gpus"] == c["swept"]["tensor_parallel_size"] for c in costed)
    cheapest = min(costed, key=lambda c: c["cost"]["usd_per_1m_output_tokens"])
    assert grid["cheapest_index"] == cheapest["index"] and grid["unpriced_gpus"] == ["L40S"]
    md = (tmp_path / "grid" / "goodput.md").read_text()
    assert "**Cheapest per output token: gpu=" in md and "No --gpu-price for L40S" in md


def test_goodput_prices_a_mixed_fleet(tmp_path):
    trace = tmp_path / "head.parquet"
    cli_ok(["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "200", "--out", str(trace)])
    cli_ok(["goodput", str(trace), *SLO, "--replicas", "2", "--replica-set", "1:gpu=H200", "--gpu-price",
            "H100-SXM=2.0", "--gpu-price", "H200=3.0", "--out", str(tmp_path / "mixed"), "--quiet"])
    record = json.loads((tmp_path / "mixed" / "goodput.json").read_text())
    assert record["cost"]["usd_per_hour"] == 5.0 and record["cost"]["gpu"] == "H100-SXM+H200"
    assert "Cost: 1 x H100-SXM at $2/h + 1 x H200 at $3/h = $5.00/h" in (tmp_path / "mixed" / "goodput.md").read_text()
    assert "no price for H200, a GPU this search runs" in cli_fails(
        ["goodput", str(trace), *SLO, "--replicas", "2", "--replica-set", "1:gpu=H200", "--gpu-price", "H100-SXM=2"])


def test_goodput_price_errors(tmp_path):
    assert "no price for H100-SXM, the GPU this search runs" in cli_fails(
        ["goodput", "traces/req400.parquet", *SLO, "--gpu-price", "H200=3"])
    assert "unknown GPU 'H1000'" in cli_fails(["goodput", "traces/req400.parquet", *SLO, "--gpu-price", "H1000=3"])
    assert "not --pd-splits" in cli_fails(["goodput", "traces/req400.parquet", *SLO, "--pd-splits", "2",
                                           "--gpu-price", "H100-SXM=3"])


def test_a_replay_prices_the_gpu_hours_it_paid(tmp_path):
    """`simkv replay --gpu-price`: the setup's GPUs from start to end (a fixed fleet of mixed
    GPUs, kind by kind), an autoscaled fleet's GPU-hours (its nodes' with --node-gpus) or P/D
    pools', over the output tokens, the finished requests and those within the SLOs."""
    trace = "traces/req400.parquet"
    cli_ok(["replay", trace, "--replicas", "2", "--replica-set", "1:gpu=H200", "--gpu-price", "H100-SXM=2",
            "--gpu-price", "H200=3", "--goodput", "ttft:2000", "--out", str(tmp_path / "f")])
    summary = json.loads((tmp_path / "f" / "summary.json").read_text())
    cost, hours = summary["cost"], summary["duration_s"] / 3600
    assert [(k["gpu"], k["usd_per_gpu_hour"]) for k in cost["kinds"]] == [("H100-SXM", 2.0), ("H200", 3.0)]
    assert cost["usd_spent"] == pytest.approx(5 * hours)
    tokens = summary["output_throughput_tok_s"] * summary["duration_s"]
    assert cost["usd_per_1m_output_tokens"] == pytest.approx(5 * hours / tokens * 1e6)
    assert cost["usd_per_1k_requests"] == pytest.approx(5 * hours / summary["num_finished"] * 1e3)
    assert cost["usd_per_1k_good_requests"] == pytest.approx(5 * hours / summary["goodput"]["num_good"] * 1e3)
    text = cli_ok(["replay", trace, "--autoscale", "1-3", "--node-gpus", "8", "--gpu-price", "H100-SXM=2",
                   "--out", str(tmp_path / "a")])
    assert "per 1M output tokens" in text
    assert "per 1M output tokens" in (tmp_path / "a" / "report.html").read_text()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    nodes = summary["fleet"]["autoscaling"]["nodes"]
    assert summary["cost"]["gpu_hours"] == nodes["gpu_hours"] and summary["cost"]["usd_spent"] == pytest.approx(
        2 * nodes["gpu_hours"])
    cli_ok(["replay", trace, "--prefill-replicas", "1", "--decode-autoscale", "1-2", "--decode-set", "gpu=H200",
            "--gpu-price", "H100-SXM=2", "--gpu-price", "H200=3", "--out", str(tmp_path / "p")])
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    scaled = summary["disaggregation"]["autoscaling"]
    assert scaled["gpu_hours_by_gpu"]["H100-SXM"] == pytest.approx(summary["duration_s"] / 3600)
    assert scaled["gpu_hours_by_gpu"]["H200"] == pytest.approx(
        summary["disaggregation"]["decode"]["autoscaling"]["gpu_hours"])
    assert summary["cost"]["usd_spent"] == pytest.approx(2 * scaled["gpu_hours_by_gpu"]["H100-SXM"]
                                                         + 3 * scaled["gpu_hours_by_gpu"]["H200"])
    for args, message in ((["--gpu-price", "H200=3"], "no price for H100-SXM"),
                          (["--gpu-price", "H100"], "expected GPU=USD_PER_GPU_HOUR")):
        assert message in cli_fails(["replay", trace, *args])


def test_a_sweep_prices_each_cell(tmp_path):
    """`simkv sweep --gpu-price`: each cell's GPU-hours priced, a GPU without a price left
    uncosted (and said); a resumed sweep reprices without running a cell again."""
    import pyarrow.parquet as pq

    args = ["sweep", "traces/req400.parquet", "--grid", "gpu=H100-SXM,H200", "--grid", "replicas=1,2",
            "--out", str(tmp_path / "s"), "--quiet"]
    cli_ok([*args, "--gpu-price", "H100-SXM=2", "--gpu-price", "H200=3"])
    rows = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    for row in rows:
        cell = json.loads((tmp_path / "s" / "cells" / row["cell_id"] / "summary.json").read_text())
        price = {"H100-SXM": 2, "H200": 3}[row["gpu"]]
        assert row["usd_spent"] == pytest.approx(price * row["replicas"] * cell["duration_s"] / 3600)
        tokens = cell["output_throughput_tok_s"] * cell["duration_s"]
        assert row["usd_per_1m_output_tokens"] == pytest.approx(row["usd_spent"] / tokens * 1e6)
        assert "cost" not in cell  # (priced in the table: a later run may price it otherwise)
    from click.testing import CliRunner

    from simkv.cli.main import main

    res = CliRunner().invoke(main, [*args, "--gpu-price", "H200=6"])
    assert res.exit_code == 0 and "2 cells not costed" in res.output
    again = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert [r["usd_spent"] is None for r in again] == [r["gpu"] == "H100-SXM" for r in again]
    assert all(a["usd_spent"] == pytest.approx(2 * r["usd_spent"]) for a, r in zip(again, rows) if a["gpu"] == "H200")
