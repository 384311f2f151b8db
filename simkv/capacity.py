"""KV-cache capacity: bytes per token, number of GPU blocks, and vLLM's start-up checks.

num_gpu_blocks = (GPU memory * gpu_memory_utilization - weights/TP - activation reserve)
                 // (block_size * KV bytes per token per GPU)
Under speculative decoding the draft network's weights and its layers' KV count too: a draft
model's whole spec, or for the EAGLE family one decoder layer with the target's attention and
MLP (the dense MLP of the published heads where a mixture of experts has one), which shares the
target's embeddings and LM head.
A model with sliding-window or linear-attention layers under vLLM's hybrid KV-cache manager has
several KV-cache groups (core/kv_cache_groups.py): a block then holds `layers_per_block` layers, not
all of them; a linear-attention group's block holds a request's state of that many layers, padded
to the attention layers' page (the block size grows until that page holds a state:
config.linear_attention_block_size).
The activation reserve stands in for vLLM's profiling run: activations of one
max_num_batched_tokens forward pass plus a fixed 1 GiB for CUDA graphs and the allocator; for a
vision model the encoder's dummy batch of the largest items too (`encoder_profile`), whose peak
may exceed the forward pass's.
"""

from __future__ import annotations

from dataclasses import dataclass

from simkv.config import ConfigError, EngineConfig
from simkv.core.kv_cache_groups import admission_cap_blocks
from simkv.specs import get_gpu_spec

GIB = 1 << 30
_FIXED_RESERVE_BYTES = 1 * GIB


OFFLOAD_PAGE_BYTES = 4096  # vLLM's CPU offload chunks are host-page aligned


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f}"


@dataclass(frozen=True, slots=True)
class Capacity:
    kv_bytes_per_token: int  # on one GPU, per token of a request (under DCP the GPU's share)
    num_gpu_blocks: int
    available_kv_bytes: int
    block_size: int
    max_model_len: int
    num_cpu_blocks: int = 0  # swap space, in blocks
    # Models under the hybrid KV-cache manager (0 otherwise): blocks one request
    # of max_model_len tokens holds at most, over all KV-cache groups.
    blocks_per_request: int = 0
    block_bytes: int = 0  # one block on one GPU (all layers, or `layers_per_block` of them)
    num_offload_chunks: int = 0  # KV offloading's CPU tier, in chunks of blocks_per_chunk blocks (over all GPUs, page-aligned)
    offload_chunk_bytes: int = 0  # one of those chunks
    lora_bytes: int | None = 0  # LoRA slots' buffers on one GPU (None: not modelled for this architecture)
    # pipeline parallelism: each stage's layers, and the stage whose GPUs hold the fewest blocks
    # (all stages get that many) with its weights per GPU
    pipeline_layers: tuple[int, ...] = ()
    pipeline_binding_stage: int = 0
    pipeline_stage_weight_bytes: int = 0

    @property
    def max_concurrency(self) -> float:
        if self.blocks_per_request:
            return self.num_gpu_blocks / self.blocks_per_request
        return self.kv_cache_tokens / self.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        if self.blocks_per_request:  # vLLM's group-aware figure: the concurrency in tokens
            return int(self.max_concurrency * self.max_model_len)
        return self.num_gpu_blocks * self.block_size

    def startup_lines(self) -> list[str]:
        """The two lines vLLM logs at start-up."""
        return [f"GPU KV cache size: {self.kv_cache_tokens:,} tokens",
                f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
                f"{self.max_concurrency:.2f}x"]


