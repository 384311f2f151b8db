"""`simkv capacity`: KV bytes per token, number of blocks and vLLM's start-up lines for one setup."""

from __future__ import annotations

import json

import click

from simkv.capacity import (GIB, activation_reserve_bytes, compute_capacity, encoder_profile, encoder_profile_bytes,
                             kv_bytes_per_token, offloaded_weight_bytes, prefetched_weight_bytes, request_concurrency,
                             resident_weight_bytes)
from simkv.cli.help_sections import SectionedCommand
from simkv.cli.replay_cmd import MAX_MODEL_LEN_HELP, VLLM_SERVE_HELP, ByteCount, ImageLimit, MaxModelLen, flat_options
from simkv.config import KV_CACHE_DTYPES, PERFORMANCE_MODE_BATCH_SCALE, SPEC_METHODS, ConfigError, EngineConfig
from simkv.specs import MAMBA_DTYPE_BYTES
from simkv.studies.layouts import LAYOUT_KEYS, layouts_of


def capacity_report(config: EngineConfig, request_tokens: tuple[int, ...] = ()) -> dict:
    """Every figure `simkv capacity` shows; raises ConfigError with vLLM's text when nothing fits.
    `request_tokens`: request lengths to give the concurrency of too (`request_concurrency`)."""
    spec = config.hardware.model_spec()
    cc = config.cache
    tp = config.hardware.tensor_parallel_size
    dp = config.hardware.data_parallel_size
    mml = config.max_model_len
    model_per_token = kv_bytes_per_token(config, 1)
    draft = config.draft_network
    cap = compute_capacity(config)
    gpu_per_token = cap.kv_bytes_per_token
    groups = config.kv_cache_groups
    hybrid = groups.is_hybrid
    # one max_model_len request: every layer's K/V of every token, or under the hybrid manager
    # the blocks it holds at most over the groups (sliding-window groups keep about a window,
    # linear-attention groups a state)
    per_request_gpu = cap.blocks_per_request * cap.block_bytes if hybrid else gpu_per_token * mml
    extra = {"draft_network": draft.name} if draft is not None else {}
    dcp = config.hardware.decode_context_parallel_size
    pcp = config.hardware.prefill_context_parallel_size
    if spec.is_mla:  # every GPU holds the whole latent cache (DCP: its share): all GPUs hold TP x PCP / DCP copies
        model_per_token = kv_bytes_per_token(config, tp) // dcp * tp * pcp  # (of every stage's layers)
        extra["latent_cache_on_every_gpu"] = dcp == 1
    if spec.is_sparse:  # (DeepSeek sparse attention: the indexer's keys ride in every block beside the latent)
        extra["sparse_attention"] = {"index_topk": spec.index_topk,
                                     "indexer_bytes_per_token": spec.indexer_bytes_per_token(),
                                     "latent_bytes_per_token": spec.latent_bytes_per_token(config.kv_element),
                                     # (the latent's layout: FlashMLA's on Hopper, plain fp8 elsewhere)
                                     "latent_layout": {1: "fp8", 2: "fp16" if cc.kv_cache_dtype in ("float16", "fp16")
                                                       else "bf16"}.get(config.kv_element, config.kv_element)}
    if dcp > 1:
        extra |= {"decode_context_parallel_size": dcp, "kv_manager_block_size": config.kv_manager_block_size}
    if pcp > 1:  # (each PCP rank's TP group holds the whole cache; the routed experts span them all)
        extra["prefill_context_parallel_size"] = pcp
    if dp > 1:  # every rank has its own pool of that many blocks
        extra |= {"data_parallel_size": dp, "kv_cache_tokens_all_ranks": dp * cap.kv_cache_tokens}
    if config.hardware.quantization:
        extra["quantization"] = config.hardware.quantization
    pp = config.hardware.pipeline_parallel_size
    weights_per_gpu = int(resident_weight_bytes(config))
    if config.cache.cpu_offload_gb and pp == 1:  # (vLLM's --cpu-offload-gb, per GPU; under PP each stage's GPUs)
        offloaded = offloaded_weight_bytes(config, spec.weight_bytes_per_gpu(tp, config.hardware.expert_shards))
        extra["cpu_offload"] = {"cpu_offload_gb": config.cache.cpu_offload_gb,
                                "offloaded_weight_bytes_per_gpu": int(offloaded)}
        if config.cache.cpu_offload_params:
            extra["cpu_offload"]["cpu_offload_params"] = config.cache.cpu_offload_params
    if config.cache.offload_group_size:  # (vLLM's prefetch weight offloading; under PP the binding stage's GPU)
        from simkv.backends.weight_prefetch import copy_seconds_per_layer, offloaded_positions

        layers = cap.pipeline_layers[cap.pipeline_binding_stage] if pp > 1 else spec.num_layers
        first = sum(cap.pipeline_layers[:cap.pipeline_binding_stage]) if pp > 1 else 0
        offloaded, buffers = prefetched_weight_bytes(config, layers, first)
        extra["weight_prefetch"] = {
            "offloaded_layers": len(offloaded_positions(config, layers, first)),
            "offloaded_weight_bytes_per_gpu": int(offloaded), "buffer_bytes_per_gpu": int(buffers),
            "copy_s_per_layer": copy_seconds_per_layer(config)}
    if pp > 1:  # (per GPU: the figures of the stage with the fewest blocks, which every stage gets)
        extra["pipeline"] = {"pipeline_parallel_size": pp, "layers_per_stage": list(cap.pipeline_layers),
                             "binding_stage": cap.pipeline_binding_stage}
        weights_per_gpu = cap.pipeline_stage_weight_bytes
    if cap.num_offload_chunks:  # KV offloading's CPU tier (vLLM's --kv-offloading-size): chunks of the engine's blocks
        from simkv.capacity import offload_copies

        copies = offload_copies(config)
        chunk_tokens = cc.kv_offloading_block_size or config.kv_manager_block_size
        tier_tokens = cap.num_offload_chunks * chunk_tokens
        extra["kv_offloading"] = {"cpu_tier_gib": cc.kv_offloading_size, "num_chunks": cap.num_offload_chunks,
                                  "chunk_tokens": chunk_tokens, "chunk_bytes": cap.offload_chunk_bytes,
                                  "tokens": tier_tokens, "tokens_per_gpu_cache_token": tier_tokens / cap.kv_cache_tokens,
                                  # (every GPU moves its copy over its own link)
                                  "chunk_transfer_s": cap.offload_chunk_bytes / copies / (cc.pcie_bandwidth_gbs * 1e9)}
        if copies == 1 < tp:  # (vLLM's replicated layout: one copy of a latent every TP rank holds)
            extra["kv_offloading"]["one_copy"] = True
        if config.kv_cache_groups.has_sliding_window:  # (a chunk holds one group's block: each group stores its own)
            extra["kv_offloading"]["chunks_per_group"] = True
        elif config.has_linear_attention:  # (the attention group's chunks, beside the states the GPU keeps)
            extra["kv_offloading"]["states_per_group"] = True
    if config.scheduler.enable_lora:  # (vLLM's LoRA slots: max_loras stacked buffers per linear layer)
        sc = config.scheduler
        extra["lora"] = {"max_loras": sc.max_loras, "max_lora_rank": sc.max_lora_rank, "slots_bytes_per_gpu": cap.lora_bytes}
        if cap.lora_bytes is not None:  # (the roofline's price of the adapters' kernels in a decode step)
            from simkv.backends.factory import make_roofline

            roofline = make_roofline(config)
            extra["lora"]["decode_step_kernels_s"] = {
                "one_token": roofline.lora_seconds(1, 1),
                "full_batch": roofline.lora_seconds(sc.max_num_seqs, min(sc.max_loras, sc.max_num_seqs)),
                "full_batch_sequences": sc.max_num_seqs,
                "launch_s": roofline.params["lora_kernel_s"]}
            from simkv.backends.lora_adapters import adapter_residency

            worker = adapter_residency(config, roofline)  # (a step that needs an adapter not in a slot)
            extra["lora"]["adapter_load_s"] = {"max_cpu_loras": sc.cpu_loras, "disk_read": worker.load_s,
                                               "slot_copy": worker.copy_s, "lora_load_gbs": sc.lora_load_gbs}
    if config.hardware.has_vision_encoder:  # (vLLM's encoder budget and cache, its time for the largest item)
        from simkv.backends.vision_encoder import vision_encoder_cost
        from simkv.core.encoder_cache import encoder_budget

        largest = config.scheduler.mm_max_tokens_per_item or spec.mm_max_tokens_per_item
        extra["vision_encoder"] = {
            "weight_bytes_per_gpu": config.hardware.vision_weight_bytes_per_gpu(),
            "mm_max_tokens_per_item": largest,
            "encoder_budget_and_cache": encoder_budget(config.scheduler.max_num_batched_tokens, largest),
            "seconds_for_largest_item": vision_encoder_cost(config).seconds((largest,))}
        profile = encoder_profile(config)
        if profile is not None:  # (vLLM's dummy batch at start-up: its activations come out of the KV cache)
            vit, embeddings = encoder_profile_bytes(config)
            extra["vision_encoder"] |= {"profile_items": profile[0], "profile_activation_bytes": vit,
                                        "profile_embedding_bytes": embeddings}
    if hybrid:
        extra["kv_cache_groups"] = groups.describe() | {"summary": groups.summary(), "hybrid_kv_cache_manager": hybrid}
    if request_tokens:
        extra["request_concurrency"] = [
            {"tokens": n, "blocks_per_request": blocks, "max_concurrency": at_once}
            for n in request_tokens for blocks, at_once in [request_concurrency(config, cap, n)]]
    if config.kv_skip_layers:  # (kv_cache_dtype_skip_layers, TurboQuant's boundary layers)
        extra["kv_unquantized_layers"] = sorted(config.kv_skip_layer_indices)
    if config.has_linear_attention:  # a state per layer and request, padded to an attention layer's page
        page = cap.block_bytes // groups.layers_per_block
        extra["linear_attention"] = {"kind": spec.linear_attention, "state_bytes_per_layer": config.linear_state_bytes,
                                     "page_bytes_per_layer": page,
                                     "state_blocks_per_request": config.state_blocks_per_request}
    return {
        "model": config.hardware.model,
        "gpu": config.hardware.gpu,
        "tensor_parallel_size": tp,
        "kv_cache_dtype": cc.kv_cache_dtype,
        "block_size": cc.block_size,
        "gpu_memory_utilization": cc.gpu_memory_utilization,
        "kv_cache_memory_bytes": cc.kv_cache_memory_bytes,
        "max_model_len": mml,
        "kv_bytes_per_token": model_per_token,  # the whole model, over all GPUs
        "kv_bytes_per_token_per_gpu": gpu_per_token,
        "kv_bytes_per_request": per_request_gpu * tp if hybrid else model_per_token * mml,  # all GPUs
        "kv_bytes_per_request_per_gpu": per_request_gpu,
        "block_bytes_per_gpu": cap.block_bytes,
        "weight_bytes_per_gpu": weights_per_gpu,  # (the draft network's, if any, not included)
        "activation_reserve_bytes": activation_reserve_bytes(config),  # (vLLM's start-up profile, estimated)
        "num_params": spec.num_params,
        "num_active_params": spec.num_active_params,  # per token (a mixture of experts: k experts)
        "available_kv_bytes_per_gpu": cap.available_kv_bytes,
        "num_gpu_blocks": cap.num_gpu_blocks,
        "num_gpu_blocks_given": cc.num_gpu_blocks is not None,
        "kv_cache_tokens": cap.kv_cache_tokens,
        "max_concurrency": cap.max_concurrency,
        "startup_lines": _encoder_line(config) + cap.startup_lines(),
        # (in force: given, or vLLM 0.33's API-server defaults on this GPU)
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
    } | extra


