"""`simkv replay TRACE`: replay a trace through the engine model and report."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from simkv.backends.factory import COST_MODELS
from simkv.calibration.cli_support import CostModelChoice
from simkv.cli.disagg_options import (check_pools, disaggregation_options, encode_options, read_disaggregation,
                                       read_encode)
from simkv.cli.help_sections import SectionedCommand
from simkv.config import (ALL2ALL_BACKENDS, EXPERT_PLACEMENT_STRATEGIES, GATHER_BACKENDS, KV_CACHE_DTYPES,
                          PERFORMANCE_MODE_BATCH_SCALE, SPEC_METHODS, ConfigError, EngineConfig, HardwareConfig)
from simkv.replay.autoscale import SETTINGS as AUTOSCALE_SETTINGS
from simkv.replay.engine import ReplayError
from simkv.cli.model_option import GPUName, ModelName
from simkv.specs import MAMBA_DTYPE_BYTES, get_model_spec

# CLI flag -> engine option (vLLM's names).
_ENGINE_FLAGS = {
    "block_size": "block_size", "num_gpu_blocks": "num_gpu_blocks",
    "gpu_memory_utilization": "gpu_memory_utilization", "enable_prefix_caching": "enable_prefix_caching",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "watermark": "watermark", "num_lookahead_tokens": "num_lookahead_tokens", "kv_cache_dtype": "kv_cache_dtype",
    "kv_cache_dtype_skip_layers": "kv_cache_dtype_skip_layers", "prefix_match_unit": "prefix_match_unit",
    "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_scheduled_tokens": "max_num_scheduled_tokens", "vllm_batch_defaults": "vllm_batch_defaults",
    "performance_mode": "performance_mode",
    "max_num_active_seqs": "max_num_active_seqs", "prefill_schedule_interval": "prefill_schedule_interval",
    "max_num_queued_reqs": "max_num_queued_reqs", "max_num_queued_tokens": "max_num_queued_tokens",
    "max_model_len": "max_model_len", "enable_chunked_prefill": "enable_chunked_prefill",
    "long_prefill_token_threshold": "long_prefill_token_threshold", "scheduling_policy": "scheduling_policy",
    "model": "model", "gpu": "gpu", "tensor_parallel_size": "tensor_parallel_size",
    "data_parallel_size": "data_parallel_size", "dp_sync_interval": "dp_sync_interval", "quantization": "quantization",
    "decode_context_parallel_size": "decode_context_parallel_size",
    "prefill_context_parallel_size": "prefill_context_parallel_size",
    "enable_expert_parallel": "enable_expert_parallel", "all2all_backend": "all2all_backend",
    "expert_placement_strategy": "expert_placement_strategy", "enable_eplb": "enable_eplb",
    "num_redundant_experts": "num_redundant_experts",
    "enable_dbo": "enable_dbo", "ubatch_size": "ubatch_size", "dbo_decode_token_threshold": "dbo_decode_token_threshold",
    "dbo_prefill_token_threshold": "dbo_prefill_token_threshold",
    "pipeline_parallel_size": "pipeline_parallel_size", "pipeline_link_gbs": "pipeline_link_gbs",
    "gpus_per_node": "gpus_per_node", "inter_node_gbs": "inter_node_gbs",
    "prefix_caching_hash_bits": "prefix_caching_hash_bits", "swap_space": "swap_space",
    "preemption_mode": "preemption_mode", "pcie_bandwidth_gbs": "pcie_bandwidth_gbs", "cpu_offload_gb": "cpu_offload_gb",
    "cpu_offload_params": "cpu_offload_params",
    "offload_group_size": "offload_group_size", "offload_num_in_group": "offload_num_in_group",
    "offload_prefetch_step": "offload_prefetch_step", "offload_params": "offload_params",
    "mamba_cache_dtype": "mamba_cache_dtype", "mamba_ssm_cache_dtype": "mamba_ssm_cache_dtype",
    "parallel_sampling": "parallel_sampling",
    "kv_offloading_size": "kv_offloading_size", "kv_offloading_block_size": "kv_offloading_block_size",
    "kv_offloading_prompt_only": "kv_offloading_prompt_only", "kv_offloading_policy": "kv_offloading_policy",
    "kv_offloading_store_threshold": "kv_offloading_store_threshold",
    "kv_offloading_max_tracker_size": "kv_offloading_max_tracker_size",
    "async_scheduling": "async_scheduling", "model_runner": "model_runner", "session_pacing": "session_pacing",
    "client_max_concurrency": "client_max_concurrency", "client_max_active_sessions": "client_max_active_sessions",
    "client_early_stop": "client_early_stop", "client_request_rate": "client_request_rate",
    "client_seed": "client_seed", "client_rotation": "client_rotation",
    "client_conversation_sampling": "client_conversation_sampling", "client_max_requests": "client_max_requests",
    "client_warmup": "client_warmup",
    "client_max_inflight_tokens": "client_max_inflight_tokens",
    "client_ttft_timeout": "client_ttft_timeout_s", "client_timeout": "client_timeout_s",
    "client_max_retries": "client_max_retries", "client_retry_backoff": "client_retry_backoff_s",
    "client_retry_max_backoff": "client_retry_max_backoff_s", "client_retry_jitter": "client_retry_jitter",
    "enable_lora": "enable_lora", "max_loras": "max_loras", "max_lora_rank": "max_lora_rank",
    "max_cpu_loras": "max_cpu_loras", "lora_load_gbs": "lora_load_gbs",
    "mm_max_tokens_per_item": "mm_max_tokens_per_item", "disable_chunked_mm_input": "disable_chunked_mm_input",
    "mm_encoder_tp_mode": "mm_encoder_tp_mode", "skip_mm_profiling": "skip_mm_profiling",
    "limit_mm_per_prompt": "limit_mm_per_prompt",
    "language_model_only": "language_model_only",
    "speculative_method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
    "spec_acceptance_rate": "spec_acceptance_rate", "spec_position_acceptance_rates": "spec_position_acceptance_rates",
    "spec_draft_model": "spec_draft_model", "spec_seed": "spec_seed", "spec_ngram_match_rate": "spec_ngram_match_rate",
    "spec_mean_draft_tokens": "spec_mean_draft_tokens",
    "spec_tokens_per_batch_size": "spec_tokens_per_batch_size", "spec_parallel_drafting": "spec_parallel_drafting",
    "spec_draft_layers": "spec_draft_layers", "spec_mtp_modules": "spec_mtp_modules",
    "spec_acceptance_length": "spec_acceptance_length",
    "sliding_window": "sliding_window", "full_attention_interval": "full_attention_interval",
    "attention_chunk_size": "attention_chunk_size",
    "disable_hybrid_kv_cache_manager": "disable_hybrid_kv_cache_manager",
    "disable_sliding_window": "disable_sliding_window",
    "prefix_cache_retention_interval": "prefix_cache_retention_interval",
    "gdn_prefill_backend": "gdn_prefill_backend",
    "indexer_tp_shard_min_rows": "indexer_tp_shard_min_rows",
}
DEFAULT_TRACE = "traces/azure_conv_slice.parquet"


class TokensOrWord(click.ParamType):
    """A whole number of tokens, or one of `words`, which stands for `meaning`."""

    def __init__(self, name: str, words: tuple[str, ...], meaning) -> None:
        self.name, self.words, self.meaning = name, words, meaning

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text in self.words:
            return self.meaning
        try:
            return int(text)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number of tokens nor '{self.words[0]}'", param, ctx)


_DENSE = "none"  # CLI spelling of a null retention interval (flat_options turns it into None)


class RetentionInterval(TokensOrWord):
    """A whole number of tokens, or "none" (vLLM's None: retain every block)."""

    def __init__(self) -> None:
        super().__init__("retention", ("none", "null", "dense"), _DENSE)


class MaxModelLen(TokensOrWord):
    """A number of tokens, or auto (vLLM's -1: the longest request the KV cache holds)."""

    def __init__(self) -> None:
        super().__init__("tokens|auto", ("auto", "-1"), -1)


MAX_MODEL_LEN_HELP = "auto: the longest request the KV cache holds, as vLLM fits it [default: the model's]"


class ByteCount(click.ParamType):
    """A number of bytes as vLLM's human-readable integers take it: 40000000000, 40g (decimal:
    k, m, g, t are powers of 1,000) or 37G (binary: K, M, G, T are powers of 1,024, whole numbers
    only)."""

    name = "bytes"
    _DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    _BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        text = str(value).strip()
        number, suffix = (text[:-1], text[-1]) if text[-1:] in self._DECIMAL or text[-1:] in self._BINARY else (text, "")
        try:
            if suffix in self._BINARY:
                return int(number) * self._BINARY[suffix]
            return int(float(number) * self._DECIMAL[suffix]) if suffix else int(number)
        except ValueError:
            self.fail(f"{value!r} is not a number of bytes (e.g. 40000000000, 40g or 37G; binary suffixes take "
                      "whole numbers)", param, ctx)


class ImageLimit(click.ParamType):
    """vLLM's --limit-mm-per-prompt for images: '{"image": 4}' (its JSON), image=4, or 4. Other
    modalities are not modelled (simkv's items are images): only a limit of 0 is taken for them."""

    name = "limit"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            if text.startswith("{"):
                limits = json.loads(text)
                if not isinstance(limits, dict) or any(v != 0 for k, v in limits.items() if k != "image"):
                    self.fail(f"{value!r}: only the image limit is modelled (simkv's items are images)", param, ctx)
                value = limits.get("image")
                return int(value["count"]) if isinstance(value, dict) else int(value)
            return int(text.split("=", 1)[1]) if text.startswith("image=") else int(text)
        except (ValueError, TypeError, KeyError, json.JSONDecodeError):
            self.fail(f"{value!r} is not an image limit (e.g. '{{\"image\": 4}}', image=4 or 4)", param, ctx)


def _splits_host_time(cost_model: str, config: EngineConfig) -> bool:
    """Whether the cost model gives the host's share of a step (`host_seconds`), which async
    scheduling overlaps with the device (the engine asks the backend the same way)."""
    from simkv.backends.factory import make_backend

    return getattr(make_backend(cost_model, config), "host_seconds", None) is not None


def load_config_file(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) if not path.endswith(".json") else json.load(f)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="--config") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: expected a mapping of option: value", param_hint="--config")
    return data


