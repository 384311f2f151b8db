"""`simkv capacity`: seed-003 figures, vLLM's start-up lines and its error text."""

import json
import re

import pytest
from click.testing import CliRunner

from simkv.cli.capacity_cmd import capacity_report
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig

GIB = 1 << 30


def run(*args: str):
    return CliRunner().invoke(main, ["capacity", *args])


def as_json(*args: str) -> dict:
    res = run(*args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_seed_003_llama_3_70b_bf16():
    """Seed 003: 2 x 80 layers x 8 KV heads x 128 x 2 B = 327,680 B per token; 2.5 GiB per 8,192 tokens."""
    rep = as_json("--model", "llama-3-70b", "--gpu", "H100-SXM", "-tp", "8", "--max-model-len", "8192")
    assert rep["kv_bytes_per_token"] == 327_680
    assert rep["kv_bytes_per_request"] == 8192 * 327_680 == int(2.5 * GIB)
    # Under TP=8 each GPU holds one KV head: an eighth of the bytes.
    assert rep["kv_bytes_per_token_per_gpu"] == 327_680 // 8
    assert rep["kv_bytes_per_request_per_gpu"] == int(2.5 * GIB) // 8
    assert rep["kv_cache_tokens"] == rep["num_gpu_blocks"] * 16
    assert rep["num_gpu_blocks"] == rep["available_kv_bytes_per_gpu"] // (16 * 40_960)


def test_fp8_halves_the_bytes():
    bf16 = as_json("--model", "llama-3-70b", "-tp", "8")
    fp8 = as_json("--model", "llama-3-70b", "-tp", "8", "--kv-cache-dtype", "fp8")
    assert fp8["kv_bytes_per_token"] == bf16["kv_bytes_per_token"] // 2 == 163_840
    assert fp8["num_gpu_blocks"] == pytest.approx(2 * bf16["num_gpu_blocks"], abs=1)


def test_table_shows_startup_lines_in_vllm_format():
    res = run("--model", "llama-3-8b", "--num-gpu-blocks", "1000", "--max-model-len", "4096")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "GPU KV cache size: 16,000 tokens" in lines
    assert "Maximum concurrency for 4,096 tokens per request: 3.91x" in lines
    assert "131,072 B" in res.output  # llama-3-8b: 2 x 32 x 8 x 128 x 2


def test_startup_line_format_from_memory():
    rep = as_json("--model", "llama-3-8b", "--gpu", "H200", "--block-size", "32")
    size, conc = rep["startup_lines"]
    assert re.fullmatch(r"GPU KV cache size: \d{1,3}(,\d{3})* tokens", size)
    assert re.fullmatch(r"Maximum concurrency for 8,192 tokens per request: \d+\.\d\dx", conc)
    assert size == f"GPU KV cache size: {rep['num_gpu_blocks'] * 32:,} tokens"
    assert conc.endswith(f"{rep['num_gpu_blocks'] * 32 / 8192:.2f}x")


def test_request_that_cannot_fit_gives_vllm_error_text():
    # 100 blocks of 16: 99 usable (block 0 is the null block) = 1,584 tokens < 8,192.
    res = run("--num-gpu-blocks", "100", "--max-model-len", "8192")
    assert res.exit_code == 1
    assert "Traceback" not in res.output
    assert res.output.count("\n") == 1
    assert res.output == (
        "Error: To serve at least one request with the model's max seq len (8192), (1.00 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (0.19 GiB). Based on the available "
        "memory, the estimated maximum model length is 1584. Try increasing `gpu_memory_utilization` or "
        "decreasing `max_model_len` when initializing the engine.\n")


def test_memory_derived_cannot_fit_estimates_max_len():
    config = EngineConfig.from_flat({"model": "llama-3-8b", "gpu_memory_utilization": 0.215, "max_model_len": 8192})
    with pytest.raises(ConfigError, match=r"estimated maximum model length is (\d+)\.") as err:
        capacity_report(config)
    estimated = int(re.search(r"length is (\d+)\.", str(err.value)).group(1))
    assert 0 < estimated < 8192 and estimated % 16 == 0
    # The estimate fits: the same setup at that max_model_len starts.
    ok = capacity_report(EngineConfig.from_flat(
        {"model": "llama-3-8b", "gpu_memory_utilization": 0.215, "max_model_len": estimated}))
    assert ok["num_gpu_blocks"] - 1 >= estimated // 16


@pytest.mark.parametrize("args, text", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--gpu", "TPU-v5e"], "unknown GPU 'TPU-v5e'"),
    (["--model", "llama-3-70b", "-tp", "3"], "divisible by tensor parallel size (3)"),
    (["--model", "llama-3-70b"], "No available memory for the cache blocks"),
    (["--block-size", "0"], "block_size must be >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], "GPU memory utilization must be within (0, 1]"),
])
def test_errors_are_one_clean_line(args, text):
    res = run(*args)
    assert res.exit_code == 1
    assert res.output.startswith("Error: ") and text in res.output
    assert res.output.count("\n") == 1 and "Traceback" not in res.output


def test_concurrency_of_shorter_requests():
    """--request-tokens: vLLM's concurrency line asked of shorter requests, in whole blocks (1,370
    tokens hold 86 blocks of 16, the last partly empty), in the JSON and the table."""
    rep = as_json("--request-tokens", "1370", "--request-tokens", "8192")
    short, full = rep["request_concurrency"]
    assert (short["tokens"], short["blocks_per_request"]) == (1370, 86) and full["blocks_per_request"] == 512
    assert short["max_concurrency"] == rep["num_gpu_blocks"] / 86
    assert full["max_concurrency"] == pytest.approx(rep["max_concurrency"])  # (max_model_len: vLLM's own line)
    table = run("--request-tokens", "1370").output
    assert f"{rep['num_gpu_blocks'] / 86:,.2f}x (86)" in table


@pytest.mark.parametrize("args, text", [
    (["--request-tokens", "8193"], "--request-tokens 8193 must be 1 to max_model_len (8,192)"),
    (["--request-tokens", "0"], "--request-tokens 0 must be 1 to max_model_len"),
    (["--request-tokens", "100", "--layouts", "2"], "--request-tokens is for one layout"),
])
def test_request_tokens_errors(args, text):
    res = run(*args)
    assert res.exit_code == 1 and text in res.output and "Traceback" not in res.output


def test_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: llama-3-70b\ntensor_parallel_size: 4\nmax_model_len: 4096\n")
    rep = as_json("--config", str(path), "--block-size", "32")
    assert (rep["tensor_parallel_size"], rep["block_size"], rep["max_model_len"]) == (4, 32, 4096)
    assert rep["kv_bytes_per_token_per_gpu"] == 327_680 // 4


def test_the_cpu_tier_in_chunks_and_tokens():
    """llama-3-70b on 4 GPUs: a 16-token block is 327,680 B x 16 = 5 MiB over the GPUs; 256-token
    chunks are 16 of them (80 MiB), so 256 GiB holds 3,276 chunks (838,656 tokens); each GPU moves
    its quarter of a chunk over its own 63 GB/s link."""
    rep = as_json("--model", "llama-3-70b", "-tp", "4", "--kv-offloading-size", "256",
                  "--kv-offloading-block-size", "256")
    off = rep["kv_offloading"]
    assert off["chunk_bytes"] == 16 * 327_680 * 16 == 80 * (1 << 20)
    assert off["num_chunks"] == 256 * GIB // off["chunk_bytes"] == 3276
    assert off["tokens"] == 3276 * 256
    assert off["tokens_per_gpu_cache_token"] == pytest.approx(off["tokens"] / rep["kv_cache_tokens"])
    assert off["chunk_transfer_s"] == pytest.approx(80 * (1 << 20) / 4 / 63e9)
    assert "kv_offloading" not in as_json("--model", "llama-3-70b", "-tp", "4")
    res = run("--kv-offloading-block-size", "24", "--kv-offloading-size", "1")
    assert res.exit_code != 0 and "multiple of block_size 16" in res.output
