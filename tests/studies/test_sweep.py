"""`simkv sweep`: grid parsing, cell ids, local and Ray executors (identical tables), resume, failures."""

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.replay.api import replay
from simkv.sweep import SweepError, make_cells, parse_grid, parse_value
from simkv.sweep.table import METRICS
from simkv.traces.schema import read_trace

TRACE = "traces/req400.parquet"
GRID = ["--grid", "block_size=8,16,32", "--grid", "watermark=0,0.01,0.05"]
FIXED = ["--set", "num_gpu_blocks=3000", "--set", "max_model_len=4096", "--cost-model", "unit"]
OUTPUTS = ("sweep.parquet", "sweep.md", "plots.html")


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def sweep(*args: str):
    return CliRunner().invoke(main, ["sweep", *args, "--quiet"])


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path_factory.mktemp("local") / "sweep"
    cwd = os.getcwd()
    os.chdir(root)
    try:
        res = sweep(TRACE, *GRID, *FIXED, "--workers", "2", "--out", str(out))
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, res.output
    return out


# --- grid and cells -------------------------------------------------------------------------------

def test_parse_value_types():
    assert [parse_value(v) for v in ("16", "0.01", "1e-5", "True", "false", "none", "fcfs")] == \
        [16, 0.01, 1e-5, True, False, None, "fcfs"]
    assert isinstance(parse_value("16"), int) and isinstance(parse_value("0.5"), float)


def test_parse_grid_keeps_order_and_normalizes_names():
    grid = parse_grid(["max-num-seqs=64,128", "enable_prefix_caching=true,false", "cost_model=unit,linear"])
    assert grid == {"max_num_seqs": [64, 128], "enable_prefix_caching": [True, False], "cost_model": ["unit", "linear"]}
    assert list(grid) == ["max_num_seqs", "enable_prefix_caching", "cost_model"]


@pytest.mark.parametrize("specs, text", [
    (["blok_size=8,16"], "unknown option 'blok_size'"),
    (["block_size"], "expected KEY=V1,V2"),
    (["block_size=8,,16"], "empty value"),
    (["block_size=8,8"], "repeated value"),
    (["block_size=8", "block-size=16"], "given twice"),
])
def test_parse_grid_errors(specs, text):
    with pytest.raises(SweepError, match=text):
        parse_grid(specs)


def test_cells_order_and_stable_ids():
    grid = {"block_size": [8, 16], "watermark": [0.0, 0.01]}
    cells = make_cells(["a.parquet", "b.parquet"], grid, {"num_gpu_blocks": 100}, "unit")
    assert [(c.trace, dict(c.swept)) for c in cells[:3]] == [
        ("a.parquet", {"block_size": 8, "watermark": 0.0}), ("a.parquet", {"block_size": 8, "watermark": 0.01}),
        ("a.parquet", {"block_size": 16, "watermark": 0.0})]
    assert [c.index for c in cells] == list(range(8))
    assert len({c.cell_id for c in cells}) == 8
    again = make_cells(["./a.parquet", "b.parquet"], grid, {"num_gpu_blocks": 100}, "unit")
    assert [c.cell_id for c in again] == [c.cell_id for c in cells]
    # Any fixed option, and the cost model, is part of the id: a changed setup is not "finished".
    assert make_cells(["a.parquet"], grid, {"num_gpu_blocks": 101}, "unit")[0].cell_id != cells[0].cell_id
    assert make_cells(["a.parquet"], grid, {"num_gpu_blocks": 100}, "linear")[0].cell_id != cells[0].cell_id
    swept_model = make_cells(["a.parquet"], {"cost_model": ["unit"]}, {"num_gpu_blocks": 100}, "roofline")[0]
    assert swept_model.cost_model == "unit" and "cost_model" not in dict(swept_model.options)


# --- local sweep ----------------------------------------------------------------------------------

def test_local_sweep_table(local_sweep):
    table = pq.read_table(local_sweep / "sweep.parquet").to_pylist()
    assert len(table) == 9
    assert [r["cell"] for r in table] == list(range(9))
    assert [(r["block_size"], r["watermark"]) for r in table] == [
        (b, w) for b in (8, 16, 32) for w in (0.0, 0.01, 0.05)]
    assert all(r["status"] == "ok" and r["error"] is None for r in table)
    assert set(METRICS) <= set(table[0]) and "engine_block_size" not in table[0]  # (every cell ran as asked)
    assert not any("wall" in name for name in table[0])
    for b in (8, 16, 32):
        pre = [r["num_preemptions"] for r in table if r["block_size"] == b]
        assert pre[0] > 0 and pre[-1] == 0 and pre == sorted(pre, reverse=True)  # watermark holds blocks back
    frag = [r["internal_fragmentation_pct"] for r in table if r["watermark"] == 0]
    assert frag == sorted(frag) and frag[0] < frag[-1]  # bigger blocks, more waste in the last block
    md = (local_sweep / "sweep.md").read_text()
    assert md.count("\n| ") == 10 and "9 cells, 9 ok, 0 failed" in md


