"""--vllm-serve: a `vllm serve` command line as simkv's engine options (simkv/cli/vllm_serve.py),
and vLLM's --disable-sliding-window, which such commands carry."""

import json

import pytest

from simkv.cli.vllm_serve import (IGNORED, REFUSED, SPECIAL, UNMODELLED, ServeCommandError, human_int,
                                  modelled_flags, resolve_model, serve_options, vllm_flags)
from simkv.config import ConfigError, EngineConfig
from simkv.specs import model_names
from tests.cli_runs import cli_fails, cli_ok

TRACE = "traces/req400.parquet"


def test_every_vllm_flag_is_sorted_once():
    """Each of vLLM 0.33's 320 serve flags is modelled, special, ignored, not modelled or refused:
    exactly one of them, and only vLLM's names appear in the lists."""
    classes = [modelled_flags(), set(SPECIAL), set(IGNORED), set(UNMODELLED), set(REFUSED)]
    flags = set(vllm_flags())
    assert len(flags) == 320
    assert set().union(*classes) == flags
    assert sum(len(c) for c in classes) == len(flags)


def test_every_modelled_flag_with_a_value_has_simkvs_reader():
    """A valued flag is read by simkv's own flag of that name (so 40g or 32K mean what they mean
    to vLLM), and a switch in vLLM is a switch in simkv."""
    from simkv.cli.vllm_serve import _simkv_params

    for name in modelled_flags():
        param = _simkv_params().get(name)
        if vllm_flags()[name]["nargs"] == "0":
            assert param is None or param.is_flag, name
        else:
            assert param is not None and not param.is_flag, name


def test_a_typical_command():
    served = serve_options(
        "CUDA_VISIBLE_DEVICES=0,1 vllm serve meta-llama/Meta-Llama-3-70B-Instruct \\\n"
        " -tp 2 --max-num-seqs 128 --max_num_batched_tokens 16k --gpu-memory-utilization=0.85 --port 8001 "
        "--enable-prefix-caching --disable-log-requests --enforce-eager -O3 --kv-cache-dtype fp8 "
        "--max-model-len 32K --no-async-scheduling --kv-cache-memory-bytes 40g")
    assert served.options == {"model": "llama-3-70b", "tensor_parallel_size": 2, "max_num_seqs": 128,
                              "max_num_batched_tokens": 16000, "gpu_memory_utilization": 0.85,
                              "enable_prefix_caching": True, "kv_cache_dtype": "fp8", "max_model_len": 32768,
                              "async_scheduling": False, "kv_cache_memory_bytes": 40 * 10**9}
    assert served.unmodelled == ["--enforce-eager", "-O3"]
    assert served.ignored == ["--port", "--disable-log-requests"]
    assert "--enforce-eager" in served.note() and "--port" in served.note()


@pytest.mark.parametrize("text, value", [("None", None), ("none", None), ("1024", 1024), ("0", 0)])
def test_a_retention_interval_of_none_is_none(text, value):
    """vLLM's None (retain every sliding-window block) reaches the config as None, as simkv's
    own flag's `none` does."""
    options = serve_options(f"vllm serve google/gemma-3-12b-it --prefix-cache-retention-interval {text}").options
    assert options["prefix_cache_retention_interval"] == value
    assert EngineConfig.from_flat(options).attention.prefix_cache_retention_interval == value


def test_negative_forms_and_the_model_flag():
    served = serve_options("vllm serve --model Qwen/Qwen2.5-7B-Instruct --disable-prefix-caching "
                           "--disable-chunked-prefill --enable-chunked-mm-input --num-gpu-blocks-override 1000")
    assert served.options == {"model": "qwen2.5-7b", "enable_prefix_caching": False, "enable_chunked_prefill": False,
                              "disable_chunked_mm_input": False, "num_gpu_blocks": 1000}
    assert serve_options("--max-num-seqs 8").options == {"max_num_seqs": 8}  # (just the flags)


@pytest.mark.parametrize("text, value", [("32768", 32768), ("32k", 32000), ("32K", 32768), ("25.6k", 25600),
                                         ("1M", 2**20)])
def test_human_readable_integers(text, value):
    assert human_int(text, "--max-model-len") == value


