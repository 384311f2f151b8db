"""vLLM 0.33's own code on --kv-cache-dtype-skip-layers and the packed KV caches (TurboQuant,
NVFP4, and ROCm's UltraQuant and Octave), against simkv's: the block size it aligns to (Platform._align_heterogeneous_kv_block_size,
and _align_hybrid_block_size for Qwen3-Next), the KV-cache groups of the layers' specs
(kv_cache_planning.get_kv_cache_groups; get_kv_cache_configs over pipeline workers) and the
blocks a given memory holds (get_kv_cache_config_from_groups), for models of simkv's catalogue.

A development aid, not a test dependency. Run it with the vLLM oracle's Python, to which the
imports of Qwen3-Next's model class and of FlashInfer's backend add four packages:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    /tmp/vllm-oracle-venv/bin/python -m pip install compressed-tensors loguru flashinfer-python nvidia-ml-py --no-deps
    PYTHONPATH=. /tmp/vllm-oracle-venv/bin/python scripts/oracle_kv_skip_layers.py

Each case prints vLLM's (block size, groups, blocks) and simkv's, and 'equal' or 'DIFFERENT';
the exit status is the number of cases that differ. vLLM's attention layers are not built (no
GPU here): each layer's spec is made as vLLM's Attention.get_kv_cache_spec makes a full-attention
layer's, with the layer's dtype (the model's for a skipped layer), after the alignment.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

CASES = [  # (model, kv_cache_dtype, skip layers, block size given, tensor parallel size[, pipeline stages])
    ("llama-3-8b", "fp8", "0,1,30,31", 16, 1),
    ("llama-3-8b", "fp8", "0", 32, 1),
    ("llama-3-8b", "fp8_e5m2", "5", 64, 1),
    ("llama-3-8b", "auto", "0,31", 16, 1),
    ("llama-3-70b", "fp8", "0,1,78,79", 16, 4),
    ("qwen3-30b-a3b", "fp8", "0,47", 16, 2),
    ("mistral-7b", "fp8", "0,1,2,3,28,29,30,31", 8, 1),
    # TurboQuant: vLLM adds the first and last two layers to the skipped ones (its boundary layers)
    ("llama-3-8b", "turboquant_k8v4", "", 16, 1),
    ("llama-3-8b", "turboquant_4bit_nc", "", 16, 1),
    ("llama-3-8b", "turboquant_k3v4_nc", "10", 16, 1),
    ("llama-3-70b", "turboquant_3bit_nc", "", 16, 4),
    ("qwen3-8b", "turboquant_4bit_nc", "", 64, 1),
    ("llama-3.2-1b", "turboquant_4bit_nc", "", 16, 1),
    # pipeline stages: each worker sums its own layers' pages; every stage gets the fewest blocks
    ("llama-3-8b", "turboquant_4bit_nc", "", 16, 1, 2),
    ("llama-3-8b", "turboquant_k8v4", "", 16, 1, 3),
    ("llama-3-8b", "fp8", "0,1,2,3,4,5", 16, 1, 4),
    ("llama-3-70b", "turboquant_3bit_nc", "", 16, 2, 4),
    # NVFP4 (FlashInfer's layout: K and V slots of fp4 values and fp8 scales), no skipped layers
    ("llama-3-8b", "nvfp4", "", 16, 1),
    ("qwen3-30b-a3b", "nvfp4", "", 32, 2),
    ("llama-3-70b", "nvfp4", "", 16, 4, 2),
    # an EAGLE-3 head: its layer comes after the target's (vLLM's start_layer_id), so it stays quantized
    ("llama-3-8b", "turboquant_4bit_nc", "", 16, 1, 1, "eagle3"),
    ("llama-3-8b", "fp8", "0,31", 16, 1, 1, "eagle3"),
    # UltraQuant (ROCm): TurboQuant's boundary layers, on ROCM_ATTN (the first ROCm backend), which
    # aligns the block; the other layers' pages packed by UltraQuant's backend
    ("llama-3-8b", "ultraquant_4bit", "", 16, 1),
    ("llama-3-8b", "ultraquant_4bit", "7", 64, 1),
    ("qwen3-8b", "ultraquant_4bit", "", 16, 1),
    ("llama-3-70b", "ultraquant_4bit", "", 16, 4),
    ("llama-3-8b", "ultraquant_4bit", "", 16, 1, 2),
    ("llama-3.2-1b", "ultraquant_4bit", "", 32, 1),
]
ROCM_DTYPES = ("ultraquant_4bit", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact")
MEMORY = 20 * 2**30  # bytes of KV cache on a GPU, for the block count
# TurboQuant on Qwen3-Next (linear attention: no boundary layers; the attention page is the packed
# one, to which Platform._align_hybrid_block_size aligns the states' page): (dtype, TP, block size given)
# one dtype, TP, block size given, prefix caching: on, vLLM's mamba_cache_mode "align" with the Triton
# GDN prefill's checkpoints (vLLM on this CPU; simkv on an A100, whose GDN prefill is Triton's too)
HYBRID_CASES = [(d, tp, bs, caching) for d in ("auto", "fp8", "turboquant_4bit_nc", "turboquant_k8v4",
                                               "turboquant_3bit_nc", "nvfp4")
                for tp in (1, 4) for bs in (16, 64) for caching in (False, True)]
# ... and ROCm's packed formats (simkv on an MI300X), with no block size given too (None: vLLM's
# backends' preferred one, UltraQuant's 64)
HYBRID_CASES += [(d, tp, bs, caching) for d in ROCM_DTYPES for tp in (1, 2, 4) for bs in (None, 16, 64)
                 for caching in (False, True)]
# NVFP4 and per-token-head caches on models with sliding-window or chunked local layers (no layer
# skipped: every group's page packed alike), on a B200: (model, dtype, block size given, TP, max_model_len)
WINDOW_CASES = [("gpt-oss-20b", "auto", 16, 1, None), ("gpt-oss-20b", "nvfp4", 16, 1, None),
                ("gpt-oss-120b", "nvfp4", 16, 2, None), ("gemma-3-12b", "nvfp4", 16, 1, None),
                ("gemma-2-9b", "nvfp4", 32, 2, None), ("gemma-3-27b", "nvfp4", 16, 2, None),
                ("llama-4-scout", "nvfp4", 16, 4, 131072),
                # per-token-head (its Triton backend's pages)
                ("gemma-3-12b", "int8_per_token_head", 16, 1, None), ("gpt-oss-20b", "int4_per_token_head", 16, 1, None),
                ("gpt-oss-120b", "fp8_per_token_head", 32, 2, None)]
# Qwen3-Next's published config.json fields (shared with tests/replay/test_linear_attention.py), and what
# vLLM's ModelConfig reads besides
QWEN3_NEXT = json.loads((Path(__file__).resolve().parent.parent / "tests" / "core" / "data"
                         / "qwen3_next_80b_a3b_config.json").read_text()) | {"torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


def hf_config(spec) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "num_hidden_layers": spec.num_layers, "vocab_size": 32000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def _stub_triton() -> None:
    """vLLM's placeholder triton.language (no GPU here) lacks the dtypes UltraQuant's kernel modules
    name at import; the oracle runs none of them."""
    import vllm.triton_utils as triton_utils

    for name in ("float16", "bfloat16", "float32", "int8", "uint8", "int32"):
        if not hasattr(triton_utils.tl, name):
            setattr(triton_utils.tl, name, None)


def packing_backend(dtype: str):
    """The vLLM attention backend whose customize_spec packs a layer of `dtype` (None: unpacked)."""
    _stub_triton()
    if dtype.startswith("turboquant_"):
        from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
        return TurboQuantAttentionBackend
    if dtype.startswith("nvfp4"):
        from vllm.v1.attention.backends.flashinfer import FlashInferBackend
        return FlashInferBackend
    if dtype == "ultraquant_4bit":
        from vllm.v1.attention.backends.ultraquant_attn import UltraQuantAttentionBackend
        return UltraQuantAttentionBackend
    if dtype.startswith("octave_"):
        from vllm.v1.attention.backends.rocm_octave_attn import RocmOctaveAttentionBackend
        return RocmOctaveAttentionBackend
    if dtype.endswith("_per_token_head"):
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
        return TritonAttentionBackend
    return None


def vllm_case(model: str, dtype: str, skip: str, block_size: int, tp: int, pp: int = 1,
              drafter: str | None = None) -> tuple[int, list[str], int]:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.platforms.interface import Platform
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.core.kv_cache_planning import (get_global_kv_cache_groups, get_kv_cache_config_from_groups,
                                                get_kv_cache_configs, get_kv_cache_groups)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from simkv.specs import get_model_spec

    spec = get_model_spec(model)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(hf_config(spec)))
    cache = CacheConfig(block_size=block_size, cache_dtype=dtype,
                        kv_cache_dtype_skip_layers=[e for e in skip.split(",") if e])
    config = VllmConfig(model_config=ModelConfig(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True),
                        cache_config=cache,
                        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                        device_config=DeviceConfig(device="cpu"))
    config.cache_config.block_size = block_size
    config.cache_config.kv_cache_layout = "LBNHC"  # (FlashAttention's NHD: one tensor a layer)
    if dtype.startswith("turboquant_") or dtype == "ultraquant_4bit":  # (create_engine_config's boundary layers)
        boundary = TurboQuantConfig.get_boundary_skip_layers(config.model_config)
        config.cache_config.kv_cache_dtype_skip_layers = sorted(set(config.cache_config.kv_cache_dtype_skip_layers)
                                                                | set(boundary))
    if config.cache_config.kv_cache_dtype_skip_layers:
        # (the first backend in layer order: layer 0's, a skipped layer's FlashAttention, FA2 under TurboQuant;
        # on ROCm its first backend, ROCM_ATTN)
        if dtype in ROCM_DTYPES:
            from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
            Platform._align_heterogeneous_kv_block_size(config, RocmAttentionBackend)
        else:
            Platform._align_heterogeneous_kv_block_size(config, FlashAttentionBackend)
    bs = config.cache_config.block_size
    skipped = set(config.cache_config.kv_cache_dtype_skip_layers)
    specs = {}
    for i in range(spec.num_layers + (drafter is not None)):  # (an EAGLE head's layer: index num_layers)
        layer_dtype = "auto" if (str(i) in skipped or dtype == "auto") else dtype
        torch_dtype = torch.bfloat16 if layer_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[layer_dtype]
        layer_spec = FullAttentionSpec(
            block_size=bs, num_kv_heads=max(spec.num_kv_heads // tp, 1), head_size=spec.head_dim,
            dtype=torch_dtype, kv_quant_mode=get_kv_quant_mode(layer_dtype))
        if (backend := packing_backend(layer_dtype)) is not None:
            layer_spec = backend.customize_spec(layer_spec)
        specs[f"model.layers.{i}.self_attn.attn"] = layer_spec
    if pp > 1:  # (the workers' layers as vLLM's get_pp_indices splits them)
        workers = []
        for rank in range(pp):
            start, end = get_pp_indices(spec.num_layers, rank, pp)
            workers.append({k: v for k, v in specs.items() if start <= int(k.split(".")[2]) < end})
        groups = get_global_kv_cache_groups(config, workers)
        configs = get_kv_cache_configs(config, workers, [MEMORY] * pp, groups)
        return bs, [type(g.kv_cache_spec).__name__ + f"({g.kv_cache_spec.block_size})" for g in groups], \
            configs[0].num_blocks
    groups = get_kv_cache_groups(config, specs)
    kv_config = get_kv_cache_config_from_groups(config, groups, MEMORY)
    return bs, [type(g.kv_cache_spec).__name__ + f"({g.kv_cache_spec.block_size})" for g in groups], kv_config.num_blocks


def simkv_case(model: str, dtype: str, skip: str, block_size: int, tp: int, pp: int = 1,
               drafter: str | None = None) -> tuple[int, list[str], int]:
    from simkv.capacity import compute_capacity
    from simkv.config import EngineConfig

    config = EngineConfig.from_flat({"model": model, "kv_cache_dtype": dtype, "kv_cache_dtype_skip_layers": skip,
                                     "gpu": "MI300X" if dtype in ROCM_DTYPES else "H100-SXM",
                                     "block_size": block_size, "tensor_parallel_size": tp,
                                     "pipeline_parallel_size": pp, "kv_cache_memory_bytes": MEMORY}
                                    | ({"speculative_method": drafter, "num_speculative_tokens": 2} if drafter else {}))
    groups = config.kv_cache_groups
    kinds = ["UniformTypeKVCacheSpecs" if config.kv_skip_layers and dtype != "auto" else "FullAttentionSpec"]
    assert len(groups.groups) == 1
    bs = config.cache.block_size
    return bs, [f"{kinds[0]}({bs})"], compute_capacity(config).num_gpu_blocks


def vllm_hybrid_block_size(dtype: str, tp: int, block_size: int | None, caching: bool) -> int:
    """vLLM's block size for Qwen3-Next (its model class reads the config; the oracle's venv needs
    compressed-tensors and loguru for that import)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(QWEN3_NEXT))
    from vllm.config.vllm import set_current_vllm_config

    config = VllmConfig(model_config=ModelConfig(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True),
                        cache_config=CacheConfig(block_size=block_size or 16, cache_dtype=dtype,
                                                 enable_prefix_caching=caching),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp), device_config=DeviceConfig(device="cpu"))
    assert config.cache_config.mamba_cache_mode == ("align" if caching else "none")
    # (the attention layers' one backend: the packing one, FlashAttention's for the others)
    backend = packing_backend(dtype) or FlashAttentionBackend
    if block_size is None:  # (update_block_size_for_backend's phase 1: the backends' preferred block)
        block_size = Platform._preferred_block_size_for_backends([backend], CacheConfig.DEFAULT_BLOCK_SIZE, config)
    config.cache_config.block_size = block_size
    with set_current_vllm_config(config):
        Platform._align_hybrid_block_size(config, backend)
    return config.cache_config.block_size


