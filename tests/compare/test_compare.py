"""simkv compare on known runs, and the whole CPU loop: calibrate -> gpu replay -> sim replay -> compare."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from click.testing import CliRunner

from simkv.cli.main import main

TRACE = "tests/gpu_backend/data/ci80.parquet"
OPTS = ["--model", "tiny-llama", "--num-gpu-blocks", "512", "--max-num-batched-tokens", "256", "--max-num-seqs", "32"]


def _invoke(args):
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res


def test_compare_identical_runs_zero_error(tmp_path):
    _invoke(["replay", TRACE, "--cost-model", "roofline", *OPTS, "--out", str(tmp_path / "a"), "--quiet"])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    _invoke(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c"), "--quiet"])
    result = json.loads((tmp_path / "c" / "compare.json").read_text())
    errs = [r["rel_error"] for r in result["metrics"] if r["rel_error"] is not None]
    assert errs and all(e == 0 for e in errs)
    assert result["steps"]["same_shape_fraction"] == 1.0
    assert result["requests"]["ttft_s"]["median_abs_rel_error"] == 0
    html = (tmp_path / "c" / "report.html").read_text()
    assert html.count("<svg") >= 6 and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert (tmp_path / "a" / "report.html").is_file()


def test_the_itl_charts_draw_every_token_gap_of_the_summary(tmp_path):
    """token_gaps.parquet holds the gaps summary.json's itl_s comes from, those that span several
    steps too (preemptions, pipeline stages); without the file, the steps give an estimate."""
    import numpy as np
    import pandas as pd

    from simkv.compare.run_report import gap_samples, load_token_gaps, token_itl
    from simkv.replay.results import weighted_dist

    for name, extra in (("preempting", ["--num-gpu-blocks", "20", "--max-model-len", "256"]), ("pp2", ["-pp", "2"])):
        out = tmp_path / name
        _invoke(["replay", TRACE, "--cost-model", "roofline", *OPTS, *extra, "--out", str(out), "--quiet"])
        summary = json.loads((out / "summary.json").read_text())
        steps = pd.read_parquet(out / "steps.parquet")
        gaps = gap_samples(load_token_gaps(out, steps))
        assert weighted_dist(*gaps)["p99"] == summary["itl_s"]["p99"]
        assert weighted_dist(*gaps)["mean"] == summary["itl_s"]["mean"]
        by_steps = token_itl(steps)  # (what the charts drew before: each step's duration per decode token)
        assert weighted_dist(*by_steps)["mean"] != summary["itl_s"]["mean"]
        if name == "preempting":
            assert summary["num_preemptions"] > 0
        (out / "token_gaps.parquet").unlink()  # (a folder from before the file: the steps' estimate)
        np.testing.assert_array_equal(gap_samples(load_token_gaps(out, steps))[0], by_steps[0])


def test_compare_refuses_different_traces(tmp_path):
    _invoke(["replay", TRACE, "--cost-model", "unit", *OPTS, "--out", str(tmp_path / "a"), "--quiet"])
    _invoke(["replay", "traces/req400.parquet", "--cost-model", "unit", "--model", "tiny-llama", "--num-gpu-blocks",
             "4096", "--out", str(tmp_path / "b"), "--quiet"])
    res = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c")])
    assert res.exit_code != 0 and "different traces" in res.output


def _simulate_and_compare(tmp_path: Path, calib: Path) -> tuple[dict, dict]:
    """Replay TRACE simulated with `calib`, compare it with tmp_path/measured (CPU targets);
    returns compare.json and its metrics by name, the calibration check already asserted."""
    _invoke(["replay", TRACE, "--cost-model", str(calib), *OPTS, "--out", str(tmp_path / "sim"), "--quiet"])
    _invoke(["compare", str(tmp_path / "sim"), str(tmp_path / "measured"), "--out", str(tmp_path / "cmp"),
             "--targets", "cpu", "--quiet"])
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["calibration_check"]["ok"], result["calibration_check"]
    return result, {r["metric"]: r for r in result["metrics"]}


def _keep_figures(tmp_path: Path, name: str) -> None:
    out = Path("out/ci_loop")
    out.mkdir(parents=True, exist_ok=True)  # keep the figures of the last CI run (git-ignored)
    (out / name).write_text((tmp_path / "cmp" / "compare.md").read_text())


def test_cpu_loop_calibrate_replay_compare(tmp_path, monkeypatch):
    """The loop of the issue, on CPU with the tiny model. Times use the process CPU clock: this
    host is shared, and wall-clock steps swing by 2x with other processes' load (docs/gpu_backend.md)."""
    monkeypatch.setenv("SIMKV_CPU_CLOCK", "process")
    t0 = time.perf_counter()
    calib = tmp_path / "calib.json"
    _invoke(["calibrate", "--model", "tiny-llama", "--device", "cpu", "--out", str(calib), "--repeats", "5",
             "--max-num-batched-tokens", "256", "--max-num-seqs", "32", "--budget-s", "60", "--quiet"])
    rec = json.loads(calib.read_text())
    assert rec["fit"]["holdout"]["n"] > 0 and rec["timing"] == "process_time cpu clock"
    assert rec["layer_ops"] == "torch attention, torch element-wise ops"
    _invoke(["replay", TRACE, "--backend", "gpu", "--device", "cpu", *OPTS, "--out", str(tmp_path / "measured"), "--quiet"])
    result, by = _simulate_and_compare(tmp_path, calib)
    assert by["num_finished"]["rel_error"] == 0 and by["prefix_cache_hit_rate"]["rel_error"] == 0
    # Loose sanity bound (units, factor-of-two biases); the 15 % target is reported, not asserted,
    # because other processes on this 2-core host move CPU step times by tens of percent.
    assert abs(by["duration_s"]["rel_error"]) < 0.6, (by["duration_s"], result["targets"])
    for f in ("compare.json", "compare.md", "report.html"):
        assert (tmp_path / "cmp" / f).is_file()
    _keep_figures(tmp_path, "compare.md")
    assert time.perf_counter() - t0 < 240


