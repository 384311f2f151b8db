"""`--vllm-serve`: the engine options of a `vllm serve` command line, so that a replay runs with
the settings a server already has.

vLLM 0.33's parser defines 320 flags (vllm_serve_flags.json, written from it by
scripts/vllm_serve_flags.py). Each one is sorted here:

- the flags simkv models under vLLM's own name (every engine option of simkv.config that has
  one) become that option, their values read by simkv's own flag of that name (so `40g`, `32k`
  or `{"image": 4}` mean what they mean to vLLM); a few take a translation (`_special`);
- IGNORED flags bear on nothing simkv models: the HTTP server, logging, metrics, loading,
  tokenizer, chat templates, tool parsers;
- UNMODELLED flags may change a real server's speed (kernels, compilation, communication, the
  API server's CPU) but not what the scheduler and the KV cache do: they are accepted and named
  in a note, since simkv's cost model does not see them (a fit by `simkv calibrate` on the
  server saw their effect);
- REFUSED flags change the scheduler's or the KV cache's behaviour in a way simkv does not
  model: the command is refused, naming them, unless the value is vLLM's default.

A flag vLLM does not know is refused too, as vLLM would.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import click
import yaml

from simkv.cli.vllm_command_line import CommandLineError, Flag, flag_table, human_int, json_object, read_command
from simkv.config import engine_option_names
from simkv.specs.hf_config import is_config_path

_HF_MODELS_FILE = Path(__file__).resolve().parent.parent / "specs" / "hf_models.yaml"

IGNORED = frozenset("""
    headless grpc grpc_port host port uds api_key ssl_keyfile ssl_certfile ssl_ca_certs ssl_cert_reqs ssl_ciphers
    enable_ssl_refresh root_path middleware allow_credentials allowed_origins allowed_methods allowed_headers
    h11_max_incomplete_event_size h11_max_header_count disable_fastapi_docs enable_offline_docs
    enable_request_id_headers uvicorn_log_level disable_uvicorn_access_log disable_access_log_for_endpoints
    sse_keep_alive_interval enable_scale_out tokens_only fingerprint_mode fingerprint_value
    data_parallel_supervisor_port dp_supervisor_probe_interval_s dp_supervisor_probe_timeout_s
    dp_supervisor_probe_failure_threshold
    served_model_name lora_modules chat_template chat_template_content_format trust_request_chat_template
    trust_request_mm_kwargs default_chat_template_kwargs reasoning_effort_map response_role
    return_tokens_as_token_ids enable_auto_tool_choice exclude_tools_when_tool_choice_none tool_call_parser
    tool_parser_plugin tool_strict_level tool_server reasoning_parser reasoning_parser_plugin reasoning_config
    cohere_is_reasoning_model cohere_format anthropic_disabled_thinking_effort enable_prompt_tokens_details
    enable_force_include_usage enable_tokenizer_info_endpoint generation_config override_generation_config
    max_logprobs logprobs_mode return_sampling_mask enable_return_routed_experts use_fp64_gumbel
    enable_trace_replay watermark_config enable_flash_late_interaction
    max_log_len enable_log_outputs enable_log_deltas enable_log_requests log_error_stack disable_log_stats
    aggregate_engine_logging enable_per_request_metrics enable_server_load_tracking logging_config log_level
    log_config_file show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces
    per_request_spec_decode_metrics kv_cache_metrics kv_cache_metrics_sample
    cudagraph_metrics enable_layerwise_nvtx_tracing enable_mfu_metrics enable_logging_iteration_details
    jit_monitor_mode jit_monitor_verbose kv_events_config profiler_config watchdog_config
    fail_on_environ_validation ray_workers_use_nsight
    tokenizer tokenizer_mode tokenizer_revision skip_tokenizer_init trust_remote_code revision code_revision
    config_format hf_token seed load_format download_dir safetensors_load_strategy
    safetensors_prefetch_num_threads safetensors_prefetch_block_size model_loader_extra_config ignore_patterns
    use_tqdm_on_load pt_load_map_location max_parallel_loading_workers weight_transfer_config
    allowed_local_media_path allowed_media_domains media_io_kwargs interleave_mm_strings enable_mm_embeds
    enable_prompt_embeds
    enable_sleep_mode sleep_mode_backend sleep_mode_offload_cudagraph sleep_preserve_parameter_names
    enable_nccl_comm_suspend enable_fault_tolerance fault_tolerance_config
    master_addr master_port node_rank distributed_timeout_seconds cpu_distributed_timeout_seconds device_ids
    data_parallel_rank data_parallel_start_rank data_parallel_size_local data_parallel_address
    data_parallel_rpc_port worker_cls worker_extension_cls additional_config