AUTOSCALE_KEYS = ("autoscale", *AUTOSCALE_SETTINGS)  # (simkv/replay/autoscale.py)
FLEET_CONFIG_KEYS = ("replicas", "router", "router_options", "class_replicas", "replica_sets", "disaggregation",
                     "encode_pool", *AUTOSCALE_KEYS)  # --config keys that are not engine options


def flat_options(cli_values: dict, config_file: str | None) -> dict:
    """Engine options from --config, then --vllm-serve's command, then the flags (vLLM's names,
    underscores)."""
    raw = {k.replace("-", "_"): v for k, v in (load_config_file(config_file) if config_file else {}).items()}
    options = {k: v for k, v in raw.items() if k not in FLEET_CONFIG_KEYS}
    if cli_values.get("vllm_serve"):
        router_given = (cli_values["router"] is not None or "router" in raw) if "router" in cli_values else None
        options.update(served_options(cli_values["vllm_serve"], model_given=cli_values.get("model") is not None,
                                      router_given=router_given))
    for flag, name in _ENGINE_FLAGS.items():
        if cli_values.get(flag) is not None:
            options[name] = None if cli_values[flag] is _DENSE else cli_values[flag]
    return options


def served_options(command: str, model_given: bool, router_given: bool | None = None) -> dict:
    """The engine options of a `vllm serve` command (cli/vllm_serve.py); what it leaves out is
    said once on stderr. `router_given`: whether a command that replays a fleet names its router
    (None: no fleet, as for capacity), which a command with an external load balancer needs."""
    from simkv.cli.vllm_serve import serve_options

    served = serve_options(command, model_given)
    if router_given is False and served.external_router:
        raise ConfigError(f"--vllm-serve: {served.external_router} puts your own router in front of the "
                          "data-parallel ranks: give simkv's --router (round_robin, least_outstanding, prefix_aware)")
    if served.note():
        _say_once(served.note())
    return served.options


@functools.cache
def _say_once(text: str) -> None:
    click.echo(text, err=True)


def build_config(cli_values: dict, config_file: str | None, overrides: dict | None = None) -> EngineConfig:
    return EngineConfig.from_flat(flat_options(cli_values, config_file) | (overrides or {}))


