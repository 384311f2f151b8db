"""vLLM 0.33's own choice of sparse-MLA backend and KV layout for DeepSeek-V3.2, by GPU generation
and --kv-cache-dtype, against simkv's (EngineConfig.kv_element: the layout whose bytes a latent
takes), and the blocks 40 GiB of KV cache hold in that layout (vLLM's grouping and block count
on the latent and indexer caches' specs, kv_cache_planning). vLLM's CUDA platform's backend priorities, each backend's validate_configuration and
mla_attention's _canonicalize_sparse_mla_kv_cache_dtype run here on a CPU; no GPU is needed.

A development aid, not a test dependency. Run it with the vLLM oracle's Python:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    PYTHONPATH=. /tmp/vllm-oracle-venv/bin/python scripts/oracle_sparse_mla_kv.py

Each case prints vLLM's backend, its layout and simkv's, and 'equal' or 'DIFFERENT'; the exit
status is the number of cases that differ. (ROCm's sparse backend, ROCM_AITER_MLA_SPARSE, takes
auto, float16, bfloat16, fp8 and fp8_e4m3 with no renaming: read off its class, not run here.)
"""

from __future__ import annotations

import json
import sys
import tempfile
import types
from pathlib import Path

# DeepSeek-V3.2's published config.json fields that vLLM's ModelConfig reads
DEEPSEEK_V32 = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 7168,
                "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61, "vocab_size": 129280,
                "max_position_embeddings": 163840, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "index_topk": 2048,
                "index_n_heads": 64, "index_head_dim": 128, "first_k_dense_replace": 3, "n_shared_experts": 1,
                "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000}
# (CUDA major -> a GPU of that generation: the catalogue's, or for consumer Blackwell a GPU file)
GPUS = {9: "H200", 10: "B200", 12: None}
DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla")
# (a layer's latent record in each layout vLLM stores)
LAYOUT_BYTES = {"auto": 1152, "bfloat16": 1152, "fp8": 576, "fp8_e4m3": 576, "fp8_ds_mla": 656, "nvfp4_ds_mla": 352}


def vllm_choice(major: int, dtype: str) -> tuple[str | None, str | None]:
    """The backend vLLM's selector takes for V3.2's sparse layers and the layout it stores."""
    # (no CUDA here: stand-ins for the compiled ops and FlashAttention's kernels, which the backends'
    # modules import and their classes' choices do not run)
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    for name in ("vllm.vllm_flash_attn", "vllm.vllm_flash_attn.flash_attn_interface"):
        stand_in = sys.modules.setdefault(name, types.ModuleType(name))
        stand_in.flash_attn_varlen_func = None
    import torch
    from oracle_kv_skip_layers import _stub_triton

    _stub_triton()
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import _canonicalize_sparse_mla_kv_cache_dtype
    from vllm.platforms.cuda import _get_backend_priorities
    from vllm.platforms.interface import DeviceCapability

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    config = VllmConfig(model_config=ModelConfig(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True),
                        device_config=DeviceConfig(device="cpu"))
    capability = DeviceCapability(major, 0)
    head_size = DEEPSEEK_V32["kv_lora_rank"] + DEEPSEEK_V32["qk_rope_head_dim"]
    with set_current_vllm_config(config):
        for backend in _get_backend_priorities(True, capability, DEEPSEEK_V32["num_attention_heads"], dtype, False,
                                               head_size, False):
            if "SPARSE" not in backend.name:  # (dense MLA backends, which refuse sparse layers; some of them
                continue                      # allocate CUDA memory at import)
            cls = backend.get_class()
            if not cls.validate_configuration(head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype=dtype,
                                              block_size=64, use_mla=True, has_sink=False, use_sparse=True,
                                              use_mm_prefix=False, use_per_head_quant_scales=False,
                                              device_capability=capability, attn_type="decoder"):
                return cls.get_name(), _canonicalize_sparse_mla_kv_cache_dtype(cls, dtype)
    return None, None


