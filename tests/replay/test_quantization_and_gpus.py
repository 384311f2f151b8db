"""vLLM's --quantization fp8 (weights at one byte, fp8 matmuls where the GPU has fp8 tensor
cores) and the GPU catalogue (Ada, Hopper, Blackwell): memory, FLOP rates and the block sizes
vLLM's attention backends pick there."""

import json

import pytest
from click.testing import CliRunner

from simkv.backends.factory import make_backend
from simkv.backends.roofline import RooflineCostModel, mla_decode_query_len
from simkv.capacity import compute_capacity
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from simkv.core.outputs import ScheduledChunk
from simkv.specs import canonical_gpu, get_gpu_spec, get_model_spec, gpu_names
from tests.core.helpers import make_request, make_step


def test_fp8_quantization_halves_the_linear_weights_and_keeps_the_rest_bf16():
    bf16 = get_model_spec("llama-3-70b")
    fp8 = bf16.quantized("fp8")
    assert fp8.num_params == bf16.num_params
    assert fp8.linear_weight_bytes == 1.0
    # the linear layers lose one byte a weight; embeddings, LM head and norms stay bf16
    assert bf16.weight_bytes - fp8.weight_bytes == bf16.num_linear_params
    assert fp8.fp8_matmul_params == bf16.num_linear_params
    assert bf16.fp8_matmul_params == 0
    moe = get_model_spec("qwen3-30b-a3b").quantized("fp8")
    assert moe.expert_weight_bytes == 1.0
    routers = moe.num_moe_layers * moe.hidden_size * moe.num_experts  # (bf16 in vLLM's fp8 models)
    assert moe.fp8_matmul_params == (moe.num_linear_params - routers
                                     + moe.num_moe_layers * moe.num_experts_per_tok * moe.expert_params)


def test_an_fp8_checkpoint_stays_as_it_is_and_another_quantization_is_refused():
    dsv3 = get_model_spec("deepseek-v3")
    assert dsv3.quantized("fp8") == dsv3
    assert dsv3.quantized(None) == dsv3
    with pytest.raises(ConfigError, match="quantization 'fp8'.*gpt-oss-120b.*0.53125"):
        EngineConfig.from_flat({"model": "gpt-oss-120b", "gpu": "H200", "quantization": "fp8"})
    with pytest.raises(ConfigError, match="quantization 'int4'.*not modelled"):
        EngineConfig.from_flat({"model": "llama-3-8b", "quantization": "int4"})


def test_fp8_weights_leave_more_memory_for_the_kv_cache():
    bf16 = compute_capacity(EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2}))
    fp8 = compute_capacity(EngineConfig.from_flat({"model": "llama-3-70b", "tensor_parallel_size": 2,
                                                   "quantization": "fp8"}))
    spec = get_model_spec("llama-3-70b")
    assert fp8.available_kv_bytes - bf16.available_kv_bytes == pytest.approx(spec.num_linear_params / 2, abs=1)
    assert fp8.num_gpu_blocks > 5 * bf16.num_gpu_blocks
    # 70B in fp8 fits one H200, not in bf16
    assert compute_capacity(EngineConfig.from_flat({"model": "llama-3-70b", "gpu": "H200",
                                                    "quantization": "fp8"})).num_gpu_blocks > 0
    with pytest.raises(ConfigError, match="No available memory"):
        compute_capacity(EngineConfig.from_flat({"model": "llama-3-70b", "gpu": "H200"}))


def _prefill(tokens: int):
    return make_step([ScheduledChunk(make_request(0, tokens, 1), 0, tokens)])


