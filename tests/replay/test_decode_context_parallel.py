"""Decode context parallelism (vLLM's --decode-context-parallel-size): the DCP GPUs of a TP group
shard the latent cache (or KV heads duplicated over TP) by tokens, the KV-cache manager's blocks
hold block_size x DCP tokens, and the roofline adds the collectives."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from simkv.backends.drafting import Drafter
from simkv.backends.factory import make_backend
from simkv.backends.roofline import RooflineCostModel
from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from simkv.core.outputs import ScheduledChunk
from simkv.replay.api import replay
from simkv.specs import get_gpu_spec, get_model_spec
from simkv.traces.schema import read_trace, take_rows
from tests.core.helpers import make_request, make_step

V3 = {"model": "deepseek-v3", "gpu": "H200", "tensor_parallel_size": 8}


def test_dcp_shards_the_latent_by_tokens_and_multiplies_the_cache():
    plain = compute_capacity(EngineConfig.from_flat(V3))
    dcp = compute_capacity(EngineConfig.from_flat(V3 | {"decode_context_parallel_size": 8}))
    assert dcp.num_gpu_blocks == plain.num_gpu_blocks  # (the same pages on every GPU)
    assert dcp.block_size == 8 * plain.block_size == 128
    assert dcp.kv_bytes_per_token * 8 == plain.kv_bytes_per_token == 70_272
    assert dcp.kv_cache_tokens == 8 * plain.kv_cache_tokens


@pytest.mark.parametrize("options, message", [
    (V3 | {"decode_context_parallel_size": 3}, "tp_size=8 must be divisible by dcp_size=3"),
    ({"model": "llama-3-70b", "tensor_parallel_size": 8, "decode_context_parallel_size": 2},
     r"requires `--tensor-parallel-size` \(8\) to be greater than the model's total number of KV heads \(8\)"),
    ({"model": "llama-3-70b", "tensor_parallel_size": 16, "decode_context_parallel_size": 4},
     r"\(4\) exceeds the maximum supported value \(2\)"),
    (V3 | {"decode_context_parallel_size": 0}, "must be >= 1"),
])
def test_what_dcp_is_refused_with(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


def test_grouped_query_attention_shards_its_duplicated_kv_heads():
    """llama-3-70b's 8 KV heads over TP 16: each is held by 2 GPUs, which DCP 2 shards by tokens."""
    base = {"model": "llama-3-70b", "tensor_parallel_size": 16}
    plain = compute_capacity(EngineConfig.from_flat(base))
    dcp = compute_capacity(EngineConfig.from_flat(base | {"decode_context_parallel_size": 2}))
    assert dcp.kv_cache_tokens == 2 * plain.kv_cache_tokens and dcp.block_size == 32
    spec, gpu = get_model_spec("llama-3-70b"), get_gpu_spec("H100-SXM")
    model = RooflineCostModel(spec, gpu, 16, decode_context_parallel_size=2)
    # every query token all-gathers (a prefill chunk's too): no latents to gather
    chunk = ScheduledChunk(make_request(0, 600, 1), 100, 500)
    assert model.dcp_seconds(make_step([chunk], decodes=2)) == pytest.approx(
        model.dcp_per_query * 502 + model.dcp_fixed)


def test_the_roofline_reads_a_dcp_share_and_pays_for_the_collectives():
    spec, gpu = get_model_spec("deepseek-v3"), get_gpu_spec("H200")
    plain = RooflineCostModel(spec, gpu, 8)
    dcp = RooflineCostModel(spec, gpu, 8, decode_context_parallel_size=8)
    assert dcp.kv_bytes_per_token * 8 == plain.kv_bytes_per_token
    assert dcp.flops_per_latent_pair == plain.flops_per_latent_pair  # (8 x the heads over 1 / 8 of the tokens)
    # 64 decodes of 100k cached tokens each: memory-bound on the latent, which DCP divides
    long = make_step(decodes=64, context=64 * 100_000)
    assert dcp.execute(long) < 0.5 * plain.execute(long)
    # a decode step over short contexts: the collectives make it slower
    short = make_step(decodes=64, context=64 * 500)
    assert dcp.execute(short) - plain.execute(short) == pytest.approx(
        dcp.dcp_per_query * 64 + dcp.dcp_fixed - (plain.kv_bytes_per_token - dcp.kv_bytes_per_token)
        * 64 * 501 / plain.byte_rate, rel=1e-6)
    # an expanded-path chunk gathers its own and its context's latents; a 1-token chunk is a query
    chunk = ScheduledChunk(make_request(0, 5000, 1), 3000, 2000)
    single = ScheduledChunk(make_request(1, 5000, 1), 4999, 1)
    assert dcp.dcp_seconds(make_step([chunk, single], decodes=3)) == pytest.approx(
        dcp.dcp_per_gathered * 5000 + dcp.dcp_per_query * 4 + dcp.dcp_fixed)