def _encoder_line(config: EngineConfig) -> list[str]:
    """vLLM's start-up line of a vision model's encoder profile (none without one)."""
    profile = encoder_profile(config)
    if profile is None:
        return []
    from simkv.core.encoder_cache import encoder_budget

    budget = encoder_budget(config.scheduler.max_num_batched_tokens, profile[1])
    return [f"Encoder cache will be initialized with a budget of {budget} tokens, and profiled with "
            f"{profile[0]} image items of the maximum feature size."]


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / GIB:.2f} GiB)" if n >= GIB // 16 else f"{n:,} B"


def print_report(rep: dict) -> None:
    from rich.table import Table

    from simkv.terminal import console as terminal_console

    tp = rep["tensor_parallel_size"]
    gpus = f"{rep['data_parallel_size']} x {tp}" if rep.get("data_parallel_size") else f"{tp}"
    if rep.get("pipeline"):
        gpus = f"{rep['pipeline']['pipeline_parallel_size']} stages x {tp}"
    if rep.get("prefill_context_parallel_size"):
        gpus = f"{rep['prefill_context_parallel_size']} PCP ranks x {gpus}"
    table = Table(title=f"KV cache capacity: {rep['model']} on {gpus} x {rep['gpu']}", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("kv_cache_dtype / block_size", f"{rep['kv_cache_dtype']} / {rep['block_size']}"),
        ("gpu_memory_utilization", f"{rep['gpu_memory_utilization']:.2f}") if rep.get("kv_cache_memory_bytes") is None
        else ("kv_cache_memory_bytes (gpu_memory_utilization ignored)", _bytes(rep["kv_cache_memory_bytes"])),
        ("KV bytes per token (model, all GPUs)", f"{rep['kv_bytes_per_token']:,} B"),
        (f"KV bytes per token per GPU (TP={tp})", f"{rep['kv_bytes_per_token_per_gpu']:,} B"),
        (f"KV per {rep['max_model_len']:,}-token request (all GPUs)", _bytes(rep["kv_bytes_per_request"])),
        (f"KV per {rep['max_model_len']:,}-token request per GPU", _bytes(rep["kv_bytes_per_request_per_gpu"])),
        ("bytes per block per GPU", f"{rep['block_bytes_per_gpu']:,} B"),
        ("max_num_seqs / max_num_batched_tokens", f"{rep['max_num_seqs']:,} / {rep['max_num_batched_tokens']:,}"),
        ("weights per GPU" + (f" ({rep['quantization']})" if rep.get("quantization") else "")
         + (" (in GPU memory)" if rep.get("cpu_offload") else ""), _bytes(rep["weight_bytes_per_gpu"])),
        ("activations and CUDA graphs per GPU (vLLM's profile, estimated)", _bytes(rep["activation_reserve_bytes"])),
        ("KV cache memory per GPU", _bytes(rep["available_kv_bytes_per_gpu"])),
        ("num_gpu_blocks" + (" (given)" if rep["num_gpu_blocks_given"] else ""), f"{rep['num_gpu_blocks']:,}"),
    ]
    if rep.get("kv_unquantized_layers"):
        rows.insert(1, ("layers whose KV stays bf16", ", ".join(map(str, rep["kv_unquantized_layers"]))))
    if rep["num_active_params"] != rep["num_params"]:
        rows.insert(0, ("parameters (active per token)",
                        f"{rep['num_params'] / 1e9:.1f}B ({rep['num_active_params'] / 1e9:.2f}B)"))
    if rep.get("kv_cache_groups"):
        groups = rep["kv_cache_groups"]
        kinds = groups["summary"] if groups["hybrid_kv_cache_manager"] else "1 (hybrid manager disabled)"
        rows.insert(0, ("KV-cache groups", kinds))
        rows.insert(1, ("layers per block (padding)", f"{groups['layers_per_block']} ({groups['num_padding_layers']})"))
    if rep.get("pipeline"):
        pipe = rep["pipeline"]
        rows.insert(0, ("pipeline stages: layers each (per-GPU figures: stage)",
                        f"{', '.join(map(str, pipe['layers_per_stage']))} ({pipe['binding_stage']})"))
    if rep.get("data_parallel_size"):
        rows.append(("data-parallel ranks (each its own KV cache)", f"{rep['data_parallel_size']}"))
        rows.append(("KV cache tokens, all ranks", f"{rep['kv_cache_tokens_all_ranks']:,}"))
    if rep.get("prefill_context_parallel_size"):
        rows.append(("prefill-context-parallel ranks (each holds the whole KV cache)",
                     f"{rep['prefill_context_parallel_size']}"))
    if rep.get("decode_context_parallel_size"):
        rows.insert(0, ("decode context parallelism: tokens per block (per GPU)",
                        f"DCP {rep['decode_context_parallel_size']}: {rep['kv_manager_block_size']} ({rep['block_size']})"))
    if rep.get("linear_attention"):
        lin = rep["linear_attention"]
        rows.insert(2, ("linear-attention state per layer (its page)",
                        f"{lin['state_bytes_per_layer']:,} B ({lin['page_bytes_per_layer']:,} B)"))
        held = lin["state_blocks_per_request"]
        rows.insert(3, ("state blocks per request (memory per GPU)",
                        f"{held:,} ({held * rep['block_bytes_per_gpu'] / GIB:.2f} GiB)"))
    if rep.get("sparse_attention"):
        sparse = rep["sparse_attention"]
        rows.insert(0, ("sparse attention: latent + indexer key per token",
                        f"{sparse['latent_bytes_per_token']:,} ({sparse['latent_layout']}) + "
                        f"{sparse['indexer_bytes_per_token']:,} B "
                        f"(each query attends its top {sparse['index_topk']:,})"))
    if rep.get("latent_cache_on_every_gpu"):
        rows.insert(0, ("attention", "MLA: each GPU holds the whole latent cache"))
    if rep.get("draft_network"):
        rows.insert(0, ("draft network (its weights and KV included)", rep["draft_network"]))
    if rep.get("lora"):
        lora = rep["lora"]
        rows.append((f"LoRA slots per GPU ({lora['max_loras']} x rank {lora['max_lora_rank']})",
                     _bytes(lora["slots_bytes_per_gpu"]) if lora["slots_bytes_per_gpu"] is not None
                     else "not modelled for this architecture"))
        if "decode_step_kernels_s" in lora:
            k = lora["decode_step_kernels_s"]
            rows.append(("LoRA kernels per decode step (roofline)",
                         f"{k['one_token'] * 1e3:.2f} ms for 1 sequence, {k['full_batch'] * 1e3:.2f} ms for "
                         f"{k['full_batch_sequences']} on {lora['max_loras']} adapters ({k['launch_s'] * 1e6:g} µs a "
                         f"launch assumed)"))
        if "adapter_load_s" in lora:
            a = lora["adapter_load_s"]
            rows.append(("LoRA adapter load", f"{a['disk_read'] * 1e3:.1f} ms from disk ({a['lora_load_gbs']:g} GB/s "
                                              f"assumed), {a['slot_copy'] * 1e3:.2f} ms into a GPU slot; host "
                                              f"memory holds {a['max_cpu_loras']}"))
    if rep.get("kv_offloading"):
        off = rep["kv_offloading"]
        rows.append((f"CPU tier (KV offloading, {'each rank' if rep.get('data_parallel_size') else 'all GPUs'})",
                     f"{off['cpu_tier_gib']:g} GiB: {off['num_chunks']:,} chunks of {off['chunk_tokens']} tokens"
                     + (" (one copy of the latent the TP ranks share)" if off.get("one_copy") else "")))
        rows.append(("CPU tier chunk (over the host link)",
                     f"{off['chunk_bytes']:,} B ({off['chunk_transfer_s'] * 1e3:.3f} ms)"))
        if off.get("chunks_per_group"):
            rows.append(("CPU tier tokens", f"{off['tokens']:,} of one KV-cache group (each group stores its own "
                                            "chunks: full attention every one, a sliding window its tails)"))
        elif off.get("states_per_group"):
            rows.append(("CPU tier tokens", f"{off['tokens']:,} of the attention group, less a chunk per state each "
                                            "linear-attention group stores (those the GPU prefix cache keeps)"))
        else:
            rows.append(("CPU tier tokens", f"{off['tokens']:,} ({off['tokens_per_gpu_cache_token']:.2f}x the GPU cache)"))
    if rep.get("vision_encoder"):
        vis = rep["vision_encoder"]
        rows.append(("vision encoder weights per GPU (in the weights)", _bytes(int(vis["weight_bytes_per_gpu"]))))
        rows.append(("encoder budget per step and encoder cache (embeddings)",
                     f"{vis['encoder_budget_and_cache']:,} (largest item {vis['mm_max_tokens_per_item']:,}: "
                     f"{vis['seconds_for_largest_item'] * 1e3:,.1f} ms to encode, roofline)"))
        if "profile_items" in vis:
            rows.append((f"start-up profile: {vis['profile_items']} item(s) of {vis['mm_max_tokens_per_item']:,} "
                         "(ViT activations; embeddings)", f"{_bytes(vis['profile_activation_bytes'])}; "
                                                         f"{_bytes(vis['profile_embedding_bytes'])}"))
    if rep.get("weight_prefetch"):
        pre = rep["weight_prefetch"]
        rows.append((f"weights per GPU in host memory (prefetch: {pre['offloaded_layers']} layers; GPU buffers)",
                     f"{_bytes(pre['offloaded_weight_bytes_per_gpu'])}; {_bytes(pre['buffer_bytes_per_gpu'])}"))
        rows.append(("a layer's copy over the host link", f"{pre['copy_s_per_layer'] * 1e3:.2f} ms"))
    if rep.get("cpu_offload"):
        off = rep["cpu_offload"]
        what = ("routed experts per GPU in host memory (--cpu-offload-params), read when routed to"
                if off.get("cpu_offload_params") else "weights per GPU in host memory (--cpu-offload-gb), read every forward")
        rows.append((what, _bytes(off["offloaded_weight_bytes_per_gpu"])))
    each = " each rank" if rep.get("data_parallel_size") else ""
    for r in rep.get("request_concurrency", ()):
        rows.append((f"at once{each}: requests of {r['tokens']:,} tokens (blocks)",
                     f"{r['max_concurrency']:,.2f}x ({r['blocks_per_request']:,})"))
    for name, value in rows:
        table.add_row(name, value)
    console = terminal_console()
    console.print(table)
    for line in rep["startup_lines"]:
        console.print(line, highlight=False, markup=False)