@pytest.mark.parametrize("gpu", ["H100-SXM", "L40S", "B200"])
def test_fp8_matmuls_run_at_the_fp8_peak_where_the_gpu_has_one(gpu):
    bf16_spec = get_model_spec("llama-3-70b")
    g = get_gpu_spec(gpu)
    bf16 = RooflineCostModel(bf16_spec, g, 4)
    fp8 = RooflineCostModel(bf16_spec.quantized("fp8"), g, 4)
    saved = 2.0 * bf16_spec.num_linear_params / 4 * (1 - g.bf16_tflops / g.fp8_tflops)
    assert bf16.flops_per_token - fp8.flops_per_token == pytest.approx(saved, rel=1e-12)
    # a long prefill is compute-bound: its matmuls take about half the time
    long = _prefill(8192)
    ratio = (fp8.execute(long) - fp8.fixed_s) / (bf16.execute(long) - bf16.fixed_s)
    assert 0.5 < ratio < 0.75
    # a lone decode is memory-bound: it reads about half the weight bytes
    assert fp8.weight_bytes < 0.52 * bf16.weight_bytes


def test_on_ampere_fp8_weights_are_read_at_one_byte_but_multiplied_at_the_bf16_rate():
    spec = get_model_spec("llama-3-8b")
    a100 = get_gpu_spec("A100-80GB")
    assert not a100.runs_fp8_matmuls
    bf16, fp8 = RooflineCostModel(spec, a100), RooflineCostModel(spec.quantized("fp8"), a100)
    assert fp8.flops_per_token == bf16.flops_per_token
    assert fp8.weight_bytes < bf16.weight_bytes


def test_a_data_parallel_rank_multiplies_its_fp8_experts_at_the_fp8_rate():
    spec = get_model_spec("qwen3-30b-a3b")
    g = get_gpu_spec("H200")
    bf16 = RooflineCostModel(spec, g, 1, data_parallel_size=4)
    fp8 = RooflineCostModel(spec.quantized("fp8"), g, 1, data_parallel_size=4)
    discount = 1 - g.bf16_tflops / g.fp8_tflops
    assert fp8.expert_flops_per_group_token == pytest.approx(bf16.expert_flops_per_group_token * (1 - discount))
    assert fp8.flops_per_token_local < bf16.flops_per_token_local


def test_mtp_takes_the_targets_quantization_and_an_eagle_head_its_own_weights():
    mtp = EngineConfig.from_flat({"model": "qwen3-30b-a3b", "quantization": "fp8", "speculative_method": "mtp",
                                  "num_speculative_tokens": 1})
    eagle = EngineConfig.from_flat({"model": "qwen3-30b-a3b", "quantization": "fp8",
                                    "speculative_method": "eagle3", "num_speculative_tokens": 1})
    assert mtp.draft_network.linear_weight_bytes == 1.0 and mtp.draft_network.expert_weight_bytes == 1.0
    assert eagle.draft_network.linear_weight_bytes == 2.0


def test_latent_attention_block_sizes_follow_the_backend_vllm_picks():
    def block(gpu, **extra):
        return EngineConfig.from_flat({"model": "deepseek-v3", "gpu": gpu, "tensor_parallel_size": 8,
                                       **extra}).cache.block_size

    assert block("H200") == 16  # FlashAttention MLA
    assert block("H200", kv_cache_dtype="fp8") == 64  # FlashMLA
    assert block("B200") == 32  # FlashInfer MLA: 32 or 64
    assert block("B300", kv_cache_dtype="fp8") == 32
    assert block("B200", block_size=16) == 16  # given: Triton MLA then
    assert block("L40S") == 16  # Triton MLA
    assert block("MI300X") == block("MI300X", kv_cache_dtype="fp8") == 16  # ROCm without AITER: Triton MLA
    # grouped-query attention keeps 16 on Blackwell (FlashInfer takes 16, 32 or 64)
    assert EngineConfig.from_flat({"model": "llama-3-8b", "gpu": "B200"}).cache.block_size == 16


def test_blackwell_holds_more_of_deepseek_v3s_cache_than_hopper():
    def tokens(gpu):
        return compute_capacity(EngineConfig.from_flat({"model": "deepseek-v3", "gpu": gpu,
                                                        "tensor_parallel_size": 8})).kv_cache_tokens

    assert tokens("B300") > tokens("B200") > tokens("H200")
    with pytest.raises(ConfigError, match="No available memory"):
        tokens("H100-SXM")  # 671B in fp8 over 8 x 80 GB leaves nothing


