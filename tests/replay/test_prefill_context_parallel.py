"""Prefill context parallelism (vLLM's --prefill-context-parallel-size, its V2 model runner, latent
attention): PCP copies of the TP group each hold the whole KV cache, split every prefill chunk of
a step between them (DualChunkSwap) and deal out the decodes; the routed experts span all their
GPUs. The scheduler's KV-cache manager is vLLM's with pcp_world_size 1: the engine core is the
same, only step times and weights per GPU change."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from simkv.backends.factory import make_backend, make_roofline
from simkv.capacity import compute_capacity, resident_weight_bytes
from simkv.cli.main import main
from simkv.clock import line_ticks, to_ticks
from simkv.config import ConfigError, EngineConfig
from simkv.core.outputs import ScheduledChunk
from simkv.replay.api import replay
from simkv.studies.serving_cost import engine_gpus
from simkv.traces.schema import read_trace, take_rows
from tests.core.helpers import make_request, make_step

V3 = {"model": "deepseek-v3", "gpu": "H200", "tensor_parallel_size": 8}
TRACES = Path(__file__).parents[2] / "traces"


@pytest.mark.parametrize("options, message", [
    ({"model": "llama-3-70b", "tensor_parallel_size": 4, "prefill_context_parallel_size": 2},
     "MRV2 PCP currently supports MLA models only."),
    (V3 | {"prefill_context_parallel_size": 2, "decode_context_parallel_size": 4},
     r"valid DCP sizes are \[1, 2, 16\]"),
    (V3 | {"prefill_context_parallel_size": 2, "decode_context_parallel_size": 2},
     "MRV2 PCP \\+ DCP supports sparse MLA models only."),
    (V3 | {"model": "deepseek-v3.2", "prefill_context_parallel_size": 2, "decode_context_parallel_size": 2},
     "not modelled with decode_context_parallel_size > 1"),
    (V3 | {"prefill_context_parallel_size": 2, "model_runner": "v1"},
     "Model Runner V1 does not support: prefill context parallel"),
    (V3 | {"prefill_context_parallel_size": 2, "enable_lora": True}, "MRV2 PCP does not support LoRA yet."),
    (V3 | {"prefill_context_parallel_size": 2, "speculative_method": "ngram", "num_speculative_tokens": 2},
     "only supports DSpark or single-module MTP"),
    (V3 | {"prefill_context_parallel_size": 2, "speculative_method": "mtp", "num_speculative_tokens": 3,
           "spec_mtp_modules": 3}, "only supports DSpark or single-module MTP"),
    (V3 | {"prefill_context_parallel_size": 2, "speculative_method": "mtp", "num_speculative_tokens": 1,
           "data_parallel_size": 2}, "not modelled with MTP and data-parallel ranks together"),
    (V3 | {"prefill_context_parallel_size": 2, "cpu_offload_gb": 10}, "not modelled with weights kept in host"),
    (V3 | {"prefill_context_parallel_size": 0}, "must be >= 1"),
])
def test_what_pcp_is_refused_with(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


def test_the_experts_span_every_pcp_rank_and_each_rank_holds_the_whole_cache():
    """DeepSeek-V3 does not fit 4 H200s; 2 PCP copies of TP 4 split its routed experts over 8 GPUs
    (vLLM flattens TP over PCP for the MoE), and each GPU's latent cache is TP 4's."""
    with pytest.raises(ConfigError):
        compute_capacity(EngineConfig.from_flat(V3 | {"tensor_parallel_size": 4}))
    tp8 = EngineConfig.from_flat(V3)
    pcp = EngineConfig.from_flat(V3 | {"tensor_parallel_size": 4, "prefill_context_parallel_size": 2})
    spec = tp8.hardware.model_spec()
    routed = spec.routed_expert_bytes
    assert resident_weight_bytes(pcp) - resident_weight_bytes(tp8) == pytest.approx(
        (spec.weight_bytes - routed) / 4 - (spec.weight_bytes - routed) / 8)
    assert pcp.hardware.num_gpus == engine_gpus(pcp) == 8
    cap = compute_capacity(pcp)
    assert cap.kv_bytes_per_token == compute_capacity(tp8).kv_bytes_per_token  # (a latent: whole on every GPU)
    rep = json.loads(CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3", "--gpu", "H200", "-tp", "4",
                                               "-pcp", "2", "--json"]).output)
    assert rep["prefill_context_parallel_size"] == 2 and rep["num_gpu_blocks"] == cap.num_gpu_blocks
    # all 8 GPUs hold a copy of every token's latent
    assert rep["kv_bytes_per_token"] == 8 * rep["kv_bytes_per_token_per_gpu"]
    # `--layouts` tries PCP for latent attention: TP 4 x PCP 2 has DP 2 x TP 4's weights and blocks
    # per GPU, but its two copies hold one cache between them
    rows = {r["layout"]: r for r in json.loads(CliRunner().invoke(main, [
        "capacity", "--model", "deepseek-v3", "--gpu", "H200", "--layouts", "8", "--json"]).output)["layouts"]}
    pcp_row, dp_row = rows["1 x TP 4 x PCP 2"], rows["DP 2 x TP 4"]
    assert pcp_row["prefill_context_parallel_size"] == 2 and pcp_row["num_gpu_blocks"] == cap.num_gpu_blocks
    assert pcp_row["num_gpu_blocks"] == dp_row["num_gpu_blocks"]
    assert 2 * pcp_row["kv_cache_tokens_all"] == dp_row["kv_cache_tokens_all"]
    assert not rows["2 x TP 4"]["fits"] and rows["1 x TP 2 x PCP 4"]["fits"]
    layouts = CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3", "--layouts", "8", "-pcp", "2"])
    assert layouts.exit_code != 0 and "tries every prefill context parallelism itself" in layouts.output
    dense = json.loads(CliRunner().invoke(main, ["capacity", "--model", "qwen3-30b-a3b", "--layouts", "4",
                                                 "--json"]).output)["layouts"]
    assert not any("PCP" in r["layout"] for r in dense)  # (vLLM runs PCP for latent attention only)


def test_an_engines_gpus_count_its_stages_and_pcp_ranks():
    """`--gpu-price` prices TP x PP x PCP x DP GPUs an engine (pipeline stages were left out)."""
    assert engine_gpus(EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2,
                                               "pipeline_parallel_size": 2})) == 4
    assert engine_gpus(EngineConfig.from_flat(V3 | {"data_parallel_size": 2, "prefill_context_parallel_size": 2})) == 32


def _ranks(p: int, chunk_tokens: int, cached: int = 0, decodes: int = 0, context: int = 0):
    model = make_roofline(EngineConfig.from_flat(V3 | {"prefill_context_parallel_size": p}))
    request = make_request(0, cached + chunk_tokens + 1, 1)
    chunks = [ScheduledChunk(request, cached, chunk_tokens)] if chunk_tokens else []
    step = make_step(chunks, decodes=decodes, context=context)
    return model, step, model.pcp_rank_works(step)


def test_a_chunk_is_split_as_vllms_dual_chunk_swap():
    """A 10-token chunk over PCP 2: four pieces of 3 tokens (the last 1); rank 0 takes pieces 0
    and 3, rank 1 pieces 1 and 2; each piece runs the expanded path with the chunk's earlier
    tokens as its context; every rank writes all 10 tokens' latents."""
    _, _, (r0, r1) = _ranks(2, 10, cached=100)
    assert (r0[0], r0[1], r1[0], r1[1]) == (4, 1, 6, 1)  # (tokens; each rank computes the one logit row)
    assert r0[2] == 3 * 100 + 6 + 1 * 109 + 1 and r1[2] == 3 * 103 + 6 + 3 * 106 + 6  # causal pairs
    assert (r0[5], r1[5]) == (100 + 109, 103 + 106)  # contexts up-projected
    assert (r0[4], r1[4]) == (0, 0)  # (no piece runs the decode path under PCP)
    assert (r0[3], r1[3]) == (103 + 110 + 6, 106 + 109 + 4)  # read up to each piece's end; the other's written
    # the pieces cover the chunk: its tokens and causal pairs, once each
    for p in (2, 3, 4):
        _, _, works = _ranks(p, 8191, cached=5000)
        assert sum(w[0] for w in works) == 8191
        assert sum(w[2] for w in works) == 8191 * 5000 + 8191 * 8192 // 2


