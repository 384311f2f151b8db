"""`--gpu FILE.yaml|FILE.json`: a GPU the catalogue lacks, from its datasheet's fields
(simkv/specs/gpu_file.py)."""

import json

import pytest
from click.testing import CliRunner

from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.replay.api import replay
from simkv.specs import get_gpu_spec
from simkv.studies.serving_cost import PriceError, parse_prices
from simkv.traces.schema import read_trace

L4 = {"memory_gib": 22.5, "mem_bandwidth_gbs": 300, "bf16_tflops": 121, "fp8_tflops": 242, "interconnect_gbs": 32,
      "compute_capability": 8.9}
A10 = "memory_gib: 22.5\nmem_bandwidth_gbs: 600\nbf16_tflops: 125\ninterconnect_gbs: 32\ncompute_capability: 8.6\n"


def _summary_without_gpu(config) -> dict:
    trace = read_trace("traces/req400.parquet")
    summary = replay(trace, config).summary
    out = {k: v for k, v in summary.items() if k not in ("gpu", "config", "wall_time_s", "replay_wall_time_s")}
    out["cost_model"] = {k: v for k, v in out["cost_model"].items() if k not in ("gpu", "gpu_spec")}
    return out


def test_a_file_with_a_catalogue_gpus_fields_replays_as_that_gpu(tmp_path):
    path = tmp_path / "l4.json"
    path.write_text(json.dumps(L4))
    assert get_gpu_spec(str(path)) == get_gpu_spec("L4").__class__(name=str(path), **L4, platform="cuda")
    mine = EngineConfig.from_flat({"model": "llama-3.2-1b", "gpu": str(path)})
    theirs = EngineConfig.from_flat({"model": "llama-3.2-1b", "gpu": "L4"})
    assert compute_capacity(mine).num_gpu_blocks == compute_capacity(theirs).num_gpu_blocks
    assert _summary_without_gpu(mine) == _summary_without_gpu(theirs)


def test_fp8_and_platform_default_and_rocm_is_read(tmp_path):
    path = tmp_path / "a10.yaml"
    path.write_text(A10)
    gpu = get_gpu_spec(str(path))
    assert (gpu.fp8_tflops, gpu.platform, gpu.cuda_major) == (0.0, "cuda", 8)
    rocm = tmp_path / "mi.yml"
    rocm.write_text(A10.replace("8.6", "9.4") + "platform: rocm\n")
    assert get_gpu_spec(str(rocm)).platform == "rocm"
    # a ROCm GPU takes vLLM's ROCm-only formats
    config = EngineConfig.from_flat({"model": "llama-3.2-1b", "gpu": str(rocm), "kv_cache_dtype": "ultraquant_4bit"})
    assert config.kv_skip_layers == 4


@pytest.mark.parametrize("text, message", [
    ("memory_gib: 22.5\n", "field 'mem_bandwidth_gbs' is missing"),
    (A10 + "nvlink: 3\n", "unknown field\\(s\\) nvlink"),
    (A10.replace("600", "-1"), "field 'mem_bandwidth_gbs' must be > 0, got -1"),
    (A10.replace("125", "'fast'"), "field 'bf16_tflops' must be a number, got 'fast'"),
    (A10 + "fp8_tflops: -2\n", "field 'fp8_tflops' must be >= 0"),
    (A10 + "platform: tpu\n", "field 'platform' must be one of cuda, rocm, got 'tpu'"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("memory_gib: [\n", "not readable YAML or JSON"),
])
def test_a_bad_file_is_refused_naming_it_and_the_field(tmp_path, text, message):
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"GPU file {path}: {message}"):
        EngineConfig.from_flat({"gpu": str(path)})
    res = CliRunner().invoke(main, ["replay", "--gpu", str(path)])
    assert res.exit_code == 2 and "Invalid value for '--gpu'" in res.output and message.split("\\")[0] in res.output
    res = CliRunner().invoke(main, ["capacity", "--gpu", str(path)])  # (capacity's errors: one clean line)
    assert res.exit_code == 1 and res.output.startswith("Error: GPU file") and res.output.count("\n") == 1


def test_the_cli_takes_a_file_where_it_takes_a_gpu(tmp_path):
    path = tmp_path / "a10.yaml"
    path.write_text(A10)
    res = CliRunner().invoke(main, ["capacity", "--gpu", str(path), "--model", "llama-3.2-1b", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["gpu"] == str(path)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--gpu", str(path), "--model", "llama-3.2-1b",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["gpu"] == str(path)
    # the numbers the replay used, as read (the file may change later)
    assert summary["cost_model"]["gpu_spec"] == {"memory_gib": 22.5, "mem_bandwidth_gbs": 600.0, "bf16_tflops": 125.0,
                                                 "interconnect_gbs": 32.0, "compute_capability": 8.6,
                                                 "fp8_tflops": 0.0, "fp4_tflops": 0.0, "platform": "cuda"}
    res = CliRunner().invoke(main, ["replay", "--gpu", "A10"])
    assert res.exit_code == 2 and "nor a GPU file" in res.output
    missing = CliRunner().invoke(main, ["replay", "--gpu", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 2 and "no such file" in missing.output
    # a price for it
    assert parse_prices([f"{path}=0.75"]) == {str(path): 0.75}
    with pytest.raises(PriceError, match="no such file"):
        parse_prices([f"{tmp_path / 'none.yaml'}=1"])
