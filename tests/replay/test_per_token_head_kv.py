"""vLLM's per-token-head KV quantization (--kv-cache-dtype int8_per_token_head, fp8_per_token_head,
int4_per_token_head; its Triton attention backend): each KV head's K and V of a token quantized
apiece with a float32 scale inline. What it does to a page, the pool and a step's KV reads."""

import pytest

from simkv.backends.factory import make_backend
from simkv.capacity import compute_capacity
from simkv.config import ConfigError, EngineConfig, linear_attention_block_size
from simkv.specs import kv_head_token_bytes
from tests.core.helpers import make_step

# vLLM 0.33's page bytes, TritonAttentionBackend.customize_spec(FullAttentionSpec(block_size=16,
# num_kv_heads=8, head_size=hd, kv_quant_mode=...)).page_size_bytes, read off the real classes
VLLM_PAGES = {
    ("auto", 64): 32768, ("auto", 80): 40960, ("auto", 128): 65536, ("auto", 256): 131072,
    ("int8_per_token_head", 64): 17408, ("int8_per_token_head", 80): 21504,
    ("int8_per_token_head", 128): 33792, ("int8_per_token_head", 256): 66560,
    ("fp8_per_token_head", 128): 33792,
    ("int4_per_token_head", 64): 9216, ("int4_per_token_head", 80): 11264,
    ("int4_per_token_head", 128): 17408, ("int4_per_token_head", 256): 33792,
}


@pytest.mark.parametrize("dtype, head_dim", sorted(VLLM_PAGES))
def test_a_page_is_vllms(dtype, head_dim):
    element = 2 if dtype == "auto" else dtype
    assert 16 * 8 * kv_head_token_bytes(element, head_dim) == VLLM_PAGES[dtype, head_dim]


def _config(dtype: str, **options) -> EngineConfig:
    return EngineConfig.from_flat({"model": "llama-3-8b", "kv_cache_dtype": dtype} | options)


def test_the_pool_holds_what_the_packed_pages_allow():
    """llama-3-8b on one H100: 131,072 KV bytes a token in bf16, 67,584 with int8 and its scales
    (1.94x the tokens), 34,816 with int4 (3.76x); the pool's bytes are the same."""
    caps = {d: compute_capacity(_config(d)) for d in ("auto", "int8_per_token_head", "int4_per_token_head")}
    assert [caps[d].kv_bytes_per_token for d in caps] == [131072, 67584, 34816]
    for d, cap in caps.items():
        assert cap.num_gpu_blocks == cap.available_kv_bytes // cap.block_bytes
    assert caps["int4_per_token_head"].num_gpu_blocks > 3.7 * caps["auto"].num_gpu_blocks


def test_a_decode_reads_the_packed_bytes():
    bf16, int4 = make_backend("roofline", _config("auto")), make_backend("roofline", _config("int4_per_token_head"))
    assert int4.kv_bytes_per_token == 34816 and bf16.kv_bytes_per_token == 131072
    step = make_step(decodes=64, context=64 * 8000)  # (memory-bound: the KV reads dominate)
    assert int4.execute(step) < 0.5 * bf16.execute(step)


def test_a_hybrid_models_attention_block_grows_from_the_packed_page():
    """Qwen3-Next: the attention block grows until one layer's page holds a Gated DeltaNet state;
    a smaller page per token makes the block longer (vLLM's _align_hybrid_block_size takes the
    backend's packed page)."""
    config = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2,
                                     "kv_cache_dtype": "int4_per_token_head"})
    spec = config.hardware.model_spec()
    packed = linear_attention_block_size(spec, 2, "int4_per_token_head", 16)
    plain = linear_attention_block_size(spec, 2, 2, 16)
    assert packed > plain and packed % 16 == 0
    page = packed * spec.kv_bytes_per_layer_token("int4_per_token_head", 2)
    assert page >= spec.linear_state_bytes(2, 0) > (packed - 16) * spec.kv_bytes_per_layer_token("int4_per_token_head", 2)


def test_latent_attention_is_refused():
    with pytest.raises(ConfigError, match="no latent attention"):
        EngineConfig.from_flat({"model": "deepseek-v3", "gpu": "H200", "tensor_parallel_size": 8,
                                "kv_cache_dtype": "int8_per_token_head"})


@pytest.mark.parametrize("dtype", ["fp8", "int8_per_token_head"])
def test_the_gpu_backend_refuses_a_quantized_cache(tmp_path, dtype):
    """Its kernels keep K and V in the model's dtype: a pool sized for one byte would not fit."""
    from tests.cli_runs import cli_fails

    out = cli_fails(["replay", "tests/gpu_backend/data/ci80.parquet", "--backend", "gpu", "--device", "cpu",
                     "--model", "tiny-llama", "--kv-cache-dtype", dtype, "--out", str(tmp_path / "o")])
    assert f"--kv-cache-dtype {dtype} is simulated only" in out