""".split())

UNMODELLED = frozenset("""
    api_server_count renderer_num_workers stream_interval enforce_eager compilation_config optimization_level
    cudagraph_capture_sizes max_cudagraph_capture_size ir_op_priority kernel_config monokernel
    enable_flashinfer_autotune enable_cumem_allocator model_impl attention_backend moe_backend linear_backend
    sparse_indexer_topk_backend mamba_backend mamba_ssu_algorithm enable_mamba_cache_stochastic_rounding
    mamba_cache_philox_rounds kda_prefill_backend kda_decode_backend use_replayssm replayssm_buffer_len
    disable_cascade_attn logits_processors io_processor_plugin structured_outputs_config prefix_caching_hash_algo
    distributed_executor_backend disable_custom_all_reduce nnodes numa_bind numa_bind_nodes numa_bind_cpus
    enable_ep_weight_filter
    enable_elastic_ep elastic_ep_max_dp_size
    enable_shm_tensor_arena enable_batch_sharded_sampling
    disable_nccl_for_dp_synchronization data_parallel_backend enable_hc_sp
    cp_kv_cache_interleave_size dcp_kv_cache_interleave_size
    dcp_comm_backend dcp_q_replicate
    mm_processor_cache_gb mm_processor_cache_type mm_hasher_algorithm mm_shm_cache_max_object_size_mb
    mm_processor_kwargs mm_processor_device mm_ipc_gpu_memory_gb mm_device_do_normalize mm_tensor_ipc
    mm_encoder_attn_backend mm_encoder_attn_dtype mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_path
    mm_encoder_fp8_scale_save_margin video_pruning_rate video_pruning_method
    lora_dtype fully_sharded_loras specialize_active_lora enable_tower_connector_lora lora_target_modules
    enable_mixed_moe_lora_format enable_moe_shared_loras default_mm_loras max_lora_cls_labels
    allow_deprecated_quantization
""".split())

# flag -> why simkv refuses it (unless its value is vLLM's default)
REFUSED = {
    "kv_transfer_config": "prefill/decode disaggregation: give simkv's --prefill-replicas/--decode-replicas",
    "ec_transfer_config": "encoder disaggregation: give simkv's --encode-replicas",
    "ec_manager_config": "encoder disaggregation: give simkv's --encode-replicas",
    "kv_sharing_fast_prefill": "KV sharing across layers is not modelled",
    "swa_bounded_replay": "DeepSeek-V4's bounded sliding-window replay is not modelled",
    "mamba_block_size": "a Mamba block size of its own is not modelled (simkv derives vLLM's)",
    "enable_mamba_shared_prefix_checkpoint": "Mamba checkpoints at shared-prefix junctions are not modelled",
    "scheduler_cls": "a scheduler class of its own is not modelled",
    "hf_overrides": "overridden model shapes: give the edited config.json with --model",
    "hf_config_path": "a config.json elsewhere: give it with --model",
    "model_class_overrides": "model class overrides are not modelled",
    "quantization_config": "a quantization config of its own is not modelled (--quantization fp8 is)",
    "pooler_config": "pooling models are not modelled",
    "mm_encoder_only": "an encoder-only instance: give simkv's --encode-replicas",
    "diffusion_config": "diffusion language models are not modelled",
    "engram_config": "n-gram embedding storage is not modelled",
    "aux_output_config": "auxiliary outputs are not modelled",
}

# vLLM 0.33's --kv-cache-dtype choices that simkv does not model, and why
UNMODELLED_KV_CACHE_DTYPES = {"fp8_inc": "Intel Gaudi's (HPU) fp8 cache: simkv models CUDA and ROCm GPUs"}

_HUMAN_INTS = ("max_model_len", "max_num_batched_tokens")  # vLLM reads these as 32k, 1M, ...


ServeCommandError = CommandLineError  # (a ConfigError)


def vllm_flags() -> dict:
    """vLLM's serve flags by name (its `dest`): option strings, negative ones, arity, default."""
    return _table().flags


def _table():
    return flag_table("vllm_serve_flags.json", ("serve",))


