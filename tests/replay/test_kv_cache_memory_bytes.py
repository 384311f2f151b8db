"""vLLM's --kv-cache-memory-bytes: the KV cache's bytes per GPU, given instead of derived from
gpu_memory_utilization."""

import json

import pytest
from click.testing import CliRunner

from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig

GIB = 1 << 30


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat(dict(model="llama-3-70b", gpu="H100-SXM", tensor_parallel_size=2) | options)


def test_the_blocks_are_the_bytes_given_and_the_utilization_is_ignored():
    """12 GiB per GPU of 2,621,440-byte blocks (llama-3-70b, TP 2, 16 tokens): 4,915 blocks
    whatever gpu_memory_utilization says; the default 0.92 leaves room for 2,438."""
    caps = [compute_capacity(_config(kv_cache_memory_bytes=12 * GIB, gpu_memory_utilization=u)) for u in (0.5, 0.92)]
    assert {c.num_gpu_blocks for c in caps} == {4915}
    assert caps[0].block_bytes == 2_621_440 and caps[0].available_kv_bytes == 12 * GIB
    assert compute_capacity(_config()).num_gpu_blocks == 2438


def test_more_than_the_gpu_holds_beside_the_weights_is_refused():
    """The weights (65 GiB per GPU) and the activation reserve leave 13,265,264,640 bytes of the
    H100's 80 GiB: that much is taken, a byte more is refused with the numbers."""
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes 13,265,264,641 .* exceeds the H100-SXM's 80.00 GiB"
                                          r".*at most 13,265,264,640 bytes fit"):
        compute_capacity(_config(kv_cache_memory_bytes=13_265_264_641))
    assert compute_capacity(_config(kv_cache_memory_bytes=13_265_264_640)).num_gpu_blocks == 13_265_264_640 // 2_621_440


def test_pipeline_stages_each_hold_the_bytes_given():
    """TP 2 x PP 2: each stage's GPUs hold half the layers, so 30 GiB holds blocks of half the bytes."""
    cap = compute_capacity(_config(pipeline_parallel_size=2, kv_cache_memory_bytes=30 * GIB))
    assert cap.block_bytes == 1_310_720 and cap.num_gpu_blocks == 30 * GIB // 1_310_720


def test_num_gpu_blocks_wins_and_bad_values_are_refused():
    assert compute_capacity(_config(kv_cache_memory_bytes=12 * GIB, num_gpu_blocks=1000)).num_gpu_blocks == 1000
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be > 0"):
        _config(kv_cache_memory_bytes=0)


def test_summary_configs_carry_it_only_when_given():
    assert "kv_cache_memory_bytes" not in _config().to_dict()
    assert _config(kv_cache_memory_bytes=12 * GIB).to_dict()["kv_cache_memory_bytes"] == 12 * GIB


@pytest.mark.parametrize("text, value", [("12884901888", 12 * GIB), ("12G", 12 * GIB), ("12.5g", 12_500_000_000),
                                         ("8000M", 8000 * 2**20)])
def test_cli_takes_vllms_human_readable_bytes(text, value):
    result = CliRunner().invoke(main, ["capacity", "--model", "llama-3-70b", "--gpu", "H100-SXM", "-tp", "2",
                                       "--kv-cache-memory-bytes", text, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["kv_cache_memory_bytes"] == value


@pytest.mark.parametrize("text", ["1.5G", "12x", "G"])
def test_cli_refuses_what_is_not_a_byte_count(text):
    result = CliRunner().invoke(main, ["capacity", "--model", "llama-3-70b", "--gpu", "H100-SXM", "-tp", "2",
                                       "--kv-cache-memory-bytes", text])
    assert result.exit_code != 0 and "is not a number of bytes" in result.output


def test_cli_takes_vllms_other_spellings():
    """vLLM's --kv-cache-memory (its start-up suggestion's spelling), --num-gpu-blocks-override and
    --device-memory-utilization name the same options."""
    def blocks(*args):
        result = CliRunner().invoke(main, ["capacity", "--model", "llama-3-8b", "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["num_gpu_blocks"]

    assert blocks("--kv-cache-memory", "10G") == blocks("--kv-cache-memory-bytes", "10G") == 10 * GIB // 2_097_152
    assert blocks("--num-gpu-blocks-override", "5000") == 5000
    assert blocks("--device-memory-utilization", "0.5") == blocks("--gpu-memory-utilization", "0.5")