def group_blocks_per_request(config: EngineConfig, num_tokens: int, startup: bool = False) -> int:
    """Blocks a request of `num_tokens` tokens holds at most, summed over the KV-cache groups: a
    block per `block_size` tokens in a full-attention group; a sliding-window group of window w
    at most ceil(min(w - 1 + max_in_flight_tokens, max_model_len) / block_size) + 1 (vLLM's
    SlidingWindowSpec.max_admission_blocks_per_request; the in-flight tokens are
    max_num_batched_tokens per batch in flight: EngineConfig.max_in_flight_tokens); a chunked local group of chunk C
    at most ceil(min(C + max_in_flight_tokens, max_model_len) / block_size); a linear-attention group
    one (the request's state), and one per draft token under speculative decoding. `startup`: vLLM's start-up figure, which counts that cap whole even
    where a request of `num_tokens` needs fewer."""
    bs, mml = config.cache.block_size, config.max_model_len
    full = -(-num_tokens // bs)
    total = 0
    for g in config.kv_cache_groups.groups:
        if g.linear:
            total += config.state_blocks_per_group if num_tokens else 0
        elif g.sliding_window:
            cap = admission_cap_blocks(g.sliding_window, g.chunked, config.max_in_flight_tokens, mml, bs)
            total += cap if startup else min(full, cap)
        else:
            total += full
    return total


def request_concurrency(config: EngineConfig, capacity: Capacity, num_tokens: int) -> tuple[int, float]:
    """(blocks, how many at once) for requests of `num_tokens` tokens (prompt and output): vLLM's
    `Maximum concurrency` line asked of a shorter request, block-granular (its last block whole)
    and, under the hybrid KV-cache manager, over every group (a linear-attention group's state
    blocks, a window's cap). Per engine (under data parallelism, per rank)."""
    if not 1 <= num_tokens <= config.max_model_len:
        raise ConfigError(f"--request-tokens {num_tokens} must be 1 to max_model_len ({config.max_model_len:,})")
    if config.kv_cache_groups.is_hybrid:
        blocks = group_blocks_per_request(config, num_tokens)
    else:
        blocks = -(-num_tokens // config.kv_manager_block_size)
    return blocks, capacity.num_gpu_blocks / blocks


def resident_weight_bytes(config: EngineConfig) -> float:
    """The target model's weights on one GPU (without pipeline stages), less what
    --cpu-offload-gb keeps in host memory."""
    hw = config.hardware
    spec = hw.model_spec()
    weights = spec.weight_bytes_per_gpu(hw.tensor_parallel_size, hw.expert_shards)
    weights += hw.vision_weight_bytes_per_gpu() - spec.vision_weight_bytes / hw.tensor_parallel_size  # (TP mode "data")
    offloaded, buffers = prefetched_weight_bytes(config)
    return weights - offloaded_weight_bytes(config, weights) - offloaded + buffers


def decoder_layer_bytes_per_gpu(config: EngineConfig) -> float:
    """One decoder layer's weights on one GPU (their mean over the layers): split by TP, the
    routed experts over every data-parallel (and prefill-context-parallel) rank's GPUs, a
    sparse-attention indexer whole."""
    hw = config.hardware
    spec = hw.model_spec()
    replicated = spec.indexer_weight_bytes
    split = spec.layer_weight_bytes - replicated + spec.routed_expert_bytes / hw.expert_shards
    return (split / hw.tensor_parallel_size + replicated) / spec.num_layers


def prefetched_weight_bytes(config: EngineConfig, num_layers: int | None = None,
                            first_layer: int = 0) -> tuple[float, float]:
    """vLLM's prefetch weight offloading (offload_group_size > 0): (the offloaded layers' weights
    a GPU keeps in host memory, its static buffers: offload_prefetch_step layers' worth); 0, 0
    without it. `num_layers`: the GPU's layers from `first_layer` (a pipeline stage's: vLLM wraps
    each stage's layers, counted from its first) [default: all of them]."""
    cc = config.cache
    if not cc.offload_group_size:
        return 0.0, 0.0
    from simkv.backends.weight_prefetch import offloaded_positions

    layer = prefetched_layer_bytes(config)
    n = config.hardware.model_spec().num_layers if num_layers is None else num_layers
    count = len(offloaded_positions(config, n, first_layer))
    return count * layer, min(cc.offload_prefetch_step, count) * layer


def offloaded_weight_bytes(config: EngineConfig, weights: float, num_layers: float | None = None) -> float:
    """Of `weights` bytes on a GPU, those vLLM's --cpu-offload-gb keeps in host memory instead:
    that many GiB, at most all of them (its UVA offloader takes parameters until the limit; taken
    as exactly the limit, not the parameter boundary below it); with --cpu-offload-params, at
    most the routed experts' parameters it names (`offloadable_expert_bytes`; `num_layers`: the
    GPU's layers, a pipeline stage's [default: all])."""
    if config.cache.cpu_offload_params:
        weights = min(weights, offloadable_expert_bytes(config, num_layers))
    return min(config.cache.cpu_offload_gb * GIB, weights)


def expert_bytes_named(config: EngineConfig, segments: tuple[str, ...]) -> float:
    """The routed experts' bytes on one GPU (split by TP, and over every data-parallel rank's
    GPUs) that parameter name `segments` name: all of each expert (experts), its gate and up
    projections (w13_weight), its down projection (w2_weight)."""
    hw = config.hardware
    spec = hw.model_spec()
    m = spec.mlp_matrices
    share = 1.0 if "experts" in segments else ("w13_weight" in segments) * (m - 1) / m + ("w2_weight" in segments) / m
    return spec.routed_expert_bytes / (hw.tensor_parallel_size * hw.expert_shards) * share


def offloadable_expert_bytes(config: EngineConfig, num_layers: float | None = None) -> float:
    """The routed experts' bytes on one GPU that --cpu-offload-params names (`expert_bytes_named`),
    of `num_layers` layers' experts [default: every layer's], taken as spread evenly."""
    spec = config.hardware.model_spec()
    named = expert_bytes_named(config, config.cache.cpu_offload_param_segments)
    return named * (1.0 if num_layers is None else num_layers / spec.num_layers)


def prefetched_layer_bytes(config: EngineConfig) -> float:
    """What the prefetch backend keeps in host memory of one offloaded layer on a GPU, and copies
    into a buffer each pass: the layer's weights (their mean over the layers), or with
    --offload-params the named parameters of one expert layer's routed experts."""
    segments = config.cache.offload_param_segments
    if not segments:
        return decoder_layer_bytes_per_gpu(config)
    return expert_bytes_named(config, segments) / config.hardware.model_spec().num_moe_layers


def activation_reserve_bytes(config: EngineConfig, encoder: bool = True) -> int:
    """What vLLM's start-up profile leaves for activations on one GPU: the peak of its dummy
    forward pass of max_num_batched_tokens tokens (bf16, at the widest MLP: the gated MLP's two
    halves and four hidden-size tensors a token), and for a vision model (unless `encoder` is
    off: a pipeline stage after the first) the encoder's dummy batch before it
    (`encoder_profile_bytes`), whose embeddings stay cached through the forward pass; plus a
    fixed reserve for CUDA graphs and the allocator."""
    spec = config.hardware.model_spec()
    tp = config.hardware.tensor_parallel_size
    per_token = 2 * (2 * spec.widest_mlp // tp + 4 * spec.hidden_size)
    forward = config.scheduler.max_num_batched_tokens * per_token
    vit, embeddings = encoder_profile_bytes(config) if encoder else (0, 0)
    return max(forward + embeddings, vit) + _FIXED_RESERVE_BYTES


def encoder_profile(config: EngineConfig) -> tuple[int, int] | None:
    """A vision model's encoder in vLLM's start-up profile (its profile_run and MultiModalBudget):
    (items, embeddings each) of the dummy batch, every item of the largest size, as many as the
    encoder budget holds, at most max_num_seqs prompts' worth (each as many as fit max_model_len,
    at most limit_mm_per_prompt) and at least one. None without a
    vision encoder, under language_model_only or under skip_mm_profiling."""
    spec, sc = config.hardware.model_spec(), config.scheduler
    if not config.hardware.has_vision_encoder or config.cache.skip_mm_profiling:
        return None
    from simkv.core.encoder_cache import encoder_budget

    largest = sc.mm_max_tokens_per_item or spec.mm_max_tokens_per_item
    by_budget = encoder_budget(sc.max_num_batched_tokens, largest) // largest
    per_prompt = max(1, min(sc.limit_mm_per_prompt or 999, config.max_model_len // largest))
    # (vLLM also caps the prompts at max_num_batched_tokens // largest with chunked prefill off,
    # which never binds below the budget's count)
    return max(1, min(by_budget, sc.max_num_seqs * per_prompt)), largest


def encoder_profile_bytes(config: EngineConfig) -> tuple[int, int]:
    """(the ViT's activation peak, the embeddings it outputs) on one GPU in vLLM's encoder profile
    (`encoder_profile`; 0, 0 without one): per patch, the language model's estimate at the ViT's
    width (two MLP-intermediate and four hidden-size bf16 tensors), the MLP split by TP, or under
    mm_encoder_tp_mode "data" whole on each GPU, which encodes its share of the items; the
    embeddings (and DeepStack's features) of every item, all-gathered onto every GPU."""
    profile = encoder_profile(config)
    if profile is None:
        return 0, 0
    items, each = profile
    hw = config.hardware
    spec = hw.model_spec()
    tp = hw.tensor_parallel_size
    split, local = (1, -(-items // tp)) if hw.mm_encoder_tp_mode == "data" else (tp, items)
    return vit_activation_bytes(spec, local * each * spec.vision_patches_per_embed, split), \
        items * each * spec.vision_embed_bytes


def vit_activation_bytes(spec, patches: int, split: int = 1) -> int:
    """The activation peak of a ViT pass over `patches` patches on one GPU, estimated as the
    language model's is: two MLP-intermediate tensors (split over `split` GPUs) and four
    hidden-size ones a patch, bf16 (bench/vision_encoder.py measures it on a GPU)."""
    return patches * 2 * (2 * spec.vision_intermediate_size // split + 4 * spec.vision_hidden_size)


def kv_bytes_per_token(config: EngineConfig, tensor_parallel_size: int) -> int:
    """K and V of one token on one GPU under that tensor parallelism (1: the whole model), the
    draft network's layers included under speculative decoding."""
    spec = config.kv_spec()
    per_token = spec.kv_bytes_per_token(config.kv_element, tensor_parallel_size)
    draft = config.draft_network
    if draft is not None:
        per_token += draft.kv_bytes_per_token(config.kv_element_for(draft), tensor_parallel_size)
    return per_token


def pipeline_layers(num_layers: int, pipeline_parallel_size: int) -> list[int]:
    """Layers of each pipeline stage as vLLM's get_pp_indices splits them: evenly, the remainder
    one each to the stages before the last, from the last but one backwards."""
    parts = [num_layers // pipeline_parallel_size] * pipeline_parallel_size
    for i in range(2, num_layers % pipeline_parallel_size + 2):
        parts[-i] += 1
    return parts


def _pipeline_stages(config: EngineConfig, block_bytes: int, draft_weights: float) -> list[tuple[int, int, int]]:
    """Pipeline parallelism: each stage's (layers, weights per GPU, block bytes per GPU). A
    stage's GPUs hold their layers' weights and KV; the first stage also the input embedding
    and a vision encoder (split by TP, or whole under mm_encoder_tp_mode "data"), the last the
    LM head and a drafter's network. `block_bytes`: a block of the whole model's layers on one
    GPU. Under the hybrid KV-cache manager a stage's block holds its share of the groups'
    layers, rounded up (vLLM projects the model's groups onto each worker's layers)."""
    spec = config.hardware.model_spec()
    tp = config.hardware.tensor_parallel_size
    layers = pipeline_layers(spec.num_layers, config.hardware.pipeline_parallel_size)
    layer = decoder_layer_bytes_per_gpu(config)  # (the layers' mean: weights taken as spread evenly)
    embedding_bytes = 2.0 * spec.vocab_size * spec.hidden_size  # (each end holds its own matrix, tied or not)
    groups = config.kv_cache_groups
    draft = config.draft_network
    draft_block = (draft.kv_bytes_per_token(config.kv_element_for(draft), tp) * config.cache.block_size
                   if draft is not None and not groups.is_hybrid else 0)
    stages = []
    first_layer = 0
    for i, n in enumerate(layers):
        last = i == len(layers) - 1
        weights = (layer * n + embedding_bytes * ((i == 0) + last) / tp
                   + config.hardware.vision_weight_bytes_per_gpu() * (i == 0))
        if groups.is_hybrid:
            lpb = groups.layers_per_block
            stage_block = block_bytes // lpb * -(-lpb * n // spec.num_layers)
        elif config.kv_skip_layers:  # (the stage's own layers' pages: its unquantized ones count double or more)
            stage_block = _stage_block_bytes(config, range(first_layer, first_layer + n))
        else:
            stage_block = (block_bytes - draft_block) * n // spec.num_layers + (draft_block if last else 0)
        weights -= offloaded_weight_bytes(config, weights, n)  # (--cpu-offload-gb: per GPU, each stage's)
        offloaded, buffers = prefetched_weight_bytes(config, n, first_layer)  # (--offload-group-size: the stage's own layers)
        weights += buffers - offloaded
        stages.append((n, int(weights + (draft_weights if last else 0)), stage_block))
        first_layer += n
    return stages


def _stage_block_bytes(config: EngineConfig, layers: range) -> int:
    """One block of these decoder layers on one GPU, each at its dtype: those the KV cache keeps
    unquantized (EngineConfig.kv_skip_layer_indices) at the model's, the others at kv_cache_dtype
    (vLLM sums a worker's layers' pages)."""
    spec, tp = config.hardware.model_spec(), config.hardware.tensor_parallel_size  # (every layer at one dtype)
    quantized, kept = spec.kv_bytes_per_layer_token(config.kv_element, tp), spec.kv_bytes_per_layer_token(2, tp)
    skipped = len(config.kv_skip_layer_indices.intersection(layers))
    return config.cache.block_size * ((len(layers) - skipped) * quantized + skipped * kept)


def _pipeline_stage_blocks(config: EngineConfig, stages: list[tuple[int, int, int]],
                           lora_bytes: int) -> tuple[int, int, int]:
    """vLLM gives every pipeline stage the blocks of the one with the fewest: (blocks, that
    stage's KV memory, the stage)."""
    num_layers = config.hardware.model_spec().num_layers
    memory = get_gpu_spec(config.hardware.gpu).memory_bytes * config.cache.gpu_memory_utilization
    given = config.cache.kv_cache_memory_bytes
    best = None
    for i, (n, weights, stage_block) in enumerate(stages):
        lora = lora_bytes * n / num_layers
        if given is not None:  # (every stage's GPUs hold the KV bytes given)
            _check_given_kv_memory(config, weights + lora, f" on pipeline stage {i}", encoder=i == 0)
        reserve = activation_reserve_bytes(config, encoder=i == 0)  # (the first stage runs a vision encoder)
        available = int(memory - reserve - weights - lora) if given is None else given
        if available <= 0:
            raise ConfigError(
                f"No available memory for the cache blocks on pipeline stage {i} ({n} layers). Try increasing "
                "`gpu_memory_utilization` when initializing the engine.")
        blocks = available // stage_block
        if best is None or blocks < best[0]:
            best = (blocks, available, i)
    return best


def _check_given_kv_memory(config: EngineConfig, resident_bytes: float, where: str = "",
                           encoder: bool = True) -> None:
    """kv_cache_memory_bytes is taken as given (vLLM skips its memory check then), but the GPU must
    also hold the weights (`resident_bytes`, LoRA slots included) and the activation reserve: else
    vLLM runs out of memory allocating the cache."""
    gpu = get_gpu_spec(config.hardware.gpu)
    kv, other = config.cache.kv_cache_memory_bytes, resident_bytes + activation_reserve_bytes(config, encoder)
    if kv + other > gpu.memory_bytes:
        raise ConfigError(
            f"kv_cache_memory_bytes {kv:,} ({_gib(kv)} GiB) with {_gib(other)} GiB of weights and activations"
            f"{where} exceeds the {config.hardware.gpu}'s {_gib(gpu.memory_bytes)} GiB: vLLM would run out of "
            f"memory allocating the KV cache (at most {max(int(gpu.memory_bytes - other), 0):,} bytes fit)")


def compute_capacity(config: EngineConfig, check_fit: bool = True) -> Capacity:
    """Blocks of the KV cache, given (`num_gpu_blocks`) or derived from memory like vLLM.
    `check_fit`: refuse, as vLLM does, a cache that cannot hold one request of max_model_len."""
    spec = config.hardware.model_spec()
    gpu = get_gpu_spec(config.hardware.gpu)
    cc = config.cache
    tp = config.hardware.tensor_parallel_size
    per_token = kv_bytes_per_token(config, tp)
    # Decode context parallelism: a block holds `bs` tokens, of which each GPU stores cc.block_size.
    dcp, bs = config.hardware.decode_context_parallel_size, config.kv_manager_block_size
    draft = config.draft_network
    draft_weights = 0.0
    if draft is not None:
        shared = draft.embedding_params if config.speculative.uses_target_hidden_states else 0
        draft_weights = (draft.weight_bytes - 2 * shared) / tp  # (config.py's draft_spec: the EAGLE layer's shape)
        # (dflash: its projection of the target's hidden states, bf16, whole on every GPU)
        draft_weights += 2 * config.speculative.dflash_fc_params(spec, draft)
    groups = config.kv_cache_groups
    hybrid = groups.is_hybrid
    if hybrid:  # one block holds `layers_per_block` layers (an EAGLE layer among them, its attention the target's)
        block_bytes = spec.kv_bytes_per_layer_token(config.kv_element, tp) * groups.layers_per_block * cc.block_size
    else:
        block_bytes = per_token * cc.block_size
    mml = config.max_model_len
    lora = lora_slot_bytes(spec, tp, config.scheduler.max_lora_rank) if config.scheduler.enable_lora else 0
    lora_bytes = None if lora is None else lora * config.scheduler.max_loras
    stages = ()
    binding = stage_weights = 0
    if config.hardware.pipeline_parallel_size > 1:  # (one stage's GPUs: its layers' share)
        stage_rows = _pipeline_stages(config, int(block_bytes), draft_weights)
        stages = tuple(n for n, _, _ in stage_rows)
        if cc.num_gpu_blocks is None:
            num_blocks, available, binding = _pipeline_stage_blocks(config, stage_rows, lora_bytes or 0)
        else:  # (the stage with the largest blocks)
            binding = max(range(len(stage_rows)), key=lambda k: stage_rows[k][2])
            num_blocks = cc.num_gpu_blocks
            available = num_blocks * stage_rows[binding][2]
        _, stage_weights, stage_block = stage_rows[binding]
        per_token = per_token * stage_block // int(block_bytes)  # (the stage's share)
        block_bytes = stage_block
    elif cc.num_gpu_blocks is not None:
        available = cc.num_gpu_blocks * block_bytes
        num_blocks = cc.num_gpu_blocks
    elif cc.kv_cache_memory_bytes is not None:  # (vLLM's --kv-cache-memory-bytes: gpu_memory_utilization ignored)
        weights = resident_weight_bytes(config) + draft_weights
        _check_given_kv_memory(config, weights + (lora_bytes or 0))
        available = cc.kv_cache_memory_bytes
        num_blocks = available // block_bytes
    else:
        weights = resident_weight_bytes(config) + draft_weights
        available = int(gpu.memory_bytes * cc.gpu_memory_utilization - weights - activation_reserve_bytes(config)
                        - (lora_bytes or 0))
        if available <= 0:
            raise ConfigError(
                "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                "when initializing the engine.")
        num_blocks = available // block_bytes
    per_request = group_blocks_per_request(config, mml, startup=True) if hybrid else -(-mml // bs)
    needed = per_request * block_bytes
    usable_blocks = _usable_blocks(config, num_blocks)
    usable_bytes = usable_blocks * block_bytes
    if needed > usable_bytes and check_fit:
        estimated = _longest_request(config, usable_blocks)
        msg = f"Based on the available memory, the estimated maximum model length is {estimated}. " if estimated > 0 else ""
        raise ConfigError(
            f"To serve at least one request with the model's max seq len ({mml}), ({_gib(needed)} GiB KV "
            f"cache is needed, which is larger than the available KV cache memory ({_gib(usable_bytes)} GiB). "
            f"{msg}Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
    num_cpu_blocks = int(cc.swap_space * GIB) // block_bytes
    num_offload_chunks = chunk_bytes = 0
    if cc.kv_offloading_size is not None:  # (vLLM: the ranks' copies of a chunk's blocks, rounded up to a host page;
        # under PP every worker's copy is counted as the first stage's, whose layout vLLM's scheduler sees)
        worker_block = stage_rows[0][2] if config.hardware.pipeline_parallel_size > 1 else int(block_bytes)
        # (decode context parallelism: the manager's blocks, each GPU holding cc.block_size of their tokens)
        raw = worker_block * offload_copies(config) * config.for_kv_manager().cache.offload_blocks_per_chunk
        chunk_bytes = -(-raw // OFFLOAD_PAGE_BYTES) * OFFLOAD_PAGE_BYTES
        num_offload_chunks = int(cc.kv_offloading_size * GIB) // chunk_bytes
        if num_offload_chunks < 1:
            raise ConfigError(f"kv_offloading_size {cc.kv_offloading_size} GiB holds no chunk of {chunk_bytes} bytes")
    return Capacity(per_token // dcp, int(num_blocks), int(available), bs, mml, num_cpu_blocks,
                    per_request if hybrid else 0, int(block_bytes), num_offload_chunks, chunk_bytes, lora_bytes,
                    stages, binding, stage_weights)


def _usable_blocks(config: EngineConfig, num_blocks: int) -> int:
    return num_blocks - 1 if config.cache.reserve_null_block else num_blocks  # block 0: the null block


def _longest_request(config: EngineConfig, usable_blocks: int) -> int:
    """The longest request whose blocks, over every KV-cache group, fit in `usable_blocks`
    (vLLM's estimated maximum model length), searched up to max_model_len where groups differ."""
    if not config.kv_cache_groups.is_hybrid:
        return usable_blocks * config.kv_manager_block_size
    lo, hi = 0, config.max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if group_blocks_per_request(config, mid) <= usable_blocks else (lo, mid - 1)
    return lo


def estimated_max_model_len(config: EngineConfig, capacity: Capacity) -> int:
    """vLLM's estimate of the longest request `capacity` holds (what --max-model-len auto fits)."""
    return _longest_request(config, _usable_blocks(config, capacity.num_gpu_blocks))


def offload_copies(config: EngineConfig) -> int:
    """Copies of a GPU block a CPU-tier chunk holds: every worker's (TP x PP: each pipeline stage
    its own layers'), but one where every TP rank holds the same KV (vLLM 0.33's "replicated
    layout": a latent-attention model under TP alone, on one node, on CUDA; rank 0 stores that
    copy and every rank loads it). Each copy moves over its own GPU's link."""
    hw = config.hardware
    tp = hw.tensor_parallel_size
    replicated = (hw.model_spec().is_mla and tp > 1 and hw.pipeline_parallel_size == 1
                  and hw.decode_context_parallel_size == 1 and tp <= hw.gpus_per_node
                  and get_gpu_spec(hw.gpu).platform == "cuda")
    return 1 if replicated else tp * hw.pipeline_parallel_size


def lora_slot_bytes(spec, tensor_parallel_size: int, max_lora_rank: int) -> int | None:
    """GPU memory of one LoRA slot on one GPU: vLLM 0.33 allocates, for every linear layer of the
    decoder layers (`ModelSpec.lora_linear_shapes`), `max_loras` stacked buffers A (rank x input)
    and B (output x rank) in the model's dtype (bf16). None where the shapes are not modelled;
    embeddings and the LM head take no LoRA by default."""
    shapes = spec.lora_linear_shapes(tensor_parallel_size)
    if shapes is None:
        return None
    return 2 * max_lora_rank * sum(i + o for i, o in shapes) * spec.num_layers