@pytest.mark.parametrize("text", ["1.5K", "-2", "12x", "1.5"])
def test_bad_integers_are_refused(text):
    with pytest.raises(ServeCommandError, match="--max-model-len"):
        serve_options(f"vllm serve --max-model-len {text}")


def test_refused_flags_are_named_unless_at_vllms_default():
    with pytest.raises(ServeCommandError) as err:
        serve_options("vllm serve Qwen/Qwen2.5-7B --kv-transfer-config '{\"kv_connector\": \"NixlConnector\"}' "
                      "--mamba-block-size 8 --no-kv-sharing-fast-prefill")
    assert "--kv-transfer-config" in str(err.value) and "--mamba-block-size" in str(err.value)
    assert "kv-sharing-fast-prefill" not in str(err.value)  # (off: vLLM's default)
    with pytest.raises(ServeCommandError, match="--kv-sharing-fast-prefill"):
        serve_options("vllm serve --kv-sharing-fast-prefill")
    # the DCP interleave changes which rank holds a token, not what the blocks hold: a speed matter
    out = serve_options("vllm serve --dcp-kv-cache-interleave-size 16 --cp-kv-cache-interleave-size 16")
    assert "--dcp-kv-cache-interleave-size" in out.unmodelled and "--cp-kv-cache-interleave-size" in out.unmodelled


@pytest.mark.parametrize("command, match", [
    ("vllm serve --bogus 3", "--bogus is not a flag"),
    ("vllm serve some-org/some-model", "give its config.json with --model"),
    ("vllm serve --max-num-seqs", "needs a value"),
    ("vllm serve --enforce-eager=1", "takes no value"),
    ("vllm serve x --max-num-seqs 4 stray", "'stray' is neither"),
    ("vllm serve --dtype float32", "16-bit"),
    ("vllm serve --kv-cache-dtype fp4", "--kv-cache-dtype 'fp4'"),
    ("vllm serve --speculative-config '{\"method\": \"custom_class\"}'", "not modelled"),
])
def test_bad_commands_name_what_is_wrong(command, match):
    with pytest.raises(ServeCommandError, match=match):
        serve_options(command, model_given="some-org" not in command)


def test_a_served_model_is_a_shipped_one_or_a_config(tmp_path):
    assert all(resolve_model(repo) in model_names() for repo in ["openai/gpt-oss-120b", "deepseek-ai/DeepSeek-R1",
                                                               "google/gemma-3-27b-it"])
    assert resolve_model("META-LLAMA/Meta-Llama-3-8B/") == "llama-3-8b"
    assert resolve_model("meta-llama/Llama-3.3-70B-Instruct") == "llama-3.1-70b"
    assert [resolve_model(repo) for repo in ("Qwen/Qwen2.5-72B-Instruct", "mistralai/Mixtral-8x7B-Instruct-v0.1",
                                             "moonshotai/Kimi-K2-Instruct")] == ["qwen2.5-72b", "mixtral-8x7b", "kimi-k2"]
    assert EngineConfig.from_flat({"model": resolve_model("meta-llama/Llama-3.1-8B-Instruct")}).max_model_len == 131072
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path / "config.json")
    assert serve_options("vllm serve some-org/some-model -tp 2", model_given=True).options == {"tensor_parallel_size": 2}