def test_cell_matches_a_direct_replay(local_sweep):
    row = pq.read_table(local_sweep / "sweep.parquet").to_pylist()[4]  # block_size 16, watermark 0.01
    config = EngineConfig.from_flat({"block_size": 16, "watermark": 0.01, "num_gpu_blocks": 3000,
                                     "max_model_len": 4096})
    direct = replay(read_trace(TRACE), config, "unit").summary
    assert (row["num_steps"], row["num_preemptions"], row["peak_running"]) == \
        (direct["num_steps"], direct["num_preemptions"], direct["peak_running"])
    assert row["ttft_p99_s"] == direct["ttft_s"]["p99"]
    cell = json.loads((local_sweep / "cells" / row["cell_id"] / "summary.json").read_text())
    assert cell["wall_time_s"] > 0 and cell["sweep_cell"]["options"]["watermark"] == 0.01


def test_plots_one_chart_per_metric_and_key(local_sweep):
    page = (local_sweep / "plots.html").read_text()
    from simkv.sweep.plots import PLOT_METRICS

    assert page.count("<svg") == 2 * len(PLOT_METRICS)
    assert "num_preemptions vs watermark" in page and "ttft_p99_s vs block_size" in page
    assert "watermark=0.05" in page  # legend: one line per other key's value
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "<script" not in page


