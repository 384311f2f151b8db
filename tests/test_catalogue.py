"""`simkv catalogue`: the models and GPUs simkv knows, and what it reads from your own files."""

import json

from click.testing import CliRunner

from simkv.cli.main import main
from simkv.specs import get_gpu_spec, get_model_spec, gpu_names, model_names

QWEN3_NEXT_CONFIG = "tests/core/data/qwen3_next_80b_a3b_config.json"


def _json(*args):
    res = CliRunner().invoke(main, ["catalogue", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_it_lists_every_model_and_gpu_with_the_numbers_simkv_uses():
    out = _json()
    assert [m["model"] for m in out["models"]] == model_names()
    assert [g["gpu"] for g in out["gpus"]] == gpu_names()
    rows = {m["model"]: m for m in out["models"]}
    v3 = get_model_spec("deepseek-v3")
    assert rows["deepseek-v3"]["params"] == v3.num_params and rows["deepseek-v3"]["active_params"] == v3.num_active_params
    assert rows["deepseek-v3"]["attention"] == "MLA" and rows["deepseek-v3"]["experts"] == "8 of 256"
    assert rows["deepseek-v3.2"]["attention"] == "MLA, sparse top 2,048"
    assert rows["gemma-3-12b"]["attention"] == "16/8 heads x 256, window 1,024 (1 full in 6)"
    assert rows["qwen3-next-80b-a3b"]["attention"] == "16/2 heads x 256, gated_deltanet (1 full in 4)"
    assert rows["llama-3-8b"]["kv_bytes_per_token_bf16"] == 131072 and "experts" not in rows["llama-3-8b"]
    gpus = {g["gpu"]: g for g in out["gpus"]}
    assert gpus["MI300X"]["platform"] == "rocm" and gpus["H200"]["memory_gib"] == get_gpu_spec("H200").memory_gib
    table = CliRunner().invoke(main, ["catalogue"], env={"COLUMNS": "160"})
    assert table.exit_code == 0 and "Models (simkv/specs/models.yaml" in table.output and "qwen3-8b" in table.output


def test_it_shows_what_simkv_reads_from_your_files(tmp_path):
    gpu = tmp_path / "a10.yaml"
    gpu.write_text("memory_gib: 22.5\nmem_bandwidth_gbs: 600\nbf16_tflops: 125\ninterconnect_gbs: 32\n"
                   "compute_capability: 8.6\n")
    out = _json("--model", QWEN3_NEXT_CONFIG, "--gpu", str(gpu))
    fields = out["model"]["fields"]
    assert fields["partial_rotary_factor"] == 0.25 and fields["linear_attention"] == "gated_deltanet"
    assert fields["head_dim"] == 256 and "sliding_window" not in fields  # (only what differs from the defaults)
    assert out["gpu"] == {"gpu": str(gpu), "memory_gib": 22.5, "mem_bandwidth_gbs": 600.0, "bf16_tflops": 125.0,
                          "interconnect_gbs": 32.0, "compute_capability": 8.6, "fp8_tflops": 0.0, "fp4_tflops": 0.0,
                          "platform": "cuda"}
    shown = CliRunner().invoke(main, ["catalogue", "--model", "llama-3-8b"], env={"COLUMNS": "120"})
    assert shown.exit_code == 0 and "model: llama-3-8b" in shown.output and "131,072" in shown.output
    bad = CliRunner().invoke(main, ["catalogue", "--gpu", str(tmp_path / "none.yaml")])
    assert bad.exit_code == 2 and "no such file" in bad.output