def read_inputs(trace: str, flags: dict, config_file: str | None, goodput: tuple[str, ...],
                overrides: dict | None = None, vllm_bench: str | None = None, vllm_multi_turn: str | None = None):
    """The --goodput SLOs, the engine config and the trace of a command, or a one-line click error.
    `overrides`: options over the flags (a grid's first cell, so that its keys count in the checks).
    `vllm_bench`: a `vllm bench serve` command whose traffic replaces the trace (its
    --max-concurrency and --goodput too, unless simkv's own flags give them). `vllm_multi_turn`:
    likewise a command of vLLM's multi-turn benchmark (its clients and conversations)."""
    from simkv.replay.classes import trace_labels
    from simkv.replay.goodput import GoodputError, check_slo_classes, parse_goodput
    from simkv.traces.schema import read_trace

    try:
        options = flat_options(flags, config_file) | (overrides or {})
        bench = None
        if vllm_bench:
            from simkv.cli.vllm_bench_command import bench_command

            bench = bench_command(vllm_bench, options.get("model", HardwareConfig().model))
            if bench.note():
                _say_once(bench.note())
            if bench.max_concurrency is not None:  # (simkv's own flag or file wins)
                options.setdefault("client_max_concurrency", bench.max_concurrency)
        if vllm_multi_turn:
            from simkv.cli.vllm_multi_turn_command import multi_turn_command
            from simkv.cli.vllm_serve import resolve_model

            bench = multi_turn_command(vllm_multi_turn)
            if bench.note():
                _say_once(bench.note())
            for key, value in bench.client_options.items():  # (simkv's own flags win)
                options.setdefault(key, value)
            if bench.model is not None and "model" not in options:
                options["model"] = resolve_model(bench.model)
        config = EngineConfig.from_flat(options)
    except (ConfigError, TypeError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    try:
        slo = parse_goodput(goodput or getattr(bench, "goodput", ()))
    except GoodputError as exc:
        raise click.UsageError(str(exc)) from None
    if bench is not None:
        data = bench.trace
    else:
        try:
            data = read_trace(trace)
        except (ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
    try:  # (an SLO for a class the trace lacks: said before anything runs)
        check_slo_classes(slo, trace_labels(data), str(data.source or trace))
    except GoodputError as exc:
        raise click.UsageError(str(exc)) from None
    return slo, config, data


def engine_options(command):
    """The engine's options as flags with vLLM's names (replay, goodput)."""
    for option in reversed(_ENGINE_OPTIONS):
        command = option(command)
    return command


def fleet_options(command):
    """--replicas, --router, --router-option (replay, goodput); --config may give them too."""
    from simkv.replay.router import ROUTERS

    for option in reversed([
        click.option("--replicas", type=int, default=None,
                     help="Engine replicas behind a router, each with the engine options below (simulated "
                          "replays) [default: 1]."),
        click.option("--router", type=click.Choice(ROUTERS), default=None,
                     help="How the fleet's router picks a replica (simkv/replay/router.py) [default: round_robin]. "
                          "With --data-parallel-size: a router in front of the ranks (vLLM's "
                          "--data-parallel-external-lb) instead of vLLM's own balancer."),
        click.option("--router-option", "router_options", multiple=True, metavar="KEY=VALUE",
                     help="prefix_aware's thresholds: cache_threshold (0.3), balance_abs (64), balance_rel (1.5)."),
        click.option("--replica-set", "replica_sets", multiple=True, metavar="REPLICAS:KEY=VALUE,...",
                     help="Replicas whose engines differ from the others, e.g. 2-3:gpu=H200,tensor_parallel_size=2 "
                          "(engine option names; the rest run the common options): a fleet of mixed GPUs."),
        click.option("--class-replicas", "class_replicas", multiple=True, metavar="CLASS=REPLICAS",
                     help="Give a request class (the trace's request_class) replicas of its own, e.g. docs=3 or "
                          "chat=0-2: its requests go there only, other classes' to the unclaimed replicas (DP "
                          "ranks behind --router likewise; P/D pools: prefill:docs=1, decode:chat=0)."),
        click.option("--autoscale", default=None, metavar="MIN-MAX",
                     help="A fleet that scales with its load, as a Kubernetes autoscaler in front of vLLM "
                          "(simkv/replay/autoscale.py): MIN replicas up from the start, at most MAX (--replicas, "
                          "if given, must be MAX); summary.json's fleet.autoscaling gives the replicas over time "
                          "and the GPU-hours paid."),
        click.option("--autoscale-metric", default=None, metavar="METRIC[=TARGET],...",
                     help="With --autoscale: what it scales on, as vLLM's gauges report it: in_flight (requests "
                          "running + waiting), waiting or running (vLLM's num_requests_waiting / _running), "
                          "kv_usage (kv_cache_usage_perc, 0-1), gpu_util (DCGM's GPU utilisation over 30 s, 0-1); "
                          "or a percentile of vLLM's latency histograms "
                          "over the fleet, its target in seconds: ttft_pQ, e2e_pQ or itl_pQ (e.g. ttft_p95=2); several "
                          "with their targets, e.g. waiting=5,kv_usage=0.7: the largest recommendation wins, as "
                          "HPA's [default: in_flight]."),
        click.option("--autoscale-target", type=float, default=None, metavar="N",
                     help="With --autoscale: the metric per replica it aims at: it wants ceil(sum over the "
                          "replicas up / N) [default: in_flight 8, waiting 5, running 8, kv_usage 0.5, gpu_util 0.7]."),
        click.option("--autoscale-tolerance", type=float, default=None, metavar="F",
                     help="With --autoscale: a sum within this share of what the replicas it has aim at "
                          "changes nothing (HPA's tolerance) [default: 0.1]."),
        click.option("--autoscale-interval-s", type=float, default=None, metavar="S",
                     help="With --autoscale: seconds between its decisions (HPA's sync period) [default: 15]."),
        click.option("--cold-start-s", type=float, default=None, metavar="S",
                     help="With --autoscale: seconds from starting a replica to its first request (scheduling, "
                          "image and weights, CUDA graphs), paid for [default: 120]."),
        click.option("--scale-down-window-s", type=float, default=None, metavar="S",
                     help="With --autoscale: a replica is drained only once every decision over this window "
                          "wanted fewer (HPA's stabilisation window) [default: 300]."),
        click.option("--scale-up-policy", default=None, metavar="POLICIES",
                     help="With --autoscale: how fast it may grow, as HPA's behavior.scaleUp policies: pods=N/S "
                          "(N replicas within any S seconds), percent=P/S, several with select=max|min (the largest "
                          "or smallest change), or disabled [default: pods=4/15,percent=100/15]."),
        click.option("--scale-down-policy", default=None, metavar="POLICIES",
                     help="With --autoscale: how fast it may shrink, as HPA's behavior.scaleDown policies, e.g. "
                          "pods=1/60 (one replica a minute) [default: percent=100/15: anything at once, after the "
                          "stabilisation window]."),
        click.option("--autoscale-histogram-buckets", default=None, metavar="JSON",
                     help="With --autoscale on a latency: the histograms' bucket bounds, as vLLM's "
                          "--custom-histogram-buckets gives them, e.g. '{\"inter_token_latency\": [0.005, 0.01, "
                          "0.015, 0.02]}' (families time_to_first_token, request_latency, inter_token_latency) "
                          "[default: vLLM's; a --vllm-serve command's own]."),
        click.option("--autoscale-metrics-delay-s", type=float, default=None, metavar="S",
                     help="With --autoscale: each decision reads its metrics as they were S seconds before (a "
                          "Prometheus scrape interval, the metrics adapter's cache) [default: 0]."),
        click.option("--autoscale-latency-window-s", type=float, default=None, metavar="S",
                     help="With --autoscale on a latency (ttft_pQ, e2e_pQ, itl_pQ): the seconds of observations its "
                          "percentile reads, the range of the Prometheus query's rate() [default: 60]."),
        click.option("--node-gpus", type=int, default=None, metavar="G",
                     help="With --autoscale: the replicas run on GPU nodes of G GPUs that a cluster autoscaler "
                          "adds and removes (simkv/replay/autoscale_nodes.py); GPU-hours paid are the nodes' "
                          "[default: not modelled: each replica's own GPUs are paid]."),
        click.option("--node-provision-s", type=float, default=None, metavar="S",
                     help="With --node-gpus: seconds a new node takes to join (instance, boot, GPU driver); a "
                          "replica placed on it starts its cold start then [default: 300]."),
        click.option("--node-image-pull-s", type=float, default=None, metavar="S",
                     help="With --node-gpus: seconds to pull the server's image on a node's first replica, before "
                          "its cold start; nodes up from the start have it [default: 0: counted in --cold-start-s]."),
        click.option("--node-unneeded-s", type=float, default=None, metavar="S",
                     help="With --node-gpus: an empty node is removed after S seconds empty (the cluster "
                          "autoscaler's --scale-down-unneeded-time) [default: 600]."),
        click.option("--node-delay-after-add-s", type=float, default=None, metavar="S",
                     help="With --node-gpus: no node is removed within S seconds of a node being added "
                          "(--scale-down-delay-after-add) [default: 600]."),
        click.option("--min-nodes", type=int, default=None, metavar="N",
                     help="With --node-gpus: nodes of each GPU kind kept up from the start, empty or not (the node "
                          "group's minimum: warm headroom) [default: 0]."),
        click.option("--node-mtbf-s", type=float, default=None, metavar="S",
                     help="With --node-gpus: nodes fail (spot reclaims, lost hosts), each S seconds after it was "
                          "made on average (drawn, seeded by --node-failure-seed): their replicas' requests are "
                          "lost (retried with --client-max-retries) and they start again elsewhere [default: never]."),
        click.option("--node-reclaim-notice-s", type=float, default=None, metavar="S",
                     help="With --node-mtbf-s: each failure is known S seconds before (a spot reclaim's notice: 120 "
                          "on AWS, 30 on GCP): the node is cordoned, its replicas replaced elsewhere at once and "
                          "each old one runs what it has until the failure (or its --shutdown-timeout) "
                          "[default: 0: no warning]."),
        click.option("--node-failure-seed", type=int, default=None, metavar="N",
                     help="With --node-mtbf-s: the seed of its draws [default: 0]."),
        click.option("--node-placement", type=click.Choice(("pack", "spread")), default=None,
                     help="With --node-gpus: a replica goes to the fullest node it fits (pack) or the emptiest "
                          "(spread) [default: pack]."),
        click.option("--shutdown-timeout", "shutdown_timeout", type=float, default=None, metavar="S",
                     help="With --autoscale: vLLM's --shutdown-timeout: a replica scaled down takes no new request, "
                          "gets SIGTERM (after --prestop-s) and ends once its requests finish, at the latest S "
                          "seconds later (within --termination-grace-s), losing what it still has in flight then "
                          "(retried with --client-max-retries); vLLM's default 0 loses it at once [default: not "
                          "modelled: it drains to its last request]."),
        click.option("--termination-grace-s", type=float, default=None, metavar="S",
                     help="With --shutdown-timeout: the pod's terminationGracePeriodSeconds, after which it is "
                          "killed whatever its drain [default: 30, Kubernetes']."),
        click.option("--prestop-s", type=float, default=None, metavar="S",
                     help="With --shutdown-timeout: a preStop hook's sleep before SIGTERM, while the replica still "
                          "serves what it has [default: 0]."),
        click.option("--autoscale-latency-target-type", type=click.Choice(("Value", "AverageValue"),
                                                                          case_sensitive=False), default=None,
                     help="With --autoscale on a latency: HPA's Value target, ceil(replicas x value / target), or "
                          "AverageValue, ceil(value / target) whatever the replicas (KEDA's default metricType: "
                          "a latency read as if summed over them) [default: Value]."),
        click.option("--scale-up-window-s", type=float, default=None, metavar="S",
                     help="With --autoscale: replicas are started only as far as every decision over this window "
                          "wanted more (HPA's scale-up stabilisation window: a spike shorter than it starts "
                          "none) [default: 0]."),
    ]):
        command = option(command)
    return command


def autoscale_settings(flags: dict, config_file: str | None = None) -> dict:
    """--autoscale and its settings (AUTOSCALE_KEYS) from `flags`, else the --config file's keys of
    the same names (None: not given)."""
    file = {k.replace("-", "_"): v for k, v in (load_config_file(config_file) if config_file else {}).items()}
    values = {k: flags.get(k) for k in AUTOSCALE_KEYS}
    values = {k: (file.get(k) if v is None else v) for k, v in values.items()}
    scales = values["autoscale"] is not None or any(
        flags.get(k) is not None or file.get(k) is not None for k in ("prefill_autoscale", "decode_autoscale"))
    if scales and flags.get("vllm_serve"):  # (the server's own buckets, what its /metrics exports, and shutdown)
        from simkv.cli.vllm_serve import serve_options

        served = serve_options(flags["vllm_serve"], True)
        for key, value in (("autoscale_histogram_buckets", served.histogram_buckets),
                           ("shutdown_timeout", served.shutdown_timeout)):  # (P/D pools: drains not bounded yet)
            if values[key] is None and (key != "shutdown_timeout" or values["autoscale"] is not None):
                values[key] = value
    return values


def read_autoscale(flags: dict, config_file: str | None = None, pools: bool = False):
    """The AutoscaleSpec of --autoscale and its settings over the --config file's keys of the same
    names (None without --autoscale; its settings alone are refused, unless `pools`: P/D pools
    that scale took them as defaults); takes them out of `flags`."""
    from simkv.replay.autoscale import AutoscaleError, AutoscaleSpec

    values = autoscale_settings(flags, config_file)
    for key in AUTOSCALE_KEYS:
        flags.pop(key, None)
    text = values.pop("autoscale")
    if text is None:
        given = [f"--{k.replace('_', '-')}" for k, v in values.items() if v is not None]
        if given and not pools:
            raise click.UsageError(f"{', '.join(given)} sets the autoscaler: give --autoscale MIN-MAX (or "
                                   "--prefill-autoscale / --decode-autoscale) too")
        return None
    try:
        return AutoscaleSpec.of(text, values)
    except AutoscaleError as exc:  # (its text names the flag)
        raise click.UsageError(str(exc)) from None


def _pools_scale(disaggregation) -> bool:
    return disaggregation is not None and (disaggregation.prefill_autoscale is not None
                                           or disaggregation.decode_autoscale is not None)


def read_fleet(replicas: int | None, router: str | None, router_options: tuple[str, ...],
               config_file: str | None = None, class_replicas: tuple[str, ...] = (), pools: bool = False,
               replica_sets: tuple[str, ...] = (), autoscale=None):
    """The FleetSpec of --replicas/--router/--router-option/--class-replicas over the --config
    file's `replicas`, `router`, `router_options` and `class_replicas` mappings (flags win, router
    options key by key; one replica is the plain engine); a click error naming the flag or the
    file otherwise. `pools`: P/D pools take the class replicas (pool_class_replicas), not the fleet."""
    from simkv.replay.api import FleetSpec
    from simkv.replay.router import (ROUTERS, RouterError, RouterOptions, check_class_replicas, parse_class_replicas,
                                     parse_replica_sets, replica_set_items_of)

    file = {k.replace("-", "_"): v for k, v in (load_config_file(config_file) if config_file else {}).items()}

    def bad(message: str, from_file: bool):
        return click.BadParameter(f"{config_file}: {message}" if from_file else message,
                                  param_hint="--config" if from_file else flag)

    flag = "--replicas"
    if replicas is None and autoscale is not None and "replicas" not in file:
        replicas = autoscale.max_replicas
    if replicas is None:
        replicas = file.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise bad(f"replicas must be a whole number >= 1, got {replicas!r}", True)
    elif replicas < 1:
        raise bad(f"must be at least 1, got {replicas}", False)
    flag = "--router"
    if router is None:
        router = file.get("router")  # (None: the default, round_robin; vLLM's balancer on DP ranks)
        if router is not None and router not in ROUTERS:
            raise bad(f"router must be one of {', '.join(ROUTERS)}, got {router!r}", True)
    flag = "--router-option"
    from_file = file.get("router_options") or {}
    if not isinstance(from_file, dict):
        raise bad("router_options must be a mapping of KEY: VALUE", True)
    if router_options and router != "prefix_aware":
        raise click.UsageError("--router-option sets prefix_aware's thresholds; add --router prefix_aware")
    if router != "prefix_aware":
        from_file = {}  # the file's thresholds were for a router the flags replaced
    try:
        RouterOptions.parse([f"{k}={v}" for k, v in from_file.items()])
    except RouterError as exc:
        raise bad(str(exc), True) from None
    try:
        options = RouterOptions.parse([f"{k}={v}" for k, v in from_file.items()] + list(router_options))
    except RouterError as exc:
        raise bad(str(exc), False) from None
    flag = "--class-replicas"
    items, from_file = class_replica_items(class_replicas, file, config_file) if not pools else ([], False)
    try:
        classes = parse_class_replicas(items)
        if replicas > 1:  # (on one engine they number the DP ranks: checked where their router is made)
            check_class_replicas(classes, replicas)
    except RouterError as exc:
        raise bad(str(exc), from_file) from None
    flag = "--replica-set"
    sets = file.get("replica_sets") or {}  # ({"2-3": {gpu: H200, ...}}; the flags replace it whole)
    try:
        items = replica_sets or replica_set_items_of(sets)
    except RouterError as exc:
        raise bad(str(exc), True) from None
    try:
        return FleetSpec(replicas, router, options, classes, parse_replica_sets(items), autoscale)
    except RouterError as exc:
        raise bad(str(exc), not replica_sets and bool(sets)) from None


def _with_failures(fleet, items: tuple[str, ...], restart_s: float | None, pools: bool, mtbf_s: float | None = None,
                   seed: int | None = None):
    """The fleet with its replicas' failures (--replica-failure, --restart-s, --replica-mtbf-s)."""
    from dataclasses import replace

    from simkv.replay.failures import FailureError, FailureSpec
    from simkv.replay.router import RouterError

    if pools:
        raise click.UsageError("--replica-failure fails a replica of a fleet (--replicas N): not modelled yet for P/D "
                               "pools or encoder replicas")
    if fleet is None or fleet.num_replicas < 2:
        raise click.UsageError("--replica-failure fails a replica of a fleet: give --replicas 2 or more (with one, "
                               "requests would have nowhere to go while it is down) or --autoscale")
    try:
        spec = FailureSpec.parse(items, restart_s, fleet.num_replicas, mtbf_s, seed)
        return replace(fleet, failures=spec)
    except (FailureError, RouterError) as exc:  # (its text names the flag)
        raise click.UsageError(str(exc)) from None


def class_replica_items(class_replicas: tuple[str, ...], file: dict, config_file: str | None) -> tuple[list, bool]:
    """--class-replicas' items, else the --config file's `class_replicas` mapping ({class: "0-2" |
    3 | [0, 1]}) as items (the flags replace it whole); and whether they came from the file."""
    from simkv.replay.router import class_replica_items_of

    from_file = file.get("class_replicas") or {}
    if not isinstance(from_file, dict):
        raise click.BadParameter(f"{config_file}: class_replicas must be a mapping of CLASS: REPLICAS",
                                 param_hint="--config")
    if class_replicas:
        return list(class_replicas), False
    return class_replica_items_of(from_file), bool(from_file)


def pool_class_replicas(disaggregation, class_replicas: tuple[str, ...], config_file: str | None):
    """The P/D spec with each pool's class replicas (`prefill:docs=1`, `decode:docs=0`; from the
    flags or the --config file's class_replicas)."""
    import dataclasses

    from simkv.replay.router import RouterError, split_pool_class_replicas

    file = {k.replace("-", "_"): v for k, v in (load_config_file(config_file) if config_file else {}).items()}
    items, from_file = class_replica_items(class_replicas, file, config_file)
    if not items:
        return disaggregation
    try:
        prefill, decode = split_pool_class_replicas(items)
        return dataclasses.replace(disaggregation, prefill_class_replicas=prefill, decode_class_replicas=decode)
    except (RouterError, ConfigError) as exc:
        raise click.BadParameter(f"{config_file}: {exc}" if from_file else str(exc),
                                 param_hint="--config" if from_file else "--class-replicas") from None


VLLM_SERVE_HELP = ("A `vllm serve ...` command line, or @FILE holding one (its --config YAML too): its engine "
                   "flags become simkv's options, over --config and under simkv's own flags; flags simkv does not "
                   "model are named on stderr, and ones it cannot honour refused (docs/vllm_serve.md).")

_ENGINE_OPTIONS = [
    click.option("--vllm-serve", "vllm_serve", default=None, metavar="COMMAND|@FILE", help=VLLM_SERVE_HELP),
    click.option("--model", type=ModelName(), default=None,
                 help="A shipped model, or a Hugging Face config.json of your own [default: llama-3-8b]"),
    click.option("--gpu", type=GPUName(), default=None,
                 help="A GPU of the catalogue, or a YAML/JSON file of its datasheet's fields (memory_gib, "
                      "mem_bandwidth_gbs, bf16_tflops, fp8_tflops, interconnect_gbs, compute_capability, platform) "
                      "[default: H100-SXM]"),
    click.option("--tensor-parallel-size", "-tp", type=int, default=None),
    click.option("--data-parallel-size", "-dp", type=int, default=None,
                 help="A mixture of experts: data-parallel attention ranks in lockstep, their experts over "
                      "all GPUs (vLLM's --data-parallel-size) [default: 1]"),
    click.option("--dp-sync-interval", type=int, default=None, metavar="N",
                 help="vLLM's: data-parallel ranks agree whether any has requests every N steps; a wave whose "
                      "requests all finished runs dummy passes until then [default: 16]"),
    click.option("--decode-context-parallel-size", "-dcp", type=int, default=None,
                 help="vLLM's: groups of DCP of the TP GPUs shard the KV cache by tokens (a latent, or KV heads "
                      "duplicated when TP exceeds them, is then not held whole on every GPU) [default: 1]"),
    click.option("--prefill-context-parallel-size", "-pcp", type=int, default=None,
                 help="vLLM's, for latent-attention models: that many TP groups, each holding the whole KV "
                      "cache, split every prefill chunk between them (decodes round robin) [default: 1]"),
    click.option("--enable-expert-parallel/--no-enable-expert-parallel", "-ep", default=None,
                 help="vLLM's, a mixture of experts: whole experts over the GPUs, which --all2all-backend's "
                      "all-to-all kernels then exchange tokens between [default: off]"),
    click.option("--all2all-backend", type=click.Choice(ALL2ALL_BACKENDS + GATHER_BACKENDS), default=None,
                 help="vLLM's: with -ep and data- (or prefill-context-) parallel ranks, an all-to-all backend "
                      "(deepep_*, ...) sends each token only to its experts' GPUs; allgather_reducescatter "
                      "gathers every rank's tokens on every GPU [default: allgather_reducescatter]"),
    click.option("--expert-placement-strategy", type=click.Choice(EXPERT_PLACEMENT_STRATEGIES), default=None,
                 help="vLLM's: with -ep, experts in contiguous runs over the GPUs (linear) or round robin, which "
                      "spreads DeepSeek's expert groups over every GPU (vLLM keeps it only on deepep_low_latency "
                      "or nixl_ep) [default: linear]"),
    click.option("--enable-eplb/--no-enable-eplb", default=None,
                 help="vLLM's expert-parallel load balancing (with -ep): its redundant experts take GPU memory; "
                      "its balancing is not modelled (simkv routes uniformly) [default: off]"),
    click.option("--num-redundant-experts", type=int, default=None, metavar="R",
                 help="vLLM's --eplb-config num_redundant_experts: R extra expert copies over the expert-parallel "
                      "GPUs [default: 0]"),
    click.option("--enable-dbo/--no-enable-dbo", default=None,
                 help="vLLM's dual batch overlap (data-parallel ranks, a DeepEP or nixl_ep backend): steps of "
                      "enough tokens on every rank run as two microbatches, one's expert exchange under the "
                      "other's work [default: off]"),
    click.option("--ubatch-size", type=int, default=None, metavar="N",
                 help="vLLM's microbatching without --enable-dbo: N > 1 splits steps of enough tokens on every "
                      "rank into N microbatches (the DBO thresholds apply) [default: 0, off]"),
    click.option("--dbo-decode-token-threshold", type=int, default=None,
                 help="vLLM's: the tokens a decode-only step needs on every rank for DBO [default: 32]"),
    click.option("--dbo-prefill-token-threshold", type=int, default=None,
                 help="vLLM's: the tokens a step with a prefill needs on every rank for DBO [default: 512]"),
    click.option("--pipeline-parallel-size", "-pp", type=int, default=None,
                 help="vLLM's: the layers split over that many stages of TP GPUs each; the engine keeps that many "
                      "batches in flight (one more under async scheduling) [default: 1]"),
    click.option("--pipeline-link-gbs", type=float, default=None,
                 help="GB/s between pipeline stages, per GPU [default: the GPU's interconnect within a node, "
                      "--inter-node-gbs between nodes]"),
    click.option("--gpus-per-node", type=int, default=None,
                 help="A TP group or expert group larger than this, and a pipeline boundary between nodes, go "
                      "over the network [default: 8]"),
    click.option("--inter-node-gbs", type=float, default=None,
                 help="GB/s one way per GPU between nodes (a 400 Gb/s NIC per GPU: 50) [default: 50]"),
    click.option("--quantization", "-q", type=click.Choice(["fp8"]), default=None,
                 help="vLLM's: fp8 quantizes a bf16 checkpoint's linear layers and experts as it loads them "
                      "(half the weight memory; fp8 matmuls on GPUs with fp8 tensor cores) [default: the checkpoint's]"),
    click.option("--block-size", type=int, default=None,
                 help="[default: 16; for latent attention vLLM's pick: on Hopper 64 with an fp8 cache (FlashMLA), on "
                      "Blackwell 32 (FlashInfer MLA)]"),
    click.option("--num-gpu-blocks", "--num-gpu-blocks-override", type=int, default=None,
                 help="[default: derived from GPU memory]"),
    click.option("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=None,
                 help="[default: 0.92]"),
    click.option("--kv-cache-memory-bytes", "--kv-cache-memory", type=ByteCount(), default=None, metavar="BYTES",
                 help="vLLM's: the KV cache's bytes per GPU (e.g. 40g, 37G), instead of what "
                      "--gpu-memory-utilization leaves [default: derived from GPU memory]"),
    click.option("--max-num-seqs", type=int, default=None,
                 help="[default: vLLM 0.33's API server's on the GPU: 1,024 from 70 GiB (not A100s), else 256]"),
    click.option("--max-num-active-seqs", type=int, default=None,
                 help="vLLM's --max-num-active-seqs: requests admitted into RUNNING, below max-num-seqs (which "
                      "still sizes the model runner) [default: max-num-seqs]"),
    click.option("--prefill-schedule-interval", type=int, default=None, metavar="N",
                 help="vLLM's --prefill-schedule-interval: prefill only once N executed steps have passed since "
                      "the last step that carried prefill, the steps between decoding alone [default: 1]"),
    click.option("--mm-max-tokens-per-item", type=int, default=None, metavar="N",
                 help="Multimodal traces (mm_* columns): the most embeddings one item (an image) can have, which "
                      "sizes vLLM's encoder budget per step and its encoder cache, max(max-num-batched-tokens, N) "
                      "[default: the model's (qwen2.5-vl-7b: 16,384), else the trace's largest item]"),
    click.option("--disable-chunked-mm-input", is_flag=True, default=None,
                 help="vLLM's: a prefill chunk never ends inside a multimodal item"),
    click.option("--mm-encoder-tp-mode", type=click.Choice(["weights", "data"]), default=None,
                 help="vLLM's: under tensor parallelism the vision encoder's layers split over the GPUs (weights) "
                      "or each GPU holding it whole and encoding its share of a step's images (data) "
                      "[default: weights]"),
    click.option("--limit-mm-per-prompt", type=ImageLimit(), default=None, metavar="LIMIT",
                 help="vLLM's, for images ('{\"image\": 4}', image=4 or 4): a trace row with more is refused, as "
                      "vLLM's API server refuses it; caps the encoder's start-up profile [default: 999]"),
    click.option("--language-model-only", is_flag=True, default=None,
                 help="vLLM's: a vision model served as text only (every modality's limit 0): no vision encoder "
                      "on the GPUs or in the start-up profile; a trace with images is refused"),
    click.option("--skip-mm-profiling", is_flag=True, default=None,
                 help="vLLM's: a vision model's start-up memory profile leaves out the encoder's dummy batch of the "
                      "largest images, which leaves the KV cache more (at the risk of running out of memory) "
                      "[default: profiled]"),
    click.option("--max-num-queued-reqs", type=int, default=None,
                 help="vLLM's --max-num-queued-reqs: refuse a request (HTTP 503) when the engine's unfinished "
                      "requests would exceed this [default: no limit]"),
    click.option("--max-num-queued-tokens", type=int, default=None,
                 help="vLLM's --max-num-queued-tokens: refuse a request when the prompts of requests without a "
                      "token yet reach this many tokens (a TTFT guard) [default: no limit]"),
    click.option("--max-num-batched-tokens", type=int, default=None,
                 help="[default: vLLM 0.33's API server's on the GPU: 16,384 from 160 GiB, 8,192 from 70 GiB "
                      "(not A100s), else 2,048; without chunked prefill at least max-model-len]"),
    click.option("--vllm-batch-defaults/--no-vllm-batch-defaults", default=None,
                 help="Off: max-num-seqs 256 and max-num-batched-tokens 8,192 on every GPU where not given "
                      "(simkv's defaults before it took vLLM's) [default: on]"),
    click.option("--performance-mode", type=click.Choice(list(PERFORMANCE_MODE_BATCH_SCALE)), default=None,
                 help="vLLM's: 'throughput' doubles max-num-seqs and max-num-batched-tokens where not given "
                      "(its CUDA-graph and kernel choices, and 'interactivity', are not the scheduler's) "
                      "[default: balanced]"),
    click.option("--max-num-scheduled-tokens", type=int, default=None,
                 help="vLLM's: the tokens a step may schedule, where --max-num-batched-tokens stays the batch's rows "
                      "(the scheduled tokens and a draft model's drafting slots) [default: max-num-batched-tokens]"),
    click.option("--max-model-len", type=MaxModelLen(), default=None, help=MAX_MODEL_LEN_HELP),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None, help="[default: on]"),
    click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None, help="[default: on]"),
    click.option("--long-prefill-token-threshold", type=int, default=None, help="[default: 0]"),
    click.option("--watermark", type=float, default=None, help="[default: 0.0]"),
    click.option("--num-lookahead-tokens", type=int, default=None, help="[default: 0]"),
    click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default=None,
                 help="vLLM's: fp8 (fp8_e4m3, fp8_e5m2) stores one byte an element; int8_per_token_head, "
                      "fp8_per_token_head (one byte) and int4_per_token_head (half) add a float32 scale per head "
                      "and token for K and V each; turboquant_* pack a head's K and V into one slot and keep the "
                      "first and last two layers bf16; nvfp4 (FlashInfer's) stores fp4 with an fp8 scale per 16; "
                      "on ROCm, ultraquant_4bit packs fp4 with a scale byte per 32 (and keeps TurboQuant's bf16 "
                      "layers), octave_* pack 3- and 4-bit codes (head_dim 256, 64 rotary dims, MI300X/MI325X); "
                      "on sparse latent attention, fp8_ds_mla and nvfp4_ds_mla (Blackwell) name FlashMLA's layouts "
                      "[default: auto, the model's bf16]"),
    click.option("--prefix-match-unit", type=int, default=None, metavar="TOKENS",
                 help="vLLM's: the finest boundary a prefix-cache hit lands on; simkv takes the block itself "
                      "(finer, on models with several KV-cache groups, is refused) [default: the block]"),
    click.option("--kv-cache-dtype-skip-layers", default=None, metavar="I,J,...",
                 help="vLLM's: decoder layers whose K and V stay bf16 under an fp8, TurboQuant or UltraQuant "
                      "--kv-cache-dtype; "
                      "the block size grows so a quantized layer's page covers 16 tokens of a skipped one (16 -> 32) "
                      "[default: none]"),
    click.option("--mamba-cache-dtype", type=click.Choice(list(MAMBA_DTYPE_BYTES)), default=None,
                 help="vLLM's: a linear-attention (Mamba) layer's convolution state, and its recurrent state "
                      "unless the checkpoint sets that [default: auto, the model's bf16]"),
    click.option("--mamba-ssm-cache-dtype", type=click.Choice(list(MAMBA_DTYPE_BYTES)), default=None,
                 help="vLLM's: the recurrent state's [default: auto, the checkpoint's or --mamba-cache-dtype's]"),
    click.option("--preemption-mode", type=click.Choice(["recompute", "swap", "restart"]), default=None,
                 help="recompute (vLLM v1), swap (vLLM v0: KV to CPU swap space), restart [default: recompute]"),
    click.option("--swap-space", type=float, default=None, help="GiB of CPU swap space per GPU [default: 4]"),
    click.option("--parallel-sampling", type=click.Choice(["fan_out", "fork"]), default=None,
                 help="A trace row with n > 1: fan_out (vLLM v1: n requests sharing the prompt's blocks through "
                      "the prefix cache) or fork (vLLM v0: sequences forked after the prompt, copy-on-write) "
                      "[default: fan_out]"),
    click.option("--pcie-bandwidth-gbs", type=float, default=None,
                 help="host<->GPU bandwidth for swapping, KV offloading and --cpu-offload-gb, GB/s [default: 63]"),
    click.option("--cpu-offload-gb", type=float, default=None, metavar="GIB",
                 help="vLLM's: GiB of each GPU's weights kept in host memory (UVA), which frees that much for the "
                      "KV cache and is read over the host link every forward pass (roofline) [default: 0]"),
    click.option("--cpu-offload-params", default=None, metavar="SEGMENTS",
                 help="vLLM's: only these parameters go to host memory under --cpu-offload-gb: a mixture of "
                      "experts' routed experts (experts), or their gate/up (w13_weight) or down (w2_weight) "
                      "projections, comma-separated; a step reads the experts it routes to over the link "
                      "[default: any weight]"),
    click.option("--offload-group-size", type=int, default=None, metavar="G",
                 help="vLLM's prefetch weight offloading: of every G decoder layers the last --offload-num-in-group "
                      "live in host memory and are copied in each forward pass, --offload-prefetch-step layers "
                      "ahead; a layer whose copy is late waits (roofline) [default: 0, off]"),
    click.option("--offload-num-in-group", type=int, default=None, metavar="N", help="[default: 1]"),
    click.option("--offload-prefetch-step", type=int, default=None, metavar="S",
                 help="GPU buffers of one layer each, the copies' lead [default: 1]"),
    click.option("--offload-params", default=None, metavar="SEGMENTS",
                 help="vLLM's: of each offloaded layer only these parameters live in host memory and are copied: a "
                      "mixture of experts' routed experts (experts, w13_weight, w2_weight), comma-separated; "
                      "layers without them stay on the GPU [default: the whole layer]"),
    click.option("--kv-offloading-size", type=float, default=None,
                 help="GiB of CPU memory for KV offloading over the engine's GPUs (vLLM's native backend) [default: off]"),
    click.option("--kv-offloading-block-size", type=int, default=None,
                 help="Tokens per CPU-tier chunk, a multiple of --block-size (vLLM's kv_connector_extra_config "
                      "block_size) [default: one GPU block]"),
    click.option("--kv-offloading-policy", type=click.Choice(["lru", "arc"]), default=None,
                 help="The CPU tier's eviction policy (vLLM's eviction_policy) [default: lru]"),
    click.option("--kv-offloading-store-threshold", type=int, default=None,
                 help="Store a chunk only once it has been offered this many times (vLLM's store_threshold; "
                      "0 or 1: always) [default: 0]"),
    click.option("--kv-offloading-max-tracker-size", type=int, default=None,
                 help="Keys the store threshold's offer counts remember, LRU (vLLM's max_tracker_size) "
                      "[default: 64000]"),
    click.option("--kv-offloading-prompt-only/--no-kv-offloading-prompt-only", default=None,
                 help="Offload prompt blocks only (vLLM's offload_prompt_only); --no-...: decode blocks too "
                      "[default: prompt only]"),
    click.option("--prefix-caching-hash-bits", type=int, default=None,
                 help="Use a deliberately weak K-bit block hash and count false prefix hits [default: 63, no collisions modelled]"),
    click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), default=None),
    click.option("--async-scheduling/--no-async-scheduling", default=None,
                 help="vLLM's async scheduling (its serving default): step N+1 is scheduled while step N runs; "
                      "the roofline's host overheads overlap the device [default: off, the synchronous scheduler]"),
    click.option("--model-runner", type=click.Choice(["auto", "v1", "v2"]), default=None,
                 help="vLLM's model runner (its VLLM_USE_V2_MODEL_RUNNER): v2 drafts n-grams on the device, K every "
                      "step, and takes async scheduling with them and with pipeline stages; v1 proposes n-grams on "
                      "the host, none without a match [default: auto, v2 unless suffix decoding or parallel "
                      "drafting needs v1, as vLLM 0.33 picks]"),
    click.option("--client-max-concurrency", type=int, default=None, metavar="N",
                 help="The client keeps at most N requests in flight (vllm bench serve's --max-concurrency): a "
                      "request waits past its trace time for one to finish; with paced sessions, a due turn "
                      "waits (vLLM's multi-turn benchmark's --num-clients) [default: no limit]"),
    click.option("--client-max-inflight-tokens", type=int, default=None, metavar="TOKENS",
                 help="The client (or a gateway) keeps the requests in flight at most this many prompt + output "
                      "tokens (a request's KV footprint at its max_tokens): a request waits until it fits "
                      "[default: no limit]"),
    click.option("--client-max-active-sessions", type=int, default=None, metavar="M",
                 help="Paced sessions: at most M conversations in progress; the next starts when one ends (vLLM's "
                      "multi-turn benchmark's --max-active-conversations) [default: no limit]"),
    click.option("--client-early-stop/--no-client-early-stop", default=None,
                 help="Paced sessions: the client stops sending once a conversation ends and none is left to start; "
                      "later turns are never sent (vLLM's multi-turn benchmark's default; with --vllm-multi-turn, "
                      "on unless its command says --no-early-stop) [default: off]"),
    click.option("--client-rotation/--no-client-rotation", default=None,
                 help="Paced sessions: each of the --client-max-concurrency N clients keeps M // N of the "
                      "--client-max-active-sessions M conversations and sends their turns in rotation, leaving "
                      "when none is left to take (vLLM's multi-turn benchmark's clients; on with "
                      "--vllm-multi-turn) [default: off, the clients share one pool of due turns]"),
    click.option("--client-conversation-sampling", type=click.Choice(["round_robin", "random"]), default=None,
                 help="Rotating clients: the conversation of a client's next request, round-robin or at random "
                      "(the multi-turn benchmark's --conversation-sampling) [default: round_robin]"),
    click.option("--client-max-requests", type=int, default=None, metavar="N",
                 help="Rotating clients: N requests in all at most, each client its share (the multi-turn "
                      "benchmark's --max-num-requests) [default: no limit]"),
    click.option("--client-warmup/--no-client-warmup", default=None,
                 help="Rotating clients: first every conversation's first turn alone, then the rest from the "
                      "second turn (the multi-turn benchmark's --warmup-step) [default: off]"),
    click.option("--client-request-rate", type=float, default=None, metavar="R",
                 help="Paced sessions: each client (one per conversation in progress) sends at most R requests "
                      "per second, pausing after a request of d seconds for an exponential draw of mean 1/R - d "
                      "(vLLM's multi-turn benchmark's --request-rate) [default: no pause]"),
    click.option("--client-seed", type=int, default=None, metavar="N",
                 help="Seed of the clients' pauses: client c draws from numpy's state seeded N + c + 1 (the "
                      "multi-turn benchmark's --seed) [default: 0]"),
    click.option("--session-pacing/--no-session-pacing", default=None,
                 help="A trace with session_id: send a turn no earlier than its previous turn's finish + its "
                      "think_time_s (a client answering a reply); --no-...: the trace's arrival times as they are "
                      "[default: on]"),
    click.option("--client-ttft-timeout", type=float, default=None, metavar="SECONDS",
                 help="Clients give up on a request without its first token this long after sending it; vLLM "
                      "aborts it (simkv/replay/client_timeouts.py) [default: they wait]"),
    click.option("--client-timeout", type=float, default=None, metavar="SECONDS",
                 help="Clients give up on a request not finished this long after sending it (an HTTP client's "
                      "timeout); vLLM aborts it [default: they wait]"),
    click.option("--client-max-retries", type=int, default=None,
                 help="A client that gave up sends the request again, up to this many times (the OpenAI "
                      "client's max_retries) [default: 0]"),
    click.option("--client-retry-backoff", type=float, default=None, metavar="SECONDS",
                 help="Wait before the first retry, doubling before each next one [default: 0.5]"),
    click.option("--client-retry-max-backoff", type=float, default=None, metavar="SECONDS",
                 help="The longest wait before a retry (the OpenAI client's: 8) [default: none]"),
    click.option("--client-retry-jitter", type=float, default=None, metavar="FRACTION",
                 help="Each wait before a retry is shortened by a draw of up to this fraction of it, the same "
                      "for a request's attempt in every replay (the OpenAI client's: 0.25) [default: 0]"),
    click.option("--enable-lora/--no-enable-lora", default=None,
                 help="vLLM's --enable-lora: serve the adapters the trace's lora_name column names [default: off]"),
    click.option("--max-loras", type=int, default=None,
                 help="vLLM's --max-loras: distinct adapters in one batch; a request whose adapter would exceed "
                      "it waits [default: 1]"),
    click.option("--max-lora-rank", type=int, default=None,
                 help="vLLM's --max-lora-rank: the adapter slots' width; max_loras slots of it take GPU memory "
                      "from the KV cache, and the roofline prices the adapters' kernels at it [default: 16]"),
    click.option("--max-cpu-loras", type=int, default=None,
                 help="vLLM's --max-cpu-loras: adapters the worker keeps in host memory; a step whose adapter is "
                      "not there reads it from disk first (>= max-loras) [default: max-loras]"),
    click.option("--lora-load-gbs", type=float, default=None, metavar="GB/S",
                 help="Reading an adapter from disk into host memory, vLLM's host-side work included (an "
                      "assumption, not a measurement: set it from your logs) [default: 2]"),
    click.option("--speculative-method", type=click.Choice(SPEC_METHODS),
                 default=None, help="Speculative decoding (vLLM's --speculative-config method) [default: off]"),
    click.option("--num-speculative-tokens", type=int, default=None, help="Draft tokens per step (K)."),
    click.option("--spec-acceptance-rate", type=float, default=None,
                 help="P(a draft is accepted | the drafts before it were) [default: 0.7]"),
    click.option("--spec-position-acceptance-rates", default=None, metavar="R1,R2,...",
                 help="Instead: vLLM's logged 'Per-position acceptance rate' figures, one per draft position."),
    click.option("--spec-acceptance-length", type=float, default=None, metavar="L",
                 help="Instead: a mean acceptance length (1 + accepted drafts per verifying step), spread over the "
                      "positions as vLLM's synthetic rejection sampler does (synthetic_acceptance_length)"),
    click.option("--spec-draft-model", type=ModelName(), default=None,
                 help="draft_model: the draft's model spec (its passes and memory) [eagle family: one target layer]"),
    click.option("--spec-tokens-per-batch-size", default=None, metavar="A-B:K,...",
                 help="Dynamic speculation (vLLM's num_speculative_tokens_per_batch_size): K drafts after steps of "
                      "A to B requests, e.g. 1-16:5,17-64:3,65-256:1 [default: always --num-speculative-tokens]"),
    click.option("--spec-parallel-drafting", is_flag=True, default=None,
                 help="vLLM's parallel_drafting (P-EAGLE, PARD; a drafter trained for it): all K drafts from one "
                      "draft pass, which takes K - 1 (eagle, eagle3) or K (draft_model) more batch slots per request"),
    click.option("--spec-draft-layers", type=int, default=None, metavar="N",
                 help="dflash: the drafter's decoder layers, shaped like the target's (or --spec-draft-model "
                      "with its config.json) [default: 5]"),
    click.option("--spec-mtp-modules", type=int, default=None, metavar="N",
                 help="mtp: the MTP modules the checkpoint ships (its num_nextn_predict_layers); with N > 1 and "
                      "K > 1 vLLM's multi-module MTP: draft i from module i, each over the whole step, and "
                      "prefill chunks never end fewer than K tokens before the prompt's end "
                      "[default: the model's, else 1]"),
    click.option("--spec-seed", type=int, default=None, help="Seed of the draft acceptance draws [default: 0]"),
    click.option("--spec-ngram-match-rate", type=float, default=None, metavar="P",
                 help="ngram, suffix: how often the prompt lookup (suffix tree) finds a match after a request "
                      "samples; without one it proposes no drafts and its next step decodes one token [default: 1]"),
    click.option("--spec-mean-draft-tokens", type=float, default=None, metavar="M",
                 help="suffix: the mean drafts of a proposal (vLLM's num_draft_tokens / num_drafts); lengths drawn "
                      "from a geometric distribution cut at --num-speculative-tokens [default 24] (required)"),
    click.option("--sliding-window", type=int, default=None,
                 help="Override the model's sliding-window size in tokens (0: no sliding-window layers) [default: the model's]"),
    click.option("--full-attention-interval", type=int, default=None,
                 help="With a sliding window: every K-th layer attends the whole context, 0: none [default: the model's]"),
    click.option("--attention-chunk-size", type=int, default=None,
                 help="Chunked local attention (Llama 4's): layers but every --full-attention-interval-th attend only "
                      "their own chunk of this many tokens, 0: none [default: the model's]"),
    click.option("--disable-hybrid-kv-cache-manager", is_flag=True, default=None,
                 help="vLLM's flag: sliding-window layers of a mixed model allocate like full attention (one block table)"),
    click.option("--disable-sliding-window", is_flag=True, default=None,
                 help="vLLM's flag: sliding-window layers attend the whole context, and max_model_len is at most "
                      "the model's window"),
    click.option("--prefix-cache-retention-interval", type=RetentionInterval(), default=None, metavar="N|none",
                 help="vLLM's: sliding-window blocks and linear-attention states cached every N tokens besides "
                      "prompt ends and shared-prefix junctions; none: all [default: 0, junctions and prompt ends only]"),
    click.option("--gdn-prefill-backend", type=click.Choice(["auto", "flashinfer", "triton"]), default=None,
                 help="vLLM's: Gated DeltaNet prefill kernels; with prefix caching FlashInfer's export a state "
                      "from inside a chunk and align blocks to 64 tokens [default: auto, FlashInfer on Hopper "
                      "and on Blackwell for 128-wide keys, else Triton]"),
    click.option("--indexer-tp-shard-min-rows", type=int, default=None, metavar="N",
                 help="vLLM's attention_config option (DeepSeek sparse attention): a step with at least N prefill "
                      "tokens splits their indexer scoring over the TP ranks [default: 65536]"),
]


