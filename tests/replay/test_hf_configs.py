"""`--model path/config.json`: model specs from Hugging Face configs (simkv/specs/hf_config.py).
The configs below carry the public configs' fields that simkv reads; each gives the spec that
simkv ships for that model."""

import dataclasses
import json

import pytest
from click.testing import CliRunner

from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.specs import get_model_spec

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "tie_word_embeddings": False, "vocab_size": 128256}
GPT_OSS_120B = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
                "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 36,
                "num_local_experts": 128, "num_experts_per_tok": 4, "vocab_size": 201088,
                "max_position_embeddings": 131072, "sliding_window": 128, "tie_word_embeddings": False,
                "layer_types": ["sliding_attention", "full_attention"] * 18,
                "quantization_config": {"quant_method": "mxfp4"}}
GEMMA3_27B = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "vision_config": {"hidden_size": 1152},
              "text_config": {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
                              "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 16,
                              "num_hidden_layers": 62, "vocab_size": 262208, "max_position_embeddings": 131072,
                              "sliding_window": 1024, "sliding_window_pattern": 6}}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "head_dim": 128, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                 "sliding_window": None, "use_sliding_window": False}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
             "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
             "max_position_embeddings": 32768, "sliding_window": 131072, "use_sliding_window": False,
             "max_window_layers": 28, "tie_word_embeddings": False}

QWEN25_VL_7B = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
                "num_hidden_layers": 28, "vocab_size": 152064, "max_position_embeddings": 128000,
                "tie_word_embeddings": False,
                "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                                  "num_heads": 16, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                                  "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}}
QWEN3_VL_30B_A3B = {"model_type": "qwen3_vl_moe", "architectures": ["Qwen3VLMoeForConditionalGeneration"],
                    "tie_word_embeddings": False,
                    "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 2048, "intermediate_size": 6144,
                                    "moe_intermediate_size": 768, "head_dim": 128, "num_attention_heads": 32,
                                    "num_key_value_heads": 4, "num_hidden_layers": 48, "num_experts": 128,
                                    "num_experts_per_tok": 8, "vocab_size": 151936,
                                    "max_position_embeddings": 262144, "decoder_sparse_step": 1, "mlp_only_layers": []},
                    "vision_config": {"depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
                                      "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048,
                                      "patch_size": 16, "spatial_merge_size": 2, "deepstack_visual_indexes": [8, 16, 24]}}
# (the configs' fields as the public config.json files give them; Qwen3's dense and MoE models)
LLAMA31_8B = LLAMA3_8B | {"max_position_embeddings": 131072,
                          "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN3_32B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "hidden_size": 5120,
             "intermediate_size": 25600, "max_position_embeddings": 40960, "num_attention_heads": 64,
             "num_hidden_layers": 64, "num_key_value_heads": 8, "sliding_window": None, "use_sliding_window": False,
             "tie_word_embeddings": False, "vocab_size": 151936}
QWEN3_235B_A22B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 128,
                   "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_attention_heads": 64, "num_key_value_heads": 4, "num_hidden_layers": 94, "num_experts": 128,
                   "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "max_position_embeddings": 40960, "tie_word_embeddings": False, "vocab_size": 151936}


def _write(tmp_path, name, cfg) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("shipped, cfg", [("llama-3-8b", LLAMA3_8B), ("gpt-oss-120b", GPT_OSS_120B),
                                          ("gemma-3-27b", GEMMA3_27B), ("qwen3-30b-a3b", QWEN3_30B_A3B),
                                          ("qwen2.5-7b", QWEN25_7B), ("qwen2.5-vl-7b", QWEN25_VL_7B),
                                          ("qwen3-vl-30b-a3b", QWEN3_VL_30B_A3B), ("llama-3.1-8b", LLAMA31_8B),
                                          ("qwen3-32b", QWEN3_32B), ("qwen3-235b-a22b", QWEN3_235B_A22B)])
def test_a_config_gives_the_shipped_spec(tmp_path, shipped, cfg):
    spec = get_model_spec(_write(tmp_path, shipped, cfg))
    expected = dataclasses.replace(get_model_spec(shipped), name=spec.name, eagle_head_intermediate_size=0)
    assert spec == expected


