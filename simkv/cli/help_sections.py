"""`--help` in sections: `simkv replay`, `goodput` and `capacity` take well over a hundred
options (most of them vLLM's engine options), listed under headings by what they set instead of
in one list. Only the help's layout changes; the options are the commands' own."""

from __future__ import annotations

import click

# (heading, option names) in the order the help shows them; options not named here fall under
# the first heading (what to replay, where the results go, the run's own switches)
SECTIONS: tuple[tuple[str, frozenset[str]], ...] = (
    ("General", frozenset()),
    ("Cost model and backend", frozenset({
        "cost_model", "backend", "device", "enforce_eager", "cudagraph_mode", "dtype", "calibrate_alongside",
        "step_noise", "noise_seed", "step_base_s", "step_per_token_s"})),
    ("Model, GPUs and parallelism (vLLM's options)", frozenset({
        "model", "gpu", "tensor_parallel_size", "data_parallel_size", "dp_sync_interval", "decode_context_parallel_size",
        "prefill_context_parallel_size", "pipeline_parallel_size", "pipeline_link_gbs", "gpus_per_node",
        "inter_node_gbs", "quantization", "enable_expert_parallel", "all2all_backend",
        "expert_placement_strategy", "enable_eplb", "num_redundant_experts", "enable_dbo",
        "ubatch_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold"})),
    ("Scheduler (vLLM's options)", frozenset({
        "max_num_seqs", "max_num_active_seqs", "prefill_schedule_interval", "max_num_queued_reqs",
        "max_num_queued_tokens", "max_num_batched_tokens", "vllm_batch_defaults", "performance_mode",
        "max_num_scheduled_tokens", "max_model_len", "enable_chunked_prefill", "long_prefill_token_threshold",
        "watermark", "num_lookahead_tokens", "preemption_mode", "parallel_sampling", "scheduling_policy",
        "async_scheduling", "model_runner"})),
    ("KV cache, attention and weights in memory (vLLM's options)", frozenset({
        "block_size", "num_gpu_blocks", "gpu_memory_utilization", "kv_cache_memory_bytes", "kv_cache_dtype",
        "kv_cache_dtype_skip_layers", "prefix_match_unit",
        "mamba_cache_dtype", "mamba_ssm_cache_dtype", "enable_prefix_caching", "prefix_caching_hash_bits",
        "swap_space", "pcie_bandwidth_gbs", "cpu_offload_gb", "cpu_offload_params", "offload_group_size",
        "offload_num_in_group", "offload_prefetch_step", "offload_params", "sliding_window",
        "full_attention_interval", "attention_chunk_size", "disable_hybrid_kv_cache_manager",
        "disable_sliding_window", "prefix_cache_retention_interval", "gdn_prefill_backend",
        "indexer_tp_shard_min_rows"})),
    ("CPU tier (vLLM's KV offloading)", frozenset({
        "kv_offloading_size", "kv_offloading_block_size", "kv_offloading_policy", "kv_offloading_store_threshold",
        "kv_offloading_max_tracker_size", "kv_offloading_prompt_only"})),
    ("Images (vLLM's options)", frozenset({
        "mm_max_tokens_per_item", "disable_chunked_mm_input", "mm_encoder_tp_mode", "limit_mm_per_prompt",
        "language_model_only", "skip_mm_profiling"})),
    ("Speculative decoding", frozenset({
        "speculative_method", "num_speculative_tokens", "spec_acceptance_rate", "spec_position_acceptance_rates",
        "spec_acceptance_length", "spec_draft_model", "spec_tokens_per_batch_size", "spec_parallel_drafting",
        "spec_draft_layers", "spec_mtp_modules", "spec_seed", "spec_ngram_match_rate", "spec_mean_draft_tokens"})),
    ("LoRA adapters", frozenset({"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_load_gbs"})),
    ("Clients", frozenset({
        "client_max_concurrency", "client_max_inflight_tokens", "client_max_active_sessions", "client_early_stop",
        "client_rotation", "client_conversation_sampling", "client_max_requests", "client_warmup",
        "client_request_rate", "client_seed", "session_pacing", "client_ttft_timeout", "client_timeout",
        "client_max_retries", "client_retry_backoff", "client_retry_max_backoff", "client_retry_jitter"})),
    ("Fleets, P/D and encoder disaggregation", frozenset({
        "replicas", "router", "router_options", "replica_sets", "class_replicas", "autoscale", "autoscale_metric",
        "autoscale_target", "autoscale_tolerance", "autoscale_interval_s", "cold_start_s", "scale_down_window_s",
        "scale_up_window_s", "autoscale_latency_window_s", "scale_up_policy", "scale_down_policy",
        "autoscale_histogram_buckets", "autoscale_metrics_delay_s", "autoscale_latency_target_type", "node_gpus",
        "node_provision_s", "node_image_pull_s", "node_unneeded_s", "node_delay_after_add_s", "min_nodes",
        "node_placement", "node_mtbf_s", "node_failure_seed", "node_reclaim_notice_s", "shutdown_timeout",
        "termination_grace_s", "prestop_s", "replica_failures", "restart_s", "replica_mtbf_s", "failure_seed",
        "prefill_replicas", "decode_replicas", "prefill_autoscale", "decode_autoscale", "prefill_sets",
        "decode_sets", "prefill_router", "decode_router", "kv_link_gbps", "kv_link_latency_ms", "handoff_ms",
        "kv_abort_timeout_s", "encode_replicas", "encode_router", "encode_sets", "ec_store_gbs",
        "encode_hop_ms"})),
)


def section_of(name: str) -> str:
    """The heading an option's help goes under."""
    for title, names in SECTIONS:
        if name in names:
            return title
    return SECTIONS[0][0]


class SectionedCommand(click.Command):
    """A command whose options' help is listed under SECTIONS' headings (empty ones left out)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):  # (arguments are in the usage line)
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                records.setdefault(section_of(param.name), []).append(record)
        for title, _ in SECTIONS:
            if title in records:
                with formatter.section(title):
                    formatter.write_dl(records[title])
