"""Steps a replay runs beyond the range its calibration measured: counted, timed, and said."""

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from simkv.calibration.coverage import fitted_range, range_coverage
from simkv.calibration.fit import fit_calibration
from simkv.cli.main import main
from simkv.config import CacheConfig, EngineConfig, SchedulerConfig
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame

COEFS = {"c0": 2e-3, "cT": 1e-5, "cH": 0.0, "cS": 3e-4, "cP": 5e-8, "cKp": 1e-6, "cKd": 8e-7}


def _config(**sched):
    return EngineConfig(CacheConfig(num_gpu_blocks=400),
                        SchedulerConfig(**{"max_model_len": 512, "max_num_batched_tokens": 512, **sched}))


def _trace(rows):
    return trace_from_frame(pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"]))


@pytest.mark.parametrize("runs", [True, False])
def test_step_log_records_the_decode_context_each_step_attends(runs):
    # one request, 10 prompt tokens, 5 outputs: a prefill step, then decodes attending 11..14 tokens
    res = replay(_trace([(0.0, 10, 5)]), _config(), "unit", use_decode_runs=runs)
    assert res.steps["num_decode_tokens"].tolist() == [0, 1, 1, 1, 1]
    assert res.steps["decode_context_tokens"].tolist() == [0, 11, 12, 13, 14]


def test_fitted_range_takes_decode_tokens_from_decode_only_steps():
    # (T, S, Pp, Kp, Kd): a mixed step of 300 tokens (40 decodes), decode-only steps of 8 and 64
    features = [[300, 41, 39_000, 260, 8_000], [8, 8, 0, 0, 4_096], [64, 64, 0, 0, 9_000]]
    assert fitted_range(features) == {"tokens": 300, "decode_tokens": 64, "decode_context_tokens": 9_000}


def test_coverage_counts_steps_and_time_beyond_each_count():
    fitted = {"tokens": 100, "decode_tokens": 10, "decode_context_tokens": 1_000}
    steps = {"num_prefill_tokens": np.array([90, 0, 0, 120]), "num_decode_tokens": np.array([5, 12, 3, 0]),
             "decode_context_tokens": np.array([500, 900, 1_500, 0]), "duration_s": np.array([1.0, 2.0, 3.0, 4.0])}
    cover = range_coverage(fitted, steps)
    assert cover["counts"] == {
        "tokens": {"calibrated_max": 100, "replay_max": 120, "steps_beyond": 1},
        "decode_tokens": {"calibrated_max": 10, "replay_max": 12, "steps_beyond": 1},
        "decode_context_tokens": {"calibrated_max": 1_000, "replay_max": 1_500, "steps_beyond": 1}}
    assert cover["steps_beyond"] == 3 and cover["share_of_steps_beyond"] == 0.75
    assert cover["share_of_time_beyond"] == pytest.approx(0.9)


def _calibration(path, batches, contexts, with_range=True):
    """A calib.json fitted on decode grid points of `batches` x `contexts` (times from COEFS)."""
    from simkv.calibration.costmodel import CalibratedCostModel

    features = np.array([[b, b, 0, 0, b * (c + 1)] for b in batches for c in contexts], dtype=np.int64)
    features = np.vstack([features, [[256, 1, 256 * 257 // 2, 256, 0], [64, 1, 64 * 65 // 2, 64, 0]]])
    y = CalibratedCostModel(COEFS, 1e9).predict_features(features)
    fit = fit_calibration(features, y)
    if not with_range:  # a file written before fits recorded their range
        del fit["range"]
    rows = [{"label": str(i), "features": [int(x) for x in f], "value_s": float(v), "samples_s": [float(v)]}
            for i, (f, v) in enumerate(zip(features, y))]
    path.write_text(json.dumps({
        "format": "simkv-calibration", "format_version": 1, "model": "llama-3-8b",
        "device": {"type": "cuda", "name": "NVIDIA H200"}, "gpu": "H200", "dtype": "bf16",
        "grid": {"measured": rows, "num_points": len(rows)}, "fit": fit}))
    return path


@pytest.mark.parametrize("with_range", [True, False])
def test_replay_beyond_the_calibrated_batch_says_so(tmp_path, with_range):
    calib = _calibration(tmp_path / "calib.json", [1, 4, 16], [64, 256], with_range)
    rng = np.random.default_rng(3)
    rows = [(float(t), int(p), int(o)) for t, p, o in
            zip(np.sort(rng.uniform(0, 0.5, 60)), rng.integers(20, 200, 60), rng.integers(20, 120, 60))]
    pd.DataFrame(rows, columns=["arrival_time_s", "prompt_tokens", "output_tokens"]).to_parquet(tmp_path / "t.parquet")
    args = ["replay", str(tmp_path / "t.parquet"), "--cost-model", str(calib), "--model", "llama-3-8b",
            "--gpu", "H200", "--max-num-batched-tokens", "256", "--quiet"]
    res = CliRunner().invoke(main, [*args, "--max-num-seqs", "64", "--out", str(tmp_path / "wide")])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "wide" / "summary.json").read_text())
    cover = summary["cost_model"]["calibrated_range"]
    steps = pd.read_parquet(tmp_path / "wide" / "steps.parquet")
    over = steps["num_decode_tokens"] > 16
    assert cover["counts"]["decode_tokens"] == {"calibrated_max": 16, "replay_max": int(steps["num_decode_tokens"].max()),
                                                "steps_beyond": int(over.sum())}
    assert cover["counts"]["decode_tokens"]["replay_max"] > 16  # the test's point: wider batches than measured
    assert cover["share_of_time_beyond"] == pytest.approx(
        steps["duration_s"][over | (steps["decode_context_tokens"] > 16 * 257)
                            | (steps["num_prefill_tokens"] + steps["num_decode_tokens"] > 256)].sum()
        / steps["duration_s"].sum())
    assert "lie beyond what" in res.output and "--max-num-seqs" in res.output
    # within the measured batch the replay says nothing
    res = CliRunner().invoke(main, [*args, "--max-num-seqs", "16", "--out", str(tmp_path / "narrow")])
    assert res.exit_code == 0, res.output
    narrow = json.loads((tmp_path / "narrow" / "summary.json").read_text())["cost_model"]["calibrated_range"]
    assert narrow["counts"]["decode_tokens"]["steps_beyond"] == 0
    assert ("lie beyond what" in res.output) == (narrow["steps_beyond"] > 0)
