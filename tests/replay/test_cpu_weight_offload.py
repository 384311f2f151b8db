"""vLLM's --cpu-offload-gb (UVA weight offloading): the offloaded weights leave GPU memory to the KV
cache, and every forward pass reads them over the host link (the roofline's weight traffic)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from simkv.backends.factory import make_backend, weight_offload_shares
from simkv.capacity import GIB, compute_capacity, offloadable_expert_bytes, resident_weight_bytes
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from tests.core.helpers import make_step

ROOT = Path(__file__).resolve().parents[2]


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": "llama-3-70b", "quantization": "fp8", "max_model_len": 8192} | options)


def test_offloaded_weights_leave_their_memory_to_the_kv_cache():
    """20 GiB offloaded per GPU: 20 GiB more KV cache, in whole blocks; the weights left on the
    GPU are that much less. An offload past the weights takes them all, and no more."""
    base, off = compute_capacity(_config()), compute_capacity(_config(cpu_offload_gb=20))
    assert off.available_kv_bytes - base.available_kv_bytes == pytest.approx(20 * GIB, abs=1)
    assert off.num_gpu_blocks == off.available_kv_bytes // off.block_bytes > 6 * base.num_gpu_blocks
    assert resident_weight_bytes(_config()) - resident_weight_bytes(_config(cpu_offload_gb=20)) == 20 * GIB
    assert resident_weight_bytes(_config(cpu_offload_gb=1000)) == 0
    with pytest.raises(ConfigError, match="cpu_offload_gb must be >= 0"):
        _config(cpu_offload_gb=-1)


def test_a_forward_reads_the_offloaded_share_over_the_host_link():
    """A memory-bound decode step: the offloaded bytes cost their time over the host link (63 GB/s
    by default, or the link given) in place of their time from GPU memory; a prefill-sized step
    pays the same read once."""
    plain = make_backend("roofline", _config())
    step = make_step(decodes=8, context=8 * 1000)
    for link in (63.0, 450.0):
        config = _config(cpu_offload_gb=20, pcie_bandwidth_gbs=link)
        share, expert_share = weight_offload_shares(config)
        assert expert_share == share
        off = make_backend("roofline", config)
        offloaded = share * plain.weight_bytes
        expected = offloaded / (link * 1e9) - offloaded / plain.byte_rate
        assert off.execute(step) - plain.execute(step) == pytest.approx(expected, rel=1e-9)
    assert share == pytest.approx(20 * GIB / _config().hardware.model_spec().weight_bytes_per_gpu(1, 1))
    assert weight_offload_shares(_config()) == (0.0, 0.0)


def test_moe_experts_read_are_offloaded_in_the_same_share():
    """A mixture of experts: the share applies to the experts a step touches too."""
    plain = make_backend("roofline", EngineConfig.from_flat({"model": "qwen3-30b-a3b"}))
    off = make_backend("roofline", EngineConfig.from_flat({"model": "qwen3-30b-a3b", "cpu_offload_gb": 10}))
    factor = off.weight_offload["weight_read_factor"]
    assert off.expert_bytes == pytest.approx(plain.expert_bytes * factor)
    assert off.weight_bytes == pytest.approx(plain.weight_bytes * factor)


def test_replay_and_capacity_with_offloaded_weights(tmp_path):
    """llama-3-70b in fp8 on one H100: 20 GiB offloaded hold 6.6x the KV cache, and every decode
    step reads 20 GiB over the host link (ITL p50 above 300 ms); `simkv capacity` says both."""
    trace = tmp_path / "t.parquet"
    res = CliRunner().invoke(main, ["trace", "transform", str(ROOT / "traces" / "azure_conv_slice.parquet"), "--head", "60",
                                    "--out", str(trace)])
    assert res.exit_code == 0, res.output
    args = ["--model", "llama-3-70b", "--quantization", "fp8"]
    runs = {}
    for extra in ([], ["--cpu-offload-gb", "20"]):
        out = tmp_path / f"r{len(extra)}"
        res = CliRunner().invoke(main, ["replay", str(trace), *args, *extra, "--out", str(out), "--quiet"])
        assert res.exit_code == 0, res.output
        runs[bool(extra)] = json.loads((out / "summary.json").read_text())
    assert runs[True]["num_gpu_blocks"] > 6 * runs[False]["num_gpu_blocks"]
    assert runs[True]["itl_s"]["p50"] > 0.3 > runs[False]["itl_s"]["p50"] * 5
    assert runs[True]["config"]["cpu_offload_gb"] == 20 and "cpu_offload_gb" not in runs[False]["config"]
    offload = runs[True]["cost_model"]["weight_offload"]
    assert offload["pcie_gbs"] == 63.0 and 0.25 < offload["share"] < 0.35 and "weight_offload" not in runs[False]["cost_model"]
    cap = json.loads(CliRunner().invoke(main, ["capacity", *args, "--cpu-offload-gb", "20", "--json"]).output)
    assert cap["cpu_offload"]["offloaded_weight_bytes_per_gpu"] == 20 * GIB


@pytest.mark.parametrize("extra, text", [
    (["--backend", "gpu", "--device", "cpu", "--model", "tiny-llama"], "--cpu-offload-gb and --offload-group-size are simulated only"),
])
def test_refused_where_not_modelled(tmp_path, extra, text):
    res = CliRunner().invoke(main, ["replay", str(ROOT / "traces" / "req400.parquet"), "--cpu-offload-gb", "1", *extra,
                                    "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and text in res.output


def test_a_calibration_is_refused_with_offloaded_weights(tmp_path):
    calib = tmp_path / "calib.json"
    calib.write_text("{}")
    with pytest.raises(ValueError, match="weight offloading's host-link traffic .--cpu-offload-gb, --offload-group-size. is the roofline's"):
        make_backend(str(calib), _config(cpu_offload_gb=1))


def _moe(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": "deepseek-v3", "gpu": "H100-SXM", "tensor_parallel_size": 8} | options)


def test_only_the_named_expert_parameters_go_to_host_memory():
    """--cpu-offload-params: the routed experts (each GPU's TP share) are all that may leave, up to
    --cpu-offload-gb; w2_weight names one of a gated expert's three projections."""
    spec = _moe().hardware.model_spec()
    experts = spec.routed_expert_bytes / 8
    assert offloadable_expert_bytes(_moe(cpu_offload_gb=30, cpu_offload_params="experts")) == experts
    assert offloadable_expert_bytes(_moe(cpu_offload_gb=30, cpu_offload_params="w2_weight")) == pytest.approx(experts / 3)
    assert offloadable_expert_bytes(_moe(cpu_offload_gb=30, cpu_offload_params="w13_weight,w2_weight")) == \
        pytest.approx(experts)
    weights = spec.weight_bytes_per_gpu(8, 1)
    # 30 GiB fit in the experts; their down projections alone hold less (about 25 GiB), and that is all that leaves
    assert resident_weight_bytes(_moe(cpu_offload_gb=30, cpu_offload_params="experts")) == pytest.approx(weights - 30 * GIB)
    assert resident_weight_bytes(_moe(cpu_offload_gb=30, cpu_offload_params="w2_weight")) == pytest.approx(weights - experts / 3)
    assert experts / 3 < 30 * GIB
    # under data-parallel ranks the experts spread over every rank's GPUs
    dp = EngineConfig.from_flat({"model": "deepseek-v3", "gpu": "H200", "data_parallel_size": 8, "cpu_offload_gb": 30,
                                 "cpu_offload_params": "experts"})
    assert offloadable_expert_bytes(dp) == pytest.approx(spec.routed_expert_bytes / 8)
    # pipeline stages: each stage's GPUs offload from their own layers' experts
    pp = compute_capacity(_moe(pipeline_parallel_size=2, tensor_parallel_size=4, gpu="H200", cpu_offload_gb=80,
                               cpu_offload_params="w2_weight"))
    plain = compute_capacity(_moe(pipeline_parallel_size=2, tensor_parallel_size=4, gpu="H200"))
    layers = pp.pipeline_layers[pp.pipeline_binding_stage]
    freed = spec.routed_expert_bytes / 4 / 3 * layers / spec.num_layers
    assert plain.pipeline_stage_weight_bytes - pp.pipeline_stage_weight_bytes == pytest.approx(freed, rel=1e-6)


def test_a_step_reads_the_experts_it_routes_to_over_the_link():
    """Offloaded experts: a step's touched experts cost the link's time for the offloaded share;
    the weights outside the experts are read from GPU memory as before."""
    plain = make_backend("roofline", _moe(cpu_offload_gb=1000))  # (a uniform offload of everything, for the rates)
    base = make_backend("roofline", EngineConfig.from_flat({"model": "deepseek-v3", "gpu": "H200", "tensor_parallel_size": 8}))
    config = _moe(cpu_offload_gb=30, cpu_offload_params="experts")
    share = weight_offload_shares(config)
    off = make_backend("roofline", config)
    assert share[0] == 0.0 and share[1] == pytest.approx(30 * GIB / (off.model.routed_expert_bytes / 8))
    assert off.weight_offload["expert_share"] == share[1] and off.weight_offload["share"] == 0.0
    h100 = make_backend("roofline", _moe(num_gpu_blocks=1000))  # (the same GPU, nothing offloaded)
    assert off.weight_bytes == h100.weight_bytes
    ratio = off.byte_rate / (63.0 * 1e9)
    assert off.expert_bytes == pytest.approx(h100.expert_bytes * (1 - share[1] + share[1] * ratio))
    # fewer decodes touch fewer experts, so they read fewer offloaded bytes
    small, large = make_step(decodes=2, context=2000), make_step(decodes=64, context=64_000)
    extra = [off.execute(s) - h100.execute(s) for s in (small, large)]
    assert 0 < extra[0] < extra[1]
    assert plain.weight_offload["share"] == 1.0 and base.weight_offload is None


@pytest.mark.parametrize("options, text", [
    ({"model": "llama-3-70b", "cpu_offload_gb": 10, "cpu_offload_params": "experts"}, "has no routed experts"),
    ({"model": "deepseek-v3", "cpu_offload_params": "experts"}, "give cpu_offload_gb too"),
    ({"model": "deepseek-v3", "cpu_offload_gb": 10, "cpu_offload_params": "experts,mlp"}, "'mlp' is not a parameter"),
])
def test_offload_params_are_checked(options, text):
    with pytest.raises(ConfigError, match=text):
        EngineConfig.from_flat({"gpu": "H200", "tensor_parallel_size": 8} | options)


def test_the_config_names_them_only_when_given():
    assert "cpu_offload_params" not in _moe(cpu_offload_gb=30).to_dict()
    assert _moe(cpu_offload_gb=30, cpu_offload_params="experts").to_dict()["cpu_offload_params"] == "experts"
