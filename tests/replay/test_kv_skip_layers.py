"""vLLM's --kv-cache-dtype-skip-layers: layers whose K and V stay bf16 under an fp8 KV cache
(simkv.config.skip_layers_block_size, EngineConfig.kv_spec, ModelSpec.kv_skip_layers), and
the packed KV formats: TurboQuant's presets and ROCm's UltraQuant, which skip their boundary
layers (simkv.specs.turboquant_slot_bytes, ultraquant_slot_bytes), NVFP4, and ROCm's Octave
(octave_slot_bytes)."""

import json

import pytest

from simkv.backends.factory import make_roofline
from simkv.capacity import compute_capacity
from simkv.cli.vllm_serve import serve_options
from simkv.config import ConfigError, EngineConfig, skip_layers_block_size, turboquant_boundary_layers
from simkv.specs import get_model_spec, octave_slot_bytes, turboquant_slot_bytes, ultraquant_slot_bytes

MEMORY = 20 * 2**30

# vLLM 0.33's own code (scripts/oracle_kv_skip_layers.py: Platform._align_heterogeneous_kv_block_size,
# get_kv_cache_groups, get_kv_cache_config_from_groups) on 20 GiB of KV cache a GPU: the block
# size it runs at and the blocks; its layers all in one group (UniformTypeKVCacheSpecs)
VLLM_CASES = [  # (model, kv_cache_dtype, skip layers, block size given, TP[, PP]), (block size, blocks)
    (("llama-3-8b", "fp8", "0,1,30,31", 16, 1), (32, 9102)),
    (("llama-3-8b", "fp8", "0", 32, 1), (32, 9929)),
    (("llama-3-8b", "fp8_e5m2", "5", 64, 1), (64, 4964)),
    (("llama-3-8b", "auto", "0,31", 16, 1), (16, 10240)),
    (("llama-3-70b", "fp8", "0,1,78,79", 16, 4), (32, 15603)),
    (("qwen3-30b-a3b", "fp8", "0,47", 16, 2), (32, 26214)),
    (("mistral-7b", "fp8", "0,1,2,3,28,29,30,31", 8, 1), (32, 8192)),
    # TurboQuant, which also skips the first and last two layers
    (("llama-3-8b", "turboquant_k8v4", "", 16, 1), (32, 11131)),
    (("llama-3-8b", "turboquant_4bit_nc", "", 16, 1), (32, 14463)),
    (("llama-3-8b", "turboquant_k3v4_nc", "10", 16, 1), (32, 14599)),
    (("llama-3-70b", "turboquant_3bit_nc", "", 16, 4), (32, 34239)),
    (("qwen3-8b", "turboquant_4bit_nc", "", 64, 1), (64, 6619)),
    (("llama-3.2-1b", "turboquant_4bit_nc", "", 16, 1), (32, 45003)),
    # pipeline stages: each stage sums its own layers' pages, and all get the fewest blocks
    (("llama-3-8b", "turboquant_4bit_nc", "", 16, 1, 2), (32, 28926)),
    (("llama-3-8b", "turboquant_k8v4", "", 16, 1, 3), (32, 30088)),
    (("llama-3-8b", "fp8", "0,1,2,3,4,5", 16, 1, 4), (32, 23405)),
    (("llama-3-70b", "turboquant_3bit_nc", "", 16, 2, 4), (32, 58661)),
    # NVFP4: FlashInfer's K and V slots, no layer kept bf16, the block size as given
    (("llama-3-8b", "nvfp4", "", 16, 1), (16, 36408)),
    (("qwen3-30b-a3b", "nvfp4", "", 32, 2), (32, 48545)),
    (("llama-3-70b", "nvfp4", "", 16, 4, 2), (16, 116508)),
    # an EAGLE-3 head, whose layer (index 32, after the target's) stays quantized
    (("llama-3-8b", "turboquant_4bit_nc", "", 16, 1, 1, "eagle3"), (32, 14136)),
    (("llama-3-8b", "fp8", "0,31", 16, 1, 1, "eagle3"), (32, 9362)),
]
# ... and ROCm's UltraQuant on an MI300X: TurboQuant's boundary layers, aligned by ROCM_ATTN (the
# boundary layers' backend; its smallest kernel block is 16 as FlashAttention's)
ROCM_CASES = [
    (("llama-3-8b", "ultraquant_4bit", "", 16, 1), (32, 14324)),
    (("llama-3-8b", "ultraquant_4bit", "7", 64, 1), (64, 6730)),
    (("qwen3-8b", "ultraquant_4bit", "", 16, 1), (32, 13107)),
    (("llama-3-70b", "ultraquant_4bit", "", 16, 4), (32, 27094)),
    (("llama-3-8b", "ultraquant_4bit", "", 16, 1, 2), (32, 28649)),
    (("llama-3.2-1b", "ultraquant_4bit", "", 32, 1), (32, 45590)),
]


