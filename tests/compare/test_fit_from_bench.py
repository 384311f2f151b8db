"""`simkv calibrate --from-bench`: the roofline fitted to a server's benchmark, and `--cost-model fit.json`.

The server here is a replay with hidden roofline numbers (tests/compare/bench_synth.py writes what
vLLM's benchmark client would have recorded from it): the fit starts from the roofline's
defaults, which are 40 % off, and must predict a window of the trace it was not fitted on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_runs import cli_fails, cli_ok
from tests.compare.bench_synth import write_bench_result

HIDDEN = {"compute_efficiency": 0.40, "memory_efficiency": 0.55, "step_overhead_s": 0.0025, "seq_overhead_s": 1.5e-5}




def _fit_file(path: Path, params: dict, model: str = "llama-3-8b", gpu: str = "H100-SXM") -> str:
    path.write_text(json.dumps({"format": "simkv-roofline-fit", "format_version": 1, "model": model, "gpu": gpu,
                                "tensor_parallel_size": 1, "params": params, "fit": {}, "source": {}}))
    return str(path)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    hidden = _fit_file(tmp / "hidden.json", HIDDEN)
    cli_ok(["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "150", "--out", str(tmp / "t.parquet")])
    cli_ok(["replay", str(tmp / "t.parquet"), "--cost-model", hidden, "--out", str(tmp / "server"), "--quiet"])
    bench = write_bench_result(tmp / "server", tmp / "bench.json")
    cli_ok(["replay", str(tmp / "t.parquet"), "--out", str(tmp / "sim"), "--quiet"])  # the user's simulation
    out = cli_ok(["calibrate", "--from-bench", str(bench), "--sim", str(tmp / "sim"), "--max-evals", "250",
                "--out", str(tmp / "fit.json")])
    return tmp, hidden, json.loads((tmp / "fit.json").read_text()), out


def test_fit_recovers_the_servers_timing_on_its_own_trace(fitted):
    _, _, doc, out = fitted
    fit = doc["fit"]
    assert fit["loss"] < 0.1 * fit["loss_at_defaults"]
    assert fit["at_defaults"]["e2e_median_abs_rel_error"] > 0.3  # the defaults are far off ...
    assert fit["fitted"]["e2e_median_abs_rel_error"] < 0.05  # ... the fit is not
    assert abs(fit["fitted"]["itl_s.p50"]) < 0.05 and abs(fit["fitted"]["duration_s"]) < 0.01
    assert doc["model"] == "llama-3-8b" and doc["gpu"] == "H100-SXM" and fit["evaluations"] <= 250
    assert "fitted llama-3-8b on H100-SXM (TP 1) to 150 requests" in out


def test_fit_predicts_a_window_it_was_not_fitted_on(fitted, tmp_path):
    tmp, hidden, _, _ = fitted
    cli_ok(["trace", "transform", "traces/azure_conv_slice.parquet", "--window", "100", "160", "--out",
          str(tmp_path / "w.parquet")])
    for name, cost_model in (("truth", hidden), ("fit", str(tmp / "fit.json")), ("defaults", "roofline")):
        cli_ok(["replay", str(tmp_path / "w.parquet"), "--cost-model", cost_model, "--out", str(tmp_path / name), "--quiet"])
    errors = {}
    for name in ("fit", "defaults"):
        cli_ok(["compare", str(tmp_path / name), str(tmp_path / "truth"), "--out", str(tmp_path / f"c_{name}"), "--quiet"])
        rows = json.loads((tmp_path / f"c_{name}" / "compare.json").read_text())["metrics"]
        errors[name] = {r["metric"]: r["rel_error"] for r in rows}
    for metric in ("ttft_s.p50", "itl_s.p50", "e2e_s.p50"):
        assert abs(errors["fit"][metric]) < 0.1, (metric, errors["fit"][metric])
        assert abs(errors["defaults"][metric]) > 0.3
    summary = json.loads((tmp_path / "fit" / "summary.json").read_text())
    assert summary["cost_model"]["fit_file"] == str(tmp / "fit.json") and summary["cost_model"]["warnings"] == []


def test_fit_files_for_another_model_or_malformed_are_refused(tmp_path):
    other = _fit_file(tmp_path / "other.json", HIDDEN, model="qwen2.5-7b")
    out = cli_fails(["replay", "traces/req400.parquet", "--cost-model", other, "--out", str(tmp_path / "o")])
    assert "fitted for model 'qwen2.5-7b', this replay runs 'llama-3-8b'" in out
    bad = _fit_file(tmp_path / "bad.json", HIDDEN | {"memory_efficiency": 3.0})
    assert "params.memory_efficiency = 3.0, expected a number in [0.01, 1.0]" in cli_fails(
        ["replay", "traces/req400.parquet", "--cost-model", bad, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_from_bench_options_are_checked(fitted, tmp_path):
    tmp = fitted[0]
    assert "--from-bench and --sim go together" in cli_fails(["calibrate", "--from-bench", str(tmp / "bench.json")])
    assert "a mode of its own" in cli_fails(["calibrate", "--from-bench", str(tmp / "bench.json"), "--sim",
                                          str(tmp / "sim"), "--model", "tiny-llama"])
    cli_ok(["replay", str(tmp / "t.parquet"), "--replicas", "2", "--out", str(tmp_path / "fleet"), "--quiet"])
    assert "a fleet replay; --from-bench fits one engine's replay" in cli_fails(
        ["calibrate", "--from-bench", str(tmp / "bench.json"), "--sim", str(tmp_path / "fleet")])


def test_frontend_latency_adds_to_every_ttft_and_e2e_and_nothing_else(tmp_path):
    """Shifting every arrival by one constant shifts the whole replay: the front end's latency is
    added to TTFT and E2E and changes no step (one engine and a fleet)."""
    base = _fit_file(tmp_path / "base.json", HIDDEN)
    doc = json.loads(Path(base).read_text()) | {"frontend_latency_s": 0.004}
    (tmp_path / "front.json").write_text(json.dumps(doc))
    for extra in ([], ["--replicas", "2"]):
        runs = {}
        for name in ("base", "front"):
            out = tmp_path / f"{name}{len(extra)}"
            cli_ok(["replay", "traces/req400.parquet", "--cost-model", str(tmp_path / f"{name}.json"), *extra,
                  "--out", str(out), "--quiet"])
            runs[name] = out
        import pandas as pd

        a, b = (pd.read_parquet(runs[n] / "requests.parquet") for n in ("base", "front"))
        for column in ("ttft_s", "e2e_s"):
            assert ((b[column] - a[column]).dropna() - 0.004).abs().max() < 1e-9
        same = [c for c in a.columns if c not in ("ttft_s", "e2e_s")]
        assert a[same].equals(b[same])
        assert (runs["base"] / "steps.parquet").read_bytes() == (runs["front"] / "steps.parquet").read_bytes()
        summary = json.loads((runs["front"] / "summary.json").read_text())
        assert summary["cost_model"]["frontend_latency_s"] == 0.004
    doc["frontend_latency_s"] = -1
    (tmp_path / "neg.json").write_text(json.dumps(doc))
    assert "frontend_latency_s = -1, expected a number in [0, 10.0]" in cli_fails(
        ["replay", "traces/req400.parquet", "--cost-model", str(tmp_path / "neg.json"), "--out", str(tmp_path / "o")])


def test_fit_is_deterministic_and_needs_a_budget(fitted, tmp_path):
    tmp = fitted[0]
    args = ["calibrate", "--from-bench", str(tmp / "bench.json"), "--sim", str(tmp / "sim"), "--max-evals", "100",
            "--quiet"]
    cli_ok([*args, "--out", str(tmp_path / "a.json")])
    cli_ok([*args, "--out", str(tmp_path / "b.json")])
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert "--max-evals 50: the search needs at least 91 replays" in cli_fails(
        [*args[:-3], "--max-evals", "50", "--out", str(tmp_path / "c.json")])
    assert not (tmp_path / "c.json").exists()