def test_speculative_configs():
    ngram = serve_options("vllm serve --speculative-config "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")
    assert ngram.options == {"speculative_method": "ngram", "num_speculative_tokens": 4}
    assert ngram.unmodelled == ["--speculative-config prompt_lookup_max"]
    mtp = serve_options("vllm serve --speculative-config.method deepseek_mtp --speculative-config.num_speculative_tokens 2 "
                        "--speculative-config.synthetic_acceptance_rates '[0.8, 0.6]'")
    assert mtp.options == {"speculative_method": "mtp", "num_speculative_tokens": 2,
                           "spec_position_acceptance_rates": "0.8,0.6"}
    draft = serve_options("vllm serve --spec-model meta-llama/Llama-3.2-1B-Instruct --spec-tokens 5")
    assert draft.options == {"speculative_method": "draft_model", "spec_draft_model": "llama-3.2-1b",
                             "num_speculative_tokens": 5}
    eagle = serve_options("vllm serve -sc '{\"model\": \"nvidia/gpt-oss-120b-Eagle3-v2\", \"num_speculative_tokens\": 3,"
                          " \"num_speculative_tokens_per_batch_size\": [[1, 16, 3], [17, 256, 1]]}'")
    assert eagle.options == {"speculative_method": "eagle3", "num_speculative_tokens": 3,
                             "spec_tokens_per_batch_size": "1-16:3,17-256:1"}


def test_vllms_config_file_and_the_command_line_over_it(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: openai/gpt-oss-20b\nmax-num-seqs: 64\nenable-prefix-caching: false\nport: 9000\n"
                      "block_size: 32\n")
    served = serve_options(f"vllm serve --config {config} --max-num-seqs 128")
    assert served.options == {"model": "gpt-oss-20b", "enable_prefix_caching": False, "block_size": 32,
                              "max_num_seqs": 128}
    assert served.ignored == ["--port"]


def test_a_replay_from_a_serve_command_is_the_replay_from_the_same_flags(tmp_path):
    """The command's options are simkv's own: the two replays are byte for byte the same."""
    command = ("vllm serve meta-llama/Meta-Llama-3-8B-Instruct --max-num-seqs 32 --max-num-batched-tokens 2k "
               "--block-size 32 --no-enable-prefix-caching --port 8000")
    (tmp_path / "serve.sh").write_text(command + "\n")
    cli_ok(["replay", TRACE, "--out", str(tmp_path / "served"), "--quiet", "--vllm-serve", f"@{tmp_path / 'serve.sh'}"])
    cli_ok(["replay", TRACE, "--out", str(tmp_path / "flags"), "--quiet", "--model", "llama-3-8b", "--max-num-seqs",
            "32", "--max-num-batched-tokens", "2000", "--block-size", "32", "--no-enable-prefix-caching"])
    for name in ("requests.parquet", "steps.parquet"):
        assert (tmp_path / "served" / name).read_bytes() == (tmp_path / "flags" / name).read_bytes(), name
    served, flags = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("served", "flags"))
    assert served.pop("wall_time_s") > 0 and flags.pop("wall_time_s") > 0  # (the one field a rerun changes)
    assert served == flags
    config = served["config"]
    assert (config["max_num_seqs"], config["block_size"], config["enable_prefix_caching"]) == (32, 32, False)


def test_simkvs_flags_win_over_the_command_and_the_command_over_config(tmp_path):
    (tmp_path / "c.yaml").write_text("max_num_seqs: 16\nblock_size: 64\n")
    cli_ok(["replay", TRACE, "--out", str(tmp_path / "o"), "--quiet", "--config", str(tmp_path / "c.yaml"),
            "--vllm-serve", "vllm serve --max-num-seqs 32 --max-num-batched-tokens 4096 --block-size 32",
            "--max-num-batched-tokens", "1024"])
    config = json.loads((tmp_path / "o" / "summary.json").read_text())["config"]
    assert (config["max_num_seqs"], config["max_num_batched_tokens"], config["block_size"]) == (32, 1024, 32)


def test_the_cli_refuses_a_command_cleanly(tmp_path):
    out = cli_fails(["replay", TRACE, "--out", str(tmp_path / "o"), "--vllm-serve", "vllm serve --scheduler-cls x.Y"])
    assert "--scheduler-cls" in out
    assert not (tmp_path / "o").exists()
    assert "Invalid prefix_match_unit=4; with a single KV cache group" in cli_fails(
        ["capacity", "--vllm-serve", "vllm serve --prefix-match-unit 4"])


def test_sweep_fixes_the_commands_options(tmp_path):
    from simkv.cli.sweep_cmd import plan

    cells, _ = plan((TRACE,), ("block_size=16,32",), ("max_num_seqs=8",), None, "roofline",
                    vllm_serve="vllm serve openai/gpt-oss-20b --max-num-seqs 64 -tp 2")
    assert [dict(c.options) for c in cells] == [
        {"block_size": bs, "max_num_seqs": 8, "model": "gpt-oss-20b", "tensor_parallel_size": 2} for bs in (16, 32)]


# vLLM's --disable-sliding-window: every layer attends the whole context, max_model_len at most the window