@dataclass
class ServeOptions:
    """What a `vllm serve` command says: simkv's engine options (flat, vLLM's names), the flags
    accepted though simkv does not model them, and the flags that bear on nothing it models."""

    options: dict = field(default_factory=dict)
    unmodelled: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    external_router: str | None = None  # the flag that puts the user's own router in front of the DP ranks
    histogram_buckets: str | None = None  # --custom-histogram-buckets: what an autoscaler's latency query reads
    shutdown_timeout: float | None = None  # --shutdown-timeout: how a scale-down's replica ends (None: not given)

    def note(self) -> str | None:
        """One line for the user on what was not carried over (None: everything was)."""
        parts = []
        if self.unmodelled:
            parts.append("not modelled (simkv's cost model does not see them; a calibration on the server "
                         f"does): {', '.join(self.unmodelled)}")
        if self.ignored:
            parts.append(f"ignored (server, logging, loading): {', '.join(self.ignored)}")
        return "vllm serve: " + "; ".join(parts) if parts else None


@cache
def _hf_table() -> dict[str, list[str]]:
    """Shipped model name -> its Hugging Face repositories (specs/hf_models.yaml)."""
    return yaml.safe_load(_HF_MODELS_FILE.read_text())


@cache
def hf_models() -> dict[str, str]:
    """Hugging Face repository (lower case) -> shipped model name."""
    return {repo.lower(): name for name, repos in _hf_table().items() for repo in repos}


def resolve_model(model: str, what: str = "model") -> str:
    """A served model as simkv's --model: a shipped model's name, or a config.json path."""
    text = model.rstrip("/")
    if is_config_path(text):
        return text
    if Path(text, "config.json").is_file():
        return str(Path(text, "config.json"))
    name = hf_models().get(text.lower())
    if name is None:
        raise ServeCommandError(
            f"vllm serve's {what} '{model}' is not a model simkv ships (simkv/specs/hf_models.yaml lists the "
            "Hugging Face repositories it knows): give its config.json with --model")
    return name


@cache
def _simkv_params() -> dict[str, click.Option]:
    """simkv's own flags for engine options, by engine option name (their converters read
    vLLM's value syntax)."""
    from simkv.cli.replay_cmd import _ENGINE_FLAGS, _ENGINE_OPTIONS

    def holder():
        pass

    for option in _ENGINE_OPTIONS:
        option(holder)
    return {_ENGINE_FLAGS[p.name]: p for p in holder.__click_params__ if p.name in _ENGINE_FLAGS}


def modelled_flags() -> set[str]:
    """vLLM's flags that simkv takes as its engine option of the same name (SPECIAL's aside)."""
    return (set(vllm_flags()) & set(engine_option_names())) - SPECIAL


SPECIAL = frozenset({"model", "config", "num_gpu_blocks_override", "dtype", "runner", "convert", "mamba_cache_mode",
                     "kv_offloading_backend", "offload_backend", "speculative_config", "spec_method", "spec_model",
                     "spec_tokens", "attention_config", "eplb_config", "data_parallel_external_lb",
                     "data_parallel_hybrid_lb", "data_parallel_multi_port_external_lb", "custom_histogram_buckets",
                     "shutdown_timeout"})


def _convert(flag: Flag):
    """A modelled flag's value, read by simkv's flag of the same name where it has one."""
    name, word = flag.name, f"vllm serve {flag.word}"
    if _table().nargs(name) == "0":
        return not flag.negative
    text = ",".join(flag.values) if _table().nargs(name) == "+" else flag.value
    if name == "max_model_len" and text.strip().lower() in ("auto", "-1"):
        return -1  # (fitted to the KV cache)
    if name in _HUMAN_INTS:
        return human_int(text, word)
    if name == "kv_cache_dtype" and text in UNMODELLED_KV_CACHE_DTYPES:
        raise ServeCommandError(f"{word} {text!r}: {UNMODELLED_KV_CACHE_DTYPES[text]}")
    param = _simkv_params().get(name)
    if param is None:
        raise ServeCommandError(f"{word}: simkv has no reader for it")  # (every valued one has one: tested)
    from simkv.cli.replay_cmd import _DENSE

    try:
        value = param.type.convert(text, param, None)
    except click.BadParameter as exc:
        raise ServeCommandError(f"{word} {text!r}: {exc.format_message()}") from None
    return None if value is _DENSE else value  # (the CLI's spelling of None: retain every block)


