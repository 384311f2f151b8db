"""DeepSeek's layout: multi-head latent attention (the cache, the roofline's two attention paths)
and mixtures of experts with leading dense layers and shared experts."""

import dataclasses
import json

import pytest
from click.testing import CliRunner

from simkv.backends.factory import make_backend
from simkv.backends.roofline import RooflineCostModel, mla_decode_query_len
from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.core.outputs import ScheduledChunk, SchedulerOutput
from simkv.specs import ModelSpec, get_gpu_spec, get_model_spec
from tests.core.helpers import make_request

DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
               "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
               "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "n_group": 8, "topk_group": 4,
               "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
                    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
                    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "vocab_size": 102400, "max_position_embeddings": 163840, "tie_word_embeddings": False,
                    "n_group": 1, "topk_group": 1}
# Kimi K2's text model in a multimodal wrapper (Kimi K2.5's layout), bf16 here
KIMI_K2 = {"model_type": "kimi_k25", "text_config": {
    "model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "max_position_embeddings": 262144, "tie_word_embeddings": False}}
QWEN15_MOE = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
              "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 8192,
              "tie_word_embeddings": False}


def _write(tmp_path, name, cfg) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_published_sizes():
    """The model cards' totals: DeepSeek-V3 671B (37B active), DeepSeek-V2-Lite 15.7B, Kimi K2
    1T (32B active), Qwen1.5-MoE-A2.7B 14.3B (2.7B active)."""
    v3, lite = get_model_spec("deepseek-v3"), get_model_spec("deepseek-v2-lite")
    assert v3.num_params / 1e9 == pytest.approx(671.0, abs=0.5)
    assert v3.num_active_params / 1e9 == pytest.approx(37.5, abs=0.5)
    assert lite.num_params / 1e9 == pytest.approx(15.7, abs=0.05)
    assert (v3.num_moe_layers, lite.num_moe_layers) == (58, 26)
    # FP8: about one byte a parameter (embeddings, LM head and norms bf16)
    assert v3.weight_bytes == pytest.approx(v3.num_params + v3.embedding_params + v3.num_norm_params + v3.hidden_size)
    assert lite.weight_bytes == pytest.approx(2 * lite.num_params)


def test_configs_give_the_shipped_specs_and_kimi_k2(tmp_path):
    for shipped, cfg in (("deepseek-v3", DEEPSEEK_V3), ("deepseek-v2-lite", DEEPSEEK_V2_LITE)):
        spec = get_model_spec(_write(tmp_path, shipped, cfg))
        assert spec == dataclasses.replace(get_model_spec(shipped), name=spec.name)
    kimi = get_model_spec(_write(tmp_path, "kimi", KIMI_K2))
    assert kimi.num_params / 1e12 == pytest.approx(1.0, abs=0.03)
    assert kimi.num_active_params / 1e9 == pytest.approx(32.9, abs=0.5)
    assert (kimi.num_dense_layers, kimi.shared_expert_intermediate_size, kimi.q_lora_rank) == (1, 2048, 1536)
    # the shipped kimi-k2 (Kimi-K2-Instruct: 131,072 positions, an FP8 checkpoint) is that text model
    assert get_model_spec("kimi-k2") == dataclasses.replace(
        kimi, name="kimi-k2", max_position_embeddings=131072, linear_weight_bytes=1.0, expert_weight_bytes=1.0)
    qwen = get_model_spec(_write(tmp_path, "qwen", QWEN15_MOE))
    assert qwen.shared_expert_intermediate_size == 5632 and qwen.num_dense_layers == 0
    assert qwen.num_params / 1e9 == pytest.approx(14.3, abs=0.05)
    assert qwen.num_active_params / 1e9 == pytest.approx(2.7, abs=0.05)


@pytest.mark.parametrize("change, field, message", [
    ({"moe_layer_freq": 2}, "moe_layer_freq", "experts on only some layers"),
    ({"mlp_only_layers": [3, 7]}, "mlp_only_layers", "dense layers among the expert layers"),
    ({"first_k_dense_replace": 61}, "first_k_dense_replace", "leaves no expert layer"),
    ({"index_topk": 2048}, "index_n_heads", "is missing"),
    ({"qk_rope_head_dim": None}, "qk_rope_head_dim", "is missing"),
])
def test_layouts_simkv_cannot_size_are_refused_with_the_field(tmp_path, change, field, message):
    path = _write(tmp_path, "bad", DEEPSEEK_V3 | change)
    with pytest.raises(ValueError, match=f"bad.json: field '{field}'.*{message}"):
        get_model_spec(path)


def test_spec_checks_its_latent_and_dense_fields():
    base = dict(name="x", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=24,
                intermediate_size=32, vocab_size=100, max_position_embeddings=128)
    with pytest.raises(ValueError, match="qk_rope_head_dim < head_dim"):
        ModelSpec(**base, kv_lora_rank=16, qk_rope_head_dim=24, v_head_dim=16)
    with pytest.raises(ValueError, match="num_dense_layers needs a mixture of experts"):
        ModelSpec(**base, num_dense_layers=1, dense_intermediate_size=64)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size needs"):
        ModelSpec(**base, shared_expert_intermediate_size=64)


def test_the_latent_cache_is_not_split_by_tensor_parallelism():
    """DeepSeek-V3 caches 512 + 64 values per token and layer, 70,272 bytes a token in bf16, on every
    GPU whatever the TP (llama-3-70b's 320 KiB a token splits to 40 KiB on 8 GPUs)."""
    v3 = get_model_spec("deepseek-v3")
    assert v3.kv_bytes_per_token(2) == v3.kv_bytes_per_token(2, 8) == 61 * 576 * 2 == 70_272
    assert v3.kv_bytes_per_token(1, 8) == 35_136  # (fp8 KV cache)
    llama = get_model_spec("llama-3-70b")
    assert llama.kv_bytes_per_token(2, 8) * 8 == llama.kv_bytes_per_token(2) == 327_680
    config = EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8))
    cap = compute_capacity(config)
    assert cap.block_bytes == 70_272 * 16
    assert cap.num_gpu_blocks == cap.available_kv_bytes // cap.block_bytes
    res = CliRunner().invoke(main, ["capacity", "--model", "deepseek-v3", "--gpu", "H200", "-tp", "8", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["kv_bytes_per_token_per_gpu"] == 70_272 and rep["kv_bytes_per_token"] == 8 * 70_272
    assert rep["latent_cache_on_every_gpu"] and rep["num_gpu_blocks"] == cap.num_gpu_blocks
    assert rep["weight_bytes_per_gpu"] == int(get_model_spec("deepseek-v3").weight_bytes / 8)


def _step(chunks=(), decodes=0, context=0) -> SchedulerOutput:
    return SchedulerOutput(step=0, chunks=list(chunks), num_decode_reqs=decodes, decode_context_tokens=context,
                           decodes=None, preempted=[], num_running=len(chunks) + decodes, num_waiting=0,
                           num_blocks_used=0, prefix_query_tokens=0, prefix_hit_tokens=0)


def _chunk(new: int, cached: int) -> ScheduledChunk:
    return ScheduledChunk(make_request(0, cached + new, 1), cached, new)


def test_roofline_sends_chunks_down_vllms_two_latent_paths():
    """On Hopper (FlashAttention MLA) chunks of up to 512 tokens take the absorbed path, 2 * heads *
    (2 * 512 + 64) FLOPs per pair and layer, with no up-projection; a 513-token chunk takes the
    expanded one, 2 * heads * (192 + 128) per pair plus the up-projection of its cached tokens.
    Ampere (Triton MLA) sends every chunk longer than one token down the expanded path."""
    v3 = get_model_spec("deepseek-v3")
    h100, a100 = get_gpu_spec("H100-SXM"), get_gpu_spec("A100-80GB")
    model = RooflineCostModel(v3, h100, tensor_parallel_size=8)
    heads_layers = 61 * 128 / 8
    assert model.flops_per_latent_pair == 2 * heads_layers * (2 * 512 + 64)
    assert model.flops_per_pair == 2 * heads_layers * (192 + 128)
    # (kv_b_proj is an fp8 linear layer of the checkpoint: its FLOPs at the fp8 rate)
    assert model.flops_per_upproj_token == pytest.approx(2 * 61 * 512 * 128 * (128 + 128) / 8 * 989 / 1979)
    assert (mla_decode_query_len(h100), mla_decode_query_len(a100), mla_decode_query_len(a100, 3)) == (512, 1, 4)
    # an fp8 cache on Hopper: FlashMLA (64-token blocks) up to 128; with 16-token blocks Triton MLA
    assert (mla_decode_query_len(h100, 0, True, 64), mla_decode_query_len(h100, 0, True, 16)) == (128, 1)
    fp8 = make_backend("roofline", EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8,
                                                               kv_cache_dtype="fp8", block_size=64)))
    assert fp8.mla_decode_query_len == 128
    # without --block-size the config takes vLLM's pick: 64 for an fp8 latent on Hopper, 16 otherwise
    picked = {(gpu, dtype): EngineConfig.from_flat(dict(model="deepseek-v3", gpu=gpu, tensor_parallel_size=8,
                                                        kv_cache_dtype=dtype)).cache.block_size
              for gpu in ("H200", "A100-80GB") for dtype in ("auto", "fp8")}
    assert picked == {("H200", "auto"): 16, ("H200", "fp8"): 64, ("A100-80GB", "auto"): 16, ("A100-80GB", "fp8"): 16}
    assert EngineConfig.from_flat(dict(kv_cache_dtype="fp8")).cache.block_size == 16  # (the default model)
    assert EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", kv_cache_dtype="fp8", tensor_parallel_size=8,
                                       block_size=16)).cache.block_size == 16
    for new, cached in ((512, 3000), (513, 3000)):
        tokens, pairs, latent, read, upproj = model.mla_chunk_work([_chunk(new, cached)])
        all_pairs = new * cached + new * (new + 1) // 2
        assert (tokens, read) == (new, new + cached)
        assert (pairs, latent, upproj) == ((0, all_pairs, 0) if new <= 512 else (all_pairs, 0, cached))
    ampere = RooflineCostModel(v3, a100, tensor_parallel_size=8)
    assert ampere.mla_chunk_work([_chunk(2, 100)])[1:3] == (2 * 100 + 3, 0)
    assert ampere.mla_chunk_work([_chunk(1, 100)])[1:3] == (0, 101)
    # the step time adds those FLOPs: at 16k cached tokens a long prefill is compute-bound
    long = _step([_chunk(4096, 16_384)])
    t, p, lat, r, u = model.mla_chunk_work(long.chunks)
    flops = model.flops_per_token * t + model.flops_per_seq * 1 + model.flops_per_pair * p + model.flops_per_upproj_token * u
    assert model.execute(long) >= flops / model.flop_rate