def test_resume_skips_finished_cells(local_sweep, tmp_path):
    out = tmp_path / "sweep"
    shutil.copytree(local_sweep, out)
    before = {p: p.stat().st_mtime_ns for p in out.glob("cells/*/summary.json")}
    victim = sorted(before)[0]
    victim.unlink()
    res = CliRunner().invoke(main, ["sweep", TRACE, *GRID, *FIXED, "--workers", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "9 cells: 8 already done, 1 run, 0 failed" in res.output
    assert victim.exists()
    assert all(p.stat().st_mtime_ns == t for p, t in before.items() if p != victim)
    for name in OUTPUTS:
        assert (out / name).read_bytes() == (local_sweep / name).read_bytes()
    assert not list(out.rglob("*.tmp"))


def test_a_cell_made_with_other_options_in_force_is_run_again(local_sweep, tmp_path):
    """A summary whose cell id matches but whose options in force differ (an older simkv's
    defaults: 256 sequences before 2026-12-06) is not resumed: the cell runs again, and the
    sweep's outputs are those of a fresh run."""
    out = tmp_path / "sweep"
    shutil.copytree(local_sweep, out)
    old = sorted(out.glob("cells/*/summary.json"))[2]
    summary = json.loads(old.read_text())
    assert summary["config"]["max_num_seqs"] == 1024
    summary["config"]["max_num_seqs"], summary["num_steps"] = 256, -1
    old.write_text(json.dumps(summary))
    res = CliRunner().invoke(main, ["sweep", TRACE, *GRID, *FIXED, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "8 already done, 1 run (1 of them again: made by an earlier simkv" in res.output
    assert json.loads(old.read_text())["config"]["max_num_seqs"] == 1024
    for name in OUTPUTS:
        assert (out / name).read_bytes() == (local_sweep / name).read_bytes()


def test_unreadable_summary_is_recomputed(local_sweep, tmp_path):
    out = tmp_path / "sweep"
    shutil.copytree(local_sweep, out)
    broken = sorted(out.glob("cells/*/summary.json"))[3]
    broken.write_text('{"num_steps": 12')  # e.g. written by hand or by another tool, cut short
    res = CliRunner().invoke(main, ["sweep", TRACE, *GRID, *FIXED, "--out", str(out)])
    assert res.exit_code == 0 and "8 already done, 1 run" in res.output
    assert json.loads(broken.read_text())["num_steps"] > 0
    assert (out / "sweep.parquet").read_bytes() == (local_sweep / "sweep.parquet").read_bytes()


def test_failed_cell_is_reported_and_others_kept(tmp_path):
    out = tmp_path / "sweep"
    res = sweep(TRACE, "--grid", "watermark=0,1.5", "--grid", "max_num_seqs=32", *FIXED, "--workers", "2",
                "--out", str(out))
    assert res.exit_code == 1
    assert "cell 1 failed" in res.output and "watermark must be in [0, 1), got 1.5" in res.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert rows[0]["num_steps"] > 0 and rows[1]["num_steps"] is None
    assert "watermark must be in [0, 1)" in (out / "cells" / rows[1]["cell_id"] / "error.txt").read_text()
    assert "1 failed" in (out / "sweep.md").read_text()
    # Resuming retries only the failed cell (and it fails again).
    again = CliRunner().invoke(main, ["sweep", TRACE, "--grid", "watermark=0,1.5", "--grid", "max_num_seqs=32",
                                      *FIXED, "--out", str(out)])
    assert again.exit_code == 1 and "1 already done, 1 run, 1 failed" in again.output


def test_two_traces_and_config_file(tmp_path):
    cfg = tmp_path / "fixed.yaml"
    cfg.write_text("num_gpu_blocks: 3000\nmax_model_len: 4096\nmax_num_seqs: 64\n")
    out = tmp_path / "sweep"
    res = sweep(TRACE, "traces/req400_prefix10.parquet", "--grid", "enable_prefix_caching=true,false",
                "--config", str(cfg), "--cost-model", "unit", "--workers", "2", "--out", str(out))
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [(r["trace"], r["enable_prefix_caching"]) for r in rows] == [
        (TRACE, True), (TRACE, False), ("traces/req400_prefix10.parquet", True),
        ("traces/req400_prefix10.parquet", False)]
    assert all(r["peak_running"] <= 64 for r in rows)
    hit = {(r["trace"], r["enable_prefix_caching"]): r["prefix_cache_hit_rate"] for r in rows}
    assert hit[("traces/req400_prefix10.parquet", True)] > 0.3 > hit[(TRACE, True)]
    assert hit[("traces/req400_prefix10.parquet", False)] == 0.0
    page = (out / "plots.html").read_text()
    assert "trace=traces/req400_prefix10.parquet" in page  # one line per trace


@pytest.mark.parametrize("args, text", [
    (["--grid", "blok_size=8"], "--grid: unknown option 'blok_size'"),
    (["--grid", "cost_model=unit,nope"], "cost_model: 'nope'"),
    (["--set", "block_size"], "--set: expected KEY=VALUE"),
])
def test_cli_errors_are_one_line(tmp_path, args, text):
    res = sweep(TRACE, *args, "--out", str(tmp_path / "s"))
    assert res.exit_code == 1 and res.output.startswith("Error: ") and text in res.output
    assert res.output.count("\n") == 1
    assert not (tmp_path / "s").exists()


def test_missing_trace_is_one_line(tmp_path):
    res = sweep("traces/nope.parquet", "--grid", "block_size=16", "--out", str(tmp_path / "s"))
    assert res.exit_code == 1 and res.output == "Error: TRACE: no such file 'traces/nope.parquet'\n"


# --- Ray ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'simkv[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_sweep_identical_to_local(local_sweep, ray_instance, tmp_path):
    out = tmp_path / "ray"
    res = sweep(TRACE, *GRID, *FIXED, "--executor", "ray", "--out", str(out))
    assert res.exit_code == 0, res.output
    for name in OUTPUTS:
        assert (out / name).read_bytes() == (local_sweep / name).read_bytes(), name
    local_ids = sorted(p.name for p in (local_sweep / "cells").iterdir())
    assert sorted(p.name for p in (out / "cells").iterdir()) == local_ids


def test_ray_failed_cell(ray_instance, tmp_path):
    out = tmp_path / "ray_fail"
    res = sweep(TRACE, "--grid", "block_size=16,0", *FIXED, "--executor", "ray", "--out", str(out))
    assert res.exit_code == 1 and "block_size must be >= 1, got 0" in res.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "failed"]


def test_ray_address_joins_an_existing_cluster(local_sweep, ray_instance, tmp_path):
    """A separate `simkv sweep` process joins the running instance by --ray-address."""
    import subprocess
    import sys

    address = ray_instance.get_runtime_context().gcs_address
    out = tmp_path / "joined"
    cmd = [sys.executable, "-c", "from simkv.cli.main import main; main()", "sweep", TRACE, *GRID, *FIXED,
           "--executor", "ray", "--ray-address", address, "--out", str(out), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Started a local Ray instance" not in proc.stderr
    assert (out / "sweep.parquet").read_bytes() == (local_sweep / "sweep.parquet").read_bytes()


def test_goodput_slos_are_judged_in_every_cell(local_sweep, tmp_path):
    """--goodput adds the attainment and goodput of each cell (as `simkv replay --goodput` counts
    them); the SLOs are part of a cell's identity, and sweeps without them keep their columns."""
    out = tmp_path / "g"
    res = sweep(TRACE, "--grid", "max_num_seqs=16,128", *FIXED, "--workers", "1", "--goodput", "ttft:300000",
                "--out", str(out))
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    for row in rows:
        cell = json.loads((out / "cells" / row["cell_id"] / "summary.json").read_text())
        direct = CliRunner().invoke(main, ["replay", TRACE, "--out", str(tmp_path / row["cell_id"]), "--quiet",
                                           "--max-num-seqs", str(row["max_num_seqs"]), "--num-gpu-blocks", "3000",
                                           "--max-model-len", "4096", "--cost-model", "unit", "--goodput", "ttft:300000"])
        assert direct.exit_code == 0, direct.output
        expected = json.loads((tmp_path / row["cell_id"] / "summary.json").read_text())["goodput"]
        assert cell["goodput"] == expected
        assert row["slo_attainment"] == expected["slo_attainment"] and row["goodput_req_s"] == expected["request_goodput_req_s"]
    # unit steps of 1 s: 400 requests at t=0 wait their turn, longer with fewer sequences at once
    assert 0 < rows[0]["slo_attainment"] < rows[1]["slo_attainment"]
    plain = make_cells([TRACE], {"max_num_seqs": [16]}, {}, "unit")[0]
    judged = make_cells([TRACE], {"max_num_seqs": [16]}, {}, "unit", {"ttft": 300000.0})[0]
    assert plain.cell_id != judged.cell_id and "goodput" not in plain.task()
    assert "slo_attainment" not in pq.read_table(local_sweep / "sweep.parquet").column_names
    res = sweep(TRACE, *FIXED, "--goodput", "ttft", "--out", str(tmp_path / "bad"))
    assert res.exit_code != 0 and "expected KEY:MILLISECONDS" in res.output


def test_fleet_cells_replay_a_fleet_and_bad_ones_fail_alone(tmp_path):
    from simkv.replay.api import FleetSpec

    out = tmp_path / "sweep"
    res = sweep("traces/req400_prefix10.parquet", "--grid", "replicas=2,0", "--grid", "router=round_robin,prefix_aware",
                *FIXED, "--out", str(out))
    assert res.exit_code == 1
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [(r["replicas"], r["router"], r["status"]) for r in rows] == [
        (2, "round_robin", "ok"), (2, "prefix_aware", "ok"), (0, "round_robin", "failed"), (0, "prefix_aware", "failed")]
    assert "replicas must be a whole number >= 1, got 0" in rows[2]["error"]
    config = EngineConfig.from_flat({"num_gpu_blocks": 3000, "max_model_len": 4096})
    direct = replay(read_trace("traces/req400_prefix10.parquet"), config, "unit", fleet=FleetSpec(2, "prefix_aware")).summary
    assert (rows[1]["num_steps"], rows[1]["prefix_cache_hit_rate"]) == (direct["num_steps"], direct["prefix_cache_hit_rate"])
    cell = json.loads((out / "cells" / rows[1]["cell_id"] / "summary.json").read_text())
    assert cell["fleet"]["num_replicas"] == 2 and cell["sweep_cell"]["fleet"] == {"replicas": 2, "router": "prefix_aware"}
    # a one-engine grid keeps its cell ids: the fleet keys enter an id only when given
    plain = make_cells(["a.parquet"], {"block_size": [16]}, {}, "unit")[0]
    assert plain.fleet == () and "fleet" not in plain.task()


def test_async_scheduling_is_a_grid_key(tmp_path):
    # vLLM's numbers for req400 (unit steps): 1,117 steps synchronously, 1,118 asynchronously.
    out = tmp_path / "sweep"
    res = sweep(TRACE, "--grid", "async_scheduling=false,true", "--set", "num_gpu_blocks=6250",
                "--set", "max_model_len=4096", "--cost-model", "unit", "--workers", "1", "--out", str(out))
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [(r["async_scheduling"], r["num_steps"]) for r in rows] == [(False, 1117), (True, 1118)]


def test_router_thresholds_are_grid_keys(tmp_path):
    trace = "traces/mooncake_synthetic_slice.parquet"
    out = tmp_path / "sweep"
    res = sweep(trace, "--grid", "cache_threshold=0.1,0.9", "--set", "router=prefix_aware", "--set", "replicas=2",
                "--set", "max_model_len=32768", "--workers", "1", "--out", str(out))
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    assert [r["cache_threshold"] for r in rows] == [0.1, 0.9]
    summaries = [json.loads((out / "cells" / r["cell_id"] / "summary.json").read_text()) for r in rows]
    decisions = [s["fleet"]["router"]["decisions"] for s in summaries]
    assert decisions[0] != decisions[1]  # the threshold changed where requests went
    assert [s["fleet"]["router"]["options"]["cache_threshold"] for s in summaries] == [0.1, 0.9]
    bad = sweep(trace, "--grid", "cache_threshold=0.1", "--set", "replicas=2", "--set", "max_model_len=32768",
                "--out", str(tmp_path / "bad"))
    assert bad.exit_code == 1 and "thresholds of the prefix_aware router; this cell's router is round_robin" in bad.output


def test_cells_that_ran_another_block_size_say_so(tmp_path):
    # vLLM grows a hybrid model's block size until an attention page holds a Mamba state: the
    # cells asking for 16 and 64 run the same engine, and the table shows the size they ran with
    out = tmp_path / "sweep"
    res = sweep(TRACE, "--grid", "block_size=16,64", "--set", "model=qwen3-next-80b-a3b", "--set", "gpu=H200",
                "--set", "tensor_parallel_size=4", "--cost-model", "unit", "--workers", "1", "--out", str(out))
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    grown = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 4}).cache.block_size
    assert grown > 64 and [(r["block_size"], r["engine_block_size"]) for r in rows] == [(16, grown), (64, grown)]
    assert rows[0]["num_steps"] == rows[1]["num_steps"]
    assert list(rows[0]).index("engine_block_size") == list(rows[0]).index("error") + 1
    assert f"| 16 | ok |  | {grown} |" in (out / "sweep.md").read_text()


def test_a_sweep_over_the_cpu_tier_has_its_columns(tmp_path):
    """Cells with KV offloading add what the tier saved and moved (a cell without one: empty)."""
    from simkv.sweep.table import OFFLOAD_METRICS

    res = sweep("traces/mooncake_synthetic_slice.parquet", "--grid", "kv_offloading_size=none,16",
                "--set", "num_gpu_blocks=2000", "--out", str(tmp_path / "s"))
    assert res.exit_code == 0, res.output
    plain, tier = pq.read_table(tmp_path / "s" / "sweep.parquet").to_pylist()
    assert set(OFFLOAD_METRICS) <= set(tier) and plain["offload_loaded_tokens"] is None
    assert tier["offload_loaded_tokens"] > 0 and tier["offload_evicted_blocks"] > 0
    assert tier["num_prefill_tokens"] < plain["num_prefill_tokens"]
    assert 0 < tier["offload_hit_rate"] < 1  # (a number, as every rate: until 2026-12-07 it was written as text)
    without = sweep(TRACE, "--grid", "watermark=0,0.01", *FIXED, "--out", str(tmp_path / "w"))
    assert without.exit_code == 0 and "offload_loaded_tokens" not in pq.read_table(tmp_path / "w" / "sweep.parquet").column_names


def test_each_cell_names_the_limit_that_held_its_queue(tmp_path):
    """`waiting_held_by`: the largest of the cell's admission_limits, with its share."""
    out = tmp_path / "held"
    res = sweep(TRACE, "--grid", "max_num_seqs=16,256", "--set", "num_gpu_blocks=1500", "--set", "max_model_len=4096",
                "--cost-model", "unit", "--out", str(out))
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "sweep.parquet").to_pylist()
    held = {r["max_num_seqs"]: r["waiting_held_by"] for r in rows}
    assert held[16] == "max_num_seqs 100 %"
    assert held[256].startswith("kv_cache ")
    cell = json.loads((out / "cells" / rows[1]["cell_id"] / "summary.json").read_text())
    top, share = next(iter(cell["admission_limits"]["by_limit"].items()))
    assert held[256] == f"{top} {100 * share['share']:.0f} %"
    assert "waiting_held_by" in (out / "sweep.md").read_text()