def test_the_catalogue_and_cuda_device_names():
    for name in gpu_names():
        g = get_gpu_spec(name)
        assert g.memory_gib > 0 and g.mem_bandwidth_gbs > 0 and g.bf16_tflops > 0 and g.interconnect_gbs > 0
        assert g.fp8_tflops == 0 or g.fp8_tflops == pytest.approx(2 * g.bf16_tflops, rel=0.03)
    assert canonical_gpu("NVIDIA H20") == "H20"
    assert canonical_gpu("NVIDIA H200") == "H200"
    assert canonical_gpu("NVIDIA B200") == "B200"
    assert canonical_gpu("NVIDIA GB200") == "GB200"
    assert canonical_gpu("NVIDIA B300 SXM6 AC") == "B300"
    assert canonical_gpu("NVIDIA L40S") == "L40S"
    assert canonical_gpu("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert canonical_gpu("AMD Instinct MI300X") == "MI300X"
    assert canonical_gpu("NVIDIA H100 PCIe") == "H100-PCIe"
    assert canonical_gpu("NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert canonical_gpu("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert canonical_gpu("NVIDIA L4") == "L4" and canonical_gpu("NVIDIA L40") is None
    assert canonical_gpu("AMD Instinct MI355X") == "MI355X"
    assert canonical_gpu("Tesla T4") is None


def test_amd_gpus_are_not_taken_for_hopper():
    """torch reports gfx942 as capability 9.4; vLLM's CUDA backends (FlashAttention MLA's 512-token
    decode path) are not picked on ROCm, and its fp8 matmuls run at the fp8 peak there."""
    mi300x, h200 = get_gpu_spec("MI300X"), get_gpu_spec("H200")
    assert (mi300x.cuda_major, h200.cuda_major) == (0, 9)
    assert mla_decode_query_len(mi300x) == 1 and mla_decode_query_len(h200) == 512
    assert mi300x.runs_fp8_matmuls


def test_replay_records_the_quantization_and_refuses_it_where_it_cannot_hold(tmp_path):
    runner = CliRunner()
    out = tmp_path / "fp8"
    res = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(out), "--model", "llama-3-8b",
                               "-q", "fp8", "--cost-model", "roofline"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["quantization"] == "fp8"
    plain = tmp_path / "bf16"
    res = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(plain), "--model", "llama-3-8b",
                               "--cost-model", "roofline"])
    assert "quantization" not in json.loads((plain / "summary.json").read_text())["config"]
    assert json.loads((plain / "summary.json").read_text())["num_gpu_blocks"] < summary["num_gpu_blocks"]
    res = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(tmp_path / "g"), "--backend", "gpu",
                               "--device", "cpu", "--model", "tiny-llama", "-q", "fp8"])
    assert res.exit_code != 0 and "--quantization" in res.output


def test_a_calibration_is_not_stretched_over_fp8_weights(tmp_path):
    config = EngineConfig.from_flat({"model": "llama-3-8b", "quantization": "fp8"})
    with pytest.raises(ValueError, match="bf16 weights.*--quantization fp8"):
        make_backend(str(tmp_path / "calib.json"), config)


def test_capacity_shows_the_quantization_in_its_tables_and_layouts():
    runner = CliRunner()
    res = runner.invoke(main, ["capacity", "--model", "llama-3-70b", "-tp", "2", "-q", "fp8"])
    assert res.exit_code == 0 and "weights per GPU (fp8)" in res.output
    layouts = runner.invoke(main, ["capacity", "--model", "llama-3-70b", "--layouts", "2", "-q", "fp8", "--json"])
    rep = json.loads(layouts.output)
    assert rep["quantization"] == "fp8"
    one, pipeline, two = rep["layouts"]
    assert one["layout"] == "2 x TP 1" and two["layout"] == "1 x TP 2" and pipeline["layout"] == "1 x TP 1 x PP 2"
    assert pipeline["fits"] and 0.95 < pipeline["num_gpu_blocks"] / two["num_gpu_blocks"] < 1.0
    # 67.7 GiB of weights leave an 80 GB H100 a few GiB of cache: TP 2 keeps 21 times as many blocks
    assert one["fits"] and two["fits"] and two["num_gpu_blocks"] > 20 * one["num_gpu_blocks"]