def _config(model, dtype, skip, block_size, tp, pp=1, drafter=None, **more):
    spec = {"speculative_method": drafter, "num_speculative_tokens": 2} if drafter else {}
    return EngineConfig.from_flat({"model": model, "kv_cache_dtype": dtype, "kv_cache_dtype_skip_layers": skip,
                                   "block_size": block_size, "tensor_parallel_size": tp,
                                   "pipeline_parallel_size": pp, "kv_cache_memory_bytes": MEMORY} | spec | more)


@pytest.mark.parametrize("case, expected", VLLM_CASES)
def test_block_size_and_blocks_are_vllms(case, expected):
    config = _config(*case)
    assert (config.cache.block_size, compute_capacity(config).num_gpu_blocks) == expected
    assert len(config.kv_cache_groups.groups) == 1


@pytest.mark.parametrize("case, expected", ROCM_CASES)
def test_ultraquants_block_size_and_blocks_are_vllms(case, expected):
    config = _config(*case, gpu="MI300X")
    assert (config.cache.block_size, compute_capacity(config).num_gpu_blocks) == expected
    assert len(config.kv_cache_groups.groups) == 1


def test_the_skipped_layers_cost_their_bf16_bytes():
    """llama-3-8b: 28 layers at 2 KiB a token in fp8 and 4 at 4 KiB: 73,728 bytes, against 65,536
    all fp8 and 131,072 in bf16; the roofline reads the same per cached token."""
    skipped = _config("llama-3-8b", "fp8", "0,1,30,31", 16, 1)
    assert skipped.kv_skip_layers == 4
    assert compute_capacity(skipped).kv_bytes_per_token == 28 * 2048 + 4 * 4096
    assert make_roofline(skipped).kv_bytes_per_token == 28 * 2048 + 4 * 4096
    plain = _config("llama-3-8b", "fp8", "", 16, 1)
    assert compute_capacity(plain).kv_bytes_per_token == 65536 and plain.cache.block_size == 16
    # a repeated index is one layer
    assert _config("llama-3-8b", "fp8", "3,3", 16, 1).kv_skip_layers == 1


def test_the_block_grows_until_a_quantized_page_covers_16_skipped_tokens():
    assert [skip_layers_block_size("fp8", b) for b in (8, 16, 32, 64, 128)] == [32, 32, 32, 64, 128]
    assert skip_layers_block_size("auto", 16) == 16 and skip_layers_block_size("bfloat16", 16) == 16


