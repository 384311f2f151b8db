"""vLLM's --cpu-offload-gb (UVA weight offloading): the offloaded weights leave GPU memory to the KV
cache, and every forward pass reads them over the host link (the roofline's weight traffic)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from simkv.backends.factory import make_backend, weight_offload_share
from simkv.capacity import GIB, compute_capacity, resident_weight_bytes
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
        share = weight_offload_share(config)
        off = make_backend("roofline", config)
        offloaded = share * plain.weight_bytes
        expected = offloaded / (link * 1e9) - offloaded / plain.byte_rate
        assert off.execute(step) - plain.execute(step) == pytest.approx(expected, rel=1e-9)
    assert share == pytest.approx(20 * GIB / _config().hardware.model_spec().weight_bytes_per_gpu(1, 1))
    assert weight_offload_share(_config()) == 0.0


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
