"""The cost model asked about measured steps, and calibration from measured replays (--from-steps)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.calibration.costmodel import COEFFICIENTS, CalibratedCostModel, CalibrationError
from simkv.calibration.from_steps import calibrate_from_steps
from simkv.cli.main import main
from simkv.compare.step_model import cost_model_on_measured, features_of, measured_step_profile

TRUE = {"c0": 2e-3, "cT": 1e-5, "cH": 4e-5, "cS": 3e-4, "cP": 5e-8, "cKp": 1e-6, "cKd": 8e-7}
KNEE = 200.0
DEVICE = {"type": "cuda", "name": "NVIDIA H200"}


def _steps(n: int = 300, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    chunks = rng.integers(0, 3, n)
    chunk_tokens = np.where(chunks > 0, rng.integers(1, 400, n), 0)
    cached = np.where(chunks > 0, rng.integers(0, 2000, n), 0)
    decodes = np.where(rng.random(n) < 0.2, 0, rng.integers(1, 64, n))
    decodes[chunks == 0] = np.maximum(decodes[chunks == 0], 1)
    ctx = decodes * rng.integers(10, 3000, n)
    new = chunks * chunk_tokens
    return pd.DataFrame({"step": np.arange(n), "num_prefill_chunks": chunks, "num_prefill_tokens": new,
                         "prefill_pairs": chunks * (chunk_tokens * cached + chunk_tokens * (chunk_tokens + 1) // 2),
                         "prefill_kv_read": chunks * (cached + chunk_tokens), "num_decodes": decodes,
                         "decode_context_tokens": ctx})


def _measured_dir(path, steps: pd.DataFrame, scale: float = 1.0, device=DEVICE, backend="gpu", graph_sizes=(),
                  coefs=TRUE, layer_ops=None):
    model = CalibratedCostModel(coefs, KNEE, graph_sizes=graph_sizes)
    steps = steps.copy()
    steps["duration_s"] = scale * model.predict_features(features_of(steps))
    steps["host_prepare_s"] = 0.1 * steps["duration_s"]
    steps["host_forward_s"] = 0.85 * steps["duration_s"]
    steps["jit_compiles"] = 0
    path.mkdir(parents=True)
    steps.to_parquet(path / "measured_steps.parquet", index=False)
    (path / "summary.json").write_text(json.dumps({
        "backend": backend, "config": {"model": "llama-3-8b", "block_size": 16}, "device_info": device,
        "dtype": "bf16", "kernel_backend": "triton", "versions": {"torch": "2.11.0"}, "timing": "cuda events",
        "cuda_graph_sizes": list(graph_sizes), "layer_ops": layer_ops}))
    return steps


def _sim_summary(coefs=TRUE):
    return {"cost_model": {"cost_model": "calibrated", "knee": KNEE, **coefs}}


def test_cost_model_on_measured_steps_reports_the_bias(tmp_path):
    _measured_dir(tmp_path / "m", _steps(), scale=1.25)  # steps 25 % slower than the model says
    check = cost_model_on_measured(_sim_summary(), tmp_path / "m")
    assert check["available"]
    assert check["all"]["mean_rel_error"] == pytest.approx(1 / 1.25 - 1)
    assert check["all"]["sum_rel_error"] == pytest.approx(1 / 1.25 - 1)
    assert sum(v["steps"] for v in check["by_family"].values()) == 300
    assert sum(r["steps"] for r in check["decode_by_batch"]) == check["by_family"]["decode"]["steps"]
    ex = check["largest_excess"]
    assert len(ex) == 8 and ex[0]["measured_s"] - ex[0]["predicted_s"] >= ex[-1]["measured_s"] - ex[-1]["predicted_s"]
    # exact model: no error anywhere
    exact = tmp_path / "exact"
    _measured_dir(exact, _steps())
    assert abs(cost_model_on_measured(_sim_summary(), exact)["all"]["mean_rel_error"]) < 1e-12
    # an unknown cost model cannot be asked
    assert not cost_model_on_measured({"cost_model": {"cost_model": "gpu"}}, exact)["available"]


def test_roofline_on_measured_steps_equals_its_execute(tmp_path):
    """The roofline rebuilt from a simulated run's summary predicts each step as its `execute` does."""
    from simkv.backends.factory import make_backend
    from simkv.compare.step_model import step_predictor
    from simkv.config import EngineConfig
    from simkv.core.outputs import ScheduledChunk, SchedulerOutput
    from simkv.core.request import Request

    config = EngineConfig.from_flat({"model": "llama-3-70b", "gpu": "H200", "tensor_parallel_size": 4,
                                     "kv_cache_dtype": "fp8"})
    roof = make_backend("roofline", config)
    summary = {"config": config.to_dict(), "cost_model": roof.describe()}
    predict = step_predictor(summary)
    steps = _steps(40, seed=5)
    expected = []
    for _, r in steps.iterrows():
        chunks = [ScheduledChunk(Request("x", 0, 0.0, 9999, 1), int(r.prefill_kv_read // max(r.num_prefill_chunks, 1))
                                 - int(r.num_prefill_tokens // max(r.num_prefill_chunks, 1)),
                                 int(r.num_prefill_tokens // max(r.num_prefill_chunks, 1)), False)
                  for _ in range(int(r.num_prefill_chunks))]
        out = SchedulerOutput(step=0, chunks=chunks, num_decode_reqs=int(r.num_decodes),
                              decode_context_tokens=int(r.decode_context_tokens), decodes=None, preempted=[],
                              num_running=0, num_waiting=0, num_blocks_used=0, prefix_query_tokens=0,
                              prefix_hit_tokens=0)
        expected.append(roof.execute(out))
    np.testing.assert_allclose(predict(features_of(steps)), expected, rtol=1e-12)


def test_measured_step_profile(tmp_path):
    steps = _measured_dir(tmp_path / "m", _steps(50))
    df = pd.read_parquet(tmp_path / "m" / "measured_steps.parquet")
    df.loc[[3, 7], "jit_compiles"] = 2
    df.to_parquet(tmp_path / "m" / "measured_steps.parquet", index=False)
    prof = measured_step_profile(tmp_path / "m")
    assert prof["host_prepare_share"] == pytest.approx(0.1) and prof["host_forward_share"] == pytest.approx(0.85)
    assert prof["host_bound_steps"] == 50 and prof["compiling_steps"] == 2 and prof["compiling_steps_list"] == [3, 7]
    assert prof["compiling_steps_duration_s"] == pytest.approx(steps["duration_s"].iloc[[3, 7]].sum())


def test_from_steps_recovers_the_model_and_leaves_out_compiling_steps(tmp_path):
    _measured_dir(tmp_path / "m", _steps(400))
    df = pd.read_parquet(tmp_path / "m" / "measured_steps.parquet")
    df.loc[:9, "duration_s"] *= 50  # ten steps that compiled a kernel: wildly slow
    df.loc[:9, "jit_compiles"] = 1
    df.to_parquet(tmp_path / "m" / "measured_steps.parquet", index=False)
    rec = calibrate_from_steps([tmp_path / "m"], tmp_path / "calib.json")
    assert rec["source"]["measured_steps"][0] == {"dir": str(tmp_path / "m"), "steps": 390, "left_out_compiling": 10}
    # exact up to the knee, which the fit places on a step size present in the data
    assert rec["fit"]["holdout"]["mape"] < 5e-3
    fitted = CalibratedCostModel(rec["fit"]["coefficients"], rec["fit"]["knee"])
    clean = _steps(400)[10:]
    np.testing.assert_allclose(fitted.predict_features(features_of(clean)),
                               CalibratedCostModel(TRUE, KNEE).predict_features(features_of(clean)), rtol=2e-2)
    assert rec["model"] == "llama-3-8b" and rec["gpu"] == "H200" and set(rec["fit"]["coefficients"]) == set(COEFFICIENTS)
    # usable by a simulated replay
    res = CliRunner().invoke(main, ["replay", "tests/gpu_backend/data/ci80.parquet", "--cost-model",
                                    str(tmp_path / "calib.json"), "--model", "llama-3-8b", "--gpu", "H200",
                                    "--out", str(tmp_path / "sim"), "--quiet"])
    assert res.exit_code == 0, res.output


def test_from_steps_refuses_mismatched_or_simulated_runs(tmp_path):
    _measured_dir(tmp_path / "a", _steps(20))
    _measured_dir(tmp_path / "b", _steps(20), device={"type": "cuda", "name": "NVIDIA H100 80GB HBM3"})
    _measured_dir(tmp_path / "s", _steps(20), backend="sim")
    with pytest.raises(CalibrationError, match="calibrate per device"):
        calibrate_from_steps([tmp_path / "a", tmp_path / "b"], tmp_path / "c.json")
    with pytest.raises(CalibrationError, match="needs a measured one"):
        calibrate_from_steps([tmp_path / "s"], tmp_path / "c.json")
    with pytest.raises(CalibrationError, match="not a replay output folder"):
        calibrate_from_steps([tmp_path], tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()


GRAPHS = [1, 2, 4] + list(range(8, 65, 8))
TRUE_GRAPHS = {**TRUE, "c0": 1e-3, "cE": 5e-3}


def test_from_steps_with_decode_graphs(tmp_path):
    """Steps measured with decode graphs fit the graph-aware formula (both intercepts), the
    simulation's model rebuilt from summary.json predicts them exactly, and runs with and
    without graphs are not fitted together."""
    _measured_dir(tmp_path / "g", _steps(400), graph_sizes=GRAPHS, coefs=TRUE_GRAPHS)
    rec = calibrate_from_steps([tmp_path / "g"], tmp_path / "calib.json")
    assert rec["cuda_graph_sizes"] == GRAPHS and rec["fit"]["graph_sizes"] == GRAPHS
    assert rec["fit"]["holdout"]["mape"] < 5e-3
    assert rec["fit"]["coefficients"]["cE"] == pytest.approx(TRUE_GRAPHS["cE"], rel=2e-2)
    from simkv.calibration.costmodel import cost_model_from_file

    sim = {"cost_model": cost_model_from_file(tmp_path / "calib.json").describe()}
    df = pd.read_parquet(tmp_path / "g" / "measured_steps.parquet")
    model = CalibratedCostModel(TRUE_GRAPHS, KNEE, graph_sizes=GRAPHS)
    df["graph_batch"] = [model.graph_batch(d) if c == 0 else 0 for c, d in zip(df["num_prefill_chunks"], df["num_decodes"])]
    df.to_parquet(tmp_path / "g" / "measured_steps.parquet", index=False)
    res = cost_model_on_measured(sim, tmp_path / "g")
    assert abs(res["all"]["mean_rel_error"]) < 5e-3
    assert res["by_path"]["decode from a CUDA graph"]["steps"] == int((df["graph_batch"] > 0).sum()) > 0
    _measured_dir(tmp_path / "e", _steps(50))
    with pytest.raises(CalibrationError, match="fit them separately"):
        calibrate_from_steps([tmp_path / "g", tmp_path / "e"], tmp_path / "c.json")


def test_calibrate_cli_from_steps_and_option_errors(tmp_path):
    _measured_dir(tmp_path / "m", _steps(60))
    r = CliRunner().invoke(main, ["calibrate", "--from-steps", str(tmp_path / "m"), "--out", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    assert "fitted on 60 measured steps" in r.output and (tmp_path / "c.json").is_file()
    r = CliRunner().invoke(main, ["calibrate", "--from-steps", str(tmp_path / "m"), "--model", "llama-2-7b",
                                  "--out", str(tmp_path / "d.json")])
    assert r.exit_code != 0 and "llama-3-8b" in r.output
    pd.read_parquet(tmp_path / "m" / "measured_steps.parquet").drop(columns=["prefill_pairs"]).to_parquet(
        tmp_path / "m" / "measured_steps.parquet")
    r = CliRunner().invoke(main, ["calibrate", "--from-steps", str(tmp_path / "m"), "--out", str(tmp_path / "e.json")])
    assert r.exit_code == 1 and "lacks columns ['prefill_pairs']" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "e.json").exists()
    r = CliRunner().invoke(main, ["calibrate", "--with-grid", str(tmp_path / "c.json")])
    assert r.exit_code != 0 and "only goes with --from-steps" in r.output
    r = CliRunner().invoke(main, ["calibrate"])
    assert r.exit_code != 0 and "--model" in r.output


def test_runs_with_different_layer_ops_are_not_mixed(tmp_path):
    """Steps timed with the fused element-wise kernels and with torch operators cost differently:
    --from-steps refuses to fit them together, and compare warns when the calibration's kernels
    are not the measured run's."""
    from simkv.compare.compare import calibration_check

    fused, plain = "triton attention, fused Triton element-wise ops", "triton attention, torch element-wise ops"
    _measured_dir(tmp_path / "f", _steps(60), layer_ops=fused)
    _measured_dir(tmp_path / "p", _steps(60), layer_ops=plain)
    _measured_dir(tmp_path / "old", _steps(60))  # a summary from before layer_ops was recorded
    with pytest.raises(CalibrationError, match="torch element-wise ops"):
        calibrate_from_steps([tmp_path / "f", tmp_path / "p"], tmp_path / "c.json")
    rec = calibrate_from_steps([tmp_path / "f", tmp_path / "old"], tmp_path / "c.json")
    assert rec["layer_ops"] == fused
    from simkv.calibration.costmodel import cost_model_from_file

    sim = {"cost_model": cost_model_from_file(tmp_path / "c.json").describe()}
    meas = json.loads((tmp_path / "p" / "summary.json").read_text())
    check = calibration_check(sim, meas)
    assert check["ok"] and any("kernels differ" in w for w in check["warnings"]), check
    same = calibration_check(sim, json.loads((tmp_path / "f" / "summary.json").read_text()))
    assert not any("kernels differ" in w for w in same["warnings"]), same