def test_turboquant_packs_a_heads_k_and_v_into_a_slot():
    """vLLM's TurboQuantConfig.slot_size_aligned for head_dim 128: fp8 keys (128) or 4-/3-bit key
    indices with an fp16 norm (66, 50), 4-/3-bit values with an fp16 scale and zero (68, 52);
    2.6x, 3.8x, 4.3x and 5.0x smaller than bf16's 512 bytes."""
    assert [turboquant_slot_bytes(d, 128) for d in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                                     "turboquant_3bit_nc")] == [196, 134, 118, 102]
    assert turboquant_slot_bytes("turboquant_3bit_nc", 64) == 26 + 28  # (key 24 + 2, value 24 + 4: even already)
    # the boundary layers: the first and last two, or fewer on a shallow model
    assert turboquant_boundary_layers(32) == [0, 1, 30, 31] and turboquant_boundary_layers(3) == [0, 2]
    config = _config("llama-3-8b", "turboquant_4bit_nc", "0,5", 16, 1)  # (0 is a boundary layer already)
    assert config.kv_skip_layers == 5
    assert compute_capacity(config).kv_bytes_per_token == 8 * (27 * 134 + 5 * 512)
    assert make_roofline(config).kv_bytes_per_token == 8 * (27 * 134 + 5 * 512)


# vLLM 0.33's Platform._align_hybrid_block_size on Qwen3-Next without prefix caching (scripts/
# oracle_kv_skip_layers.py): TurboQuant skips no layer there, and the states' page is aligned to
# the packed attention page
@pytest.mark.parametrize("dtype, tp, block_size, expected", [
    ("turboquant_4bit_nc", 1, 16, 2096), ("turboquant_4bit_nc", 4, 64, 1088), ("turboquant_k8v4", 1, 16, 1424),
    ("turboquant_k8v4", 4, 64, 768), ("turboquant_3bit_nc", 1, 64, 2816), ("turboquant_3bit_nc", 4, 16, 1392),
    ("nvfp4", 1, 16, 1920), ("nvfp4", 4, 64, 960),
])
def test_turboquant_on_linear_attention_grows_the_block_from_the_packed_page(dtype, tp, block_size, expected):
    config = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "kv_cache_dtype": dtype, "tensor_parallel_size": tp,
                                     "block_size": block_size, "enable_prefix_caching": False})
    assert config.cache.block_size == expected and config.kv_skip_layers == 0
    if tp == 4:  # (the model fits on four H100s)
        assert compute_capacity(config).num_gpu_blocks > 0
    # with prefix caching (vLLM's mamba_cache_mode "align"; on an A100 the GDN prefill is Triton's, whose
    # checkpoints add no alignment, as on the CPU vLLM ran on): the same block sizes
    cached = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "A100-80GB", "kv_cache_dtype": dtype,
                                     "tensor_parallel_size": tp, "block_size": block_size})
    assert cached.cache.block_size == expected


def test_rocms_formats_pack_a_heads_k_and_v_into_a_slot():
    """vLLM's slot sizes: UltraQuant's fp4 codes and a scale byte per 32 for K and V (136 bytes at
    head_dim 128, 272 at 256); Octave's codes (its rotary 64 dims' K at 4 bits, the rest at 3; V
    at its bits) and fp16 scales, padded to 8 bytes (compact: 4)."""
    assert [ultraquant_slot_bytes(d) for d in (64, 128, 256)] == [68, 136, 272]
    assert [octave_slot_bytes(d, 256) for d in ("octave_k3v4", "octave_k3v3", "octave_k3v3_compact")] == [248, 216, 196]
    # UltraQuant keeps TurboQuant's boundary layers: 28 packed layers and 4 bf16 ones of llama-3-8b
    config = _config("llama-3-8b", "ultraquant_4bit", "", 16, 1, gpu="MI300X")
    assert config.kv_skip_layer_indices == {0, 1, 30, 31}
    assert compute_capacity(config).kv_bytes_per_token == 8 * (28 * 136 + 4 * 512)
    assert make_roofline(config).kv_bytes_per_token == 8 * (28 * 136 + 4 * 512)
    # Octave keeps none: Qwen3-Next's 12 attention layers of 2 KV heads, on four MI300Xs
    octave = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "MI300X", "tensor_parallel_size": 4,
                                     "kv_cache_dtype": "octave_k3v4"})
    assert octave.kv_skip_layers == 0 and get_model_spec("qwen3-next-80b-a3b").rotary_dim == 64
    assert make_roofline(octave).kv_bytes_per_token == 12 * 1 * 248