def test_a_replay_of_a_config_equals_the_shipped_models(tmp_path):
    path = _write(tmp_path, "llama3", LLAMA3_8B)
    for name, model in (("a", path), ("b", "llama-3-8b")):
        res = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--model", model, "--quiet",
                                        "--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
    for part in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "a" / part).read_bytes() == (tmp_path / "b" / part).read_bytes()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["config"]["model"] == path
    config = EngineConfig.from_flat({"model": path, "max_model_len": 4096})  # (a --config file's `model:` too)
    assert config.max_model_len == 4096


@pytest.mark.parametrize("change, field, message", [
    ({"index_topk": 2048}, "index_topk", "sparse attention"),
    ({"layer_types": ["conv", "full_attention"] * 16}, "layer_types", "conv are not modelled"),  # (LFM2's short convolutions)
    ({"layer_types": ["linear_attention", "full_attention"] * 16}, "linear_num_key_heads", "is missing"),
    ({"attention_chunk_size": 8192, "no_rope_layers": [1, 1, 0]}, "no_rope_layers", "must name each of the"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config", "quant_method 'awq' is not modelled"),
    ({"quantization_config": {"quant_method": "compressed-tensors",
                              "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}},
     "quantization_config", "quant_method 'compressed-tensors' is not modelled"),
    ({"num_hidden_layers": None}, "num_hidden_layers", "is missing"),
    ({"hidden_size": -1}, "hidden_size", "must be a positive whole number, got -1"),
    ({"sliding_window": 4096, "layer_types": ["full_attention", "sliding_attention"] * 16}, "layer_types",
     "one full-attention layer every k layers"),
    ({"sliding_window": 4096, "layer_types": ["sliding_attention"] * 31}, "layer_types", "each of the 32 layers"),
])
def test_configs_simkv_cannot_size_are_refused_with_the_field(tmp_path, change, field, message):
    path = _write(tmp_path, "bad", LLAMA3_8B | change)
    with pytest.raises(ValueError, match=f"bad.json: field '{field}'.*{message}"):
        get_model_spec(path)
    res = CliRunner().invoke(main, ["capacity", "--model", path])
    assert res.exit_code != 0 and f"field '{field}'" in res.output and "bad.json" in res.output


def test_a_file_that_is_not_a_config(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(main, ["capacity", "--model", str(bad)])
    assert res.exit_code != 0 and "not readable JSON" in res.output
    res = CliRunner().invoke(main, ["capacity", "--model", str(tmp_path / "missing.json")])
    assert res.exit_code != 0 and "no such file" in res.output
    res = CliRunner().invoke(main, ["capacity", "--model", "llama-9"])
    assert res.exit_code == 1 and "(or the path of a Hugging Face config.json)" in res.output
    res = CliRunner().invoke(main, ["replay", "--model", "llama-9"])
    assert res.exit_code == 2 and "nor a Hugging Face config.json" in res.output


def test_a_wrapper_may_hold_fields_at_its_top_level(tmp_path):
    text = {k: v for k, v in GEMMA3_27B["text_config"].items() if k != "vocab_size"}
    spec = get_model_spec(_write(tmp_path, "g", GEMMA3_27B | {"text_config": text, "vocab_size": 262208}))
    assert spec.vocab_size == 262208
    with pytest.raises(ValueError, match=r"g2.json \(text_config\): field 'vocab_size' is missing"):
        get_model_spec(_write(tmp_path, "g2", GEMMA3_27B | {"text_config": text}))
    # the window fields too: the wrapper's sliding_window and pattern, the text config's layers
    bare = {k: v for k, v in GEMMA3_27B["text_config"].items() if k not in ("sliding_window", "sliding_window_pattern",
                                                                            "layer_types")}
    windows = {k: GEMMA3_27B["text_config"][k] for k in ("sliding_window", "sliding_window_pattern",
                                                          "layer_types") if k in GEMMA3_27B["text_config"]}
    outer = get_model_spec(_write(tmp_path, "g3", GEMMA3_27B | {"text_config": bare} | windows))
    assert (outer.sliding_window, outer.full_attention_interval) == (1024, 6)


def test_sliding_windows_from_layer_types_and_on_every_layer(tmp_path):
    every = get_model_spec(_write(tmp_path, "mistral", LLAMA3_8B | {"sliding_window": 4096}))
    assert (every.sliding_window, every.full_attention_interval) == (4096, 0)
    untied_unsaid = {k: v for k, v in LLAMA3_8B.items() if k != "tie_word_embeddings"}
    gemma2 = get_model_spec(_write(tmp_path, "gemma2", untied_unsaid | {"model_type": "gemma2", "sliding_window": 4096}))
    assert (gemma2.sliding_window, gemma2.full_attention_interval, gemma2.tie_word_embeddings) == (4096, 2, True)


FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}
CT_FP8_CONFIG = {"quant_method": "compressed-tensors",
                 "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}}


@pytest.mark.parametrize("quant", [FP8_CONFIG, CT_FP8_CONFIG])
def test_fp8_checkpoints_hold_their_linear_layers_at_one_byte(tmp_path, quant):
    """An FP8 checkpoint (vLLM's fp8, or compressed-tensors' FP8 weights) keeps its layers' linear
    weights at 1 byte; embeddings, LM head and norms stay bf16. Its weights take about 7.5 GB
    of llama-3-8b's 16 GB less, which the KV cache gets, and a decode step reads half the
    layer bytes (the roofline's compute rate stays bf16's)."""
    from simkv.backends.roofline import RooflineCostModel
    from simkv.capacity import compute_capacity
    from simkv.specs import get_gpu_spec

    bf16 = get_model_spec("llama-3-8b")
    fp8 = get_model_spec(_write(tmp_path, "fp8", LLAMA3_8B | {"quantization_config": quant}))
    assert fp8.linear_weight_bytes == 1.0 and fp8.expert_weight_bytes == 2.0
    linear = bf16.num_linear_params
    assert bf16.weight_bytes - fp8.weight_bytes == linear  # (one byte less per linear weight)
    assert 6.9e9 < linear < 7.0e9
    blocks = [compute_capacity(EngineConfig.from_flat({"model": m})).num_gpu_blocks for m in ("llama-3-8b", fp8.name)]
    assert blocks[1] - blocks[0] == linear // (16 * bf16.kv_bytes_per_token(2))  # (the freed bytes, in blocks)
    gpu = get_gpu_spec("H100-SXM")
    a, b = RooflineCostModel(bf16, gpu), RooflineCostModel(fp8, gpu)
    assert b.weight_bytes == a.weight_bytes - linear
    # Hopper multiplies them in fp8: their FLOPs count bf16 / fp8 peak of theirs
    assert a.flops_per_token - b.flops_per_token == pytest.approx(
        2 * linear * (1 - gpu.bf16_tflops / gpu.fp8_tflops), rel=1e-12)
    moe = get_model_spec(_write(tmp_path, "moe", QWEN3_30B_A3B | {"quantization_config": quant}))
    assert (moe.linear_weight_bytes, moe.expert_weight_bytes) == (1.0, 1.0)


def test_a_qwen2_vl_vision_config_gives_its_vit_by_hand(tmp_path):
    """Qwen2-VL-7B's ViT: 32 layers of embed_dim 1,280 with an MLP of mlp_ratio 4 (two
    projections), 2 x 2 patches an embedding, every layer over the whole image, one merger."""
    cfg = dict(QWEN25_VL_7B, model_type="qwen2_vl",
               vision_config={"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "hidden_size": 3584,
                              "patch_size": 14, "spatial_merge_size": 2})
    spec = get_model_spec(_write(tmp_path, "qwen2-vl", cfg))
    assert (spec.vision_num_layers, spec.vision_hidden_size, spec.vision_intermediate_size) == (32, 1280, 5120)
    assert spec.vision_layer_params == 4 * 1280 ** 2 + 2 * 1280 * 5120
    assert spec.vision_full_attention_layers == 32 and spec.vision_window_patches == 0
    assert spec.vision_merger_params == 5120 ** 2 + 5120 * 3584 and spec.mm_max_tokens_per_item == 16384


@pytest.mark.parametrize("vision, message", [
    ({"depth": 0}, "field 'depth' must be a positive whole number, got 0"),
    ({"deepstack_visual_indexes": [8, 30]}, "field 'deepstack_visual_indexes' must list layers below depth (27)"),
])
def test_bad_vision_fields_are_refused_with_the_field(tmp_path, vision, message):
    cfg = dict(QWEN3_VL_30B_A3B, vision_config=QWEN3_VL_30B_A3B["vision_config"] | vision)
    with pytest.raises(ValueError, match=r"q.json \(vision_config\): " + message.replace("(", r"\(").replace(")", r"\)")):
        get_model_spec(_write(tmp_path, "q", cfg))


# NVIDIA ModelOpt quantization configs and the KV dtype vLLM 0.33 runs `--kv-cache-dtype auto` as for
# each (its get_kv_cache_quant_algo_string on these dicts; "": the model's dtype)
MODELOPT_CASES = [
    ({"quant_method": "modelopt", "quant_algo": "FP8",
      "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}}, "fp8_e4m3"),
    ({"quant_method": "modelopt", "quant_algo": "FP8",
      "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": True}}, ""),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"type": "float", "num_bits": 4}}, "nvfp4"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, ""),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}, "fp8_e4m3"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8_PB_WO", "kv_cache_quant_algo": "NVFP4"}},
     "nvfp4"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}}, ""),
    ({"quant_method": "modelopt", "quant_algo": "fp8_per_channel_per_token", "kv_cache_quant_algo": "fp8"},
     "fp8_e4m3"),
]