def test_dual_chunk_swap_balances_causal_attention():
    """An early piece and a late one each: a fresh 32k-token prompt's pairs split within 0.1 % of
    an even share, where cutting it in PCP contiguous parts would give the last rank 2P - 1 times
    the first's."""
    for p in (2, 4):
        _, _, works = _ranks(p, 32768)
        pairs = [w[2] for w in works]
        assert max(pairs) / min(pairs) < 1.001


def test_decodes_are_dealt_round_robin():
    model, step, works = _ranks(2, 0, decodes=5, context=5000)
    assert [w[0] for w in works] == [3, 2] and [w[4] for w in works] == [3000, 2000]
    # a pure-decode step's line is rank 0's (it takes the most), as execute times it
    for n, context in ((5, 5000), (64, 64 * 4000), (1, 30_000)):
        decode = make_step(decodes=n, context=context)
        assert line_ticks(model.decode_step_line(n), context) == pytest.approx(to_ticks(model.execute(decode)),
                                                                              rel=1e-5)  # (the slopes' rounding)


def test_a_long_prompt_runs_faster_on_pcp_ranks_that_share_a_fast_link():
    """A fresh 32k-token prompt: 2 PCP copies of TP 8 in one 16-GPU NVLink domain halve each GPU's
    attention and dense work; over a 50 GB/s network between two nodes the expert layers'
    all-gathers of every token's hidden states cost more than that saves. The collectives are
    each rank's: the new latents, the experts' gather and reduce-scatter, the hidden states."""
    chunk = ScheduledChunk(make_request(0, 32769, 1), 0, 32768)
    step = make_step([chunk])
    tp8 = make_roofline(EngineConfig.from_flat(V3)).execute(step)
    domain = make_roofline(EngineConfig.from_flat(V3 | {"prefill_context_parallel_size": 2, "gpus_per_node": 16}))
    nodes = make_roofline(EngineConfig.from_flat(V3 | {"prefill_context_parallel_size": 2}))
    assert domain.execute(step) < 0.6 * tp8 < tp8 < nodes.execute(step)
    spec = domain.model
    per_token = 0.5 * 2 * (spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) + 2 * spec.num_moe_layers
                           * spec.hidden_size + spec.hidden_size)
    assert domain.pcp_gather_seconds(32768) == pytest.approx(
        per_token * 32768 / (domain.gpu.interconnect_gbs * 1e9)
        + (spec.num_layers + 2 * spec.num_moe_layers + 1) * domain.params["allreduce_latency_s"])
    assert nodes.pcp_gather_seconds(32768) > 5 * domain.pcp_gather_seconds(32768)