# vLLM 0.33's Platform._align_hybrid_block_size on Qwen3-Next (scripts/oracle_kv_skip_layers.py; None:
# no block size given, where UltraQuant's backend prefers 64)
@pytest.mark.parametrize("dtype, tp, block_size, expected", [
    ("ultraquant_4bit", 1, None, 2048), ("ultraquant_4bit", 1, 16, 2032), ("ultraquant_4bit", 4, None, 1024),
    ("octave_k3v4", 1, None, 2224), ("octave_k3v4", 2, 64, 2240), ("octave_k3v4", 4, 16, 1120),
    ("octave_k3v3", 1, 16, 2544), ("octave_k3v3", 4, 64, 1280), ("octave_k3v3_compact", 2, None, 2816),
    ("octave_k3v3_compact", 4, 64, 1408),
])
def test_rocms_formats_on_linear_attention_grow_the_block_from_the_packed_page(dtype, tp, block_size, expected):
    given = {"block_size": block_size} if block_size else {}
    for caching in (False, True):  # (on ROCm the GDN prefill is Triton's: no checkpoint alignment)
        config = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "gpu": "MI300X", "kv_cache_dtype": dtype,
                                         "tensor_parallel_size": tp, "enable_prefix_caching": caching} | given)
        assert config.cache.block_size == expected and config.kv_skip_layers == 0


def test_octave_reads_the_rotary_dims_from_a_models_config(tmp_path):
    """A dense model of head_dim 256 with a quarter of it rotary runs Octave; skipped layers with it
    are not modelled. The factor comes from the config (or Qwen3-Next's class default, 0.25)."""
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "num_hidden_layers": 16, "vocab_size": 32000, "max_position_embeddings": 8192}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base | {"partial_rotary_factor": 0.25}))
    config = EngineConfig.from_flat({"model": str(path), "gpu": "MI325X", "kv_cache_dtype": "octave_k3v3_compact"})
    assert compute_capacity(config).kv_bytes_per_token == 16 * 2 * 196 and config.cache.block_size == 16
    with pytest.raises(ConfigError, match="kv_cache_dtype_skip_layers is not modelled with kv_cache_dtype octave_k3v3"):
        EngineConfig.from_flat({"model": str(path), "gpu": "MI300X", "kv_cache_dtype": "octave_k3v3",
                                "kv_cache_dtype_skip_layers": "0"})
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(base | {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}}))
    with pytest.raises(ConfigError, match="got head_size=256, rotary dims=256"):
        EngineConfig.from_flat({"model": str(whole), "gpu": "MI300X", "kv_cache_dtype": "octave_k3v4"})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(base | {"partial_rotary_factor": 0}))
    with pytest.raises(ValueError, match="field 'partial_rotary_factor' must be a number in"):
        EngineConfig.from_flat({"model": str(bad)})


def test_nvfp4_packs_k_and_v_with_a_scale_every_16_values():
    """FlashInfer's NVFP4 slot (vLLM's nvfp4_kv_cache_full_dim): head_dim / 2 bytes of fp4 and
    head_dim / 16 fp8 scales, for K and V each: 144 bytes a head and token at head_dim 128."""
    config = EngineConfig.from_flat({"kv_cache_dtype": "nvfp4"})
    assert compute_capacity(config).kv_bytes_per_token == 32 * 8 * 144
    assert make_roofline(config).kv_bytes_per_token == 32 * 8 * 144
    assert EngineConfig.from_flat({"kv_cache_dtype": "nvfp4_4over6", "gpu": "B200"}).cache.block_size == 16