def test_disable_sliding_window_makes_every_layer_full_and_caps_max_model_len():
    plain = EngineConfig.from_flat({"model": "gemma-3-12b"})
    off = EngineConfig.from_flat({"model": "gemma-3-12b", "disable_sliding_window": True})
    assert any(plain.layer_windows) and not any(off.layer_windows)
    assert (plain.max_model_len, off.max_model_len) == (131072, 1024)
    assert EngineConfig.from_flat({"model": "gpt-oss-20b", "disable_sliding_window": True}).max_model_len == 128
    assert EngineConfig.from_flat({"model": "gemma-3-12b", "disable_sliding_window": True,
                                   "max_model_len": 512}).max_model_len == 512
    assert off.to_dict()["disable_sliding_window"] is True
    assert "disable_sliding_window" not in plain.to_dict()


def test_disable_sliding_window_refuses_a_longer_max_model_len_and_a_window():
    with pytest.raises(ConfigError, match=r"max_model_len \(4096\) is greater than the derived max_model_len "
                                          r"\(sliding_window=1024"):
        EngineConfig.from_flat({"model": "gemma-3-12b", "disable_sliding_window": True, "max_model_len": 4096})
    with pytest.raises(ConfigError, match="give one of them"):
        EngineConfig.from_flat({"model": "gemma-3-12b", "disable_sliding_window": True, "sliding_window": 512})


def test_disable_sliding_window_leaves_other_models_alone():
    for model in ("llama-3-8b", "llama-4-scout"):
        plain = EngineConfig.from_flat({"model": model})
        off = EngineConfig.from_flat({"model": model, "disable_sliding_window": True})
        assert (off.layer_windows, off.max_model_len) == (plain.layer_windows, plain.max_model_len)


def test_disable_sliding_window_from_the_cli():
    out = cli_ok(["capacity", "--model", "gemma-3-12b", "--disable-sliding-window", "--json"])
    assert json.loads(out)["max_model_len"] == 1024


def test_json_options_given_key_by_key_merge_as_in_vllm():
    served = serve_options("vllm serve -sc '{\"method\": \"eagle3\", \"num_speculative_tokens\": 2}' "
                           "--speculative-config.num_speculative_tokens 4 "
                           "-ac '{\"backend\": \"FLASHINFER\"}' --attention-config.indexer_tp_shard_min_rows 1024 "
                           "--limit-mm-per-prompt.image 3 --limit-mm-per-prompt.video 0")
    assert served.options == {"indexer_tp_shard_min_rows": 1024, "limit_mm_per_prompt": 3,
                              "speculative_method": "eagle3", "num_speculative_tokens": 4}
    assert served.unmodelled == ["-ac backend"]


def test_other_modalities_may_be_limited_to_none():
    assert serve_options("vllm serve --limit-mm-per-prompt '{\"image\": 2, \"video\": 0}'").options == {
        "limit_mm_per_prompt": 2}
    with pytest.raises(ServeCommandError, match="only the image limit"):
        serve_options("vllm serve --limit-mm-per-prompt '{\"image\": 2, \"video\": 1}'")


# vLLM's --max-model-len auto (-1): the longest request the KV cache holds

def _estimate_in_error(options: dict) -> int:
    from simkv.capacity import compute_capacity

    with pytest.raises(ConfigError, match="estimated maximum model length is") as err:
        compute_capacity(EngineConfig.from_flat(options))
    return int(str(err.value).split("estimated maximum model length is ")[1].split(".")[0])


@pytest.mark.parametrize("options", [
    {"model": "llama-3.1-405b", "gpu": "H100-SXM", "tensor_parallel_size": 8, "quantization": "fp8",
     "gpu_memory_utilization": 0.7},
    {"model": "gemma-3-27b", "gpu": "H100-SXM", "quantization": "fp8", "gpu_memory_utilization": 0.42},
])
def test_auto_fits_max_model_len_to_vllms_estimate(options):
    """Where the model's length does not fit, auto serves the length vLLM's error names (a
    full-attention model, and a sliding-window one whose groups hold different blocks)."""
    from simkv.capacity import compute_capacity

    estimate = _estimate_in_error(options)
    config = EngineConfig.from_flat(options | {"max_model_len": -1})
    assert 0 < config.max_model_len == estimate < 131072
    compute_capacity(config)  # (which now fits)
    assert config.to_dict()["max_model_len_fitted"] is True
    assert config.given_options()["max_model_len"] == -1  # (a derived config fits its own)