def test_tensor_parallelism_leaves_every_gpu_the_whole_latent_to_read():
    """Under TP=8 a decode step's FLOPs and weights split 8 ways but its latent reads do not (the
    decode lines are checked against execute in test_cost_models.py)."""
    v3, gpu = get_model_spec("deepseek-v3"), get_gpu_spec("H200")
    one, eight = RooflineCostModel(v3, gpu, 1), RooflineCostModel(v3, gpu, 8)
    assert eight.kv_bytes_per_token == one.kv_bytes_per_token
    assert eight.flops_per_latent_pair * 8 == one.flops_per_latent_pair
    a1, b1 = eight.decode_step_line(256)[1::2]  # (per context token, in ticks)
    assert b1 == one.decode_step_line(256)[3]
    assert a1 * 8 == pytest.approx(one.decode_step_line(256)[1], abs=8)


def test_deepseek_replays_with_mtp_and_refuses_the_gpu_backend(tmp_path):
    """A DeepSeek-V3 replay on 8 H200s runs and repeats itself byte for byte; an MTP drafter is one
    target-shaped expert layer with latent attention whose cache rides in every block; the GPU
    backend refuses the model (simulated only)."""
    args = ["replay", "traces/req400.parquet", "--model", "deepseek-v3", "--gpu", "H200", "-tp", "8", "--quiet"]
    for name in ("a", "b"):
        res = CliRunner().invoke(main, args + ["--out", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
    for part in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "a" / part).read_bytes() == (tmp_path / "b" / part).read_bytes()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["num_finished"] == 400
    mtp = EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8,
                                      speculative_method="mtp", num_speculative_tokens=1))
    draft = mtp.speculative.draft_spec(get_model_spec("deepseek-v3"))
    assert (draft.num_layers, draft.num_moe_layers, draft.kv_lora_rank) == (1, 1, 512)
    plain = compute_capacity(EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8)))
    assert compute_capacity(mtp).block_bytes == plain.block_bytes * 62 // 61
    backend = make_backend("roofline", mtp)
    assert backend.execute(_step([_chunk(2, 1000)])) > 0
    res = CliRunner().invoke(main, ["replay", "--model", "deepseek-v2-lite", "--backend", "gpu", "--device", "cpu"])
    assert res.exit_code != 0 and "simulated only" in res.output and "latent attention" in res.output