@pytest.mark.parametrize("dtype, like", [("fp8_e4m3", "fp8"), ("fp8_e5m2", "fp8"), ("float16", "auto"),
                                         ("bfloat16", "auto")])
def test_vllms_kv_cache_dtype_spellings(dtype, like):
    """vLLM's --kv-cache-dtype spellings: both fp8 formats store a byte an element as fp8 does
    (and pick FlashMLA's block of 64 on Hopper for latent attention), the 16-bit ones two bytes."""
    def cap(kv):
        return compute_capacity(EngineConfig.from_flat(dict(model="deepseek-v3", gpu="H200", tensor_parallel_size=8,
                                                            kv_cache_dtype=kv)))
    a, b = cap(dtype), cap(like)
    assert (a.kv_bytes_per_token, a.block_size, a.num_gpu_blocks) == (b.kv_bytes_per_token, b.block_size, b.num_gpu_blocks)
    result = CliRunner().invoke(main, ["capacity", "--model", "llama-3-8b", "--kv-cache-dtype", dtype, "--json"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("gpu, tokens, seqs", [("H100-SXM", 8192, 1024), ("H200", 8192, 1024), ("H20", 8192, 1024),
                                               ("B200", 16384, 1024), ("MI300X", 16384, 1024), ("A100-80GB", 2048, 256),
                                               ("L40S", 2048, 256)])
def test_vllms_batch_defaults_by_gpu(gpu, tokens, seqs):
    """vLLM 0.33's API-server defaults (EngineArgs.get_batch_defaults): by the GPU's memory, an A100
    kept on the small tier."""
    from simkv.config import vllm_batch_defaults

    assert vllm_batch_defaults(gpu, 8192) == (tokens, seqs)


def test_vllms_batch_defaults_adjustments():
    """Without chunked prefill the tokens cover max_model_len; at most max_num_seqs x max_model_len;
    the sequences at most the tokens."""
    from simkv.config import vllm_batch_defaults

    assert vllm_batch_defaults("H100-SXM", 32768, enable_chunked_prefill=False) == (32768, 1024)
    assert vllm_batch_defaults("L40S", 4, enable_chunked_prefill=True) == (1024, 256)
    assert vllm_batch_defaults("L40S", 1, enable_chunked_prefill=True) == (256, 256)


def test_replay_takes_vllms_batch_defaults_for_the_gpu(tmp_path):
    """`simkv replay` runs vLLM 0.33's API-server defaults for its GPU unless given; off, 256 and
    8,192 on every GPU (simkv's defaults before); summary.json records the values in force."""
    import pandas as pd

    trace = tmp_path / "t.csv"
    pd.DataFrame({"arrival_time_s": [0.0, 0.1], "prompt_tokens": [100, 200], "output_tokens": [5, 5]}).to_csv(trace, index=False)
    runs = {"h100": [], "l40s": ["--gpu", "L40S"], "given": ["--gpu", "L40S", "--max-num-seqs", "128"],
            "off": ["--gpu", "L40S", "--no-vllm-batch-defaults"]}
    seen = {}
    for name, flags in runs.items():
        done = CliRunner().invoke(main, ["replay", str(trace), "--out", str(tmp_path / name), "--num-gpu-blocks",
                                         "1000", *flags])
        assert done.exit_code == 0, done.output
        config = json.loads((tmp_path / name / "summary.json").read_text())["config"]
        seen[name] = (config["max_num_seqs"], config["max_num_batched_tokens"], config.get("vllm_batch_defaults"))
    assert seen == {"h100": (1024, 8192, None), "l40s": (256, 2048, None), "given": (128, 2048, None),
                    "off": (256, 8192, False)}


@pytest.mark.parametrize("options, seqs, tokens", [
    (dict(), 1024, 8192), (dict(gpu="B200"), 1024, 16384), (dict(gpu="L40S"), 256, 2048),
    (dict(gpu="B200", max_num_seqs=64), 64, 16384), (dict(max_num_batched_tokens=512), 512, 512),
    (dict(enable_chunked_prefill=False, max_model_len=32768), 1024, 32768),
    (dict(vllm_batch_defaults=False, gpu="B200"), 256, 8192),
    (dict(vllm_batch_defaults=False, max_num_batched_tokens=512), 256, 512),
    (dict(performance_mode="throughput"), 2048, 16384), (dict(performance_mode="throughput", gpu="L40S"), 512, 4096),
    (dict(performance_mode="throughput", max_num_seqs=100), 100, 16384),
    (dict(performance_mode="throughput", enable_chunked_prefill=False, max_model_len=8192), 2048, 16384),
    (dict(performance_mode="throughput", vllm_batch_defaults=False), 512, 16384)])
def test_vllm_batch_defaults_option(options, seqs, tokens):
    """What is not given is vLLM 0.33's on the GPU (a given token budget caps the defaulted
    sequences; without chunked prefill the defaulted budget covers max_model_len); with
    vllm_batch_defaults off, 256 and 8,192; the throughput performance mode doubles what is
    defaulted, before the budget covers max_model_len, as vLLM does. A config read back from its own to_dict is the same."""
    config = EngineConfig.from_flat(options)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (seqs, tokens)
    assert config.to_dict().get("vllm_batch_defaults", True) is options.get("vllm_batch_defaults", True)
    assert config.to_dict().get("performance_mode", "balanced") == options.get("performance_mode", "balanced")
    assert EngineConfig.from_flat(config.to_dict()).to_dict() == config.to_dict()
    assert "defaulted_batch_options" not in config.to_dict()


def test_a_derived_config_defaults_its_batch_again():
    """given_options() leaves out the defaulted batch sizes, so that a P/D pool's own GPU or token
    budget defaults them again; to_dict() keeps every value in force."""
    base = EngineConfig.from_flat(dict(max_num_seqs=64))
    assert base.scheduler.defaulted_batch_options == ("max_num_batched_tokens",)
    assert "max_num_batched_tokens" not in base.given_options() and base.given_options()["max_num_seqs"] == 64
    pool = EngineConfig.from_flat(base.given_options() | dict(gpu="B200"))
    assert (pool.scheduler.max_num_seqs, pool.scheduler.max_num_batched_tokens) == (64, 16384)
    with pytest.raises(ConfigError, match="unknown option 'defaulted_batch_options'"):
        EngineConfig.from_flat(dict(defaulted_batch_options=()))


def test_capacity_shows_the_batch_in_force_and_its_activation_reserve():
    """`simkv capacity` shows the batch sizes in force; vLLM's 2,048-token default on an L40S
    leaves a smaller activation reserve, so more KV blocks, than 8,192 tokens
    (--no-vllm-batch-defaults)."""
    ours = json.loads(CliRunner().invoke(main, ["capacity", "--gpu", "L40S", "--json"]).output)
    fixed = json.loads(CliRunner().invoke(main, ["capacity", "--gpu", "L40S", "--no-vllm-batch-defaults",
                                                 "--json"]).output)
    assert (ours["max_num_seqs"], ours["max_num_batched_tokens"]) == (256, 2048)
    assert (fixed["max_num_seqs"], fixed["max_num_batched_tokens"]) == (256, 8192)
    assert ours["num_gpu_blocks"] > fixed["num_gpu_blocks"]


def test_performance_mode_takes_vllms_names_and_refuses_interactivity():
    """`--performance-mode throughput` reaches the replay's config; 'interactivity' (vLLM's, which
    changes only CUDA graphs and kernels) is refused with the reason, not replayed as something else."""
    with pytest.raises(ConfigError, match="interactivity.*not the scheduler"):
        EngineConfig.from_flat(dict(performance_mode="interactivity"))
    shown = json.loads(CliRunner().invoke(main, ["capacity", "--performance-mode", "throughput", "--json"]).output)
    assert (shown["max_num_seqs"], shown["max_num_batched_tokens"]) == (2048, 16384)
