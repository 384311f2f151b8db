"""The expert layers' token exchange between lockstep ranks (vLLM's --enable-expert-parallel,
--all2all-backend) and dual batch overlap (--enable-dbo): simkv/backends/expert_exchange.py and
the roofline's lockstep step (`RooflineCostModel.dp_time`)."""

import json
from pathlib import Path

import numpy as np
import pytest

from simkv.backends.expert_exchange import all_to_all_exchange, gather_exchange
from simkv.backends.factory import make_roofline
from simkv.cli.vllm_serve import serve_options
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.specs import get_model_spec
from simkv.traces.schema import read_trace, take_rows

V3 = {"model": "deepseek-v3", "gpu": "H200"}
DEEPEP = {"enable_expert_parallel": True, "all2all_backend": "deepep_low_latency"}
TRACES = Path(__file__).parents[2] / "traces"


def test_gathering_moves_every_token_to_every_gpu():
    """allgather_reducescatter: each GPU gets (g - 1) / g of the step's tokens twice an expert layer."""
    spec = get_model_spec("deepseek-v3")
    per_token, fixed = gather_exchange(spec, 16, 50.0, 8e-6)
    assert per_token == pytest.approx(2 * 58 * 15 / 16 * 7168 * 2 / 50e9)
    assert fixed == pytest.approx(2 * 58 * 8e-6)


def test_all_to_all_sends_a_token_to_its_experts_gpus():
    """DeepEP: DeepSeek-V3's token picks its 8 experts from its best 4 of 8 expert groups, which
    lie on 8 of 16 GPUs: 8 x (1 - (7/8)^8) = 5.25 GPUs, all but 1/16 of them remote; an FP8
    checkpoint dispatches fp8 with scales and combines bf16; within a node everything goes over
    NVLink, across two nodes 8 of the 15 other GPUs are behind the network."""
    spec = get_model_spec("deepseek-v3")
    assert (spec.n_group, spec.topk_group) == (8, 4)
    remote = 8 * (1 - (7 / 8) ** 8) * 15 / 16
    copy = 7168 * (1 + 4 / 128 + 2)
    one_node = all_to_all_exchange(spec, 16, 16, 450.0, 50.0, 8e-6)[0]
    assert one_node == pytest.approx(58 * remote / 16 * copy * (15 / 15) / 450e9)
    two_nodes = all_to_all_exchange(spec, 16, 8, 450.0, 50.0, 8e-6)[0]
    assert two_nodes == pytest.approx(58 * remote / 16 * copy * max(7 / 15 / 450e9, 8 / 15 / 50e9))
    # a third of the gathered bytes or less, over the same network
    assert two_nodes < 0.35 * gather_exchange(spec, 16, 50.0, 8e-6)[0]
    bf16 = get_model_spec("qwen3-30b-a3b")  # (bf16 experts: bf16 dispatch)
    assert all_to_all_exchange(bf16, 8, 8, 450.0, 50.0, 0.0)[0] == pytest.approx(
        bf16.num_moe_layers * 8 * (1 - (7 / 8) ** bf16.num_experts_per_tok) * 7 / 8 / 8
        * bf16.hidden_size * 4 / 450e9)