_MTP = re.compile(r"(.+_)?mtp")
# vLLM's speculative-config keys that are simkv options as they are, both ways (serve_options,
# serve_command); acceptance (synthetic_acceptance_*) is read but not written: it is the traffic's
SPECULATIVE_KEYS = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
                    "parallel_drafting": "spec_parallel_drafting"}


def _speculative(spec: dict, word: str, out: ServeOptions) -> None:
    """vLLM's speculative config as simkv's speculative options."""
    spec = dict(spec)
    method, model = spec.pop("method", None), spec.pop("model", None)
    if method is None and model is not None:  # (vLLM's inference from the draft's name)
        lower = str(model).lower()
        method = "eagle3" if "eagle3" in lower else "eagle" if "eagle" in lower else "draft_model"
    if method is None:
        raise ServeCommandError(f"vllm serve {word}: give its method (or a draft model)")
    method = "mtp" if _MTP.fullmatch(str(method)) else str(method)
    if method not in ("ngram", "suffix", "eagle", "eagle3", "mtp", "draft_model", "dflash"):
        raise ServeCommandError(f"vllm serve {word}: speculative method {method!r} is not modelled")
    spec["method"] = method
    if method == "draft_model" and model is not None:
        out.options["spec_draft_model"] = resolve_model(str(model), "draft model")
    elif model is not None:
        out.unmodelled.append(f"{word} model (simkv sizes the {method} drafter from the target)")
    translate = SPECULATIVE_KEYS | {"synthetic_acceptance_length": "spec_acceptance_length"}
    for key in list(spec):
        value = spec.pop(key)
        if key in translate:
            out.options[translate[key]] = value
        elif key == "synthetic_acceptance_rates":
            out.options["spec_position_acceptance_rates"] = ",".join(str(v) for v in value)
        elif key == "num_speculative_tokens_per_batch_size":
            out.options["spec_tokens_per_batch_size"] = ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in value)
        elif key != "rejection_sample_method" or value not in ("standard", "synthetic"):
            out.unmodelled.append(f"{word} {key}")


def _special(flag: Flag, out: ServeOptions) -> None:
    name, word, value = flag.name, flag.word, flag.value
    if name.startswith("data_parallel_"):  # (a router in front of the ranks: simkv's --router says which)
        out.external_router = None if flag.negative else word
        return
    if name == "num_gpu_blocks_override":
        out.options["num_gpu_blocks"] = human_int(value, f"vllm serve {word}")
    elif name == "dtype":
        if value in ("float32", "float"):
            raise ServeCommandError(f"vllm serve {word} {value}: simkv models 16-bit weights and activations")
    elif name in ("runner", "convert"):
        if value not in ("auto", "generate", "none"):
            raise ServeCommandError(f"vllm serve {word} {value}: simkv models text generation")
    elif name == "mamba_cache_mode":
        out.unmodelled.append(f"{word} {value} (simkv follows vLLM's choice: align with prefix caching, else none)")
    elif name == "kv_offloading_backend":
        if value != "native":
            raise ServeCommandError(f"vllm serve {word} {value}: simkv models vLLM's native CPU offloading")
    elif name == "offload_backend":
        if value != "auto":
            out.unmodelled.append(f"{word} {value} (simkv picks as auto does: prefetch with --offload-group-size)")
    elif name == "shutdown_timeout":  # (a replica scaled down: simkv/replay/autoscale.py)
        try:
            out.shutdown_timeout = float(value)
        except ValueError:
            raise ServeCommandError(f"vllm serve {word} {value}: expected a number of seconds") from None
    elif name == "custom_histogram_buckets":  # (the buckets of /metrics' histograms: a latency autoscaler's)
        out.histogram_buckets = json.dumps(json_object(value, f"vllm serve {word}"))
    elif name in ("attention_config", "eplb_config"):
        taken = "indexer_tp_shard_min_rows" if name == "attention_config" else "num_redundant_experts"
        for key, item in json_object(value, f"vllm serve {word}").items():
            if key == taken:
                out.options[key] = int(item)
            else:
                out.unmodelled.append(f"{word} {key}")


def _refused(flag: Flag) -> bool:
    """Whether a REFUSED flag's value differs from vLLM's default."""
    default = _table().default(flag.name)
    if _table().nargs(flag.name) == "0":
        return (not flag.negative) != bool(default)
    return flag.value not in (None, "None", "null") and str(flag.value) != str(default)