@click.command("capacity", cls=SectionedCommand)
@click.option("--model", default=None,
              help="A model of simkv/specs/models.yaml, or a Hugging Face config.json [default: llama-3-8b]")
@click.option("--gpu", default=None,
              help="A GPU of simkv/specs/gpus.yaml, or a YAML/JSON file of its datasheet's fields [default: H100-SXM]")
@click.option("--tensor-parallel-size", "-tp", type=int, default=None, help="[default: 1]")
@click.option("--data-parallel-size", "-dp", type=int, default=None,
              help="A mixture of experts: data-parallel attention ranks (their experts span all GPUs) [default: 1]")
@click.option("--enable-expert-parallel/--no-enable-expert-parallel", "-ep", default=None,
              help="vLLM's, a mixture of experts: whole experts over the GPUs (EPLB needs it) [default: off]")
@click.option("--enable-eplb/--no-enable-eplb", default=None,
              help="vLLM's expert-parallel load balancing: its redundant experts take GPU memory [default: off]")
@click.option("--num-redundant-experts", type=int, default=None, metavar="R",
              help="vLLM's --eplb-config num_redundant_experts: R extra expert copies over the GPUs [default: 0]")
@click.option("--decode-context-parallel-size", "-dcp", type=int, default=None,
              help="vLLM's: groups of DCP of the TP GPUs shard the KV cache by tokens [default: 1]")