@pytest.mark.parametrize("options, message", [
    (V3 | {"data_parallel_size": 8, "all2all_backend": "alltoall"}, "all2all_backend must be one of"),
    (V3 | {"data_parallel_size": 8, "enable_dbo": True},
     "Microbatching currently only supports the deepep_low_latency, deepep_high_throughput, nixl_ep all2all"),
    (V3 | {"data_parallel_size": 8, "enable_dbo": True, "dbo_decode_token_threshold": 1} | DEEPEP,
     "must be at least the number of microbatches"),
    (V3 | {"tensor_parallel_size": 8, "enable_dbo": True} | DEEPEP, "modelled with data-parallel ranks"),
    (V3 | {"data_parallel_size": 8, "enable_dbo": True, "speculative_method": "mtp",
           "num_speculative_tokens": 1} | DEEPEP, "enable_dbo is not modelled with speculative decoding"),
    (V3 | {"data_parallel_size": 8, "ubatch_size": 4}, "Microbatching currently only supports"),
    (V3 | {"data_parallel_size": 8, "ubatch_size": 4, "dbo_decode_token_threshold": 3} | DEEPEP,
     r"must be at least the number of microbatches \(4\)"),
    (V3 | {"tensor_parallel_size": 8, "ubatch_size": 3} | DEEPEP, "ubatch_size 3 is modelled with data-parallel"),
    (V3 | {"data_parallel_size": 8, "ubatch_size": 3, "pipeline_parallel_size": 2} | DEEPEP,
     "ubatch_size 3 is not modelled with pipeline parallelism"),
    (V3 | {"data_parallel_size": 8, "ubatch_size": -1}, "ubatch_size must be >= 0"),
])
def test_what_is_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(options)


def test_deepep_low_latency_ranks_default_to_vllms_256_token_budget():
    """vLLM's use_batched_dp_moe (DeepEP low-latency or NIXL EP kernels, expert parallelism,
    data-parallel ranks): a defaulted token budget of 256 (512 in throughput mode), sequences at
    most that; another backend, no expert parallelism, or a budget given keep the GPU's."""
    def budget(**options):
        sc = EngineConfig.from_flat(V3 | {"data_parallel_size": 8} | options).scheduler
        return sc.max_num_batched_tokens, sc.max_num_seqs

    assert budget(**DEEPEP) == (256, 256)
    assert budget(enable_expert_parallel=True, all2all_backend="nixl_ep") == (256, 256)
    assert budget(**DEEPEP, performance_mode="throughput") == (512, 512)
    assert budget(enable_expert_parallel=True, all2all_backend="deepep_high_throughput") == (8192, 1024)
    assert budget(all2all_backend="deepep_low_latency") == (8192, 1024)
    assert budget(**DEEPEP, max_num_batched_tokens=4096) == (4096, 1024)
    tp = EngineConfig.from_flat(V3 | {"tensor_parallel_size": 8} | DEEPEP).scheduler
    assert tp.max_num_batched_tokens == 8192  # (no data-parallel ranks)


def test_group_limited_routing_narrows_the_gpus_a_token_reaches():
    """vLLM's grouped_topk (DeepSeek-V3: n_group 8, topk_group 4): over 16 GPUs a token's experts
    lie on 5.25 GPUs instead of 6.45, over 64 on 7.18 instead of 7.58; over 4 GPUs (two groups
    each) the chosen groups miss a GPU with probability C(6, 4) / C(8, 4); without groups
    (Kimi K2) routing is uniform over all experts."""
    from dataclasses import replace

    from simkv.backends.expert_exchange import token_gpus

    v3 = get_model_spec("deepseek-v3")
    flat = replace(v3, n_group=1, topk_group=1)
    assert token_gpus(v3, 16) == pytest.approx(8 * (1 - (7 / 8) ** 8))
    assert token_gpus(flat, 16) == pytest.approx(16 * (1 - (15 / 16) ** 8))
    assert token_gpus(v3, 64) == pytest.approx(32 * (1 - (31 / 32) ** 8))
    c = 4 * (1 - 15 / 70)
    assert token_gpus(v3, 4) == pytest.approx(c * (1 - (1 - 1 / c) ** 8))
    kimi = get_model_spec("kimi-k2")
    assert token_gpus(kimi, 16) == pytest.approx(16 * (1 - (15 / 16) ** 8))