def serve_options(command: str, model_given: bool = False, source: str = "--vllm-serve") -> ServeOptions:
    """simkv's engine options from a `vllm serve` command line (a @FILE holds one); a flag simkv
    cannot honour raises ServeCommandError naming it. `model_given`: simkv's own --model is set
    (the served model is then not looked up)."""
    model, flags = read_command(command, _table(), source)
    out = ServeOptions()
    if model is not None and not model_given:
        out.options["model"] = resolve_model(model)
    speculative = {}
    refused = []
    for flag in flags:
        name, word = flag.name, flag.word
        if name in ("model", "config"):
            continue
        if name == "speculative_config":
            speculative.update(json_object(flag.value, f"vllm serve {word}"))
        elif name in ("spec_method", "spec_model", "spec_tokens"):
            key = {"spec_method": "method", "spec_model": "model", "spec_tokens": "num_speculative_tokens"}[name]
            speculative[key] = int(flag.value) if key == "num_speculative_tokens" else flag.value
        elif name in SPECIAL:
            _special(flag, out)
        elif name in modelled_flags():
            out.options[name] = _convert(flag)
        elif name in IGNORED:
            out.ignored.append(word)
        elif name in UNMODELLED:
            out.unmodelled.append(word)
        elif name in REFUSED:
            if _refused(flag):
                refused.append(f"{word} ({REFUSED[name]})")
        else:  # (a flag of a newer vLLM, not sorted yet)
            raise ServeCommandError(f"{source}: {word} is not sorted by simkv/cli/vllm_serve.py")
    if refused:
        raise ServeCommandError(f"{source}: simkv cannot honour " + "; ".join(refused))
    if speculative:
        _speculative(speculative, "--speculative-config", out)
    return out


def _repository(model: str) -> str:
    """A shipped model's first Hugging Face repository, a config.json's folder, else MODEL."""
    if is_config_path(model):
        return str(Path(model).parent)
    repos = _hf_table().get(model, [])
    served = [r for r in repos if re.search(r"instruct|-it$|chat", r, re.IGNORECASE)]  # (a chat model if listed)
    return (served or repos or ["MODEL"])[0]


def _flag_words(name: str, value) -> list[str]:
    """A modelled option as vLLM's flag words."""
    flag = vllm_flags()[name]
    option = max(flag["options"], key=len)  # (the long form)
    if flag["nargs"] == "0":
        if value:
            return [option]
        negatives = [o for o in flag["negative"] if not o.startswith("--no-")] or flag["negative"]
        return [negatives[0]]
    if name == "limit_mm_per_prompt":
        return [option, json.dumps({"image": value})]
    if flag["nargs"] == "+":
        return [option, *str(value).split(",")]
    return [option, "None" if value is None else "auto" if (name, value) == ("max_model_len", -1) else str(value)]


def serve_command(options: dict) -> tuple[str, list[str]]:
    """The `vllm serve` command line of simkv engine options (flat, as given), and the options
    it cannot carry (simkv's own, such as gpu). Async scheduling is always spelled out: vLLM
    serves with it by default, simkv replays without unless asked."""
    options = {k.replace("-", "_"): v for k, v in options.items()}
    words = ["vllm", "serve", _repository(str(options.pop("model", "llama-3-8b")))]
    speculative, left = {}, []
    options.setdefault("async_scheduling", False)
    translate = {option: key for key, option in SPECULATIVE_KEYS.items()}
    for key, value in options.items():
        if key in modelled_flags():
            words += _flag_words(key, value)
        elif key == "num_gpu_blocks" and value is not None:
            words += ["--num-gpu-blocks-override", str(value)]
        elif key == "indexer_tp_shard_min_rows":
            words += ["--attention-config", json.dumps({key: value})]
        elif key == "num_redundant_experts":
            if value:
                words += ["--eplb-config", json.dumps({key: value})]
        elif key in translate:
            speculative[translate[key]] = value
        elif key == "spec_draft_model" and value is not None:
            speculative["model"] = _repository(str(value))
        elif key == "spec_tokens_per_batch_size" and value:
            speculative["num_speculative_tokens_per_batch_size"] = [
                [int(x) for x in span.split("-")] + [int(k)]
                for span, k in (part.split(":") for part in str(value).split(","))]
        else:
            left.append(key)
    if speculative.get("method"):
        words += ["--speculative-config", json.dumps(speculative)]
    return " ".join(shlex.quote(w) for w in words), left