@click.option("--prefill-context-parallel-size", "-pcp", type=int, default=None,
              help="vLLM's (latent attention): that many TP groups, each holding the whole KV cache, split "
                   "each prefill between them [default: 1]")
@click.option("--pipeline-parallel-size", "-pp", type=int, default=None,
              help="vLLM's: the layers split over that many stages of TP GPUs each [default: 1]")
@click.option("--mm-encoder-tp-mode", type=click.Choice(["weights", "data"]), default=None,
              help="vLLM's: the vision encoder split over the TP GPUs, or whole on each [default: weights]")
@click.option("--mm-max-tokens-per-item", type=int, default=None, metavar="N",
              help="A vision model's largest item (an image) in embeddings: its encoder budget, cache and start-up "
                   "profile [default: the model's]")
@click.option("--limit-mm-per-prompt", type=ImageLimit(), default=None, metavar="LIMIT",
              help="vLLM's, for images ('{\"image\": 4}', image=4 or 4): caps the encoder's start-up profile")
@click.option("--language-model-only", is_flag=True, default=None,
              help="vLLM's: a vision model served as text only: no vision encoder on the GPUs")
@click.option("--skip-mm-profiling", is_flag=True, default=None,
              help="vLLM's: the start-up memory profile leaves out the vision encoder [default: profiled]")