def _summary(result) -> str:
    result.summary.pop("wall_time_s")
    return json.dumps(result.summary, sort_keys=True, default=str)


def test_the_engine_core_is_the_same_only_step_times_change():
    """vLLM's scheduler builds its KV-cache manager with pcp_world_size 1: with 1 s steps (unit
    cost) and the same blocks, PCP 2 schedules every step as without it."""
    trace = take_rows(read_trace(TRACES / "req400.parquet"), np.arange(200))
    blocks = {"num_gpu_blocks": 3000, "max_model_len": 8192}
    plain = replay(trace, EngineConfig.from_flat(V3 | blocks), "unit")
    pcp = replay(trace, EngineConfig.from_flat(V3 | blocks | {"prefill_context_parallel_size": 2}), "unit")
    assert plain.steps.keys() == pcp.steps.keys()
    for name in plain.steps:
        assert np.array_equal(np.asarray(plain.steps[name]), np.asarray(pcp.steps[name])), name
    assert plain.requests.equals(pcp.requests)


@pytest.mark.parametrize("extra", [[], ["-dp", "2"], ["-pp", "2"], ["--async-scheduling"]])
def test_a_pcp_replay(tmp_path, extra):
    """PCP alone, with data-parallel ranks (each rank's step split over its PCP copies, the
    experts over all 32 GPUs), with pipeline stages and under async scheduling: every request is
    served, decode runs agree with stepping, and the replay is deterministic."""
    trace = take_rows(read_trace(TRACES / "azure_conv_slice.parquet"), np.arange(150))
    runner = CliRunner()
    path = tmp_path / "t.parquet"
    from simkv.traces.schema import write_trace

    write_trace(trace, path)
    base = ["replay", str(path), "--model", "deepseek-v3", "--gpu", "H200", "-tp", "8", "-pcp", "2"] + extra
    outs, printed = [], []
    for name, more in (("a", []), ("b", []), ("steps", ["--no-decode-runs"])):
        res = runner.invoke(main, base + more + ["--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        printed.append(res.output)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        summary.pop("wall_time_s")
        outs.append(summary)
    assert outs[0] == outs[1]
    assert outs[0]["num_finished"] == 150 and outs[0]["config"]["prefill_context_parallel_size"] == 2
    if "-dp" not in extra and "-pp" not in extra:
        assert outs[0]["duration_s"] == outs[2]["duration_s"]
    assert "prefill-context-parallel ranks" in printed[0]


def test_a_pcp_prefill_pool_under_pd():
    """P/D with a PCP prefill pool (vLLM's NIXL transfer size is max(TP, PCP); each PCP rank holds
    the whole latent, so a pull moves the same bytes): every request is served and TTFT falls
    as the long prompts' prefills split over two copies in one NVLink domain."""
    from simkv.replay.disaggregated import DisaggregationSpec

    trace = take_rows(read_trace(TRACES / "mooncake_synthetic_slice.parquet"), np.arange(60))
    config = EngineConfig.from_flat(V3 | {"gpus_per_node": 16})
    plain = replay(trace, config, disaggregation=DisaggregationSpec(1, 1))
    spec = DisaggregationSpec(1, 1, prefill_options=(("prefill_context_parallel_size", 2),))
    pcp = replay(trace, config, disaggregation=spec)
    assert (pcp.requests["status"] == "finished").all()
    assert pcp.summary["disaggregation"]["kv_transfer"]["pulled_bytes"] == \
        plain.summary["disaggregation"]["kv_transfer"]["pulled_bytes"]
    assert pcp.summary["ttft_s"]["mean"] < plain.summary["ttft_s"]["mean"]


def test_vllm_serve_takes_pcp():
    from simkv.cli.vllm_serve import serve_options

    out = serve_options("vllm serve deepseek-ai/DeepSeek-V3 -tp 8 -pcp 2")
    assert out.options["prefill_context_parallel_size"] == 2
    config = EngineConfig.from_flat(out.options | {"gpu": "H200"})
    assert config.hardware.num_gpus == 16
    with pytest.raises(ValueError, match="prefill context parallelism"):
        make_backend("calib.json", config)


def test_verifications_are_decode_rows_dealt_round_robin():
    """Under MTP a verification (the last sampled token and K drafts) is a decode row: vLLM deals
    it whole to one rank, down the decode (absorbed) path; single-token decodes are dealt on
    after the verifications."""
    model = make_roofline(EngineConfig.from_flat(V3 | {"prefill_context_parallel_size": 2}))
    verifications = []
    for i, context in enumerate((1000, 2000, 3000)):
        chunk = ScheduledChunk(make_request(i, context + 10, 20), context, 2)
        chunk.num_spec_tokens = 1
        verifications.append(chunk)
    r0, r1 = model.pcp_rank_works(make_step(verifications, decodes=3, context=3 * 600))
    # rank 0: verifications 0 and 2, then decode 4 of 3..5; rank 1: verification 1, decodes 3 and 5
    assert (r0[0], r1[0]) == (2 + 2 + 1, 2 + 2)
    assert r0[4] == (2 * 1000 + 3) + (2 * 3000 + 3) + 600 and r1[4] == (2 * 2000 + 3) + 1200
    assert r0[2] == r1[2] == r0[5] == r1[5] == 0  # (nothing down the expanded path)
    assert r0[1] == r1[1] == 6


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_under_pcp(k):
    """Single-module MTP, which vLLM runs with PCP: the drafter's first pass is split over the
    ranks as the target's step is, so a long prefill's drafting shrinks in one NVLink domain;
    a replay is whole, deterministic, and accepts drafts."""
    from simkv.backends.drafting import Drafter

    mtp = {"speculative_method": "mtp", "num_speculative_tokens": k, "gpus_per_node": 16}
    plain, split = (Drafter(EngineConfig.from_flat(V3 | mtp | {"prefill_context_parallel_size": p})) for p in (1, 2))
    request = make_request(0, 32768, 10)
    step = make_step([ScheduledChunk(request, 0, 32768)])
    step.num_spec_tokens_to_schedule = k
    assert 0 < split.seconds(step) < 0.7 * plain.seconds(step)
    trace = take_rows(read_trace(TRACES / "azure_conv_slice.parquet"), np.arange(150))
    config = EngineConfig.from_flat(V3 | mtp | {"prefill_context_parallel_size": 2})
    first, again = (_summary(replay(trace, config)) for _ in range(2))
    assert first == again
    summary = json.loads(first)
    assert summary["num_finished"] == 150 and summary["speculative_decoding"]["num_accepted_tokens"] > 0


def test_sparse_attention_under_pcp():
    """DeepSeek-V3.2 (vLLM runs sparse MLA with PCP): each rank's indexer scores its own rows
    against the whole context and its queries attend their top 2,048, the TP ranks no longer
    split the prefill rows (vLLM's row sharding is off under PCP), and the indexer's keys are
    gathered with the latents. A 32k-token prompt's pieces: every causal pair scored once over
    the ranks, every query's capped pairs attended once."""
    v32 = V3 | {"model": "deepseek-v3.2", "gpus_per_node": 16}
    plain = make_roofline(EngineConfig.from_flat(v32))
    pcp = make_roofline(EngineConfig.from_flat(v32 | {"prefill_context_parallel_size": 2}))
    assert pcp.indexer_shard_min_rows is None and not pcp.supports_decode_runs
    chunk = ScheduledChunk(make_request(0, 32769, 1), 0, 32768)
    step = make_step([chunk])
    whole, ranks = plain.sparse_work(step), pcp.pcp_rank_works(step)
    assert sum(r[0] for r in ranks) == whole[0] == 32768
    assert sum(r[4] for r in ranks) == pytest.approx(whole[4])  # (attended + scored at the indexer's ratio)
    assert max(r[4] for r in ranks) < 0.52 * whole[4]  # (balanced: an early and a late piece each)
    assert pcp.execute(step) < 0.65 * plain.execute(step)
    trace = take_rows(read_trace(TRACES / "mooncake_synthetic_slice.parquet"), np.arange(40))
    config = EngineConfig.from_flat(v32 | {"prefill_context_parallel_size": 2})
    first, again = (_summary(replay(trace, config)) for _ in range(2))
    assert first == again and json.loads(first)["num_finished"] == 40


def test_pcp_with_an_all_to_all_backend_exchanges_tokens_instead_of_gathering_them():
    """With -ep and a DeepEP backend vLLM's MoE dispatches PCP ranks' tokens all-to-all (its
    use_all2all_kernels): the PCP group then gathers only the latents and the last hidden states."""
    spec = make_roofline(EngineConfig.from_flat(V3)).model
    gathered = make_roofline(EngineConfig.from_flat(V3 | {"prefill_context_parallel_size": 2}))
    deepep = make_roofline(EngineConfig.from_flat(V3 | {"prefill_context_parallel_size": 2,
                                                        "enable_expert_parallel": True,
                                                        "all2all_backend": "deepep_high_throughput"}))
    assert gathered.dp_comm_per_token == 0.0 < deepep.dp_comm_per_token
    moe_share = 2 * spec.num_moe_layers * spec.hidden_size
    assert gathered.pcp_gather_per_token / deepep.pcp_gather_per_token == pytest.approx(
        (spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) + moe_share + spec.hidden_size)
        / (spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) + spec.hidden_size))