# vLLM 0.33's planning code on NVFP4 and per-token-head caches of models with sliding-window or chunked
# local layers on a B200 (scripts/oracle_kv_skip_layers.py): every layer's page packed alike, so the
# groups keep one block size; (model, dtype, block size, TP, max_model_len), (groups, blocks of 20 GiB)
WINDOW_CASES = [
    (("gpt-oss-20b", "nvfp4", 16, 1, None), (2, 194180)), (("gpt-oss-120b", "nvfp4", 16, 2, None), (2, 258907)),
    (("gemma-3-12b", "nvfp4", 16, 1, None), (6, 72817)), (("gemma-2-9b", "nvfp4", 32, 2, None), (2, 27740)),
    (("gemma-3-27b", "nvfp4", 16, 2, None), (7, 116508)), (("llama-4-scout", "nvfp4", 16, 4, 131072), (4, 388361)),
    (("gemma-3-12b", "int8_per_token_head", 16, 1, None), (6, 40329)),
    (("gpt-oss-20b", "int4_per_token_head", 16, 1, None), (2, 194180)),
    (("gpt-oss-120b", "fp8_per_token_head", 32, 2, None), (2, 68534)),
]


@pytest.mark.parametrize("case, expected", WINDOW_CASES)
def test_packed_caches_on_sliding_window_models_are_vllms(case, expected):
    model, dtype, block_size, tp, max_len = case
    config = EngineConfig.from_flat({"model": model, "gpu": "B200", "kv_cache_dtype": dtype, "block_size": block_size,
                                     "tensor_parallel_size": tp, "kv_cache_memory_bytes": MEMORY}
                                    | ({"max_model_len": max_len} if max_len else {}))
    assert (len(config.kv_cache_groups.groups), compute_capacity(config).num_gpu_blocks) == expected


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_dtype": "nvfp4_4over6"}, "slot-mapping writer has no scale search"),
    ({"kv_cache_dtype": "nvfp4", "model": "llama-3.2-1b"}, "fa2 prefill misreads an NVFP4 KV cache at head_size 64"),
    ({"kv_cache_dtype": "nvfp4", "model": "qwen3-30b-a3b", "tensor_parallel_size": 8,
      "decode_context_parallel_size": 2}, "The DCP prefill wrapper cannot read NVFP4 block scales"),
    ({"kv_cache_dtype": "nvfp4", "gpu": "MI300X"}, "vLLM runs it on FlashInfer, which MI300X"),
    ({"kv_cache_dtype": "nvfp4", "model": "deepseek-v2-lite"}, "nvfp4 KV cache is not supported with MLA"),
    ({"kv_cache_dtype": "nvfp4", "kv_cache_dtype_skip_layers": "0"},
     "kv_cache_dtype nvfp4 is not modelled with kv_cache_dtype_skip_layers"),
    ({"kv_cache_dtype": "turboquant_k8v4", "model": "gpt-oss-20b"},
     "kv_cache_dtype turboquant_k8v4 is not modelled with sliding-window"),
    ({"kv_cache_dtype": "turboquant_k8v4", "kv_cache_dtype_skip_layers": "3", "model": "qwen3-next-80b-a3b",
      "tensor_parallel_size": 4}, "kv_cache_dtype turboquant_k8v4 is not modelled with linear-attention layers"),
    ({"kv_cache_dtype": "ultraquant_4bit"}, "vLLM runs it on its ROCm attention backend ULTRAQUANT, which H100-SXM"),
    ({"kv_cache_dtype": "octave_k3v4", "model": "qwen3-next-80b-a3b", "gpu": "MI355X", "tensor_parallel_size": 2},
     "ROCM_OCTAVE supports RDNA3 and CDNA3 only"),
    ({"kv_cache_dtype": "octave_k3v4", "gpu": "MI300X"},
     "ROCM_OCTAVE kernels need ROCm, head_size=256 and 64 rotary dims; got head_size=128, rotary dims=128"),
    ({"kv_cache_dtype": "octave_k3v4", "model": "gemma-3-12b", "gpu": "MI300X"}, "rotary dims=256"),
    ({"kv_cache_dtype": "ultraquant_4bit", "model": "deepseek-v2-lite", "gpu": "MI300X"},
     "vLLM's ROCm MLA backends do not take it"),
    ({"kv_cache_dtype": "ultraquant_4bit", "model": "gemma-3-12b", "gpu": "MI300X"},
     "kv_cache_dtype ultraquant_4bit is not modelled with sliding-window"),
    ({"kv_cache_dtype_skip_layers": "0,x"}, "'x' is neither a layer index nor 'sliding_window'"),
    ({"kv_cache_dtype_skip_layers": "32"}, "'32' matches no layer of llama-3-8b"),
    ({"kv_cache_dtype_skip_layers": "sliding_window"}, "'sliding_window' matches no layer"),
    ({"kv_cache_dtype_skip_layers": "0", "model": "gemma-3-12b"}, "not modelled with sliding-window"),
    ({"kv_cache_dtype_skip_layers": "0", "model": "deepseek-v2-lite"}, "not modelled with latent attention"),
    ({"kv_cache_dtype_skip_layers": "0", "kv_cache_dtype": "int8_per_token_head"},
     "not modelled with kv_cache_dtype int8_per_token_head"),
    ({"kv_cache_dtype_skip_layers": "0", "speculative_method": "draft_model", "spec_draft_model": "llama-3.2-1b",
      "num_speculative_tokens": 2}, "not modelled with a drafter's layers"),
])
def test_what_is_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat({"model": "llama-3-8b", "kv_cache_dtype": "fp8"} | options)