@click.option("--quantization", "-q", type=click.Choice(["fp8"]), default=None,
              help="vLLM's: fp8 quantizes a bf16 checkpoint's linear layers and experts [default: the checkpoint's]")
@click.option("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=None, help="[default: 0.92]")
@click.option("--kv-cache-memory-bytes", "--kv-cache-memory", type=ByteCount(), default=None, metavar="BYTES",
              help="vLLM's: the KV cache's bytes per GPU (e.g. 40g, 37G), gpu_memory_utilization then ignored")
@click.option("--max-model-len", type=MaxModelLen(), default=None, help=MAX_MODEL_LEN_HELP)
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default=None, help="[default: auto]")
@click.option("--kv-cache-dtype-skip-layers", default=None, metavar="I,J,...",
              help="vLLM's: decoder layers whose K and V stay bf16 under an fp8, TurboQuant or UltraQuant cache (the block "
                   "size grows: 16 -> 32)")
@click.option("--mamba-cache-dtype", type=click.Choice(list(MAMBA_DTYPE_BYTES)), default=None,
              help="vLLM's: linear-attention states (convolution, and recurrent unless the checkpoint sets it)")
@click.option("--mamba-ssm-cache-dtype", type=click.Choice(list(MAMBA_DTYPE_BYTES)), default=None,
              help="vLLM's: the recurrent state [default: the checkpoint's or --mamba-cache-dtype's]")