def test_round_robin_placement_spreads_every_group_over_every_gpu():
    """--expert-placement-strategy round_robin (expert e on GPU e mod g): DeepSeek-V3's groups
    then span all 16 GPUs, so a token reaches 6.45 of them, as without groups; vLLM keeps it only
    for a model with expert groups on DeepEP low-latency or NIXL EP kernels, else linear."""
    from simkv.backends.expert_exchange import token_gpus

    v3 = get_model_spec("deepseek-v3")
    assert token_gpus(v3, 16, round_robin=True) == pytest.approx(16 * (1 - (15 / 16) ** 8))
    base = V3 | {"data_parallel_size": 16, "gpus_per_node": 8} | DEEPEP
    linear = make_roofline(EngineConfig.from_flat(base))
    spread = make_roofline(EngineConfig.from_flat(base | {"expert_placement_strategy": "round_robin"}))
    assert spread.dp_comm_per_token / linear.dp_comm_per_token == pytest.approx(
        token_gpus(v3, 16, True) / token_gpus(v3, 16))
    kept = EngineConfig.from_flat(base | {"expert_placement_strategy": "round_robin"}).hardware
    assert kept.round_robin_experts
    for fallback in (base | {"all2all_backend": "deepep_high_throughput"},
                     {"model": "qwen3-30b-a3b", "data_parallel_size": 4} | DEEPEP):
        assert not EngineConfig.from_flat(fallback | {"expert_placement_strategy": "round_robin"}
                                          ).hardware.round_robin_experts
    with pytest.raises(ConfigError, match="expert_placement_strategy must be one of linear, round_robin"):
        EngineConfig.from_flat(base | {"expert_placement_strategy": "random"})
    out = serve_options("vllm serve deepseek-ai/DeepSeek-V3 -dp 16 -ep --all2all-backend deepep_low_latency "
                        "--expert-placement-strategy round_robin")
    assert out.options["expert_placement_strategy"] == "round_robin" and not out.unmodelled


def test_eplb_redundant_experts_take_gpu_memory():
    """--enable-eplb with num_redundant_experts 32 on 16 ranks: two more experts a GPU in each of
    DeepSeek-V3's 58 expert layers (fp8, 3 x 7168 x 2048 bytes each), 5.1 GB a GPU less KV cache;
    the parameters stay the model's. vLLM's checks in its words; EPLB keeps linear placement."""
    from simkv.capacity import compute_capacity

    base = V3 | {"data_parallel_size": 16} | DEEPEP
    plain, eplb = (EngineConfig.from_flat(base | extra) for extra in
                   ({}, {"enable_eplb": True, "num_redundant_experts": 32}))
    expert = 3 * 7168 * 2048
    per_gpu = eplb.hardware.model_spec().weight_bytes_per_gpu(1, 16) - plain.hardware.model_spec().weight_bytes_per_gpu(1, 16)
    assert per_gpu == pytest.approx(32 / 16 * 58 * expert)
    assert eplb.hardware.model_spec().num_params == plain.hardware.model_spec().num_params
    lost = compute_capacity(plain).available_kv_bytes - compute_capacity(eplb).available_kv_bytes
    assert lost == pytest.approx(per_gpu, rel=1e-6)
    for bad, message in ((base | {"num_redundant_experts": 32}, "but EPLB is not enabled"),
                         (V3 | {"data_parallel_size": 16, "enable_eplb": True}, "enable_expert_parallel must be True"),
                         ({"model": "llama-3-8b", "tensor_parallel_size": 2, "enable_expert_parallel": True,
                           "enable_eplb": True}, "has no routed experts")):
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_flat(bad)
    assert not EngineConfig.from_flat(base | {"enable_eplb": True, "expert_placement_strategy": "round_robin"}
                                      ).hardware.round_robin_experts
    out = serve_options("vllm serve deepseek-ai/DeepSeek-V3 -dp 16 -ep --all2all-backend deepep_low_latency "
                        "--enable-eplb --eplb-config '{\"num_redundant_experts\": 32, \"window_size\": 500}'")
    assert out.options["enable_eplb"] and out.options["num_redundant_experts"] == 32
    assert out.unmodelled == ["--eplb-config window_size"]
    from click.testing import CliRunner

    from simkv.cli.main import main

    def weights(*flags):
        res = CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3", "--gpu", "H200", "-dp", "16", "-ep",
                                        *flags, "--json"])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["weight_bytes_per_gpu"]

    assert weights("--enable-eplb", "--num-redundant-experts", "32") - weights() == pytest.approx(per_gpu)