def test_capacity_names_the_layers_kept_bf16():
    from click.testing import CliRunner

    from simkv.cli.main import main

    res = CliRunner().invoke(main, ["capacity", "--kv-cache-dtype", "turboquant_4bit_nc",
                                    "--kv-cache-dtype-skip-layers", "7", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["kv_unquantized_layers"] == [0, 1, 7, 30, 31] and rep["block_size"] == 32
    plain = json.loads(CliRunner().invoke(main, ["capacity", "--kv-cache-dtype", "fp8", "--json"]).output)
    assert "kv_unquantized_layers" not in plain


def test_a_serve_command_takes_it():
    out = serve_options("vllm serve meta-llama/Meta-Llama-3-8B-Instruct --kv-cache-dtype fp8 "
                        "--kv-cache-dtype-skip-layers 0 1 30 31")
    assert out.options["kv_cache_dtype_skip_layers"] == "0,1,30,31"
    config = EngineConfig.from_flat(out.options)
    assert config.kv_skip_layers == 4 and config.cache.block_size == 32
    assert EngineConfig.from_flat(config.given_options()).cache == config.cache
    assert config.to_dict()["kv_cache_dtype_skip_layers"] == "0,1,30,31"
    tq = serve_options("vllm serve meta-llama/Meta-Llama-3-8B-Instruct --kv-cache-dtype turboquant_4bit_nc")
    assert tq.options["kv_cache_dtype"] == "turboquant_4bit_nc"
    assert EngineConfig.from_flat(tq.options).kv_skip_layers == 4


def test_a_serve_command_takes_rocms_formats():
    for dtype, block_size in (("octave_k3v4", 2224), ("ultraquant_4bit", 2048)):
        out = serve_options(f"vllm serve Qwen/Qwen3-Next-80B-A3B-Instruct -tp 2 --kv-cache-dtype {dtype}")
        config = EngineConfig.from_flat(out.options | {"gpu": "MI300X"})
        assert config.cache.kv_cache_dtype == dtype and config.cache.block_size == block_size
        assert EngineConfig.from_flat(config.given_options()).cache == config.cache