@pytest.mark.parametrize("quant, kv_dtype", MODELOPT_CASES)
def test_a_modelopt_checkpoint_is_fp8_and_sets_the_kv_cache_dtype_auto_runs_as(tmp_path, quant, kv_dtype):
    spec = get_model_spec(_write(tmp_path, "modelopt", LLAMA3_8B | {"quantization_config": quant}))
    assert spec.linear_weight_bytes == 1.0 and spec.checkpoint_kv_cache_dtype == kv_dtype


def test_auto_is_the_checkpoints_kv_dtype_and_a_given_one_wins(tmp_path):
    from simkv.capacity import compute_capacity

    quant = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}
    path = _write(tmp_path, "fp8kv", LLAMA3_8B | {"quantization_config": quant})
    for options in ({}, {"kv_cache_dtype": "auto"}):
        config = EngineConfig.from_flat({"model": path} | options)
        assert config.cache.kv_cache_dtype == "fp8_e4m3" and compute_capacity(config).kv_bytes_per_token == 65536
    assert EngineConfig.from_flat({"model": path, "kv_cache_dtype": "bfloat16"}).cache.kv_cache_dtype == "bfloat16"
    # an older export keeps its quantization in hf_quant_config.json beside config.json
    folder = tmp_path / "older"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    older = get_model_spec(str(folder / "config.json"))
    assert older.linear_weight_bytes == 1.0 and older.checkpoint_kv_cache_dtype == "fp8_e4m3"
    # exclusions outside the decoder layers (the LM head, routers) change nothing; inside them, refused
    ok = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", "model.layers.*.mlp.gate"]}
    assert get_model_spec(_write(tmp_path, "ok", LLAMA3_8B | {"quantization_config": ok})).linear_weight_bytes == 1.0
    attn = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8",
                                                         "exclude_modules": ["lm_head", "model.layers.0.self_attn*"]}}
    with pytest.raises(ValueError, match="model.layers.0.self_attn\\* kept out of the quantized format"):
        get_model_spec(_write(tmp_path, "attn", LLAMA3_8B | {"quantization_config": attn}))
    # the same for vLLM's fp8 (ignored_layers) and compressed-tensors (ignore) checkpoints
    for quant, bad in ((FP8_CONFIG | {"ignored_layers": ["model.layers.0.mlp.down_proj"]}, "model.layers.0.mlp.down_proj"),
                       (CT_FP8_CONFIG | {"ignore": ["lm_head", "re:.*self_attn.o_proj"]}, "re:.\\*self_attn.o_proj")):
        with pytest.raises(ValueError, match=f"{bad} kept out of the quantized format"):
            get_model_spec(_write(tmp_path, "ignored", LLAMA3_8B | {"quantization_config": quant}))
    routers = CT_FP8_CONFIG | {"ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]}
    assert get_model_spec(_write(tmp_path, "routers", QWEN3_30B_A3B | {"quantization_config": routers})
                          ).expert_weight_bytes == 1.0
    # an algorithm simkv does not size is refused by name
    other = _write(tmp_path, "other", LLAMA3_8B | {"quantization_config": {"quant_method": "modelopt",
                                                                          "quant_algo": "INT4_AWQ"}})
    with pytest.raises(ValueError, match="ModelOpt quant_algo 'INT4_AWQ' is not modelled"):
        get_model_spec(other)


def test_attention_kept_out_of_the_format_stays_bf16(tmp_path):
    """NVIDIA's NVFP4 exports of DeepSeek keep every layer's attention out of the format
    (`model.layers.*.self_attn*`): those projections stay bf16 and are multiplied at the bf16
    rate, the MLPs and experts at 4 bits and the fp4 peak."""
    from simkv.backends.roofline import RooflineCostModel
    from simkv.specs import NVFP4_WEIGHT_BYTES, get_gpu_spec

    patterns = (["lm_head", "model.layers.*.self_attn*"], ["re:.*self_attn.*"], ["*self_attn*"])
    bf16 = get_model_spec("llama-3-8b")
    attention = bf16.num_attention_layers * bf16.attention_params
    for k, exclude in enumerate(patterns):
        quant = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "exclude_modules": exclude}}
        spec = get_model_spec(_write(tmp_path, f"a{k}", LLAMA3_8B | {"quantization_config": quant}))
        assert (spec.linear_weight_bytes, spec.attention_weight_bytes) == (NVFP4_WEIGHT_BYTES, 2.0)
        assert bf16.weight_bytes - spec.weight_bytes == pytest.approx(
            (bf16.num_linear_params - attention) * (2 - NVFP4_WEIGHT_BYTES))
        assert spec.fp4_matmul_params == bf16.num_linear_params - attention
    b200 = get_gpu_spec("B200")
    a, b = RooflineCostModel(bf16, b200), RooflineCostModel(spec, b200)
    mlp = bf16.num_linear_params - attention
    assert a.flops_per_token - b.flops_per_token == pytest.approx(2 * mlp * (1 - 2250 / 9000), rel=1e-12)
    # FP8 likewise, and on a latent-attention model its KV up-projection keeps the bf16 rate too
    quant = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["model.layers.*.self_attn*"]}
    fp8 = get_model_spec(_write(tmp_path, "fp8a", LLAMA3_8B | {"quantization_config": quant}))
    assert (fp8.fp8_matmul_params, fp8.matmul_params_at(2.0)) == (mlp, attention)
    from tests.replay.test_mla_models import DEEPSEEK_V3

    v3 = get_model_spec(_write(tmp_path, "v3a", DEEPSEEK_V3 | {"quantization_config": {
        "quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*"]}}}))
    plain = get_model_spec(_write(tmp_path, "v3b", DEEPSEEK_V3 | {"quantization_config": {
        "quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}}))
    assert RooflineCostModel(v3, b200).flops_per_upproj_token > RooflineCostModel(plain, b200).flops_per_upproj_token
    assert v3.weight_bytes - plain.weight_bytes == pytest.approx(
        v3.num_attention_layers * v3.attention_params * (2 - NVFP4_WEIGHT_BYTES))
    sparse = DEEPSEEK_V3 | {"index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128, "quantization_config": {
        "quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*"]}}}
    with pytest.raises(ValueError, match="attention kept out of the quantized format is not modelled with sparse"):
        get_model_spec(_write(tmp_path, "v32", sparse))


def test_a_modelopt_nvfp4_checkpoint_holds_its_linear_layers_in_fp4(tmp_path):
    """NVFP4 (W4A4): every linear layer at 4 bits and an fp8 scale per 16 weights (0.5625 bytes);
    on a data-center Blackwell its matmuls run at the fp4 peak, elsewhere weight-only at the
    bf16 rate (vLLM's Marlin kernels), as the roofline counts them."""
    from simkv.backends.roofline import RooflineCostModel
    from simkv.specs import NVFP4_WEIGHT_BYTES, get_gpu_spec

    quant = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
                                                          "group_size": 16, "exclude_modules": ["lm_head"]}}
    bf16 = get_model_spec("llama-3-8b")
    fp4 = get_model_spec(_write(tmp_path, "fp4", LLAMA3_8B | {"quantization_config": quant}))
    linear = bf16.num_linear_params
    assert fp4.linear_weight_bytes == NVFP4_WEIGHT_BYTES and fp4.checkpoint_kv_cache_dtype == "fp8_e4m3"
    assert bf16.weight_bytes - fp4.weight_bytes == pytest.approx(linear * (2 - 0.5625))
    assert fp4.fp4_matmul_params == linear and fp4.fp8_matmul_params == 0
    b200 = get_gpu_spec("B200")
    a, b = RooflineCostModel(bf16, b200), RooflineCostModel(fp4, b200)
    assert a.flops_per_token - b.flops_per_token == pytest.approx(2 * linear * (1 - 2250 / 9000), rel=1e-12)
    assert b.weight_bytes == pytest.approx(a.weight_bytes - linear * (2 - 0.5625))
    h200 = get_gpu_spec("H200")  # (no fp4 tensor cores: the bf16 rate, the smaller reads)
    assert RooflineCostModel(fp4, h200).flops_per_token == RooflineCostModel(bf16, h200).flops_per_token
    moe = get_model_spec(_write(tmp_path, "moe4", QWEN3_30B_A3B | {"quantization_config": quant}))
    assert (moe.linear_weight_bytes, moe.expert_weight_bytes) == (NVFP4_WEIGHT_BYTES, NVFP4_WEIGHT_BYTES)
    with pytest.raises(ValueError, match="its checkpoint is quantized already"):
        moe.quantized("fp8")
    # weight-only NVFP4 (W4A16): the same bytes, multiplied in bf16 even on a B200
    w4a16 = get_model_spec(_write(tmp_path, "w4a16", LLAMA3_8B | {"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}}))
    assert w4a16.linear_weight_bytes == NVFP4_WEIGHT_BYTES and w4a16.fp4_weight_only
    assert RooflineCostModel(w4a16, b200).flops_per_token == a.flops_per_token
    assert RooflineCostModel(w4a16, b200).weight_bytes == b.weight_bytes
    # on data-parallel ranks each rank's share of the routed experts' FLOPs is at the fp4 peak too
    dp = RooflineCostModel(moe, b200, data_parallel_size=2)
    routed = 2 * moe.num_moe_layers * moe.num_experts_per_tok * moe.expert_params * 2250 / 9000
    assert dp.expert_flops_per_group_token == pytest.approx(routed / 2, rel=1e-12)


def _mixed(layers: dict, **extra) -> dict:
    """A ModelOpt MIXED_PRECISION quantization_config over `layers` (module name: quant_algo)."""
    table = {name: {"quant_algo": algo} | ({"group_size": 16} if "NVFP4" in algo else {})
             for name, algo in layers.items()}
    return {"quant_method": "modelopt", "quantization": {"quant_algo": "MIXED_PRECISION",
                                                         "quantized_layers": table, **extra}}


def _modules(layers, kind: str, algo: str, experts: int = 2) -> dict:
    """Module names of a kind in the given layers, as ModelOpt exports them (a few experts each)."""
    names = {"attention": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"],
             "mla": ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                     "self_attn.kv_b_proj", "self_attn.o_proj"],
             "mlp": ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
             "shared": ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"],
             "experts": [f"mlp.experts.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")]}
    return {f"model.layers.{i}.{n}": algo for i in layers for n in names[kind]}


def test_a_mixed_precision_checkpoint_sizes_each_kind_of_module_in_its_format(tmp_path):
    """ModelOpt's MIXED_PRECISION names each module's format: FP8 attention beside NVFP4 experts
    (the router, the LM head and the modules it does not name stay bf16), or DeepSeek's dense and
    shared MLPs in FP8 with NVFP4 experts and bf16 attention; an MTP layer's entries are not the
    decoder's. The roofline multiplies each at its format's peak."""
    from simkv.backends.roofline import RooflineCostModel
    from simkv.specs import NVFP4_WEIGHT_BYTES, get_gpu_spec
    from tests.replay.test_mla_models import DEEPSEEK_V3

    layers = range(48)
    quant = _mixed(_modules(layers, "attention", "FP8") | _modules(layers, "experts", "NVFP4")
                   | {f"model.layers.{i}.mlp.gate": "FP8" for i in layers} | {"lm_head": "NVFP4"},
                   kv_cache_quant_algo="FP8", exclude_modules=["lm_head"])
    spec = get_model_spec(_write(tmp_path, "qmix", QWEN3_30B_A3B | {"quantization_config": quant}))
    bf16 = get_model_spec("qwen3-30b-a3b")
    assert (spec.attention_weight_bytes, spec.expert_weight_bytes, spec.linear_weight_bytes) == (
        1.0, NVFP4_WEIGHT_BYTES, 2.0)
    assert spec.checkpoint_kv_cache_dtype == "fp8_e4m3" and not spec.fp4_weight_only
    attention = bf16.attention_linear_params
    experts = bf16.num_moe_layers * bf16.num_experts * bf16.expert_params
    assert bf16.weight_bytes - spec.weight_bytes == pytest.approx(attention * 1.0 + experts * (2 - NVFP4_WEIGHT_BYTES))
    assert spec.fp8_matmul_params == attention
    assert spec.fp4_matmul_params == bf16.num_moe_layers * bf16.num_experts_per_tok * bf16.expert_params
    b200 = get_gpu_spec("B200")
    assert RooflineCostModel(spec, b200).flops_per_token < RooflineCostModel(bf16, b200).flops_per_token
    # DeepSeek-V3: dense MLPs (layers 0-2) and shared experts FP8, experts NVFP4, attention not named (bf16)
    dense, moe = range(3), range(3, 61)
    table = (_modules(dense, "mlp", "FP8") | _modules(moe, "shared", "FP8_PB_WO") | _modules(moe, "experts", "NVFP4")
             | _modules([61], "experts", "FP8"))  # (layer 61: the MTP module)
    v3 = get_model_spec(_write(tmp_path, "v3mix", DEEPSEEK_V3 | {"quantization_config": _mixed(table)}))
    assert (v3.linear_weight_bytes, v3.attention_weight_bytes, v3.expert_weight_bytes) == (1.0, 2.0, NVFP4_WEIGHT_BYTES)
    # an older export keeps it in hf_quant_config.json beside config.json; W4A16 experts multiply in bf16
    folder = tmp_path / "side"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    (folder / "hf_quant_config.json").write_text(json.dumps(_mixed(_modules(layers, "experts", "W4A16_NVFP4"))))
    side = get_model_spec(str(folder / "config.json"))
    assert side.expert_weight_bytes == NVFP4_WEIGHT_BYTES and side.fp4_weight_only
    assert side.attention_weight_bytes == side.linear_weight_bytes == 2.0
    out = CliRunner().invoke(main, ["replay", "traces/req400.parquet", "--model", _write(tmp_path, "q", QWEN3_30B_A3B | {
        "quantization_config": quant}), "--gpu", "B200", "--out", str(tmp_path / "r"), "--quiet"])
    assert out.exit_code == 0, out.output


@pytest.mark.parametrize("table, extra, message", [
    (_modules(range(47), "attention", "FP8"), {}, "attention of 47 layers .* the model has 48 such layers"),
    (_modules(range(48), "attention", "FP8"), {"exclude_modules": ["model.layers.0.self_attn*"]},
     "attention of 47 layers"),
    (_modules(range(48), "experts", "NVFP4") | {"model.layers.5.mlp.experts.9.up_proj": "W4A16_NVFP4"}, {},
     "in NVFP4 and model.layers.5.mlp.experts.9.up_proj in W4A16_NVFP4: one kind of module .* two formats"),
    (_modules(range(48), "experts", "NVFP4") | _modules(range(48), "attention", "W4A16_NVFP4"), {},
     "both NVFP4 and W4A16_NVFP4"),
    (_modules(range(48), "experts", "INT4_AWQ"), {}, "quant_algo 'INT4_AWQ' is not modelled"),
    ({"model.layers.3.post_feedforward_norm_proj": "FP8"}, {}, "a decoder module simkv cannot place"),
])
def test_mixed_precision_that_simkv_cannot_size_is_refused(tmp_path, table, extra, message):
    with pytest.raises(ValueError, match=message):
        get_model_spec(_write(tmp_path, "bad", QWEN3_30B_A3B | {"quantization_config": _mixed(table, **extra)}))


def test_mixed_precision_keeps_one_format_for_dense_and_shared_mlps(tmp_path):
    from tests.replay.test_mla_models import DEEPSEEK_V3

    moe = range(3, 61)
    cases = [(_modules(range(3), "mlp", "FP8") | _modules(moe, "experts", "NVFP4"),  # (shared experts bf16)
              "no module of the model's shared experts is named"),
             (_modules(range(3), "mlp", "FP8") | _modules(moe, "shared", "NVFP4"), "in one format")]
    for table, message in cases:
        with pytest.raises(ValueError, match=message):
            get_model_spec(_write(tmp_path, "v3bad", DEEPSEEK_V3 | {"quantization_config": _mixed(table)}))
    with pytest.raises(ValueError, match="without a 'quantized_layers' mapping"):
        get_model_spec(_write(tmp_path, "empty", LLAMA3_8B | {"quantization_config": _mixed({})}))