def test_auto_keeps_the_models_length_where_it_fits_and_refuses_an_empty_cache():
    config = EngineConfig.from_flat({"model": "llama-3-8b", "max_model_len": -1})
    assert config.max_model_len == 8192
    with pytest.raises(ConfigError, match="Cannot auto-fit max_model_len"):
        EngineConfig.from_flat({"model": "llama-3-8b", "max_model_len": -1, "kv_cache_memory_bytes": 100_000})
    for bad in (0, -2):
        with pytest.raises(ConfigError, match="max_model_len must be >= 1, or -1"):
            EngineConfig.from_flat({"max_model_len": bad})


def test_auto_from_the_cli_and_a_serve_command():
    assert serve_options("vllm serve --max-model-len auto").options == {"max_model_len": -1}
    flags = ["capacity", "--model", "llama-3.1-405b", "-tp", "8", "--quantization", "fp8",
             "--gpu-memory-utilization", "0.7", "--json"]
    assert json.loads(cli_ok(flags + ["--max-model-len", "auto"]))["max_model_len"] == 100832
    assert "estimated maximum model length is 100832" in cli_fails(flags)


# simkv's options as a `vllm serve` command (goodput --grid's best combination)

@pytest.mark.parametrize("options", [
    {"model": "llama-3-70b", "tensor_parallel_size": 4, "max_num_seqs": 128, "max_num_batched_tokens": 2048,
     "enable_prefix_caching": False, "kv_cache_dtype": "fp8", "max_model_len": -1, "block_size": 32},
    {"model": "qwen2.5-vl-7b", "limit_mm_per_prompt": 2, "mm_encoder_tp_mode": "data", "async_scheduling": True,
     "kv_cache_memory_bytes": 40 * 10**9, "watermark": 0.01},
    {"model": "gpt-oss-120b", "speculative_method": "draft_model", "spec_draft_model": "llama-3.2-1b",
     "num_speculative_tokens": 4, "spec_tokens_per_batch_size": "1-16:4,17-64:2", "disable_sliding_window": True,
     "num_gpu_blocks": 5000, "prefix_cache_retention_interval": 1024},
    {"model": "gemma-3-27b", "prefix_cache_retention_interval": None, "kv_offloading_size": 64.0},
    {"model": "deepseek-v3", "cpu_offload_gb": 10.0, "cpu_offload_params": "experts,w2_weight",
     "indexer_tp_shard_min_rows": 100, "speculative_method": "mtp", "num_speculative_tokens": 1,
     "data_parallel_size": 8},
])
def test_options_as_a_serve_command_read_back_the_same(options):
    from simkv.cli.vllm_serve import serve_command

    command, left = serve_command(options | {"gpu": "H200"})
    assert left == ["gpu"] and command.startswith("vllm serve ")
    assert serve_options(command).options == {"async_scheduling": False} | options


def test_a_goodput_grid_names_the_serve_command_of_its_best(tmp_path):
    cli_ok(["goodput", "traces/azure_conv_slice.parquet", "--goodput", "ttft:2000", "--grid", "max_num_seqs=32,128",
            "--gpu", "H200", "--tolerance", "0.25", "--quiet", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "goodput.json").read_text())
    best = record["cells"][record["best_index"]]["swept"]["max_num_seqs"]
    serve = record["best_vllm_serve"]
    assert serve["not_vllm_flags"] == ["gpu"]
    assert serve_options(serve["command"]).options == {"model": "llama-3-8b", "max_num_seqs": best,
                                                       "async_scheduling": False}
    assert serve["command"] in (tmp_path / "goodput.md").read_text()


def test_an_external_load_balancer_needs_simkvs_router(tmp_path):
    command = "vllm serve deepseek-ai/DeepSeek-V2-Lite -dp 2 --data-parallel-external-lb"
    assert serve_options(command).external_router == "--data-parallel-external-lb"
    assert "give simkv's --router" in cli_fails(["replay", TRACE, "--out", str(tmp_path / "a"), "--vllm-serve", command])
    cli_ok(["replay", TRACE, "--out", str(tmp_path / "b"), "--quiet", "--vllm-serve", command, "--router",
            "least_outstanding"])
    cli_ok(["capacity", "--vllm-serve", command])  # (no ranks to route to in a capacity question)


