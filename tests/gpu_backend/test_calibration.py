"""Cost-model fit, exact decode runs, calibration runs (budget, OOM) and refusal of bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from simkv.calibration.costmodel import (COEFFICIENTS, CalibratedCostModel, CalibrationError, check_calibration,
                                         cost_model_from_file, design_matrix, load_calibration)
from simkv.calibration.fit import fit_calibration, nnls
from simkv.calibration.grid import build_grid
from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.replay.api import replay

TRUE = {"c0": 2e-3, "cT": 3e-5, "cH": 5e-5, "cS": 4e-4, "cP": 1e-7, "cKp": 2e-6, "cKd": 1e-6}


def _calib_record(model="tiny-llama", device=None, gpu=None, versions=None):
    return {"format": "simkv-calibration", "format_version": 1, "model": model,
            "device": device or {"type": "cpu", "name": "x86_64"}, "gpu": gpu, "dtype": "fp32",
            "versions": versions or {"torch": torch.__version__}, "block_size": 16,
            "fit": {"coefficients": TRUE, "knee": 200.0, "holdout": {"mape": 0.01}}}


def test_nnls_matches_lstsq_when_unconstrained_and_respects_bounds():
    rng = np.random.default_rng(0)
    A = rng.uniform(0, 1, (40, 4))
    x = np.array([1.0, 2.0, 0.5, 3.0])
    assert np.allclose(nnls(A, A @ x), x)
    b = A @ np.array([1.0, -2.0, 0.5, 3.0])
    assert (nnls(A, b) >= 0).all()


def test_fit_recovers_known_model_on_grid():
    points, _ = build_grid("tiny", max_num_batched_tokens=512)
    feats = np.array([p.features for p in points], dtype=np.int64)
    model = CalibratedCostModel(TRUE, 176.0)
    y = model.predict_features(feats)
    fit = fit_calibration(feats, y)
    assert fit["holdout"]["mape"] < 1e-3 and fit["all_points"]["max_ape"] < 1e-3


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), ctx=st.integers(1, 10**6), knee=st.floats(1, 1000))
def test_decode_line_equals_execute(n, ctx, knee):
    """The replay times pure-decode steps with the decode line (clock ticks): it matches the
    formula to within the rounding of its coefficients."""
    from simkv.clock import TICKS_PER_SECOND
    from simkv.core.outputs import SchedulerOutput

    m = CalibratedCostModel(TRUE, knee)
    a0, a1, b0, b1 = m.decode_step_line(n)
    assert (a0, a1) == (b0, b1)
    out = SchedulerOutput(step=0, chunks=[], num_decode_reqs=n, decode_context_tokens=ctx, decodes=None,
                          preempted=[], num_running=n, num_waiting=0, num_blocks_used=0,
                          prefix_query_tokens=0, prefix_hit_tokens=0)
    exact = m.execute(out)
    assert abs((a0 + a1 * ctx) / TICKS_PER_SECOND - exact) <= (1 + 0.5 * ctx) / TICKS_PER_SECOND + 1e-12 * exact


@pytest.mark.parametrize("graphs", [False, True])
def test_calibrated_replay_decode_runs_identical(tmp_path, graphs):
    path = tmp_path / "calib.json"
    rec = _calib_record()
    if graphs:  # decode steps padded to the captured sizes, eager steps pay cE
        rec["fit"]["coefficients"] = {**TRUE, "cE": 3e-3}
        rec["fit"]["graph_sizes"] = [1, 2, 4, 8, 16, 24]
    path.write_text(json.dumps(rec))
    from simkv.traces.schema import read_trace
    from tests.gpu_backend.conftest import CI_TRACE

    trace = read_trace(CI_TRACE)
    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 512, "max_num_batched_tokens": 256,
                                     "max_num_seqs": 32})
    a = replay(trace, config, str(path), use_decode_runs=True)
    b = replay(trace, config, str(path), use_decode_runs=False)
    assert a.summary["duration_s"] == b.summary["duration_s"]
    assert np.array_equal(a.steps["duration_s"], b.steps["duration_s"])
    assert a.summary["cost_model"]["cost_model"] == "calibrated"
    assert a.summary["cost_model"]["graph_sizes"] == ([1, 2, 4, 8, 16, 24] if graphs else [])


def test_bad_calibration_files_refused(tmp_path):
    def write(name, data):
        p = tmp_path / name
        p.write_text(data if isinstance(data, str) else json.dumps(data))
        return p

    with pytest.raises(CalibrationError, match="not 'llama-3-8b'"):
        cost_model_from_file(write("m.json", _calib_record()), model="llama-3-8b")
    h200 = _calib_record("llama-3-8b", {"type": "cuda", "name": "NVIDIA H200"}, gpu="H200")
    with pytest.raises(CalibrationError, match="--gpu H200"):
        cost_model_from_file(write("g.json", h200), model="llama-3-8b", gpu="H100-SXM")
    assert cost_model_from_file(write("g2.json", h200), model="llama-3-8b", gpu="H200").knee == 200.0
    with pytest.raises(CalibrationError, match="not valid JSON"):
        load_calibration(write("bad.json", "{nope"))
    with pytest.raises(CalibrationError, match="format version"):
        load_calibration(write("v.json", _calib_record() | {"format_version": 99}))
    with pytest.raises(CalibrationError, match="not a simkv calibration"):
        load_calibration(write("x.json", {"hello": 1}))
    with pytest.raises(CalibrationError, match="no fitted model"):
        load_calibration(write("nofit.json", {k: v for k, v in _calib_record().items() if k != "fit"}))
    calib = load_calibration(write("ok.json", _calib_record(versions={"torch": "2.0.0", "triton": "3.0"})))
    with pytest.raises(CalibrationError, match="calibrated on cpu"):
        check_calibration(calib, device={"type": "cuda", "name": "NVIDIA H200"})
    warnings = check_calibration(calib, model="tiny-llama", device=calib["device"],
                                 versions={"torch": torch.__version__, "triton": "3.0"})
    assert len(warnings) == 1 and "versions differ" in warnings[0] and "torch 2.0.0" in warnings[0]
    # through the CLI: a clear message, no traceback
    res = CliRunner().invoke(main, ["replay", "tests/gpu_backend/data/ci80.parquet", "--model", "llama-3-8b",
                                    "--cost-model", str(tmp_path / "m.json"), "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and "calibrated for model 'tiny-llama'" in res.output
    res = CliRunner().invoke(main, ["replay", "--cost-model", str(tmp_path / "missing.json")])
    assert res.exit_code != 0 and "does not exist" in res.output


def test_calibrate_budget_and_oom_keep_partial_results(tmp_path, monkeypatch):
    import gpu_backend.synthetic as syn
    from simkv.calibration.profile import calibrate

    orig = syn.run_synthetic

    def oom_on_big(runner, output):
        if output.total_num_scheduled_tokens > 200:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return orig(runner, output)

    monkeypatch.setattr(syn, "run_synthetic", oom_on_big)
    out = tmp_path / "calib.json"
    rec = calibrate("tiny-llama", out, "cpu", preset="tiny", warmup=1, repeats=2, budget_s=6.0,
                    max_num_batched_tokens=512, log=lambda s: None)
    saved = json.loads(out.read_text())
    assert saved["grid"]["measured"] and saved["oom"]
    oom = saved["oom"][0]
    assert oom["features"][0] > 200 and oom["nearest_fitting"]["family"] == oom["shape"]["family"]
    assert not saved["complete"]
    assert rec["measure_time_s"] < 6.0 + 3.0
    if len(saved["grid"]["measured"]) >= 3:
        assert "fit" in saved


def test_grid_has_ragged_decode_points():
    """The ragged family: the same batch sizes and mean contexts as decode points, but every
    decode at its own length (as in a replay), spread over [C/4, 7C/4]."""
    from simkv.calibration.grid import build_grid, ragged_contexts

    points, _ = build_grid("default", 8192, 256, 8192, None, 16, 0)
    ragged = [p for p in points if p.family == "ragged"]
    assert len(ragged) == 6
    for p in ragged:
        b, c = len(p.decodes), p.describe()["context"]
        assert abs(sum(p.decodes) / b - c) <= 1 and max(p.decodes) >= 6 * min(p.decodes)
    assert ragged_contexts(1, 300) == [300] and ragged_contexts(3, 400) == [100, 400, 700]



@pytest.mark.parametrize("name, given, expected", [
    ("NVIDIA H200", (None, None), (8192, 1024)),
    ("NVIDIA B200", (None, None), (16384, 1024)),
    ("NVIDIA H100 80GB HBM3", (None, None), (8192, 1024)),
    ("NVIDIA H100 80GB HBM3", (4096, 128), (4096, 128)),
    ("Tesla T4", (None, None), (8192, 256)),  # a GPU simkv has no spec of
])
def test_calibration_reaches_the_batches_a_replay_on_the_gpu_runs(monkeypatch, name, given, expected):
    """calibrate's defaults are a replay's on the same GPU (vLLM's), so the default grid measures
    1,024-decode steps where a replay runs them; options given win."""
    from simkv.cli.calibrate_cmd import calibration_batch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    assert calibration_batch("cuda", "llama-3-8b", *given) == expected
    assert calibration_batch("cpu", "tiny-llama", None, None) == (8192, 256)
    points, dropped = build_grid("default", *expected, 8192, None, 16, 0)
    decode_batches = {len(p.decodes) for p in points if p.family == "decode"}
    assert max(decode_batches) == expected[1] and max(p.tokens for p in points) == expected[0]
    assert all(len(p.decodes) + len(p.prefills) <= expected[1] for p in points)


def test_prefill_points_longer_than_the_model_are_split_over_sequences():
    """A full token budget of prefill on a model whose max_model_len it reaches is measured as the
    fewest even chunks each sequence can hold (as a full step over shorter prompts), not dropped."""
    from simkv.calibration.grid import prefill_chunks

    assert prefill_chunks(0, 4096, 8192) == [(0, 4096)]
    assert prefill_chunks(0, 8192, 8192) == [(0, 4096), (0, 4096)]
    assert prefill_chunks(4096, 8192, 8192) == [(4096, 2731), (4096, 2731), (4096, 2730)]
    assert prefill_chunks(8191, 16, 8192) == [(8191, 16)]  # no sequence can: left for build_grid to drop
    points, dropped = build_grid("default", 8192, 256, 8192, None, 16, 0)
    prefills = [p for p in points if p.family == "prefill"]
    assert {p.tokens for p in prefills} >= {8192} and all(c + n < 8192 for p in prefills for c, n in p.prefills)
    assert not [d for d in dropped if d["family"] == "prefill" and "max_model_len" in d["reason"]]

# ---- decode steps run from CUDA graphs -------------------------------------------------------
GRAPHS = [1, 2, 4] + list(range(8, 65, 8))  # vLLM's ladder up to 64 (capture_sizes(64))
TRUE_GRAPHS = {**TRUE, "c0": 1e-3, "cE": 6e-3}  # eager steps pay 6 ms of kernel launches on top


def test_graph_padding_of_decode_steps():
    """A decode-only step of n <= max(graph_sizes) decodes counts as the next captured size with
    E = 0 (each pad row attends one slot); larger decode batches and any step with a prefill
    chunk are eager and counted as they are."""
    from simkv.calibration.costmodel import effective_features

    feats = np.array([[5, 5, 0, 0, 500],  # 5 decodes -> graph of 8
                      [8, 8, 0, 0, 800],  # on the ladder: no padding
                      [65, 65, 0, 0, 650],  # above the largest graph: eager
                      [37, 2, 500, 40, 1],  # 36-token chunk + 1 decode: eager
                      [16, 1, 136, 16, 0]], dtype=np.int64)  # a lone chunk: eager
    e, w, t, s, pp, kp, kd = effective_features(feats, GRAPHS)
    assert e.tolist() == [0, 0, 1, 1, 1] and w.tolist() == [0] * 5
    assert t.tolist() == [8, 8, 65, 37, 16] and s.tolist() == [8, 8, 65, 2, 1]
    assert kd.tolist() == [503, 800, 650, 1, 0] and pp.tolist() == feats[:, 2].tolist()
    m = CalibratedCostModel(TRUE_GRAPHS, 176.0, graph_sizes=GRAPHS)
    assert [m.graph_batch(n) for n in (1, 3, 5, 8, 9, 64, 65)] == [1, 4, 8, 8, 16, 64, 0]
    # without graphs every step is eager and E has no coefficient of its own
    plain = CalibratedCostModel(TRUE_GRAPHS, 176.0)
    assert plain.cE == 0.0 and plain.graph_batch(5) == 0
    assert np.array_equal(design_matrix(feats, 176.0)[:, 1], np.zeros(len(feats)))


def test_fit_separates_graph_and_eager_intercepts():
    """On a grid whose decode points ran from graphs, the fit recovers both intercepts; a model
    fitted without knowing the graphs cannot (one intercept for both kinds of step)."""
    points, _ = build_grid("tiny", max_num_batched_tokens=512, max_num_seqs=64)
    feats = np.array([p.features for p in points], dtype=np.int64)
    true = CalibratedCostModel(TRUE_GRAPHS, 176.0, graph_sizes=GRAPHS)
    y = true.predict_features(feats)
    fit = fit_calibration(feats, y, graph_sizes=GRAPHS)
    assert fit["graph_sizes"] == GRAPHS and set(fit["coefficients"]) == set(COEFFICIENTS)
    assert fit["holdout"]["mape"] < 1e-3 and fit["all_points"]["max_ape"] < 1e-3
    assert fit["coefficients"]["cE"] == pytest.approx(TRUE_GRAPHS["cE"], rel=1e-3)
    blind = fit_calibration(feats, y)
    assert blind["coefficients"]["cE"] == 0.0 and blind["all_points"]["mape"] > 0.05


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 80), ctx=st.integers(1, 10**6), knee=st.floats(1, 1000))
def test_graph_decode_line_equals_execute_and_features(n, ctx, knee):
    from simkv.clock import TICKS_PER_SECOND
    from simkv.calibration.costmodel import step_features
    from simkv.core.outputs import SchedulerOutput

    m = CalibratedCostModel(TRUE_GRAPHS, knee, graph_sizes=GRAPHS)
    out = SchedulerOutput(step=0, chunks=[], num_decode_reqs=n, decode_context_tokens=ctx, decodes=None,
                          preempted=[], num_running=n, num_waiting=0, num_blocks_used=0,
                          prefix_query_tokens=0, prefix_hit_tokens=0)
    exact = m.execute(out)
    assert exact == m.predict_features(np.array([step_features(out)]))[0]
    a0, a1, _, _ = m.decode_step_line(n)
    assert abs((a0 + a1 * ctx) / TICKS_PER_SECOND - exact) <= (1 + 0.5 * ctx) / TICKS_PER_SECOND + 1e-12 * exact
    eager = m._time(1, 0, n, n, 0, 0, ctx)  # the same step run eagerly
    assert (exact < eager) == (n <= GRAPHS[-1])  # a graph saves the launches (worth more than 7 pad rows here)


PIECES = [1, 2, 4] + list(range(8, 129, 8))  # piecewise_sizes(128)
TRUE_PIECES = {**TRUE_GRAPHS, "cW": 1.5e-3}  # piecewise steps: 1.5 ms of replays and attention launches


def test_piecewise_padding_of_steps_with_chunks():
    """With piecewise graphs, a step that no decode graph serves and has at most max(piecewise)
    tokens counts the next piecewise size of tokens (S and the attention terms unpadded), with
    E = 0 and W = 1; larger steps stay eager."""
    from simkv.calibration.costmodel import effective_features

    feats = np.array([[5, 5, 0, 0, 500],  # 5 decodes -> decode graph of 8
                      [37, 2, 500, 40, 1],  # 36-token chunk + 1 decode -> piecewise 40
                      [16, 1, 136, 16, 0],  # a lone chunk, on the ladder
                      [65, 65, 0, 0, 650],  # 65 decodes: above the decode graphs, piecewise 72
                      [300, 1, 45150, 300, 0]], dtype=np.int64)  # above the largest piece: eager
    e, w, t, s, pp, kp, kd = effective_features(feats, GRAPHS, PIECES)
    assert e.tolist() == [0, 0, 0, 0, 1] and w.tolist() == [0, 1, 1, 1, 0]
    assert t.tolist() == [8, 40, 16, 72, 300] and s.tolist() == [8, 2, 1, 65, 1]
    assert kd.tolist() == [503, 1, 0, 650, 0] and pp.tolist() == feats[:, 2].tolist()
    m = CalibratedCostModel(TRUE_PIECES, 176.0, graph_sizes=GRAPHS, piecewise_sizes=PIECES)
    assert [m.piecewise_tokens(n) for n in (1, 3, 37, 128, 129)] == [1, 4, 40, 128, 0]
    assert m.describe()["piecewise_sizes"] == PIECES
    # without piecewise graphs W has no coefficient and such steps are eager
    plain = CalibratedCostModel(TRUE_PIECES, 176.0, graph_sizes=GRAPHS)
    assert plain.cW == 0.0 and plain.piecewise_tokens(5) == 0
    assert np.array_equal(design_matrix(feats, 176.0, GRAPHS)[:, 2], np.zeros(len(feats)))


def test_fit_recovers_the_piecewise_term():
    points, _ = build_grid("tiny", max_num_batched_tokens=512, max_num_seqs=64)
    feats = np.array([p.features for p in points], dtype=np.int64)
    true = CalibratedCostModel(TRUE_PIECES, 176.0, graph_sizes=GRAPHS, piecewise_sizes=PIECES)
    y = true.predict_features(feats)
    fit = fit_calibration(feats, y, graph_sizes=GRAPHS, piecewise_sizes=PIECES)
    assert fit["piecewise_sizes"] == PIECES and fit["all_points"]["max_ape"] < 1e-3
    assert fit["coefficients"]["cW"] == pytest.approx(TRUE_PIECES["cW"], rel=1e-3)
    assert fit["coefficients"]["cE"] == pytest.approx(TRUE_PIECES["cE"], rel=1e-3)


@settings(max_examples=80, deadline=None)
@given(prefill=st.integers(0, 200), cached=st.integers(0, 500), n=st.integers(0, 80), ctx=st.integers(0, 10**5))
def test_piecewise_scalar_path_equals_vectorised_features(prefill, cached, n, ctx):
    """The replay's per-step path (`execute`) and the array path (`predict_features`) agree on
    every step shape, and a decode run's line equals `execute` for pure decodes."""
    from simkv.calibration.costmodel import shape_features

    if prefill == 0 and n == 0:
        return
    m = CalibratedCostModel(TRUE_PIECES, 176.0, graph_sizes=GRAPHS, piecewise_sizes=PIECES)
    feats = shape_features([(cached, prefill)] if prefill else [], [ctx // max(n, 1)] * n)
    assert m._step_time(*feats) == pytest.approx(m.predict_features(np.array([feats]))[0], rel=1e-12)
    if prefill == 0:
        from simkv.clock import TICKS_PER_SECOND

        a0, a1, _, _ = m.decode_step_line(n)
        assert abs((a0 + a1 * feats[4]) / TICKS_PER_SECOND - m._step_time(*feats)) <= (1 + 0.5 * feats[4]) / TICKS_PER_SECOND + 1e-9


def test_calibration_without_ce_still_loads(tmp_path):
    """calib.json files written before graphs were modelled have no cE and no graph sizes."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_calib_record()))
    cm = cost_model_from_file(path)
    assert cm.cE == 0.0 and cm.graph_sizes == () and cm.describe()["graph_sizes"] == []
    rec = _calib_record()
    rec["fit"]["graph_sizes"] = GRAPHS
    rec["fit"]["coefficients"] = TRUE_GRAPHS
    path.write_text(json.dumps(rec))
    cm = cost_model_from_file(path)
    assert cm.graph_sizes == tuple(GRAPHS) and cm.cE == TRUE_GRAPHS["cE"]


def test_refit_changes_the_statistic_without_measuring(tmp_path):
    """`simkv calibrate --refit`: the grid points' samples valued by another statistic and fitted
    again (graph sizes kept); bad files and another model are refused, nothing is written."""
    points, _ = build_grid("tiny", max_num_batched_tokens=512, max_num_seqs=64)
    true = CalibratedCostModel(TRUE_GRAPHS, 176.0, graph_sizes=GRAPHS)
    base = true.predict_features(np.array([p.features for p in points], dtype=np.int64))
    # each point: four samples at the model's time and one 3x outlier, so median != mean
    measured = [{"label": p.label(), "features": list(p.features), "samples_s": [t, t, t, t, 3 * t], "value_s": t}
                for p, t in zip(points, base)]
    rec = {**_calib_record(), "cuda_graph_sizes": GRAPHS, "grid": {"measured": measured, "num_points": len(measured)}}
    src = tmp_path / "calib.json"
    src.write_text(json.dumps(rec))
    res = CliRunner().invoke(main, ["calibrate", "--refit", str(src), "--statistic", "mean", "--out", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    mean = json.loads((tmp_path / "m.json").read_text())
    assert mean["refit"]["statistic"] == "mean" and mean["fit"]["graph_sizes"] == GRAPHS
    assert mean["fit"]["coefficients"]["c0"] == pytest.approx(1.4 * TRUE_GRAPHS["c0"], rel=1e-3)  # mean = 1.4 x
    res = CliRunner().invoke(main, ["calibrate", "--refit", str(src), "--out", str(tmp_path / "med.json"), "--quiet"])
    med = json.loads((tmp_path / "med.json").read_text())
    assert med["fit"]["coefficients"]["cE"] == pytest.approx(TRUE_GRAPHS["cE"], rel=1e-3)
    assert cost_model_from_file(tmp_path / "med.json").graph_sizes == tuple(GRAPHS)
    res = CliRunner().invoke(main, ["calibrate", "--refit", str(src), "--model", "llama-3-8b", "--out", str(tmp_path / "x.json")])
    assert res.exit_code != 0 and "is a calibration of 'tiny-llama'" in res.output
    measured[3]["samples_s"] = []
    src.write_text(json.dumps(rec))
    res = CliRunner().invoke(main, ["calibrate", "--refit", str(src), "--out", str(tmp_path / "x.json")])
    assert res.exit_code != 0 and "grid point 3" in res.output and not (tmp_path / "x.json").exists()


def test_step_noise_draws_from_the_calibrations_repeats(tmp_path):
    """--step-noise empirical: each step's time is the formula's times a ratio drawn (seeded)
    from the grid samples over their point's median; the formula itself is unchanged."""
    from simkv.calibration.costmodel import step_noise_log_ratios
    from simkv.core.outputs import SchedulerOutput

    rec = _calib_record()
    rec["grid"] = {"measured": [{"samples_s": [1.0, 1.0, 2.0]}, {"samples_s": [0.5, 1.0, 1.0, 1.0]},
                                {"samples_s": [3.0, 3.0]}]}  # too few samples: left out
    logs = step_noise_log_ratios(rec)
    assert sorted(np.round(np.exp(logs), 6)) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    m = CalibratedCostModel(TRUE, 200.0, noise_log_ratios=logs, noise_seed=5)
    plain = CalibratedCostModel(TRUE, 200.0)
    assert not m.supports_decode_runs and plain.supports_decode_runs
    out = SchedulerOutput(step=0, chunks=[], num_decode_reqs=4, decode_context_tokens=400, decodes=None,
                          preempted=[], num_running=4, num_waiting=0, num_blocks_used=0,
                          prefix_query_tokens=0, prefix_hit_tokens=0)
    ratios = [m.execute(out) / plain.execute(out) for _ in range(700)]
    assert set(np.round(ratios, 9)) == {0.5, 1.0, 2.0}
    assert abs(ratios.count(min(ratios)) / 700 - 1 / 7) < 0.05  # drawn uniformly from the pooled samples
    again = CalibratedCostModel(TRUE, 200.0, noise_log_ratios=logs, noise_seed=5)
    assert [again.execute(out) / plain.execute(out) for _ in range(700)] == ratios  # seeded
    feats = np.array([[4, 4, 0, 0, 400]])
    assert m.predict_features(feats)[0] == plain.predict_features(feats)[0]
    assert m.describe()["step_noise"]["samples"] == 7
    with pytest.raises(CalibrationError, match="3 or more samples"):
        step_noise_log_ratios({**rec, "grid": {"measured": [{"samples_s": [1.0, 2.0]}]}})


def test_step_noise_cli(tmp_path):
    from tests.gpu_backend.conftest import CI_TRACE

    rec = _calib_record()
    rec["grid"] = {"measured": [{"samples_s": [1.0, 1.1, 1.5, 0.9]}]}
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(rec))
    opts = ["--model", "tiny-llama", "--num-gpu-blocks", "512", "--max-num-batched-tokens", "256", "--max-num-seqs", "32"]
    outs = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        res = CliRunner().invoke(main, ["replay", str(CI_TRACE), "--cost-model", str(path), "--step-noise", "empirical",
                                        "--noise-seed", seed, *opts, "--out", str(tmp_path / name), "--quiet"])
        assert res.exit_code == 0, res.output
        outs.append((tmp_path / name / "requests.parquet").read_bytes())
    assert outs[0] == outs[1] and outs[0] != outs[2]  # the same seed gives the same bytes
    res = CliRunner().invoke(main, ["replay", str(CI_TRACE), "--step-noise", "empirical", *opts, "--out", str(tmp_path / "d")])
    assert res.exit_code != 0 and "needs a calibrated cost model" in res.output
    res = CliRunner().invoke(main, ["replay", str(CI_TRACE), "--backend", "gpu", "--device", "cpu", "--step-noise", "empirical",
                                    *opts, "--out", str(tmp_path / "e")])
    assert res.exit_code != 0 and "for simulated replays" in res.output
