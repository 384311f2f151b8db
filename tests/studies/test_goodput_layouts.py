"""`simkv goodput --layouts N`: the highest rate within the SLOs of every layout of N GPUs
(simkv/studies/layouts.py), each layout's independent engines as replicas behind a router."""

import json

import pytest
from click.testing import CliRunner

from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.replay.api import FleetSpec
from simkv.specs import get_model_spec
from simkv.studies.goodput_search import search_max_rate
from simkv.studies.layouts import layouts_of
from simkv.traces.schema import read_trace

OPTIONS = ["--model", "qwen3-30b-a3b", "--goodput", "ttft:2000", "--goodput", "tpot:100", "--tolerance", "0.1"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    """The Azure slice's first 300 requests."""
    path = tmp_path_factory.mktemp("layouts") / "t.parquet"
    res = CliRunner().invoke(main, ["trace", "transform", "traces/azure_conv_slice.parquet", "--head", "300",
                                    "--out", str(path)])
    assert res.exit_code == 0, res.output
    return str(path)


def test_layouts_of_two_gpus():
    names = [layout.name for layout in layouts_of(2, get_model_spec("qwen3-30b-a3b"))]
    assert names == ["2 x TP 1", "DP 2 x TP 1", "1 x TP 1 x PP 2", "1 x TP 2"]
    assert [layout.name for layout in layouts_of(2, get_model_spec("llama-3-8b"))] == [
        "2 x TP 1", "1 x TP 1 x PP 2", "1 x TP 2"]  # (a dense model: no data-parallel ranks)
    assert "1 x TP 1 x PCP 2" in [layout.name for layout in layouts_of(2, get_model_spec("deepseek-v2-lite"))]


def test_goodput_searches_every_layout(tmp_path, trace):
    """Every layout of 2 H100s is searched; two TP 1 engines run as two replicas behind a
    least-outstanding router, and their rate is the one a search of that fleet finds; each row
    is priced on 2 GPUs; the best is the highest rate and prints its serve command."""
    res = CliRunner().invoke(main, ["goodput", trace] + OPTIONS + ["--layouts", "2", "--gpu-price", "H100-SXM=2",
                                                                    "--out", str(tmp_path), "--quiet"])
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "goodput.json").read_text())
    cells = {c["swept"]["layout"]: c for c in record["cells"]}
    assert list(cells) == ["2 x TP 1", "DP 2 x TP 1", "1 x TP 1 x PP 2", "1 x TP 2"]
    assert record["num_gpus"] == 2 and record["router"] == "least_outstanding"
    assert all(c["gpus"] == 2 and c["cost"]["gpus"] == 2 for c in cells.values())
    assert cells["2 x TP 1"]["num_replicas"] == 2 and cells["1 x TP 2"]["num_replicas"] == 1
    config = EngineConfig.from_flat({"model": "qwen3-30b-a3b"})
    alone = search_max_rate(read_trace(trace), config, {"ttft": 2000.0, "tpot": 100.0},
                            tolerance=0.1, fleet=FleetSpec(2, "least_outstanding"))
    assert cells["2 x TP 1"]["max_rate_req_s"] == alone["max_rate_req_s"]
    best = record["cells"][record["best_index"]]
    assert best["max_rate_req_s"] == max(c["max_rate_req_s"] or 0 for c in cells.values())
    assert "vllm serve" in record["best_vllm_serve"]["command"]
    assert "# simkv goodput over the layouts of 2 GPUs" in (tmp_path / "goodput.md").read_text()


def test_what_layouts_refuse(trace):
    runner = CliRunner()
    for extra, message in ((["-tp", "2"], "drop tensor_parallel_size"), (["--replicas", "2"], "drop --replicas"),
                           (["--grid", "max_num_seqs=8,16"], "drop --clients/--pd-splits/--grid")):
        res = runner.invoke(main, ["goodput", trace] + OPTIONS + ["--layouts", "2"] + extra)
        assert res.exit_code != 0 and message in res.output, res.output


def test_dual_batch_overlap_goes_to_the_data_parallel_layouts_only(monkeypatch):
    """`--enable-dbo` (vLLM's, with DeepEP) splits data-parallel ranks' steps: the layouts of TP
    engines and pipelines are searched without it rather than refused."""
    import simkv.studies.goodput_search as module

    seen = []
    monkeypatch.setattr(module, "_search_cells", lambda cells, *args: seen.extend(cells) or [])
    base = {"model": "qwen3-30b-a3b", "enable_expert_parallel": True, "all2all_backend": "deepep_low_latency",
            "enable_dbo": True, "dbo_decode_token_threshold": 8}
    module.search_layouts("t.parquet", base, layouts_of(2, get_model_spec("qwen3-30b-a3b")), {"ttft": 1000.0})
    options = {dict(cell.swept)["layout"]: dict(cell.options) for cell in seen}
    assert options["DP 2 x TP 1"]["enable_dbo"] and options["DP 2 x TP 1"]["dbo_decode_token_threshold"] == 8
    for name in ("2 x TP 1", "1 x TP 1 x PP 2", "1 x TP 2"):
        assert "enable_dbo" not in options[name] and "dbo_decode_token_threshold" not in options[name]
        assert options[name]["enable_expert_parallel"]  # (harmless without lockstep ranks: kept)