@click.option("--block-size", type=int, default=None,
              help="[default: 16; for latent attention vLLM's pick: on Hopper 64 with an fp8 cache, on Blackwell 32]")
@click.option("--num-gpu-blocks", "--num-gpu-blocks-override", type=int, default=None, help="[default: derived from GPU memory]")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Sizes the activation reserve [default: vLLM 0.33's on the GPU]")
@click.option("--vllm-batch-defaults/--no-vllm-batch-defaults", default=None,
              help="Off: max_num_seqs 256 and max_num_batched_tokens 8,192 where not given [default: on]")
@click.option("--performance-mode", type=click.Choice(list(PERFORMANCE_MODE_BATCH_SCALE)), default=None,
              help="vLLM's: 'throughput' doubles max_num_seqs and max_num_batched_tokens where not given "
                   "[default: balanced]")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
              help="A model with linear-attention layers is modelled without (vLLM's mamba_cache_mode 'none') "
                   "[default: on]")
@click.option("--enable-lora/--no-enable-lora", default=None, help="vLLM's LoRA slots take GPU memory [default: off]")
@click.option("--max-loras", type=int, default=None, help="LoRA slots [default: 1]")
@click.option("--max-lora-rank", type=int, default=None, help="[default: 16]")
@click.option("--max-cpu-loras", type=int, default=None, help="Adapters kept in host memory [default: max-loras]")
@click.option("--lora-load-gbs", type=float, default=None, metavar="GB/S",
              help="An adapter's read from disk, host-side work included (assumed) [default: 2]")
@click.option("--kv-offloading-size", type=float, default=None,
              help="GiB of CPU memory for KV offloading over the engine's GPUs: the tier's size in chunks and tokens")
@click.option("--kv-offloading-block-size", type=int, default=None,
              help="Tokens per CPU-tier chunk, a multiple of --block-size [default: one GPU block]")