def gpu_of(major: int) -> str:
    """A GPU of that CUDA generation: the catalogue's, or a GPU file (an SM120 card, given the memory
    for the block count's 40 GiB beside the weights)."""
    if GPUS[major] is not None:
        return GPUS[major]
    path = Path(tempfile.mkdtemp()) / "sm120.yaml"
    path.write_text("memory_gib: 192\nmem_bandwidth_gbs: 1600\nbf16_tflops: 500\nfp8_tflops: 1000\n"
                    "interconnect_gbs: 64\ncompute_capability: 12.0\n")
    return str(path)


def simkv_bytes(major: int, dtype: str) -> int | None:
    """The bytes of a layer's latent record simkv sizes (None: refused)."""
    from simkv.config import ConfigError, EngineConfig

    try:
        config = EngineConfig.from_flat({"model": "deepseek-v3.2", "gpu": gpu_of(major), "tensor_parallel_size": 8,
                                         "kv_cache_dtype": dtype})
    except ConfigError:
        return None
    return config.hardware.model_spec().latent_bytes_per_token(config.kv_element) // 61


MEMORY = 40 * 2**30  # bytes of KV cache on a GPU, for the block count


def vllm_blocks(layout: str) -> tuple[list[str], int]:
    """vLLM's KV-cache groups and block count for V3.2's layers (each an MLA spec as
    MLAAttention.get_kv_cache_spec makes it, in `layout`, and its indexer's key cache as
    DeepseekV32IndexerCache's) on MEMORY bytes, at 64-token blocks."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole, get_kv_quant_mode

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    config = VllmConfig(model_config=ModelConfig(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True),
                        cache_config=CacheConfig(block_size=64), device_config=DeviceConfig(device="cpu"))
    config.cache_config.kv_cache_layout = "LBNHC"  # (as oracle_kv_skip_layers.py sets it)
    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
             "fp8_e4m3": torch.float8_e4m3fn}.get(layout, torch.uint8)
    index_dim = DEEPSEEK_V32["index_head_dim"]
    specs = {}
    for i in range(DEEPSEEK_V32["num_hidden_layers"]):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=dtype, cache_dtype_str=layout,
            kv_quant_mode=get_kv_quant_mode(layout), state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(layout),
            is_index_group_leader=True)
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=index_dim + index_dim // 128 * 4,
            dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
    groups = get_kv_cache_groups(config, specs)
    return ([type(g.kv_cache_spec).__name__ for g in groups],
            get_kv_cache_config_from_groups(config, groups, MEMORY).num_blocks)


def simkv_blocks(major: int, dtype: str) -> int:
    from simkv.capacity import compute_capacity
    from simkv.config import EngineConfig

    return compute_capacity(EngineConfig.from_flat({"model": "deepseek-v3.2", "gpu": gpu_of(major), "tensor_parallel_size": 8,
                                                    "kv_cache_dtype": dtype, "kv_cache_memory_bytes": MEMORY})).num_gpu_blocks


def main() -> int:
    differ = 0
    for major in GPUS:
        for dtype in DTYPES:
            backend, layout = vllm_choice(major, dtype)
            theirs_bytes, ours = LAYOUT_BYTES.get(layout), simkv_bytes(major, dtype)
            same = theirs_bytes == ours
            differ += not same
            print(f"SM{major}0 {dtype}: vLLM {backend} storing {layout} ({theirs_bytes} B); simkv {ours} B: "
                  f"{'equal' if same else 'DIFFERENT'}")
            if layout is not None:  # (the blocks 40 GiB of KV cache a GPU hold in that layout)
                groups, theirs = vllm_blocks(layout)
                mine = simkv_blocks(major, dtype)
                differ += theirs != mine
                print(f"    groups {groups}, blocks: vLLM {theirs}, simkv {mine}: {'equal' if theirs == mine else 'DIFFERENT'}")
    return differ


if __name__ == "__main__":
    sys.exit(main())