def vllm_window_case(model: str, dtype: str, block_size: int, tp: int, max_model_len: int | None) -> tuple[list, int]:
    """vLLM's KV-cache groups and block count for a model with sliding-window (or chunked local)
    layers: each layer's spec as Attention.get_kv_cache_spec makes it (a sliding-window layer's
    block from _largest_kernel_block_within), packed by the dtype's backend."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec,
                                            get_kv_quant_mode)

    from simkv.specs import get_model_spec

    spec = get_model_spec(model)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(hf_config(spec)))
    config = VllmConfig(model_config=ModelConfig(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True),
                        cache_config=CacheConfig(block_size=block_size, cache_dtype=dtype),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp), device_config=DeviceConfig(device="cpu"))
    config.cache_config.block_size = block_size
    config.cache_config.kv_cache_layout = "LBNHC"
    config.scheduler_config.disable_hybrid_kv_cache_manager = False  # (its config has no windows: the specs do)
    backend = packing_backend(dtype) or FlashAttentionBackend
    common = dict(num_kv_heads=max(spec.num_kv_heads // tp, 1), head_size=spec.head_dim,
                  dtype=torch.bfloat16 if dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[dtype],
                  kv_quant_mode=get_kv_quant_mode(dtype))
    specs = {}
    with set_current_vllm_config(config):
        for i, window in enumerate(spec.layer_windows()):
            if window and spec.attention_chunk_size:
                layer = ChunkedLocalAttentionSpec(block_size=block_size, attention_chunk_size=window, **common)
            elif window:
                one = backend.customize_spec(SlidingWindowSpec(block_size=1, sliding_window=window, **common))
                sw_block = _largest_kernel_block_within(backend, one.real_page_size_bytes,
                                                        one.real_page_size_bytes * block_size, block_size, one)
                layer = SlidingWindowSpec(block_size=sw_block, sliding_window=window, **common)
            else:
                layer = FullAttentionSpec(block_size=block_size, **common)
            specs[f"model.layers.{i}.self_attn.attn"] = backend.customize_spec(layer)
        groups = get_kv_cache_groups(config, specs)
        blocks = get_kv_cache_config_from_groups(config, groups, MEMORY).num_blocks
    return [f"{type(g.kv_cache_spec).__name__}({g.kv_cache_spec.block_size})" for g in groups], blocks


def main() -> int:
    from simkv.capacity import compute_capacity
    from simkv.config import EngineConfig

    differ = 0
    for case in CASES:
        theirs, ours = vllm_case(*case), simkv_case(*case)
        same = theirs == ours
        differ += not same
        print(f"{case}: vLLM {theirs}, simkv {ours}: {'equal' if same else 'DIFFERENT'}")
    for dtype, tp, bs, caching in HYBRID_CASES:
        theirs = vllm_hybrid_block_size(dtype, tp, bs, caching)
        ours = EngineConfig.from_flat({"model": "qwen3-next-80b-a3b", "kv_cache_dtype": dtype,
                                       "gpu": "MI300X" if dtype in ROCM_DTYPES else "A100-80GB",
                                       "tensor_parallel_size": tp, "enable_prefix_caching": caching}
                                      | ({"block_size": bs} if bs else {})).cache.block_size
        differ += theirs != ours
        print(f"qwen3-next {dtype} TP {tp} block {bs} prefix caching {caching}: vLLM {theirs}, simkv {ours}: "
              f"{'equal' if theirs == ours else 'DIFFERENT'}")
    for model, dtype, bs, tp, max_len in WINDOW_CASES:
        groups, theirs = vllm_window_case(model, dtype, bs, tp, max_len)
        config = EngineConfig.from_flat({"model": model, "gpu": "B200", "kv_cache_dtype": dtype, "block_size": bs,
                                         "tensor_parallel_size": tp, "kv_cache_memory_bytes": MEMORY}
                                        | ({"max_model_len": max_len} if max_len else {}))
        ours = compute_capacity(config).num_gpu_blocks
        same = theirs == ours and len(groups) == len(config.kv_cache_groups.groups)
        differ += not same
        print(f"{model} {dtype} block {bs} TP {tp}: vLLM {groups} {theirs} blocks, simkv "
              f"{len(config.kv_cache_groups.groups)} groups {ours} blocks: {'equal' if same else 'DIFFERENT'}")
    return differ


if __name__ == "__main__":
    sys.exit(main())