@click.option("--pcie-bandwidth-gbs", type=float, default=None, help="host<->GPU bandwidth, GB/s [default: 63]")
@click.option("--cpu-offload-gb", type=float, default=None, metavar="GIB",
              help="vLLM's: GiB of each GPU's weights kept in host memory, freeing that much for the KV cache")
@click.option("--cpu-offload-params", default=None, metavar="SEGMENTS",
              help="vLLM's: only these go to host memory under --cpu-offload-gb: experts, w13_weight, w2_weight "
                   "(a mixture of experts' routed experts, vLLM's names), comma-separated [default: any weight]")
@click.option("--offload-group-size", type=int, default=None, metavar="G",
              help="vLLM's prefetch weight offloading: the last --offload-num-in-group of every G decoder layers in "
                   "host memory, --offload-prefetch-step layers' buffers on the GPU [default: off]")
@click.option("--offload-num-in-group", type=int, default=None, metavar="N", help="[default: 1]")
@click.option("--offload-prefetch-step", type=int, default=None, metavar="S", help="[default: 1]")
@click.option("--offload-params", default=None, metavar="SEGMENTS",
              help="vLLM's: of each offloaded layer only these: experts, w13_weight, w2_weight (routed experts, "
                   "vLLM's names), comma-separated [default: the whole layer]")
@click.option("--speculative-method", type=click.Choice(SPEC_METHODS),
              default=None, help="Speculative decoding: a draft network's weights and KV take cache memory.")
@click.option("--num-speculative-tokens", type=int, default=None)
@click.option("--spec-draft-model", default=None, help="draft_model: the draft's model spec (e.g. llama-3.2-1b)")
@click.option("--spec-draft-layers", type=int, default=None, help="dflash: the drafter's layers [default: 5]")
@click.option("--spec-mtp-modules", type=int, default=None,
              help="mtp: the checkpoint's MTP modules, all loaded [default: the model's, else 1]")
@click.option("--sliding-window", type=int, default=None,
              help="Override the model's sliding-window size (0: none) [default: the model's]")
@click.option("--full-attention-interval", type=int, default=None,
              help="With a sliding window: every K-th layer attends everything, 0: none [default: the model's]")
@click.option("--attention-chunk-size", type=int, default=None,
              help="Chunked local attention (Llama 4's): the local layers' chunk, 0: none [default: the model's]")
@click.option("--disable-hybrid-kv-cache-manager", is_flag=True, default=None,
              help="vLLM's flag: sliding-window layers of a mixed model allocate like full attention")
@click.option("--disable-sliding-window", is_flag=True, default=None,
              help="vLLM's flag: sliding-window layers attend the whole context (max_model_len at most the window)")
@click.option("--async-scheduling", is_flag=True, default=None,
              help="vLLM's: two batches in flight, which a sliding-window group's admission cap counts")
@click.option("--layouts", "num_gpus", type=int, default=None, metavar="N",
              help="Instead: every way to lay the model out over N GPUs (TP engines, pipelines, for a mixture "
                   "of experts data-parallel ranks of TP, for latent attention PCP copies of TP), with the KV "
                   "cache each gives in all.")
@click.option("--request-tokens", type=int, multiple=True, metavar="TOKENS",
              help="Also: how many requests of TOKENS tokens (prompt and output) fit at once, counting whole "
                   "blocks and every KV-cache group's (state blocks, windows); repeat for several lengths.")