def test_a_replay_at_an_auto_fitted_length_rejects_longer_prompts_and_says_why(tmp_path):
    out = cli_ok(["replay", TRACE, "--out", str(tmp_path), "--model", "llama-3-8b", "--num-gpu-blocks", "40",
                  "--max-model-len", "auto"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["max_model_len"] == 39 * 16  # (40 blocks less the null block)
    assert summary["num_rejected"] > 0 and "(the longest request the KV cache holds" in out


@pytest.mark.parametrize("name", sorted(vllm_flags()))
def test_each_flag_alone_is_taken_or_refused_cleanly(name):
    """Every serve flag, alone with vLLM's default value (or 1): its options build an engine
    config, or the command is refused with a ServeCommandError or the config with a ConfigError;
    nothing else escapes."""
    flag = vllm_flags()[name]
    option = max(flag["options"] or flag["negative"], key=len)
    default = flag["default"]
    value = [] if flag["nargs"] == "0" else [
        json.dumps(default) if isinstance(default, bool) else "1" if default is None else str(default)]
    try:
        served = serve_options(" ".join(["vllm serve", option, *value]), model_given=True)
    except ServeCommandError:
        return
    try:
        EngineConfig.from_flat(served.options)
    except ConfigError:
        pass


def test_layouts_refuse_a_layout_the_command_gives():
    assert "--vllm-serve gives tensor_parallel_size" in cli_fails(
        ["capacity", "--vllm-serve", "vllm serve meta-llama/Meta-Llama-3-70B -tp 2", "--layouts", "8"])
    cli_ok(["capacity", "--vllm-serve", "vllm serve meta-llama/Meta-Llama-3-70B", "--layouts", "8"])


# vLLM 0.33's --kv-cache-dtype choices (its CacheDType literal, vllm/config/cache.py)
VLLM_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                        "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                        "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit",
                        "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")


def test_every_kv_cache_dtype_of_vllms_is_taken_or_named():
    from simkv.cli.vllm_serve import UNMODELLED_KV_CACHE_DTYPES
    from simkv.config import KV_CACHE_DTYPES

    for dtype in VLLM_KV_CACHE_DTYPES:
        assert (dtype in KV_CACHE_DTYPES) != (dtype in UNMODELLED_KV_CACHE_DTYPES), dtype
    with pytest.raises(ServeCommandError, match="'fp8_inc': Intel Gaudi's \\(HPU\\) fp8 cache"):
        serve_options("vllm serve meta-llama/Meta-Llama-3-8B-Instruct --kv-cache-dtype fp8_inc")
    assert serve_options("vllm serve meta-llama/Meta-Llama-3-8B-Instruct --kv-cache-dtype ultraquant_4bit"
                         ).options["kv_cache_dtype"] == "ultraquant_4bit"


# vLLM 0.33's resolve_kv_cache_block_sizes on these KV-cache groups (a 16-token block): the error it
# raises, or None where the unit changes nothing; simkv refuses a unit below the block on several
# groups, where vLLM would hash finer and hit inside blocks
@pytest.mark.parametrize("options, error", [
    ({"prefix_match_unit": 16}, None),
    ({"prefix_match_unit": 32}, "Invalid prefix_match_unit=32; with a single KV cache group, prefix-cache hits land "
                                "on the block size (16). Unset it or set it to 16."),
    ({"prefix_match_unit": 32, "enable_prefix_caching": False}, None),
    ({"model": "gemma-3-12b", "prefix_match_unit": 16}, None),
    ({"model": "gemma-3-12b", "prefix_match_unit": 5}, "Invalid prefix_match_unit=5; prefix-cacheable KV cache group "
                                                       "block sizes must be divisible by prefix_match_unit. Got group "
                                                       "block sizes=[16, 16, 16, 16, 16, 16], prefix-cacheable=[16, 16, "
                                                       "16, 16, 16, 16]."),
    ({"model": "gemma-3-12b", "prefix_match_unit": 8}, "prefix-cache hits inside a block are not modelled"),
])
def test_prefix_match_unit_as_vllm_resolves_it(options, error):
    if error is None:
        assert EngineConfig.from_flat(options).cache.prefix_match_unit == options["prefix_match_unit"]
    else:
        with pytest.raises(ConfigError) as raised:
            EngineConfig.from_flat(options)
        assert error in str(raised.value)
    out = serve_options("vllm serve meta-llama/Meta-Llama-3-8B-Instruct --prefix-match-unit 16")
    assert out.options["prefix_match_unit"] == 16