def test_a_dcp_replay_runs_its_core_on_manager_blocks(tmp_path):
    runner = CliRunner()
    out = tmp_path / "dcp"
    res = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(out), "--model", "deepseek-v3",
                               "--gpu", "H200", "-tp", "8", "-dcp", "8"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["decode_context_parallel_size"] == 8 and summary["config"]["block_size"] == 16
    assert summary["num_finished"] == summary["num_requests"]
    assert "of 128 tokens" in (out / "report.html").read_text() or "of 128 tokens" in res.output
    # a calibration and the GPU backend do not take it; P/D pools do where vLLM's NIXL does (D = TP)
    config = EngineConfig.from_flat(V3 | {"decode_context_parallel_size": 8})
    with pytest.raises(ValueError, match="decode context parallelism"):
        make_backend(str(tmp_path / "calib.json"), config)
    pd_args = ["replay", "traces/req400.parquet", "--model", "deepseek-v3", "--gpu", "H200", "-tp", "8",
               "--prefill-replicas", "1", "--decode-replicas", "1"]
    pd = runner.invoke(main, pd_args + ["-dcp", "8", "--out", str(tmp_path / "pd")])
    assert pd.exit_code == 0, pd.output
    assert json.loads((tmp_path / "pd" / "summary.json").read_text())["num_finished"] == 400
    short = runner.invoke(main, pd_args + ["-dcp", "2", "--out", str(tmp_path / "pd2")])
    assert short.exit_code != 0 and "must be 1 or equal to the NIXL transfer parallel size=8" in short.output


def test_capacity_reports_the_manager_block():
    res = CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3", "--gpu", "H200", "-tp", "8", "-dcp", "8",
                                    "--json"])
    rep = json.loads(res.output)
    assert rep["kv_manager_block_size"] == 128 and rep["decode_context_parallel_size"] == 8
    assert rep["kv_bytes_per_token_per_gpu"] == 8_784 and not rep["latent_cache_on_every_gpu"]


def test_mtp_drafts_under_dcp():
    """MTP under DCP 8 (vLLM's proposers read the DCP groups' local lengths): the engine core runs
    on the manager's 128-token blocks, the drafter's layer reads its 1 / DCP share of the latent
    (a long-context step's drafting costs less than without DCP), and the replay is whole and
    deterministic."""
    mtp = {"speculative_method": "mtp", "num_speculative_tokens": 2}
    plain = Drafter(EngineConfig.from_flat(V3 | mtp))
    sharded = Drafter(EngineConfig.from_flat(V3 | mtp | {"decode_context_parallel_size": 8}))
    # (64 verifying requests of 100k tokens: the last sampled token and two drafts each)
    requests = [make_request(i, 100_000, 10) for i in range(64)]
    for r in requests:
        r.num_output_tokens = 1
    step = make_step(chunks=[ScheduledChunk(r, r.num_tokens - 1, 3, True) for r in requests])
    step.num_spec_tokens_to_schedule = 2
    assert 0 < sharded.seconds(step) < plain.seconds(step)
    trace = take_rows(read_trace(Path(__file__).parents[2] / "traces" / "azure_conv_slice.parquet"), np.arange(200))
    config = EngineConfig.from_flat(V3 | mtp | {"decode_context_parallel_size": 8})
    runs = [replay(trace, config).summary for _ in range(2)]
    for s in runs:
        s.pop("wall_time_s")
    assert json.dumps(runs[0], sort_keys=True, default=str) == json.dumps(runs[1], sort_keys=True, default=str)
    assert runs[0]["num_finished"] == 200 and runs[0]["speculative_decoding"]["num_accepted_tokens"] > 0
    assert runs[0]["config"]["decode_context_parallel_size"] == 8


def test_a_dcp_decode_pool_under_pd():
    """P/D with a DCP decode pool (vLLM: a NIXL side is fully replicated or fully DCP-sharded,
    MLA only): the decode engine runs on 128-token manager blocks, each decode GPU pulls only its
    token shard (an eighth of the replicated latent's bytes, save the last block's rounding),
    every request is served and decode runs change nothing. A GQA model, or DCP short of TP, is
    refused with vLLM's words."""
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = take_rows(read_trace(Path(__file__).parents[2] / "traces" / "azure_conv_slice.parquet"), np.arange(150))
    config = EngineConfig.from_flat(V3)
    plain = replay(trace, config, disaggregation=DisaggregationSpec(1, 1))
    spec = DisaggregationSpec(1, 1, decode_options=(("decode_context_parallel_size", 8),))
    runs = replay(trace, config, disaggregation=spec)
    steps = replay(trace, config, disaggregation=spec, use_decode_runs=False)
    for res in (runs, steps):
        res.summary.pop("wall_time_s")
    assert json.dumps(runs.summary, sort_keys=True, default=str) == json.dumps(steps.summary, sort_keys=True,
                                                                                default=str)
    assert (runs.requests["status"] == "finished").all()
    full, shard = plain.summary["disaggregation"]["kv_transfer"], runs.summary["disaggregation"]["kv_transfer"]
    assert full["num_pulls"] == shard["num_pulls"] == 150
    assert full["pulled_bytes"] / 8 <= shard["pulled_bytes"] < full["pulled_bytes"] / 7
    for options, message in [({"model": "qwen3-30b-a3b", "gpu": "H100-SXM", "tensor_parallel_size": 8},
                               "only supported for MLA models"),
                              (V3, "must be 1 or equal to the NIXL transfer parallel size=8")]:
        bad = DisaggregationSpec(1, 1, decode_options=(("decode_context_parallel_size", 2),))
        with pytest.raises(ConfigError, match=message):
            replay(trace, EngineConfig.from_flat(options), disaggregation=bad)