@click.option("--config", "config_file", default=None, help="YAML or JSON file of engine options.")
@click.option("--vllm-serve", "vllm_serve", default=None, metavar="COMMAND|@FILE", help=VLLM_SERVE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def capacity_cmd(config_file: str | None, as_json: bool, num_gpus: int | None, request_tokens: tuple[int, ...],
                 **flags) -> None:
    """KV bytes per token, number of KV blocks and vLLM's start-up lines
    (`GPU KV cache size`, `Maximum concurrency`) for a model, GPU and cache options."""
    try:
        if num_gpus is not None:
            if request_tokens:
                raise ConfigError("--request-tokens is for one layout: drop --layouts, or give the layout (-tp, -dp)")
            rep = layouts_report(flags, config_file, num_gpus)
        else:
            rep = capacity_report(capacity_config(flags, config_file), request_tokens)
    except click.BadParameter as exc:
        raise click.ClickException(exc.format_message()) from None
    except (ConfigError, TypeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(rep, indent=2))
    elif num_gpus is not None:
        print_layouts(rep)
    else:
        print_report(rep)


def capacity_config(flags: dict, config_file: str | None, overrides: dict | None = None) -> EngineConfig:
    """The engine config of the flags and file. Suffix decoding's mean proposal, which a replay
    requires, is not asked for: capacity schedules nothing (K sizes what it reserves)."""
    options = flat_options(flags, config_file) | (overrides or {})
    if options.get("speculative_method") == "suffix" and options.get("spec_mean_draft_tokens") is None:
        options["spec_mean_draft_tokens"] = 1.0
    return EngineConfig.from_flat(options)


def layouts_report(flags: dict, config_file: str | None, num_gpus: int) -> dict:
    """Every layout of `num_gpus` GPUs: engines of TP GPUs (num_gpus / TP of them, independent),
    engines of PP pipeline stages of TP GPUs each (where simkv models pipeline parallelism), and
    for a mixture of experts one engine of num_gpus / TP data-parallel ranks (and of ranks of
    PP stages), for latent attention engines of PCP copies of TP GPUs (prefill context
    parallelism: each copy holds the engine's whole cache); for each, the
    weights and KV memory per GPU and the KV cache tokens in all (or why it does not fit). With
    -dcp D, the layouts whose TP D divides, each with decode context parallelism D."""
    if num_gpus < 1:
        raise ConfigError(f"--layouts must be >= 1 GPUs, got {num_gpus}")
    if flags.get("tensor_parallel_size") is not None or flags.get("data_parallel_size") is not None:
        raise ConfigError("--layouts tries every tensor and data parallelism itself: drop -tp/-dp")
    given = flat_options({k: v for k, v in flags.items() if k not in LAYOUT_KEYS}, config_file)
    layout = [k for k in LAYOUT_KEYS if k in given]
    if layout:
        raise ConfigError(f"--layouts tries every layout itself, but --config or --vllm-serve gives {', '.join(layout)}: "
                          "drop it there")
    if flags.get("prefill_context_parallel_size") is not None:
        raise ConfigError("--layouts tries every prefill context parallelism itself: drop -pcp")
    dcp = flags.get("decode_context_parallel_size") or 1
    base = capacity_config(flags, config_file, {"tensor_parallel_size": dcp} if dcp > 1 else None)
    spec = base.hardware.model_spec()
    if flags.get("pipeline_parallel_size") is not None:
        raise ConfigError("--layouts tries every pipeline parallelism itself: drop -pp")
    rows = []
    for layout in layouts_of(num_gpus, spec, dcp):
        pp = layout.pipeline_parallel_size
        row = layout.options() | {"data_parallel_size": layout.data_parallel_size,
                                  "pipeline_parallel_size": pp, "copies": layout.num_kv_caches, "layout": layout.name}
        try:
            config = capacity_config(flags, config_file, layout.options())
            cap = compute_capacity(config)
        except ConfigError as exc:
            if pp > 1 and "not modelled" in str(exc):
                continue
            rows.append(row | {"fits": False, "why": str(exc)})
            continue
        weights = cap.pipeline_stage_weight_bytes if pp > 1 else int(resident_weight_bytes(config))
        rows.append(row | {"fits": True, "weight_bytes_per_gpu": weights,
                           "available_kv_bytes_per_gpu": cap.available_kv_bytes,
                           "num_gpu_blocks": cap.num_gpu_blocks, "block_size": cap.block_size,
                           "kv_cache_tokens_all": cap.kv_cache_tokens * layout.num_kv_caches,
                           "max_concurrency_all": cap.max_concurrency * layout.num_kv_caches})
    return {"model": base.hardware.model, "gpu": base.hardware.gpu, "num_gpus": num_gpus,
            "max_model_len": base.max_model_len, "layouts": rows} | (
        {"quantization": base.hardware.quantization} if base.hardware.quantization else {})


def print_layouts(rep: dict) -> None:
    from rich.table import Table

    from simkv.terminal import console as terminal_console

    model = rep["model"] + (f" ({rep['quantization']})" if rep.get("quantization") else "")
    table = Table(title=f"{model} on {rep['num_gpus']} x {rep['gpu']}: KV cache by layout")
    for name in ("layout", "weights / GPU", "KV / GPU", "blocks each", "KV tokens, all",
                 f"x {rep['max_model_len']:,} tokens"):
        table.add_column(name, justify="left" if name == "layout" else "right")
    for row in rep["layouts"]:
        if not row["fits"]:
            memory = "memory" in row["why"] or "KV cache" in row["why"]
            table.add_row(row["layout"], "does not fit" if memory else row["why"][:60], "", "", "", "")
            continue
        table.add_row(row["layout"], f"{row['weight_bytes_per_gpu'] / GIB:.1f} GiB",
                      f"{row['available_kv_bytes_per_gpu'] / GIB:.1f} GiB",
                      f"{row['num_gpu_blocks']:,} ({row['block_size']:,} tokens)",
                      f"{row['kv_cache_tokens_all']:,}", f"{row['max_concurrency_all']:.2f}x")
    terminal_console().print(table)