def test_cpu_loop_with_calibration_alongside_the_replay(tmp_path):
    """The issue's CPU loop with the grid timed between the measured replay's steps
    (`--calibrate-alongside`): both see the same phases of this host's drifting speed, so the
    duration error shows the cost model, not the drift. Issue target 15 %; 14 manual runs on this
    host stayed within 7.2 % (docs/gpu_backend.md); the gate is 20 % for a CI host under more load."""
    calib = tmp_path / "calib.json"
    _invoke(["replay", TRACE, "--backend", "gpu", "--device", "cpu", *OPTS, "--out", str(tmp_path / "measured"),
             "--calibrate-alongside", str(calib), "--quiet"])
    rec = json.loads(calib.read_text())
    assert rec["settings"]["protocol"].startswith("interleaved") and rec["rounds"] >= 3
    assert len(rec["grid"]["measured"]) == rec["grid"]["num_points"] and rec["fit"]["holdout"]["n"] > 0
    meas = json.loads((tmp_path / "measured" / "summary.json").read_text())
    assert meas["calibrated_alongside"]["file"] == str(calib)
    result, by = _simulate_and_compare(tmp_path, calib)
    assert abs(by["duration_s"]["rel_error"]) < 0.20, (by["duration_s"], result["targets"])
    assert abs(by["request_throughput_req_s"]["rel_error"]) < 0.25, by["request_throughput_req_s"]
    _keep_figures(tmp_path, "compare_interleaved.md")


def test_calibrate_alongside_needs_the_gpu_backend(tmp_path):
    res = CliRunner().invoke(main, ["replay", TRACE, *OPTS, "--calibrate-alongside", str(tmp_path / "c.json"),
                                    "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--calibrate-alongside needs --backend gpu" in res.output
    assert not (tmp_path / "c.json").exists()


def test_goodput_is_compared_when_both_runs_were_judged_on_the_same_slos(tmp_path):
    from simkv.compare.compare import metric_rows

    slo = ["--goodput", "ttft:100", "--goodput", "tpot:5"]
    _invoke(["replay", TRACE, "--cost-model", "roofline", *OPTS, *slo, "--out", str(tmp_path / "a"), "--quiet"])
    _invoke(["replay", TRACE, "--cost-model", "linear", *OPTS, *slo, "--out", str(tmp_path / "b"), "--quiet"])
    sim, meas = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    rows = {r["metric"]: r for r in metric_rows(sim, meas)}
    row = rows["goodput.slo_attainment"]
    assert (row["simulated"], row["measured"]) == (sim["goodput"]["slo_attainment"], meas["goodput"]["slo_attainment"])
    assert "goodput.request_goodput_req_s" in rows
    meas["goodput"]["slo_ms"] = {"ttft": 200.0}  # other SLOs: nothing to compare
    assert not [m for m in (r["metric"] for r in metric_rows(sim, meas)) if m.startswith("goodput")]


def test_what_held_each_queue_is_compared_limit_by_limit():
    from simkv.compare.compare import metric_rows

    def summary(total, shares):
        return {"admission_limits": {"waiting_request_s": total, "steps_with_waiting": 1,
                                     "by_limit": {k: {"share": v, "waiting_request_s": v * total, "steps": 1}
                                                  for k, v in shares.items()}}}

    sim = summary(10.0, {"kv_cache": 0.75, "preemption": 0.25})
    meas = summary(8.0, {"kv_cache": 0.5, "max_num_seqs": 0.5})
    rows = {r["metric"]: r for r in metric_rows(sim, meas) if r["metric"].startswith("admission_limits")}
    assert rows["admission_limits.waiting_request_s"]["rel_error"] == 0.25
    assert (rows["admission_limits.kv_cache.share"]["simulated"], rows["admission_limits.kv_cache.share"]["measured"]) \
        == (0.75, 0.5)
    assert rows["admission_limits.preemption.share"]["measured"] == 0.0  # (a limit one run never met)
    assert rows["admission_limits.max_num_seqs.share"]["simulated"] == 0.0
    assert not [r for r in metric_rows(sim, {}) if r["metric"].startswith("admission_limits")]  # (a vLLM bench run)