def test_which_exchange_runs():
    """All-to-all needs expert parallelism, an all-to-all backend and lockstep ranks (vLLM's
    use_all2all_kernels); vLLM's removed naive and pplx backends gather; DBO puts vLLM on its V1
    model runner unless V2 is asked for."""
    assert EngineConfig.from_flat(V3 | {"data_parallel_size": 8} | DEEPEP).hardware.all_to_all
    assert not EngineConfig.from_flat(V3 | {"data_parallel_size": 8, "all2all_backend": "deepep_low_latency"}
                                      ).hardware.all_to_all
    assert not EngineConfig.from_flat(V3 | {"tensor_parallel_size": 8} | DEEPEP).hardware.all_to_all
    assert not EngineConfig.from_flat(V3 | {"data_parallel_size": 8, "enable_expert_parallel": True,
                                            "all2all_backend": "pplx"}).hardware.all_to_all
    dbo = V3 | {"data_parallel_size": 8, "enable_dbo": True} | DEEPEP
    assert EngineConfig.from_flat(dbo).model_runner_in_force == "v1"
    assert EngineConfig.from_flat(dbo | {"model_runner": "v2"}).model_runner_in_force == "v2"
    out = serve_options("vllm serve deepseek-ai/DeepSeek-V3 -dp 16 -ep --all2all-backend deepep_low_latency "
                        "--enable-dbo --dbo-decode-token-threshold 64")
    assert out.options == {"model": "deepseek-v3", "data_parallel_size": 16, "enable_expert_parallel": True,
                           "all2all_backend": "deepep_low_latency", "enable_dbo": True,
                           "dbo_decode_token_threshold": 64} and not out.unmodelled


def test_ubatch_size_is_the_number_of_microbatches_unless_dbo_is_on():
    """vLLM's num_ubatches: 2 under --enable-dbo whatever --ubatch-size says, else --ubatch-size;
    0 and 1 leave steps whole (no checks apply)."""
    base = V3 | {"data_parallel_size": 8} | DEEPEP
    assert EngineConfig.from_flat(base | {"ubatch_size": 4}).hardware.num_ubatches == 4
    assert EngineConfig.from_flat(base | {"ubatch_size": 4, "enable_dbo": True}).hardware.num_ubatches == 2
    for off in (0, 1):
        hw = EngineConfig.from_flat(V3 | {"tensor_parallel_size": 8, "ubatch_size": off}).hardware
        assert not hw.use_ubatching
    assert make_roofline(EngineConfig.from_flat(base | {"ubatch_size": 1})).ubatching is None
    out = serve_options("vllm serve deepseek-ai/DeepSeek-V3 -dp 8 -ep --all2all-backend deepep_low_latency "
                        "--ubatch-size 4")
    assert out.options["ubatch_size"] == 4 and not out.unmodelled
    assert EngineConfig.from_flat(base | {"ubatch_size": 4}).to_dict()["ubatch_size"] == 4
    assert "ubatch_size" not in EngineConfig.from_flat(base).to_dict()


def _decodes(n: int, context: int = 1000) -> tuple:
    return n, n, 0, n * context, n * context, 0  # (a latent-attention decode step's step_work)