def test_data_parallel_ranks_with_dcp_pay_each_their_own_collectives():
    """DP 2 x TP 8 with DCP 8 (vLLM takes DCP within each rank's TP group): a lockstep step lasts
    as long as its slowest rank, collectives included, and a dummy pass (no attention metadata)
    adds none."""
    spec, gpu = get_model_spec("deepseek-v3"), get_gpu_spec("H200")
    model = RooflineCostModel(spec, gpu, 8, data_parallel_size=2, decode_context_parallel_size=8)
    long = make_step(decodes=64, context=64 * 100_000)
    short = make_step(decodes=2, context=2 * 500)
    works = [model.step_work(long), model.step_work(short)]
    assert model.dcp_seconds(long) > model.dcp_seconds(short) > 0
    assert model.dp_step_seconds([long, short]) == pytest.approx(model.dp_time(works) + model.dcp_seconds(long))
    assert model.dp_step_seconds([short], num_dummy=1) == pytest.approx(
        model.dp_time([works[1]], 1) + model.dcp_seconds(short))
    # (one rank short of the other's collectives: the slower rank's own sum, not the sum of maxima)
    slow_short = make_step(decodes=300, context=300 * 200)
    assert model.dcp_seconds(slow_short) > model.dcp_seconds(long)
    both = model.dp_step_seconds([long, slow_short])
    plain = model.dp_time([model.step_work(long), model.step_work(slow_short)])
    assert plain < both <= plain + model.dcp_seconds(slow_short) + 1e-12


@pytest.mark.parametrize("extra", [["-dp", "2"], ["-pp", "2"], ["-dp", "2", "--kv-offloading-size", "64"]])
def test_dcp_under_data_parallel_ranks_or_pipeline_stages(tmp_path, extra):
    """DCP composes with DP ranks (each rank's cache on 128-token manager blocks) and with pipeline
    stages (each stage's share of the latent sharded by tokens): the pool keeps its blocks and
    holds 8 times the tokens, every request is served, and the replay is deterministic."""
    runner = CliRunner()
    base = ["replay", "traces/req400.parquet", "--model", "deepseek-v3", "--gpu", "H200", "-tp", "8"] + extra
    summaries = []
    for name, dcp in (("plain", []), ("dcp", ["-dcp", "8"]), ("again", ["-dcp", "8"])):
        res = runner.invoke(main, base + dcp + ["--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        summary.pop("wall_time_s")
        summaries.append(summary)
    plain, dcp, again = summaries
    assert json.dumps(dcp, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert dcp["num_finished"] == plain["num_finished"] == 400
    assert dcp["num_gpu_blocks"] == plain["num_gpu_blocks"]
    assert dcp["config"]["decode_context_parallel_size"] == 8
    # the same requests' KV on blocks of 8 x the tokens: at most an eighth of the blocks, plus rounding
    assert dcp["peak_blocks_used"] <= plain["peak_blocks_used"] / 8 + 400
    assert dcp["duration_s"] != plain["duration_s"]  # (the collectives, the shard's reads)


def test_layouts_with_dcp():
    """`simkv capacity --layouts N -dcp D`: the layouts whose TP D divides, each holding D times
    the tokens of the same layout without DCP (data-parallel ranks and pipeline stages too)."""
    runner = CliRunner()
    base = ["capacity", "--model", "deepseek-v3", "--gpu", "H200", "--layouts", "16", "--json"]
    plain = {r["layout"]: r for r in json.loads(runner.invoke(main, base).output)["layouts"]}
    sharded = json.loads(runner.invoke(main, base + ["-dcp", "8"]).output)["layouts"]
    assert {r["layout"] for r in sharded} == {"2 x TP 8 DCP 8", "DP 2 x TP 8 DCP 8", "1 x TP 8 x PP 2 DCP 8",
                                             "1 x TP 16 DCP 8"}
    for row in sharded:
        assert row["tensor_parallel_size"] % 8 == 0 and row["decode_context_parallel_size"] == 8
        same = plain[row["layout"].removesuffix(" DCP 8")]
        assert row["num_gpu_blocks"] == same["num_gpu_blocks"]
        assert row["kv_cache_tokens_all"] == 8 * same["kv_cache_tokens_all"]