@click.command("replay", cls=SectionedCommand)
@click.argument("trace", required=False, default=DEFAULT_TRACE)
@click.option("--out", "out_dir", default="out/replay", show_default=True, help="Output folder.")
@click.option("--config", "config_file", default=None, help="YAML or JSON file of engine options.")
@click.option("--vllm-bench", "vllm_bench", default=None, metavar="COMMAND|@FILE",
              help="Instead of TRACE: the traffic of a `vllm bench serve` command, or @FILE holding one (its random, "
                   "prefix_repetition or timed_trace dataset and schedule, as vLLM's client draws them; its "
                   "--max-concurrency and --goodput) (docs/vllm_serve.md).")
@click.option("--vllm-multi-turn", "vllm_multi_turn", default=None, metavar="COMMAND|@FILE",
              help="Instead of TRACE: the conversations and clients of a command of vLLM's multi-turn benchmark "
                   "(benchmark_serving_multi_turn.py --input-file GEN.json --num-clients N ...), or @FILE holding "
                   "one; its statistics are printed in its layout too (docs/traces.md).")
@click.option("--cost-model", default="roofline", show_default=True, type=CostModelChoice(COST_MODELS),
              help="A cost model name, or a calib.json fitted by `simkv calibrate`.")
@click.option("--backend", type=click.Choice(["sim", "gpu"]), default="sim", show_default=True,
              help="sim: step durations from --cost-model; gpu: run every step on the model runner (gpu_backend/).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, help="gpu backend [default: cuda if present]")
@click.option("--enforce-eager", is_flag=True,
              help="gpu backend: run decode steps without CUDA graphs (vLLM's flag; by default they are captured).")
@click.option("--cudagraph-mode", type=click.Choice(["full_decode_only", "full_and_piecewise"]), default="full_decode_only",
              show_default=True, help="gpu backend (vLLM's cudagraph_mode): decode-only steps from full CUDA graphs, "
                                      "and with full_and_piecewise also steps with prefill chunks of up to "
                                      "min(2 * max_num_seqs, 512) tokens from piecewise graphs (attention eager between).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="gpu backend [default: bf16 on cuda, fp32 on cpu]")
@click.option("--calibrate-alongside", "calibrate_alongside", type=click.Path(dir_okay=False), default=None,
              help="gpu backend: also time calibration grid points between the replay's steps and write their "
                   "fit to this calib.json (for hosts whose speed drifts; the replay takes about twice as long).")
@click.option("--step-noise", type=click.Choice(["none", "empirical"]), default="none", show_default=True,
              help="calib.json cost model: multiply each step's time by a ratio drawn from the calibration's own "
                   "repeats (real steps scatter, and queues grow with the scatter); turns decode runs off.")
@click.option("--noise-seed", type=int, default=0, show_default=True, help="Seed of --step-noise (same seed, same output).")
@click.option("--step-base-s", type=float, default=0.015, show_default=True, help="linear cost model")
@click.option("--step-per-token-s", type=float, default=2e-5, show_default=True, help="linear cost model")
@engine_options
@click.option("--goodput", "goodput", multiple=True, metavar="[CLASS:]KEY:MS",
              help="Latency SLO (vLLM's --goodput): ttft, tpot or e2el and a limit in ms, e.g. --goodput ttft:2000 "
                   "--goodput tpot:100; summary.json then counts the requests that met all of them. CLASS:KEY:MS "
                   "holds one request class (the trace's request_class) to its own limit (batch:ttft:30000).")
@click.option("--gpu-price", "gpu_prices", multiple=True, metavar="GPU=USD",
              help="What a GPU-hour costs, e.g. --gpu-price H100-SXM=2.49 (each GPU kind the setup runs on): "
                   "summary.json's `cost` then prices the GPU-hours paid (an autoscaled fleet's, its nodes') per "
                   "1M output tokens and per 1,000 requests.")
@fleet_options
@click.option("--replica-failure", "replica_failures", multiple=True, metavar="T:R",
              help="Replica R of the fleet fails at T seconds (simkv/replay/failures.py): the requests in flight "
                   "there are lost (retried through the router with --client-max-retries, else failed), and it "
                   "takes none until it is back, its caches empty, --restart-s later. Repeatable.")
@click.option("--restart-s", type=float, default=None, metavar="S",
              help="With --replica-failure: seconds a failed replica takes to be back (its pod's restart, weights "
                   "and CUDA graphs) [default: 120].")
@click.option("--replica-mtbf-s", type=float, default=None, metavar="S",
              help="Each replica also fails at random, S seconds apart on average (a Poisson process over the "
                   "trace's arrivals), with --replica-failure's rules.")
@click.option("--failure-seed", type=int, default=None, metavar="N",
              help="Seed of --replica-mtbf-s' draws (same seed, same failures) [default: 0].")
@disaggregation_options
@encode_options
@click.option("--no-decode-runs", is_flag=True, help="Step one by one (slower; same results).")
@click.option("--quiet", is_flag=True, help="No progress bar or table.")
def replay_cmd(trace: str, out_dir: str, config_file: str | None, vllm_bench: str | None,
               vllm_multi_turn: str | None, cost_model: str,
               step_base_s: float,
               step_per_token_s: float, no_decode_runs: bool, quiet: bool, backend: str, device: str | None,
               dtype: str | None, enforce_eager: bool, calibrate_alongside: str | None, step_noise: str,
               noise_seed: int, cudagraph_mode: str, goodput: tuple[str, ...], replicas: int, router: str,
               router_options: tuple[str, ...], class_replicas: tuple[str, ...], replica_sets: tuple[str, ...],
               gpu_prices: tuple[str, ...], replica_failures: tuple[str, ...], restart_s: float | None,
               replica_mtbf_s: float | None, failure_seed: int | None, **flags) -> None:
    """Replay TRACE (parquet or CSV, canonical schema) and write summary.json,
    requests.parquet and steps.parquet into --out."""
    from simkv.replay.api import replay, save
    from simkv.replay.report import print_summary
    from simkv.studies.serving_cost import PriceError, SetupGPUs, parse_prices, replay_cost, replay_gpu_hours

    try:
        prices = parse_prices(gpu_prices)
    except PriceError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpu-price") from None

    if step_noise != "none" and backend == "gpu":
        raise click.UsageError("--step-noise is for simulated replays (the gpu backend's steps vary by themselves)")
    if calibrate_alongside and backend != "gpu":
        raise click.UsageError("--calibrate-alongside needs --backend gpu (it times grid points between measured steps)")
    disaggregation = read_disaggregation(flags, config_file, router_options)
    encode = read_encode(flags, config_file)
    autoscale = read_autoscale(flags, config_file, pools=_pools_scale(disaggregation))
    if autoscale is not None and (disaggregation is not None or backend == "gpu"):
        raise click.UsageError("--autoscale scales a fleet of simulated replicas: not P/D pools or the gpu backend")
    if encode is not None and backend == "gpu":
        raise click.UsageError("--encode-replicas is simulated only (the gpu backend runs one text-only engine)")
    if disaggregation is not None:
        if replicas is not None or router is not None:
            raise click.UsageError("P/D disaggregation sets its pools with --prefill-replicas/--decode-replicas and "
                                   "--prefill-router/--decode-router; drop --replicas/--router")
        if backend == "gpu":
            raise click.UsageError("P/D disaggregation is simulated only (the gpu backend runs one engine)")
        if replica_sets:
            raise click.UsageError("--replica-set: P/D pools set each pool's engines with --prefill-set/--decode-set")
        disaggregation = pool_class_replicas(disaggregation, class_replicas, config_file)
        fleet = None
    else:
        fleet = read_fleet(replicas, router, router_options, config_file, class_replicas, replica_sets=replica_sets,
                           autoscale=autoscale)
    if replica_failures or restart_s is not None or replica_mtbf_s is not None or failure_seed is not None:
        fleet = _with_failures(fleet, replica_failures, restart_s, disaggregation is not None or encode is not None,
                               replica_mtbf_s, failure_seed)
    if fleet is not None and fleet.num_replicas > 1 and backend == "gpu":
        raise click.UsageError("--replicas: the gpu backend runs one engine on one device; simulate the fleet "
                               "with --cost-model calib.json instead")
    if (vllm_bench or vllm_multi_turn) and trace != DEFAULT_TRACE:
        raise click.UsageError("give TRACE or --vllm-bench / --vllm-multi-turn (whose traffic is the trace), not both")
    if vllm_bench and vllm_multi_turn:
        raise click.UsageError("give --vllm-bench or --vllm-multi-turn, not both")
    slo, config, data = read_inputs(trace, flags | {"router": router}, config_file, goodput, vllm_bench=vllm_bench,
                                    vllm_multi_turn=vllm_multi_turn)
    if disaggregation is not None:
        check_pools(disaggregation, config)
    if prices:
        if backend == "gpu":
            raise click.UsageError("--gpu-price prices simulated replays")
        missing = SetupGPUs.of(config, fleet, disaggregation).unpriced(prices)
        if missing:
            raise click.BadParameter(f"no price for {', '.join(missing)}, which this setup runs on (give "
                                     f"{missing[0]}=USD_PER_GPU_HOUR)", param_hint="--gpu-price")
    if backend == "gpu" and (config.cache.cpu_offload_gb or config.cache.offload_group_size):
        raise click.UsageError("--cpu-offload-gb and --offload-group-size are simulated only: the gpu backend keeps "
                               "every weight on the device")
    if backend == "gpu" and config.speculative.enabled:
        raise click.UsageError("--speculative-method is simulated only: the gpu backend runs no drafter")
    if backend == "gpu" and config.cache.kv_cache_dtype not in ("auto", "bfloat16", "float16", "fp16"):
        raise click.UsageError(f"--kv-cache-dtype {config.cache.kv_cache_dtype} is simulated only: the gpu backend's "
                               "paged-attention kernels keep K and V in the model's 16-bit dtype")
    if backend == "gpu":
        # (sliding windows may come from --sliding-window on any model)
        why = get_model_spec(config.hardware.model).simulated_only or (
            ("chunked local attention" if config.attention_chunk_size else "sliding-window layers")
            if config.has_sliding_window else None) or (
            "--quantization" if config.hardware.quantization else None) or (
            "decode context parallelism" if config.hardware.decode_context_parallel_size > 1 else None)
        if why:
            raise click.UsageError(f"{config.hardware.model} has {why}: simulated only (the gpu backend runs dense "
                                   "Llama-architecture decoders that attend the whole context)")
    if backend == "gpu" and config.scheduler.async_scheduling:
        raise click.UsageError("--async-scheduling is simulated only: the gpu backend runs each step to its end "
                               "before scheduling the next")
    from rich.progress import Progress

    with Progress(disable=quiet or len(data) < 5000, transient=True) as progress:
        task = progress.add_task("replaying", total=len(data))
        try:
            if backend == "gpu":
                from gpu_backend.replay import run_gpu_replay_cli

                result = run_gpu_replay_cli(data, config, out_dir, device, dtype, lambda k: progress.advance(task, k),
                                            enforce_eager=enforce_eager, calibrate_alongside=calibrate_alongside,
                                            cudagraph_mode=cudagraph_mode, goodput=slo)
            else:
                result = replay(data, config, cost_model,
                                {"step_base_s": step_base_s, "step_per_token_s": step_per_token_s,
                                 "step_noise": step_noise, "noise_seed": noise_seed},
                                use_decode_runs=not no_decode_runs,
                                on_progress=lambda k: progress.advance(task, k), goodput=slo, fleet=fleet,
                                disaggregation=disaggregation, encode=encode)
        except (ConfigError, ValueError, ReplayError) as exc:
            raise click.ClickException(str(exc)) from None
    if prices:  # (what the traffic cost on this setup)
        result.summary["cost"] = replay_cost(result.summary, replay_gpu_hours(result.summary, config, fleet,
                                                                              disaggregation, encode), prices)
    save(result, out_dir)
    requests = result.requests  # (those refused by the admission control have their own row; a retried 503 is no rejection)
    rejected = int(((requests["status"] == "rejected") & (requests["prompt_tokens"] >= config.max_model_len)).sum())
    if rejected:  # vLLM refuses these prompts the same way; say how to serve them
        how = ("the model's sliding window under --disable-sliding-window" if config.attention.disable_sliding_window
               and config.max_model_len == config.hardware.model_spec().sliding_window
               else "the longest request the KV cache holds (--max-model-len auto)" if config.scheduler.max_model_len_fitted
               else "--max-model-len raises it")
        click.echo(f"warning: {rejected:,} of {result.summary['num_requests']:,} requests were rejected: their prompts "
                   f"have at least max_model_len = {config.max_model_len:,} tokens ({how})", err=True)
    from simkv.calibration.coverage import cost_model_warnings

    for line in cost_model_warnings(result.summary.get("cost_model") or {}, cost_model):
        click.echo(f"warning: {line}", err=True)
    sc, spec = config.scheduler, config.speculative
    if spec.speculative_method == "dflash" and config.max_num_active < (sc.max_num_active_seqs or sc.max_num_seqs):
        click.echo(f"warning: dflash's draft pass needs {spec.num_lookahead_tokens} query tokens per request within "
                   f"max_num_batched_tokens = {sc.max_num_batched_tokens:,}: at most {config.max_num_active:,} "
                   "requests run at once (vLLM lowers max_num_active_seqs likewise; raise max_num_batched_tokens "
                   "for more)", err=True)
    if config.scheduler.async_scheduling and cost_model != "unit" and not _splits_host_time(cost_model, config):
        click.echo(f"warning: --cost-model {cost_model} gives whole step times: async scheduling changes when "
                   "requests are scheduled and freed, but no host time is overlapped with the device "
                   "(the roofline model's is)", err=True)
    from simkv.compare.run_report import write_run_report_safely

    report = write_run_report_safely(out_dir)
    if not quiet:
        print_summary(result.summary, Path(out_dir), with_report=report is not None)
        if vllm_bench:  # (the same figures as the benchmark prints its own)
            from simkv.cli.vllm_bench_command import bench_report

            click.echo(bench_report(result.summary, result.requests))
        if vllm_multi_turn:  # (likewise, the multi-turn benchmark's statistics)
            from simkv.cli.vllm_multi_turn_command import command_args, multi_turn_report

            stream = not command_args(vllm_multi_turn).no_stream  # (its flags only: the trace is built)
            click.echo(multi_turn_report(result.summary, result.requests, stream))