def test_dual_batch_overlap_hides_the_exchange_when_every_rank_has_enough_tokens():
    """Two microbatches: each reads the weights (the memory term counts them twice) and one's
    exchange runs under the other's work, all but one expert layer's share at each end. Every
    rank needs the threshold's tokens (decode-only: 32; with a prefill: 512), a dummy rank has
    none."""
    options = V3 | {"data_parallel_size": 16, "gpus_per_node": 8} | DEEPEP
    plain = make_roofline(EngineConfig.from_flat(options))
    dbo = make_roofline(EngineConfig.from_flat(options | {"enable_dbo": True}))
    works = [_decodes(64)] * 16
    assert dbo._microbatched(works) and not dbo._microbatched([_decodes(64)] * 15 + [_decodes(31)])
    assert not dbo._microbatched(works + [(0, 0, 0, 0, 0, 0)])
    prefill = (600, 3, 300_000, 600, 0, 0)  # (a rank with a 598-token chunk and two decodes: 512 needed)
    assert dbo._microbatched([prefill] * 16) and not dbo._microbatched([(500, 3, 1, 500, 0, 0)] * 16)
    # a step of 2,048-token prefill chunks, whose exchange is long: DBO hides it; a decode step of
    # 64 a rank, which reads its experts' weights (41 GB a GPU) once: DBO reads them twice
    chunks = [(2048, 1, 2048 * 2049 // 2, 2048, 0, 0)] * 16
    assert dbo.dp_time(chunks) < 0.8 * plain.dp_time(chunks)
    assert dbo.dp_time(works) > 1.2 * plain.dp_time(works)
    assert dbo.dp_time(works, num_dummy=1) == pytest.approx(plain.dp_time(works, num_dummy=1))
    # with DBO a step lasts max(work, exchange) + a layer's share of the smaller, the work reading
    # the weights twice
    assert dbo.dp_time(works) == pytest.approx(_microbatched_seconds(plain, works, 2))


def _microbatched_seconds(plain, works: list[tuple], n: int) -> float:
    """A lockstep step of equal ranks (`works`) as n microbatches, from the roofline's terms:
    max(work with the weights read n times, exchange) + 1 / n of an expert layer's (58) smaller."""
    total = sum(w[0] for w in works)
    exchange = plain.dp_comm_per_token * total + plain.dp_comm_fixed
    tokens, seqs, _, kv_read, latent_pairs, _ = works[0]
    flops = (plain.flops_per_token_local * tokens + plain.flops_per_seq * seqs
             + plain.flops_per_latent_pair * latent_pairs + plain.expert_flops_per_group_token * total)
    traffic = (n * plain.weight_bytes + n * plain.expert_bytes_per_rank * plain.moe.experts_touched(total)
               + plain.kv_bytes_per_token * (kv_read + tokens))
    busy = max(flops / plain.flop_rate, traffic / plain.byte_rate)
    overhead = plain.comm_per_token * tokens + plain.fixed_s + plain.seq_overhead_s * seqs
    return max(busy, exchange) + min(busy, exchange) / (n * 58) + overhead


def test_more_microbatches_read_the_weights_more_often_and_expose_less_exchange():
    """--ubatch-size 4: every microbatch reads the weights (four reads of them), one microbatch's
    share of an expert layer's exchange or work stays exposed at each end."""
    options = V3 | {"data_parallel_size": 16, "gpus_per_node": 8} | DEEPEP
    plain = make_roofline(EngineConfig.from_flat(options))
    four = make_roofline(EngineConfig.from_flat(options | {"ubatch_size": 4}))
    two = make_roofline(EngineConfig.from_flat(options | {"enable_dbo": True}))
    works = [_decodes(64)] * 16
    assert four.dp_time(works) == pytest.approx(_microbatched_seconds(plain, works, 4))
    assert four.dp_time(works) > two.dp_time(works) > plain.dp_time(works)  # (decodes: weight reads dominate)
    # long prefill chunks, whose exchange outlasts the work: four microbatches hide more of it than two
    chunks = [(2048, 1, 2048 * 2049 // 2, 2048, 0, 0)] * 16
    assert four.dp_time(chunks) < two.dp_time(chunks) < plain.dp_time(chunks)


def test_deepep_across_two_nodes_serves_what_gathering_cannot():
    """DeepSeek-V3 as 16 data-parallel ranks on two nodes of H200s, the Azure slice at 10x: with
    the default allgather_reducescatter every expert layer gathers all 16 ranks' tokens over the
    network and the engine falls behind; DeepEP's all-to-all keeps up. Replays are deterministic."""
    trace = take_rows(read_trace(TRACES / "azure_conv_slice.parquet"), np.arange(400))
    from dataclasses import replace

    trace = replace(trace, arrival_time_s=trace.arrival_time_s / 10)
    base = V3 | {"data_parallel_size": 16}
    gathered = replay(trace, EngineConfig.from_flat(base)).summary
    runs = [replay(trace, EngineConfig.from_flat(base | DEEPEP)).summary for _ in range(2)]
    for s in runs:
        s.pop("wall_time_s")
    assert json.dumps(runs[0], sort_keys=True, default=str) == json.dumps(runs[1], sort_keys=True, default=str)
    assert runs[0]["num_finished"] == gathered["num_finished"] == 400
    assert runs[0]["ttft_s"]["mean"] < 0.2 * gathered["ttft_s"]["mean"]
    assert runs[0]["config"]["all2all_backend"] == "deepep_low_latency"


def test_a_dbo_replay_counts_its_microbatched_steps():
    """summary.json's cost model says how many lockstep steps ran as two microbatches."""
    from dataclasses import replace

    trace = take_rows(read_trace(TRACES / "azure_conv_slice.parquet"), np.arange(300))
    trace = replace(trace, arrival_time_s=trace.arrival_time_s / 10)
    options = V3 | {"data_parallel_size": 2, "tensor_parallel_size": 8, "enable_dbo": True} | DEEPEP
    dbo = replay(trace, EngineConfig.from_flat(options)).summary["cost_model"]["dual_batch_overlap"]
    assert 0 < dbo["microbatched_steps"] < dbo["lockstep_steps"]
    assert (dbo["decode_token_threshold"], dbo["prefill_token_threshold"]) == (32, 512)
    assert "dual_batch_overlap" not in replay(trace, EngineConfig.from_flat(
        V3 | {"data_parallel_size": 2, "tensor_parallel_size": 8} | DEEPEP)).summary["cost_model"]


def test_the_replay_table_names_the_exchange_and_the_split_steps(tmp_path):
    from click.testing import CliRunner

    from simkv.cli.main import main
    from simkv.traces.schema import write_trace

    path = tmp_path / "t.parquet"
    write_trace(take_rows(read_trace(TRACES / "azure_conv_slice.parquet"), np.arange(100)), path)
    res = CliRunner().invoke(main, ["replay", str(path), "--model", "deepseek-v3", "--gpu", "H200", "-dp", "2",
                                    "-tp", "8", "-ep", "--all2all-backend", "deepep_low_latency", "--enable-dbo",
                                    "--out", str(tmp_path / "out")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "all-to-all (deepep_low_latency, expert parallelism)" in res.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    dbo = summary["cost_model"]["dual_batch_overlap"]
    assert f"{dbo['microbatched_steps']:,} of {dbo['lockstep_steps']:,} lockstep steps" in res.output
    plain = CliRunner().invoke(main, ["replay", str(path), "--model", "deepseek-v3", "--gpu", "H200", "-dp", "2",
                                      "-tp", "8", "--out", str(tmp_path / "plain")], env={"COLUMNS": "200"})
    assert "expert exchange" not in plain.output and "dual batch overlap" not in plain.output
    four = CliRunner().invoke(main, ["replay", str(path), "--model", "deepseek-v3", "--gpu", "H200", "-dp", "2",
                                     "-tp", "8", "-ep", "--all2all-backend", "deepep_low_latency", "--ubatch-size",
                                     "4", "--out", str(tmp_path / "four")], env={"COLUMNS": "200"})
    assert four.exit_code == 0, four.output
    dbo = json.loads((tmp_path / "four" / "summary.json").read_text())["cost_model"]["dual_batch_overlap"]
    assert dbo["microbatches"] == 4
    assert f"{dbo['microbatched_steps']:,} of {dbo['lockstep_steps']:,} lockstep steps as 4 microbatches" in four.output
