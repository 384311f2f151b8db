"""vLLM's --mamba-cache-dtype and --mamba-ssm-cache-dtype: the dtypes of a linear-attention layer's
convolution and recurrent states (MambaStateDtypeCalculator), and what they do to its page."""

import json

import pytest

from simkv.capacity import compute_capacity
from simkv.config import ConfigError, EngineConfig
from simkv.specs import get_model_spec
from tests.replay.test_linear_attention import NEMOTRON_H_8B

# vLLM 0.33's Qwen3-Next state at TP 2, bytes: MambaStateShapeCalculator.gated_delta_net_state_shape
# (2, 16, 32, 128, 128, 4) = ((3, 4096), (16, 128, 128)) in gated_delta_net_state_dtype's dtypes
VLLM_QWEN3_NEXT_TP2 = {("auto", "auto"): 548864, ("auto", "float32"): 1073152, ("float32", "auto"): 1097728}


@pytest.mark.parametrize("conv, ssm", sorted(VLLM_QWEN3_NEXT_TP2))
def test_the_state_is_vllms(conv, ssm):
    config = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2,
                                     "mamba_cache_dtype": conv, "mamba_ssm_cache_dtype": ssm})
    assert config.linear_state_bytes == VLLM_QWEN3_NEXT_TP2[conv, ssm]


def test_a_larger_state_grows_the_attention_block_and_shrinks_the_pool():
    """Every group's page holds one layer's state: a float32 recurrent state nearly doubles it, so
    the attention block grows from 576 to 1,088 tokens and fewer tokens fit."""
    base = {"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2}
    plain, fp32 = (EngineConfig.from_flat(base | extra) for extra in ({}, {"mamba_ssm_cache_dtype": "float32"}))
    assert (plain.cache.block_size, fp32.cache.block_size) == (576, 1088)
    assert compute_capacity(fp32).kv_cache_tokens < compute_capacity(plain).kv_cache_tokens


def test_a_checkpoint_that_pins_its_recurrent_state_keeps_it(tmp_path):
    """Nemotron-H's config keeps its recurrent state in float32: --mamba-cache-dtype changes only
    its convolution state then, --mamba-ssm-cache-dtype the recurrent one."""
    path = tmp_path / "nemotron_h_8b.json"
    path.write_text(json.dumps(NEMOTRON_H_8B))
    spec = get_model_spec(str(path))
    conv = (128 * 64 + 2 * 8 * 128) * 3
    recurrent = 128 * 64 * 128
    assert spec.linear_state_bytes(1) == conv * 2 + recurrent * 4
    assert spec.with_mamba_cache_dtypes("float32", "auto").linear_state_bytes(1) == conv * 4 + recurrent * 4
    assert spec.with_mamba_cache_dtypes("auto", "bfloat16").linear_state_bytes(1) == conv * 2 + recurrent * 2


@pytest.mark.parametrize("options, text", [
    ({"model": "llama-3-8b", "mamba_cache_dtype": "float32"}, "has no linear-attention"),
    ({"model": "qwen3-next-80b-a3b", "gpu": "H200", "tensor_parallel_size": 2, "mamba_ssm_cache_dtype": "fp8"},
     "must be one of"),
])
def test_bad_values_are_refused(options, text):
    with pytest.raises(ConfigError, match=text):
        EngineConfig.from_flat(options)
