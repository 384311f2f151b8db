"""Engine configuration: one frozen dataclass per concern, validated with vLLM's error texts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

from simkv.specs import (DS_MLA_KV_DTYPES, MAMBA_DTYPE_BYTES, NVFP4_KV_DTYPES, OCTAVE_HEAD_DIM, OCTAVE_KV_DTYPES, OCTAVE_ROTARY_DIM,
                         PER_TOKEN_HEAD_KV_DTYPES, TURBOQUANT_KV_DTYPES, ULTRAQUANT_GROUP, ULTRAQUANT_KV_DTYPES, ModelSpec,
                         get_gpu_spec, get_model_spec)


class ConfigError(ValueError):
    """An invalid option or combination of options."""


_KINDS = {"bool": ("true or false", lambda v: isinstance(v, bool)),
          "int": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
          "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
          "str": ("a string", lambda v: isinstance(v, str))}


def _check_type(key: str, value, annotation: str) -> None:
    """A flat option's value (from a --config file, a sweep's --set) has its field's type."""
    base, _, optional = annotation.partition(" | ")
    if base not in _KINDS or (optional == "None" and value is None):
        return
    what, ok = _KINDS[base]
    if not ok(value):
        raise ConfigError(f"option '{key}' must be {what}{' or null' if optional == 'None' else ''}, got {value!r}")


# vLLM's parameter name segments of a fused mixture-of-experts layer (mlp.experts.w13_weight: the
# gate and up projections of every routed expert, mlp.experts.w2_weight: the down projection)
CPU_OFFLOAD_PARAM_SEGMENTS = ("experts", "w13_weight", "w2_weight")

# vLLM 0.33's --all2all-backend values: those that exchange tokens all-to-all (simkv prices them
# alike: simkv/backends/expert_exchange.py), and those that gather every rank's tokens (vLLM falls
# back from its removed naive and pplx backends to allgather_reducescatter)
ALL2ALL_BACKENDS = ("deepep_high_throughput", "deepep_low_latency", "deepep_v2", "mori_high_throughput",
                    "mori_low_latency", "moonep", "nixl_ep", "flashinfer_nvlink_two_sided",
                    "flashinfer_nvlink_one_sided", "flashinfer_all2allv")
GATHER_BACKENDS = ("allgather_reducescatter", "naive", "pplx")
EXPERT_PLACEMENT_STRATEGIES = ("linear", "round_robin")  # vLLM's --expert-placement-strategy


def exchanges_all_to_all(enable_expert_parallel: bool, all2all_backend: str, expert_shards: int) -> bool:
    """The expert layers exchange tokens all-to-all (vLLM's all2all kernels: expert parallelism,
    an all-to-all backend, and data- or prefill-context-parallel ranks) rather than gathering them."""
    return enable_expert_parallel and all2all_backend in ALL2ALL_BACKENDS and expert_shards > 1
# vLLM's --kv-cache-dtype choices simkv models (fp16 is simkv's older spelling of float16)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2", *PER_TOKEN_HEAD_KV_DTYPES,
                   *TURBOQUANT_KV_DTYPES, *NVFP4_KV_DTYPES, *ULTRAQUANT_KV_DTYPES, *OCTAVE_KV_DTYPES, *DS_MLA_KV_DTYPES)
# KV dtypes whose pages a backend packs (ModelSpec.kv_bytes_per_token takes their names)
PACKED_KV_DTYPES = (*PER_TOKEN_HEAD_KV_DTYPES, *TURBOQUANT_KV_DTYPES, *NVFP4_KV_DTYPES, *ULTRAQUANT_KV_DTYPES,
                    *OCTAVE_KV_DTYPES, "nvfp4_ds_mla")
# UltraQuantAttentionBackend.get_preferred_block_size (its FlyDSL decode kernel's KV block)
ULTRAQUANT_BLOCK_SIZE = 64
# KV dtypes under which vLLM keeps a dense model's first and last two layers at the model's dtype
# (EngineArgs.create_engine_config: TurboQuant's and UltraQuant's boundary layers)
BOUNDARY_SKIP_KV_DTYPES = (*TURBOQUANT_KV_DTYPES, *ULTRAQUANT_KV_DTYPES)
# vLLM's ROCm-only packed KV formats (its ULTRAQUANT and ROCM_OCTAVE attention backends)
ROCM_PACKED_KV_DTYPES = (*ULTRAQUANT_KV_DTYPES, *OCTAVE_KV_DTYPES)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: derived from GPU memory like vLLM
    gpu_memory_utilization: float = 0.92
    # vLLM's --kv-cache-memory-bytes: the KV cache's bytes on each GPU, given instead of derived from
    # gpu_memory_utilization (which is then ignored); num_gpu_blocks, if given too, still wins
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    watermark: float = 0.0
    num_lookahead_tokens: int = 0
    # KV_CACHE_DTYPES: auto (= model dtype, bf16), 16-bit, fp8 (one byte), vLLM's per-token-head
    # and TurboQuant formats (packed pages: simkv.specs.kv_head_token_bytes)
    kv_cache_dtype: str = "auto"
    # vLLM's --kv-cache-dtype-skip-layers: the decoder layers (indices, comma-separated) whose K and
    # V stay in the model's dtype under an fp8 or TurboQuant cache (EngineConfig.kv_skip_layers);
    # the block size then grows so that a quantized layer's page covers a skipped layer's 16 tokens
    kv_cache_dtype_skip_layers: str = ""
    # vLLM's --prefix-match-unit: the finest token boundary a prefix-cache hit lands on (None: the
    # block). simkv models it where it changes nothing (EngineConfig._verify_prefix_match_unit)
    prefix_match_unit: int | None = None
    prefix_caching_hash_bits: int = 63
    reserve_null_block: bool = True  # vLLM keeps block 0 as a null block; False: all blocks usable
    allocator: str = "paged"  # or "contiguous": one max_model_len region per request (pre-paging engines)
    swap_space: float = 4.0  # GiB of CPU swap space per GPU (vLLM v0's --swap-space), used by preemption_mode=swap
    pcie_bandwidth_gbs: float = 63.0  # host<->GPU bytes per second (GB/s) for swapping and offloading (PCIe Gen5 x16)
    # vLLM's --cpu-offload-gb (its UVA weight offloading): GiB of each GPU's weights kept in pinned
    # host memory, which leaves that much more for the KV cache, and which every forward pass reads
    # over the host link (capacity.offloaded_weight_bytes, the roofline's weight traffic)
    cpu_offload_gb: float = 0.0
    # vLLM's --cpu-offload-params: the parameter name segments --cpu-offload-gb may take ("" : any,
    # up to its limit), comma-separated; simkv knows a mixture of experts' routed experts by vLLM's
    # names: experts (all of them), w13_weight (gate and up), w2_weight (down)
    cpu_offload_params: str = ""
    # vLLM's prefetch weight offloading (--offload-group-size G --offload-num-in-group N
    # --offload-prefetch-step S; its PrefetchOffloader): the last N decoder layers of every G live
    # in host memory, copied each forward pass into S GPU buffers, S layers ahead of their use
    # (simkv/backends/weight_prefetch.py); 0: off
    offload_group_size: int = 0
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1
    # vLLM's --offload-params: of each offloaded layer only these parameter name segments go to host
    # memory and are copied ("": all of the layer); as cpu_offload_params, a mixture of experts'
    # routed experts by vLLM's names: experts, w13_weight, w2_weight. A layer without them (a
    # dense layer) is not offloaded.
    offload_params: str = ""
    # vLLM's --skip-mm-profiling: a vision model's start-up profile leaves its encoder out (the
    # activation reserve then holds the language model's alone; simkv/capacity.py)
    skip_mm_profiling: bool = False
    # GiB of CPU memory for KV offloading, over all GPUs of the engine (vLLM's --kv-offloading-size
    # with its native backend; each data-parallel rank is an engine with a tier of its own);
    # None: no offloading (core/kv_offload.py)
    kv_offloading_size: float | None = None
    # tokens of one CPU-tier chunk (vLLM's kv_connector_extra_config "block_size"), a multiple of
    # block_size; None: one GPU block a chunk
    kv_offloading_block_size: int | None = None
    # store only prompt blocks (vLLM's "offload_prompt_only", on by default); False: decode blocks too
    kv_offloading_prompt_only: bool = True
    # the CPU tier's eviction policy (vLLM's "eviction_policy"): lru (its default) or arc
    kv_offloading_policy: str = "lru"
    # store a chunk the tier lacks only once it has been offered this many times (vLLM's
    # "store_threshold"; 0 or 1: every offer is stored), counted in an LRU table of at most
    # kv_offloading_max_tracker_size keys (vLLM's "max_tracker_size")
    kv_offloading_store_threshold: int = 0
    kv_offloading_max_tracker_size: int = 64_000

    def __post_init__(self) -> None:
        if self.swap_space < 0 or self.pcie_bandwidth_gbs <= 0:
            raise ConfigError(f"swap_space must be >= 0 and pcie_bandwidth_gbs > 0, got {self.swap_space}, {self.pcie_bandwidth_gbs}")
        if self.cpu_offload_gb < 0:
            raise ConfigError(f"cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")
        for name, segments in (("cpu_offload_params", self.cpu_offload_param_segments),
                               ("offload_params", self.offload_param_segments)):
            unknown = [p for p in segments if p not in CPU_OFFLOAD_PARAM_SEGMENTS]
            if unknown:
                raise ConfigError(f"{name}: '{unknown[0]}' is not a parameter name segment simkv models; give "
                                  f"{', '.join(CPU_OFFLOAD_PARAM_SEGMENTS)} (a mixture of experts' routed experts, "
                                  "vLLM's names)")
        for entry in self.kv_skip_layer_names:
            if not entry.isdigit() and entry != "sliding_window":
                raise ConfigError(f"kv_cache_dtype_skip_layers: '{entry}' is neither a layer index nor "
                                  "'sliding_window' (vLLM's two kinds of entry)")
        if self.cpu_offload_params and not self.cpu_offload_gb:
            raise ConfigError("cpu_offload_params selects what --cpu-offload-gb offloads: give cpu_offload_gb too")
        if self.offload_params and not self.offload_group_size:
            raise ConfigError("offload_params selects what the prefetch backend offloads of each offloaded layer: "
                              "give offload_group_size too")
        if self.offload_group_size < 0 or self.offload_num_in_group < 1:
            raise ConfigError(f"offload_group_size must be >= 0 and offload_num_in_group >= 1, got "
                              f"{self.offload_group_size}, {self.offload_num_in_group}")
        if self.offload_group_size:  # (vLLM's texts)
            if self.offload_num_in_group > self.offload_group_size:
                raise ConfigError(f"offload_num_in_group ({self.offload_num_in_group}) must be <= offload_group_size "
                                  f"({self.offload_group_size})")
            if self.offload_prefetch_step < 1:
                raise ConfigError(f"offload_prefetch_step ({self.offload_prefetch_step}) must be >= 1 when prefetch "
                                  "offloading is enabled (offload_group_size > 0)")
            if self.cpu_offload_gb:
                raise ConfigError("cpu_offload_gb and offload_group_size: vLLM then picks the prefetch backend and "
                                  "ignores cpu_offload_gb (with a warning); give one")
        if self.allocator not in ("paged", "contiguous"):
            raise ConfigError(f"allocator must be 'paged' or 'contiguous', got '{self.allocator}'")
        if self.prefix_match_unit is not None and self.prefix_match_unit < 1:  # (vLLM's Field(gt=0))
            raise ConfigError(f"prefix_match_unit must be > 0, got {self.prefix_match_unit}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ConfigError(f"num_gpu_blocks must be >= 2 (block 0 is the null block), got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"GPU memory utilization must be within (0, 1]. Got {self.gpu_memory_utilization}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.num_lookahead_tokens < 0:
            raise ConfigError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got '{self.kv_cache_dtype}'")
        if not 1 <= self.prefix_caching_hash_bits <= 63:
            raise ConfigError(f"prefix_caching_hash_bits must be in [1, 63], got {self.prefix_caching_hash_bits}")
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ConfigError(f"kv_offloading_size must be > 0 (GiB), got {self.kv_offloading_size}")
        if self.kv_offloading_policy not in ("lru", "arc"):
            raise ConfigError(f"kv_offloading_policy must be 'lru' or 'arc', got '{self.kv_offloading_policy}'")
        if self.kv_offloading_store_threshold < 0 or self.kv_offloading_max_tracker_size < 1:
            raise ConfigError(f"kv_offloading_store_threshold must be >= 0 and kv_offloading_max_tracker_size >= 1, "
                              f"got {self.kv_offloading_store_threshold}, {self.kv_offloading_max_tracker_size}")
        tpc = self.kv_offloading_block_size
        if tpc is not None and (tpc < 1 or tpc % self.block_size):
            raise ConfigError(f"kv_offloading_block_size {tpc} must be a positive multiple of block_size "
                              f"{self.block_size} (use {max(-(-tpc // self.block_size), 1) * self.block_size})")

    @property
    def kv_skip_layer_names(self) -> tuple[str, ...]:
        """kv_cache_dtype_skip_layers' entries: layer indices, or 'sliding_window'."""
        return tuple(e.strip() for e in self.kv_cache_dtype_skip_layers.split(",") if e.strip())

    @property
    def cpu_offload_param_segments(self) -> tuple[str, ...]:
        return _param_segments(self.cpu_offload_params)

    @property
    def offload_param_segments(self) -> tuple[str, ...]:
        return _param_segments(self.offload_params)

    @property
    def offload_blocks_per_chunk(self) -> int:
        """GPU blocks in one chunk of KV offloading's CPU tier (vLLM's blocks_per_chunk)."""
        return (self.kv_offloading_block_size or self.block_size) // self.block_size

    @property
    def kv_dtype_bytes(self) -> int:
        return kv_dtype_bytes(self.kv_cache_dtype)

    @property
    def kv_element(self) -> int | str:
        """What sizes a KV head's token (ModelSpec.kv_bytes_per_token): an element's bytes, or
        the per-token-head dtype's name (its scales are per head)."""
        return kv_element(self.kv_cache_dtype)


def vllm_batch_defaults(gpu: str, max_model_len: int, enable_chunked_prefill: bool = True,
                        max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                        performance_mode: str = "balanced", batched_dp_moe: bool = False) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) as vLLM 0.33's API server takes them on this GPU, the
    ones not given defaulted (EngineArgs.get_batch_defaults and its adjustments): 16,384 and 1,024
    with at least 160 GiB, 8,192 and 1,024 with at least 70 GiB (not an A100), else 2,048 and 256;
    a token budget of 256 for data-parallel ranks exchanging tokens through DeepEP's low-latency
    or NIXL EP kernels (`batched_dp_moe`, vLLM's use_batched_dp_moe); each doubled in the
    throughput performance mode; a defaulted token budget is at least max_model_len without
    chunked prefill and at most max_num_seqs x max_model_len, defaulted sequences at most the
    tokens. simkv's defaults, unless `vllm_batch_defaults` is off (then FIXED_BATCH_DEFAULTS)."""
    spec = get_gpu_spec(gpu)
    if spec.memory_gib >= 160:
        tokens, seqs = 16384, 1024
    elif spec.memory_gib >= 70 and not spec.name.startswith("A100"):
        tokens, seqs = 8192, 1024
    else:
        tokens, seqs = 2048, 256
    if batched_dp_moe:
        tokens = BATCHED_DP_MOE_TOKENS
    scale = PERFORMANCE_MODE_BATCH_SCALE[performance_mode]
    tokens, seqs = tokens * scale, seqs * scale
    seqs = seqs if max_num_seqs is None else max_num_seqs
    if max_num_batched_tokens is None:
        if not enable_chunked_prefill:
            tokens = max(max_model_len, tokens)
        tokens = min(seqs * max_model_len, tokens)
    else:
        tokens = max_num_batched_tokens
    return tokens, min(seqs, tokens) if max_num_seqs is None else seqs


# simkv's fixed defaults before it took vLLM 0.33's (vllm_batch_defaults off): vLLM V0's 256
# sequences and V1's 8,192-token API-server budget on an H100, on every GPU
FIXED_BATCH_DEFAULTS = (8192, 256)
# vLLM's token budget for data-parallel ranks on DeepEP low-latency or NIXL EP all-to-all kernels
# (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP)
BATCHED_DP_MOE_TOKENS = 256

MODEL_RUNNERS = ("auto", "v1", "v2")  # (SchedulerConfig.model_runner)
# vLLM's --performance-mode: 'throughput' doubles the batch defaults (those not given); its other
# effects (CUDA-graph sizes, kernel choices; 'interactivity' has only those) are not the scheduler's
PERFORMANCE_MODE_BATCH_SCALE = {"balanced": 1, "throughput": 2}


def kv_dtype_bytes(kv_cache_dtype: str) -> int:
    """Bytes of one cached K or V element: fp8 (either format) and the 8-bit per-token-head
    dtypes 1 (int4's packs two: ModelSpec.kv_bytes_per_token sizes those), TurboQuant's 1 (its
    uint8 storage; its packed slot is ModelSpec.kv_bytes_per_token's), the model's bf16 (auto) or
    fp16 2."""
    return 1 if is_fp8_kv(kv_cache_dtype) or kv_cache_dtype in PACKED_KV_DTYPES else 2


def _param_segments(text: str) -> tuple[str, ...]:
    """A comma-separated list of parameter name segments (cpu_offload_params, offload_params)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def kv_element(kv_cache_dtype: str) -> int | str:
    """CacheConfig.kv_element of a kv_cache_dtype."""
    return kv_cache_dtype if kv_cache_dtype in PACKED_KV_DTYPES else kv_dtype_bytes(kv_cache_dtype)


def is_fp8_kv(kv_cache_dtype: str | None) -> bool:
    """vLLM's fp8 KV caches: fp8 (its e4m3 on CUDA), fp8_e4m3, fp8_e5m2, and fp8_ds_mla (the
    sparse-MLA layout of fp8 values, its scales and a bf16 rotary key)."""
    return kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # None: vLLM 0.33's API-server defaults on the GPU (vllm_batch_defaults: 1,024 sequences and
    # 8,192 tokens on an H100), resolved by EngineConfig, which knows the GPU and max_model_len
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # vLLM's --max-num-scheduled-tokens: the scheduler's token budget of a step, where
    # max_num_batched_tokens stays the batch's rows (the scheduled tokens and any drafting slots)
    # [default: max_num_batched_tokens]
    max_num_scheduled_tokens: int | None = None
    # max_num_seqs and max_num_batched_tokens, where not given, as vLLM 0.33's API server takes them on
    # the GPU (vllm_batch_defaults); off: 256 and 8,192 on every GPU (FIXED_BATCH_DEFAULTS)
    vllm_batch_defaults: bool = True
    # vLLM's --performance-mode: 'throughput' doubles max_num_seqs and max_num_batched_tokens where
    # not given (on either kind of defaults)
    performance_mode: str = "balanced"
    # set by EngineConfig: which of max_num_seqs and max_num_batched_tokens it defaulted (a config
    # derived from this one with other options re-derives them: EngineConfig.given_options)
    defaulted_batch_options: tuple[str, ...] = ()
    # None: the model's max_position_embeddings; -1: vLLM's --max-model-len auto, the longest
    # request the KV cache holds (at most the model's length), fitted by EngineConfig
    max_model_len: int | None = None
    max_model_len_fitted: bool = False  # set by EngineConfig: max_model_len was -1 and is the fitted length
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    scheduling_policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    # vLLM's --max-num-active-seqs: requests admitted into RUNNING (None: max_num_seqs, which
    # still sizes the model runner)
    max_num_active_seqs: int | None = None
    # vLLM's --prefill-schedule-interval: prefill (admissions and running prompts' chunks) only
    # once that many executed steps have passed since the last step that carried one
    prefill_schedule_interval: int = 1
    # vLLM's API-server admission control: a request is refused (HTTP 503) when the engine's
    # unfinished requests would exceed max_num_queued_reqs, or the prompt tokens of its requests
    # without a token yet have reached max_num_queued_tokens (simkv/replay/admission.py)
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # vLLM's --async-scheduling (its serving default): step N+1 is scheduled while step N runs,
    # before N's sampled tokens are processed.
    async_scheduling: bool = False
    # vLLM's model runner (its VLLM_USE_V2_MODEL_RUNNER): "v2", vLLM 0.33's default, runs the
    # n-gram drafter on the device (K drafts every step, a miss's rejected) and takes async
    # scheduling with pipeline stages; "v1" proposes n-grams on the host (none without a match)
    # and refuses async scheduling with either. "auto": v2 unless a feature only V1 has is asked
    # for (suffix decoding, EAGLE or draft-model parallel drafting), as vLLM picks.
    model_runner: str = "auto"
    # Policy knobs beyond vLLM (defaults = vLLM's behaviour), for other engines' step models:
    max_num_admissions_per_step: int | None = None  # None: as many as fit
    admission_order: str = "after_running"  # or "before_running"
    preemption_victim: str = "newest"  # vLLM: the newest running request; or "requester"
    preemption_mode: str = "recompute"  # keep outputs and recompute them; "restart": drop them;
    # "swap": copy the victim's KV to CPU swap space (vLLM v0), recompute when the space is full
    # A trace row with n > 1 sequences: "fan_out", vLLM v1's n requests that share the prompt's
    # blocks through the prefix cache (core/parallel_sampling.py); "fork", vLLM v0's sequences
    # forked after the prompt, sharing its blocks with copy-on-write.
    parallel_sampling: str = "fan_out"
    # The replay's clients, not the engine: a trace's sessions send a turn no earlier than the
    # previous turn's finish + its think time (simkv/replay/sessions.py); False replays the
    # trace's arrival times as they are (open loop).
    session_pacing: bool = True
    # A client that keeps at most this many requests in flight (vllm bench serve's
    # --max-concurrency): a request is sent at its trace time (paced sessions: when its turn is
    # due) or, when that many are in flight, once one of them is done with (simkv/replay/
    # sessions.py's Pacing); None: no limit
    client_max_concurrency: int | None = None
    # Sessions paced on their replies: at most this many conversations in progress (vLLM's
    # multi-turn benchmark's --max-active-conversations; it defaults to --num-clients, one each).
    # A conversation starts at its first turn's trace time or, when that many are in progress,
    # once one of them ends (its last turn done with); None: every conversation at its own time
    client_max_active_sessions: int | None = None
    # Sessions paced on their replies: the client stops sending once a conversation ends and
    # none is left to start (vLLM's multi-turn benchmark's default early stop; its --no-early-stop
    # sends every turn). Turns not sent by then never are (status not_sent); those in flight finish
    client_early_stop: bool = False
    # Sessions paced on their replies: each client (a chain of conversations: one per conversation
    # in progress) sends at most this many requests per second, as a Poisson process: after a
    # request of d seconds it pauses for an exponential draw of mean 1 / rate - d, from numpy's
    # state seeded client_seed + client + 1 (vLLM's multi-turn benchmark's --request-rate and
    # --seed); None: no pause
    client_request_rate: float | None = None
    client_seed: int = 0
    # Sessions paced on their replies, as vLLM's multi-turn benchmark's clients take them: each of
    # the client_max_concurrency clients keeps client_max_active_sessions // that many
    # conversations and sends their turns in rotation, one request at a time; a client leaves when
    # it wants a conversation and none is left (simkv/replay/client_rotation.py). False: the
    # clients share one pool of due turns
    client_rotation: bool = False
    # Rotating clients: how a client picks the conversation of its next request, "round_robin"
    # (the newest first, then the one waiting longest) or "random" (Python's random.choice,
    # seeded client_seed + client + 1); the requests the clients send in all at most (each its
    # share, // client_max_concurrency; None: no limit); and a warm-up first (every conversation's
    # first turn alone, then the rest from the second turn): the benchmark's
    # --conversation-sampling, --max-num-requests and --warmup-step
    client_conversation_sampling: str = "round_robin"
    client_max_requests: int | None = None
    client_warmup: bool = False
    # A client (or a gateway in front) that keeps the requests in flight at most this many tokens:
    # each holds its prompt and its output as the trace gives it (n outputs for n samples: what
    # its max_tokens lets the KV cache grow to); a request waits until it fits, and those behind
    # it too (one larger than the whole budget goes alone); None: no limit
    client_max_inflight_tokens: int | None = None
    # Clients that give up (simkv/replay/client_timeouts.py): a request without its first token
    # `client_ttft_timeout_s` after it was sent, or unfinished `client_timeout_s` after, is
    # abandoned, and vLLM aborts it; the client sends it again up to `client_max_retries` times,
    # waiting `client_retry_backoff_s` before the first retry and twice as long before each next,
    # at most `client_retry_max_backoff_s`, shortened by up to the fraction `client_retry_jitter`
    # (the OpenAI client: 0.5 s, 8 s, 0.25).
    client_ttft_timeout_s: float | None = None
    client_timeout_s: float | None = None
    client_max_retries: int = 0
    client_retry_backoff_s: float = 0.5
    client_retry_max_backoff_s: float | None = None
    client_retry_jitter: float = 0.0
    # vLLM's --enable-lora / --max-loras: a request naming an adapter (the trace's lora_name) is
    # admitted only while at most max_loras distinct adapters run in the batch.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16  # vLLM's --max-lora-rank: the slots' buffers are this wide (GPU memory)
    # vLLM's --max-cpu-loras: adapters the worker keeps in host memory (None: max_loras, vLLM's
    # default); one not there is read from disk at lora_load_gbs (simkv/backends/lora_adapters.py)
    max_cpu_loras: int | None = None
    lora_load_gbs: float = 2.0  # an assumption, not a measurement: disk read and host-side packing
    # Multimodal models (simkv/core/encoder_cache.py): the most embeddings one item (an image) can
    # have, which sizes vLLM's encoder budget per step and its encoder cache, both
    # max(max_num_batched_tokens, it); None: the trace's largest item (a text-only trace: none).
    # vLLM's --disable-chunked-mm-input: a prefill chunk never ends inside an item.
    mm_max_tokens_per_item: int | None = None
    disable_chunked_mm_input: bool = False
    # vLLM's --limit-mm-per-prompt '{"image": N}': the most images a prompt may show (its API
    # server refuses more), which also caps the encoder's start-up profile at N a prompt
    # (simkv/capacity.py); None: vLLM's 999
    limit_mm_per_prompt: int | None = None
    # Encoder disaggregation (vLLM's --ec-transfer-config over shared storage; simkv/replay/encode_pool.py):
    # "ec_producer", an encode instance (no language model: a request ends when its prompt is
    # consumed; what it encodes goes to the store), or "ec_consumer", an engine that loads its
    # requests' embeddings from the store, at ec_store_gbs GB/s (an assumption: shared memory or
    # a local disk), instead of encoding them. Set by the replay for --encode-replicas.
    ec_role: str | None = None
    ec_store_gbs: float = 10.0

    def __post_init__(self) -> None:
        for name in ("client_ttft_timeout_s", "client_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value}")
        if self.client_max_retries < 0:
            raise ConfigError(f"client_max_retries must be >= 0, got {self.client_max_retries}")
        if self.client_retry_backoff_s < 0:
            raise ConfigError(f"client_retry_backoff_s must be >= 0, got {self.client_retry_backoff_s}")
        if self.client_retry_max_backoff_s is not None and not self.client_retry_max_backoff_s > 0:
            raise ConfigError(f"client_retry_max_backoff_s must be > 0, got {self.client_retry_max_backoff_s}")
        if not 0 <= self.client_retry_jitter < 1:
            raise ConfigError(f"client_retry_jitter must be in [0, 1), got {self.client_retry_jitter}")
        # (client_max_retries without what it retries: refused by the replay, which knows whether a
        # fleet's replicas fail: simkv/replay/api.py)
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.client_max_concurrency is not None and self.client_max_concurrency < 1:
            raise ConfigError(f"client_max_concurrency must be >= 1, got {self.client_max_concurrency}")
        if self.client_max_inflight_tokens is not None and self.client_max_inflight_tokens < 1:
            raise ConfigError(f"client_max_inflight_tokens must be >= 1, got {self.client_max_inflight_tokens}")
        if self.client_max_active_sessions is not None:
            if self.client_max_active_sessions < 1:
                raise ConfigError(f"client_max_active_sessions must be >= 1, got {self.client_max_active_sessions}")
            if not self.session_pacing:
                raise ConfigError("client_max_active_sessions limits conversations paced on their replies: it needs "
                                  "session pacing (not --no-session-pacing)")
        if self.client_request_rate is not None and not self.client_request_rate > 0:
            raise ConfigError(f"client_request_rate must be > 0 (requests per second per client), got "
                              f"{self.client_request_rate}")
        if self.client_request_rate is not None and not self.session_pacing:
            raise ConfigError("client_request_rate paces the clients of conversations paced on their replies: it "
                              "needs session pacing (not --no-session-pacing)")
        if self.client_rotation:
            if self.client_max_concurrency is None or not self.session_pacing:
                raise ConfigError("client_rotation gives each of client_max_concurrency clients its conversations "
                                  "paced on their replies: it needs client_max_concurrency and session pacing")
            if (self.client_max_active_sessions or self.client_max_concurrency) < self.client_max_concurrency:
                raise ConfigError(f"client_rotation: client_max_active_sessions {self.client_max_active_sessions} "
                                  f"gives none of the {self.client_max_concurrency} clients a conversation")
        if not 0 <= self.client_seed < 2**31:
            raise ConfigError(f"client_seed must be a whole number from 0 to 2**31 - 1, got {self.client_seed}")
        if self.client_conversation_sampling not in ("round_robin", "random"):
            raise ConfigError(f"client_conversation_sampling must be round_robin or random, got "
                              f"{self.client_conversation_sampling!r}")
        rotating = {"client_conversation_sampling": self.client_conversation_sampling != "round_robin",
                    "client_max_requests": self.client_max_requests is not None, "client_warmup": self.client_warmup}
        for name, given in rotating.items():
            if given and not self.client_rotation:
                raise ConfigError(f"{name} is a rotating client's (vLLM's multi-turn benchmark's): it needs "
                                  "client_rotation")
        if self.client_max_requests is not None and self.client_max_concurrency is not None and (
                self.client_max_requests < self.client_max_concurrency):
            raise ConfigError(f"client_max_requests {self.client_max_requests} leaves none of the "
                              f"{self.client_max_concurrency} clients a request")
        if self.client_early_stop and not self.session_pacing:
            raise ConfigError("client_early_stop stops a client of conversations paced on their replies: it needs "
                              "session pacing (not --no-session-pacing)")
        if self.max_model_len is not None and self.max_model_len < 1 and self.max_model_len != -1:
            raise ConfigError(f"max_model_len must be >= 1, or -1 (auto: fitted to the KV cache), got {self.max_model_len}")
        if self.ec_role not in (None, "ec_producer", "ec_consumer"):
            raise ConfigError(f"ec_role must be ec_producer or ec_consumer, got {self.ec_role!r}")
        if not self.ec_store_gbs > 0:
            raise ConfigError(f"ec_store_gbs must be > 0 (GB/s), got {self.ec_store_gbs}")
        if self.limit_mm_per_prompt is not None and self.limit_mm_per_prompt < 1:
            raise ConfigError(f"limit_mm_per_prompt must be >= 1 (images a prompt may show), got "
                              f"{self.limit_mm_per_prompt}; --language-model-only serves a vision model as text")
        if self.mm_max_tokens_per_item is not None and self.mm_max_tokens_per_item < 1:
            raise ConfigError(f"mm_max_tokens_per_item must be >= 1, got {self.mm_max_tokens_per_item}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}), "
                              "as vLLM requires")
        if not self.lora_load_gbs > 0:
            raise ConfigError(f"lora_load_gbs must be > 0 (GB/s), got {self.lora_load_gbs}")
        if self.admission_order not in ("after_running", "before_running"):
            raise ConfigError(f"admission_order must be 'after_running' or 'before_running', got '{self.admission_order}'")
        if self.preemption_victim not in ("newest", "requester"):
            raise ConfigError(f"preemption_victim must be 'newest' or 'requester', got '{self.preemption_victim}'")
        if self.performance_mode not in PERFORMANCE_MODE_BATCH_SCALE:
            raise ConfigError(f"performance_mode must be 'balanced' or 'throughput', got '{self.performance_mode}'"
                              + (" (vLLM's 'interactivity' changes CUDA-graph sizes and kernels, not the "
                                 "scheduler: replay it as 'balanced')" if self.performance_mode == "interactivity" else ""))
        if self.parallel_sampling not in ("fan_out", "fork"):
            raise ConfigError(f"parallel_sampling must be 'fan_out' or 'fork', got '{self.parallel_sampling}'")
        if self.preemption_mode not in ("recompute", "restart", "swap"):
            raise ConfigError(f"preemption_mode must be 'recompute', 'restart' or 'swap', got '{self.preemption_mode}'")
        if self.model_runner not in MODEL_RUNNERS:
            raise ConfigError(f"model_runner must be one of {', '.join(MODEL_RUNNERS)}, got '{self.model_runner}'")
        if self.async_scheduling and self.preemption_mode != "recompute":
            raise ConfigError(f"async_scheduling is vLLM v1's and needs preemption_mode 'recompute', "
                              f"got '{self.preemption_mode}'")
        if self.max_num_admissions_per_step is not None and self.max_num_admissions_per_step < 1:
            raise ConfigError(f"max_num_admissions_per_step must be >= 1, got {self.max_num_admissions_per_step}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_scheduled_tokens is not None and self.max_num_scheduled_tokens < 1:
            raise ConfigError(f"max_num_scheduled_tokens must be >= 1, got {self.max_num_scheduled_tokens}")
        if self.max_num_active_seqs is not None and not 1 <= self.max_num_active_seqs <= (self.max_num_seqs or 1 << 62):
            raise ConfigError(f"max_num_active_seqs ({self.max_num_active_seqs}) must be >= 1 and cannot be greater "
                              f"than max_num_seqs ({self.max_num_seqs})")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefill_schedule_interval < 1:
            raise ConfigError(f"prefill_schedule_interval must be >= 1, got {self.prefill_schedule_interval}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be 'fcfs' or 'priority', got '{self.scheduling_policy}'")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")

    @property
    def cpu_loras(self) -> int:
        """Adapters the worker keeps in host memory (vLLM's max_cpu_loras, max_loras by default)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def has_client_timeouts(self) -> bool:
        return self.client_ttft_timeout_s is not None or self.client_timeout_s is not None

    @property
    def has_clients(self) -> bool:
        """Clients are modelled: they give up (time-outs), or they retry the front end's HTTP 503s."""
        return self.has_client_timeouts or bool(self.client_max_retries and (
            self.max_num_queued_reqs is not None or self.max_num_queued_tokens is not None))

    def verify_max_model_len(self, max_model_len: int) -> None:
        """vLLM's SchedulerConfig checks, with its texts."""
        if self.max_num_batched_tokens < max_model_len and not self.enable_chunked_prefill:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}). This effectively limits the maximum sequence length to "
                "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                "max_num_batched_tokens or decrease max_model_len.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal "
                f"to max_num_seqs ({self.max_num_seqs}).")
        if self.long_prefill_token_threshold > max_model_len:
            raise ConfigError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be greater "
                f"than the max_model_len ({max_model_len}).")


@dataclass(frozen=True, slots=True)
class HardwareConfig:
    model: str = "llama-3-8b"
    gpu: str = "H100-SXM"
    tensor_parallel_size: int = 1
    # vLLM's --data-parallel-size for a mixture of experts: that many engine ranks (each its own
    # scheduler and KV cache, attention and dense layers replicated over them, TP within each)
    # whose expert layers span all ranks' GPUs and whose steps run in lockstep
    # (simkv/replay/data_parallel.py)
    data_parallel_size: int = 1
    # vLLM's --dp-sync-interval: data-parallel ranks agree whether any has requests on the first
    # step of a wave and every this many steps after; a wave whose requests all finished runs
    # dummy passes until its next such step (simkv/replay/data_parallel.py, PrefillCadence)
    dp_sync_interval: int = 16
    # vLLM's --decode-context-parallel-size: groups of that many of the TP GPUs shard the KV cache
    # by tokens (each stores block_size tokens of every block of block_size x DCP) instead of
    # each holding every token of its heads (a latent, or KV heads duplicated when TP > KV heads)
    decode_context_parallel_size: int = 1
    # vLLM's --prefill-context-parallel-size (latent-attention models, its V2 model runner): that
    # many copies of the TP group, each holding the whole KV cache, split every prefill chunk of
    # a step between them (decodes round robin) and gather each layer's new latents; the expert
    # layers span all their GPUs (simkv/backends/roofline.py, `pcp_rank_works`)
    prefill_context_parallel_size: int = 1
    # vLLM's --enable-expert-parallel and --all2all-backend: with expert parallelism and data- (or
    # prefill-context-) parallel ranks, an all-to-all backend (DeepEP and kin, ALL2ALL_BACKENDS)
    # sends each token's hidden state only to the GPUs holding its experts instead of gathering
    # every rank's tokens on every GPU (allgather_reducescatter, vLLM's default, and what runs
    # without expert parallelism); simkv/backends/expert_exchange.py prices both
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"
    # vLLM's --expert-placement-strategy: linear (each GPU a contiguous run of experts) or
    # round_robin (expert e on GPU e mod g); vLLM keeps round_robin only for a model with expert
    # groups on the DeepEP low-latency or NIXL EP kernels (`round_robin_experts`)
    expert_placement_strategy: str = "linear"
    # vLLM's --enable-eplb (expert-parallel load balancing) and its --eplb-config
    # num_redundant_experts: that many extra copies of routed experts spread over the expert-
    # parallel GPUs, in memory (HardwareConfig.model_spec); the balancing itself is not modelled
    # (simkv's routing is uniform, already balanced)
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    # vLLM's --enable-dbo (dual batch overlap, data-parallel ranks): a step of at least
    # dbo_decode_token_threshold tokens (decodes only) or dbo_prefill_token_threshold (with a
    # prefill) on every rank runs as two microbatches, one's expert exchange under the other's work;
    # vLLM's --ubatch-size N (N > 1, without --enable-dbo) splits such steps into N microbatches
    enable_dbo: bool = False
    ubatch_size: int = 0
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    # vLLM's --pipeline-parallel-size: the model's layers split over that many stages (each on
    # its own TP GPUs, layers as vLLM's get_pp_indices splits them); the engine keeps that many
    # batches in flight, one more under async scheduling (simkv/replay/pipeline.py)
    pipeline_parallel_size: int = 1
    # the link between pipeline stages, GB/s one way (None: the GPU's interconnect_gbs within a
    # node, inter_node_gbs between nodes); a step's hidden states cross it at every stage boundary
    pipeline_link_gbs: float | None = None
    # GPUs per node: a tensor-parallel group or data-parallel expert group larger than a node,
    # and a pipeline boundary between nodes, go over the network at inter_node_gbs (GB/s one
    # way per GPU: a 400 Gb/s NIC per GPU) instead of the GPU's interconnect
    gpus_per_node: int = 8
    inter_node_gbs: float = 50.0
    # vLLM's --quantization: None (the checkpoint's weights as they are) or "fp8" (vLLM quantizes a
    # bf16 checkpoint's linear layers and experts to fp8 as it loads them: ModelSpec.quantized)
    quantization: str | None = None
    # vLLM's --mm-encoder-tp-mode under tensor parallelism: "weights" (the vision encoder's layers
    # split over the TP GPUs, with their all-reduces) or "data" (each TP GPU holds the whole
    # encoder and encodes its share of a step's images, balanced by size; simkv/backends/vision_encoder.py)
    mm_encoder_tp_mode: str = "weights"
    # vLLM's --language-model-only: a vision model served as text only (every modality's limit 0):
    # no vision encoder on the GPUs, none in the start-up profile; prompts with images refused
    language_model_only: bool = False
    # vLLM's --mamba-cache-dtype and --mamba-ssm-cache-dtype (cache options in vLLM; here, as they
    # size the model's linear-attention states: ModelSpec.with_mamba_cache_dtypes): auto, bfloat16,
    # float16 or float32
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        get_model_spec(self.model)  # raise on unknown names
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            value = getattr(self, name)
            if value not in MAMBA_DTYPE_BYTES:
                raise ConfigError(f"{name} must be one of {', '.join(MAMBA_DTYPE_BYTES)}, got {value!r}")
            if value != "auto" and not get_model_spec(self.model).linear_attention:
                raise ConfigError(f"{name} {value}: {self.model} has no linear-attention (Mamba) layers, whose "
                                  "states it sizes")
        if self.mm_encoder_tp_mode not in ("weights", "data"):
            raise ConfigError(f"mm_encoder_tp_mode must be weights or data, got {self.mm_encoder_tp_mode!r}")
        get_gpu_spec(self.gpu)
        if self.quantization is not None:
            try:
                self.model_spec()
            except ValueError as exc:
                raise ConfigError(f"quantization {self.quantization!r}: {exc}") from None
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        spec = get_model_spec(self.model)
        dcp = self.decode_context_parallel_size
        if dcp < 1:
            raise ConfigError(f"decode_context_parallel_size must be >= 1, got {dcp}")
        if self.tensor_parallel_size % dcp:  # (vLLM's text)
            raise ConfigError(f"tp_size={self.tensor_parallel_size} must be divisible by dcp_size={dcp}.")
        if dcp > 1 and not spec.is_mla:  # (vLLM's checks and texts: KV heads duplicated over TP, split by tokens)
            tp, kv = self.tensor_parallel_size, spec.num_kv_heads
            if tp <= kv:
                raise ConfigError(f"Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` ({tp}) "
                                  f"to be greater than the model's total number of KV heads ({kv}). Increase "
                                  "`--tensor-parallel-size` or set `--decode-context-parallel-size 1`.")
            if dcp > tp // kv:
                raise ConfigError(f"`--decode-context-parallel-size` ({dcp}) exceeds the maximum supported value "
                                  f"({tp // kv}) for `--tensor-parallel-size` ({tp}) and {kv} model KV heads.")
            if (spec.num_heads // kv) % dcp:
                raise ConfigError(f"The model's number of query heads per KV head ({spec.num_heads // kv}) must be "
                                  f"divisible by `--decode-context-parallel-size` ({dcp}) for GQA/MQA.")
        if self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.dp_sync_interval < 1:
            raise ConfigError(f"dp_sync_interval must be >= 1, got {self.dp_sync_interval}")
        self._check_prefill_context_parallel(spec)
        self._check_expert_exchange()
        pp = self.pipeline_parallel_size
        if pp < 1:
            raise ConfigError(f"pipeline_parallel_size must be >= 1, got {pp}")
        if pp > spec.num_layers:
            raise ConfigError(f"pipeline_parallel_size {pp}: {self.model} has {spec.num_layers} layers, fewer "
                              "than the stages")
        if self.pipeline_link_gbs is not None and self.pipeline_link_gbs <= 0:
            raise ConfigError(f"pipeline_link_gbs must be > 0, got {self.pipeline_link_gbs}")
        if self.gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.inter_node_gbs <= 0:
            raise ConfigError(f"inter_node_gbs must be > 0, got {self.inter_node_gbs}")
        if self.data_parallel_size > 1 and not spec.is_moe:
            raise ConfigError(f"data_parallel_size {self.data_parallel_size}: {self.model} is dense, and vLLM's "
                              "data-parallel ranks of a dense model are independent engines: replay them as a "
                              "fleet (--replicas N)")
        if spec.num_heads % self.tensor_parallel_size:
            raise ConfigError(
                f"Total number of attention heads ({spec.num_heads}) must be divisible by tensor "
                f"parallel size ({self.tensor_parallel_size}).")
        if spec.linear_attention:
            try:
                spec.linear_conv_dim(self.tensor_parallel_size)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    def _check_prefill_context_parallel(self, spec) -> None:
        """vLLM 0.33's checks of --prefill-context-parallel-size (its texts), and what simkv does
        not model with it."""
        pcp, dcp, tp = self.prefill_context_parallel_size, self.decode_context_parallel_size, self.tensor_parallel_size
        if pcp < 1:
            raise ConfigError(f"prefill_context_parallel_size must be >= 1, got {pcp}")
        if pcp == 1:
            return
        if not spec.is_mla:
            raise ConfigError("MRV2 PCP currently supports MLA models only.")
        if dcp not in (1, pcp, tp * pcp):
            raise ConfigError("When PCP is enabled, DCP must be disabled, span the PCP axis, or span the full TP x "
                              f"PCP axis. Got TP={tp}, PCP={pcp}, DCP={dcp}; valid DCP sizes are "
                              f"{sorted({1, pcp, tp * pcp})}.")
        if dcp > 1 and not spec.is_sparse:
            raise ConfigError("MRV2 PCP + DCP supports sparse MLA models only.")

    def _check_expert_exchange(self) -> None:
        """vLLM 0.33's --all2all-backend values and its checks of dual batch overlap (its texts)."""
        backend = self.all2all_backend
        if backend not in ALL2ALL_BACKENDS + GATHER_BACKENDS:
            raise ConfigError(f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS + GATHER_BACKENDS)} "
                              f"(vLLM's), got {backend!r}")
        self._check_eplb()
        if self.expert_placement_strategy not in EXPERT_PLACEMENT_STRATEGIES:
            raise ConfigError(f"expert_placement_strategy must be one of {', '.join(EXPERT_PLACEMENT_STRATEGIES)} "
                              f"(vLLM's), got {self.expert_placement_strategy!r}")
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold", "ubatch_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.use_ubatching:
            return
        if min(self.dbo_decode_token_threshold, self.dbo_prefill_token_threshold) < self.num_ubatches:
            raise ConfigError("dbo_decode_token_threshold and dbo_prefill_token_threshold must be at least the "
                              f"number of microbatches ({self.num_ubatches}).")
        supported = (("deepep_low_latency", "deepep_high_throughput", "nixl_ep")
                     + (("allgather_reducescatter",) if get_gpu_spec(self.gpu).platform == "rocm" else ()))
        if backend not in supported:
            raise ConfigError(f"Microbatching currently only supports the {', '.join(supported)} all2all backends on "
                              f"this platform. {backend} is not supported. To fix use one of "
                              f"{', '.join('--all2all-backend=' + b for b in supported)} and install the matching "
                              "kernels.")
        if self.data_parallel_size == 1:
            raise ConfigError(f"{self.ubatching_option} is modelled with data-parallel ranks (a mixture of experts' "
                              "expert exchange between them is what the microbatches overlap)")

    def _check_eplb(self) -> None:
        """vLLM 0.33's checks of EPLB (its texts)."""
        if self.num_redundant_experts < 0:
            raise ConfigError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if not self.enable_eplb:
            if self.num_redundant_experts:
                raise ConfigError(f"num_redundant_experts is set to {self.num_redundant_experts} but EPLB is not "
                                  "enabled. Either enable EPLB or unset num_redundant_experts.")
            return
        if not self.enable_expert_parallel:
            raise ConfigError("enable_expert_parallel must be True to use EPLB.")
        if self.tensor_parallel_size * self.prefill_context_parallel_size * self.data_parallel_size <= 1:
            raise ConfigError("EPLB requires tensor, prefill-context, or data parallelism, but got "
                              f"TP={self.tensor_parallel_size}, PCP={self.prefill_context_parallel_size}, "
                              f"DP={self.data_parallel_size}.")
        if not get_model_spec(self.model).is_moe:
            raise ConfigError(f"enable_eplb: {self.model} has no routed experts to balance")

    @property
    def round_robin_experts(self) -> bool:
        """Experts placed round robin over the expert-parallel GPUs, as vLLM keeps
        --expert-placement-strategy round_robin (determine_expert_placement_strategy): a model
        with expert groups (n_group > 1), without EPLB, on the DeepEP low-latency or NIXL EP
        kernels where its tokens go all-to-all; else vLLM falls back to linear."""
        if self.expert_placement_strategy != "round_robin" or self.model_spec().n_group <= 1 or self.enable_eplb:
            return False
        return not self.all_to_all or self.all2all_backend in ("deepep_low_latency", "nixl_ep")

    @property
    def batched_dp_moe(self) -> bool:
        """Data-parallel ranks exchanging tokens through DeepEP's low-latency or NIXL EP kernels
        (vLLM's use_batched_dp_moe), whose token budget vLLM defaults to 256."""
        return (self.all2all_backend in ("deepep_low_latency", "nixl_ep") and self.enable_expert_parallel
                and self.data_parallel_size > 1)

    @property
    def use_ubatching(self) -> bool:
        """Lockstep steps of enough tokens run as microbatches (vLLM's use_ubatching)."""
        return self.enable_dbo or self.ubatch_size > 1

    @property
    def num_ubatches(self) -> int:
        """Microbatches of a microbatched step: two under --enable-dbo, else ubatch_size (vLLM's)."""
        return 2 if self.enable_dbo else self.ubatch_size

    @property
    def ubatching_option(self) -> str:
        """The option that turned microbatching on, for messages."""
        return "enable_dbo" if self.enable_dbo else f"ubatch_size {self.ubatch_size}"

    @property
    def all_to_all(self) -> bool:
        """The expert layers exchange tokens all-to-all (`exchanges_all_to_all`)."""
        return exchanges_all_to_all(self.enable_expert_parallel, self.all2all_backend, self.expert_shards)

    @property
    def expert_shards(self) -> int:
        """The copies of the attention layers a mixture of experts' routed experts are split over
        (beside TP): data-parallel ranks times prefill-context-parallel ranks."""
        return self.data_parallel_size * self.prefill_context_parallel_size

    @property
    def num_gpus(self) -> int:
        """The GPUs one engine runs on: TP x PP x PCP x DP (vLLM's world size across DP)."""
        return (self.tensor_parallel_size * self.pipeline_parallel_size * self.prefill_context_parallel_size
                * self.data_parallel_size)

    def _link(self, across_nodes: bool) -> float:
        """GB/s one way per GPU: the GPU's interconnect, or between nodes the network's."""
        interconnect = get_gpu_spec(self.gpu).interconnect_gbs
        return min(interconnect, self.inter_node_gbs) if across_nodes else interconnect

    def vision_weight_bytes_per_gpu(self) -> float:
        """The vision encoder's weights on one of its GPUs: split by TP, or whole under
        mm_encoder_tp_mode "data"; none under language_model_only."""
        spec = self.model_spec()
        if self.language_model_only:
            return 0.0
        return spec.vision_weight_bytes / (1 if self.mm_encoder_tp_mode == "data" else self.tensor_parallel_size)

    @property
    def has_vision_encoder(self) -> bool:
        """The model has a vision encoder and serves images with it (not language_model_only)."""
        return bool(self.model_spec().vision_num_layers) and not self.language_model_only

    def link_gbs(self, num_gpus: int) -> float:
        """The bandwidth (GB/s one way, per GPU) of a collective over `num_gpus` consecutive GPUs:
        the GPU's interconnect within a node, the network's when they span nodes."""
        return self._link(num_gpus > self.gpus_per_node)

    def stage_link_gbs(self, boundary: int) -> float:
        """Pipeline parallelism: the link between stage `boundary` and the next (stages of TP GPUs
        each, TP x PCP under prefill context parallelism, laid out one after another):
        `pipeline_link_gbs` if set, else the interconnect when both sides are on one node, the
        network's otherwise."""
        if self.pipeline_link_gbs is not None:
            return self.pipeline_link_gbs
        first_next = (boundary + 1) * self.tensor_parallel_size * self.prefill_context_parallel_size
        return self._link((first_next - 1) // self.gpus_per_node != first_next // self.gpus_per_node)

    def model_spec(self) -> ModelSpec:
        """The model as served: its spec under `quantization` and the Mamba cache dtypes, with
        EPLB's redundant experts."""
        spec = get_model_spec(self.model).quantized(self.quantization)
        spec = spec.with_mamba_cache_dtypes(self.mamba_cache_dtype, self.mamba_ssm_cache_dtype)
        return (dataclasses.replace(spec, num_redundant_experts=self.num_redundant_experts)
                if self.num_redundant_experts else spec)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Sliding-window attention: overrides of the model's layer windows, and vLLM's switch
    for its hybrid KV-cache manager (core/kv_cache_groups.py)."""

    sliding_window: int | None = None  # None: the model's (0: no sliding-window layers)
    full_attention_interval: int | None = None  # None: the model's; every k-th layer full, 0: none
    # chunked local attention (Llama 4's attention_chunk_size): None: the model's, 0: none
    attention_chunk_size: int | None = None
    disable_hybrid_kv_cache_manager: bool = False  # vLLM's --disable-hybrid-kv-cache-manager
    # vLLM's --disable-sliding-window: the model's sliding-window layers attend the whole context
    # (chunked local attention stays), and max_model_len defaults to at most the window
    disable_sliding_window: bool = False
    # vLLM's --prefix-cache-retention-interval: sliding-window blocks cached for later hits. 0 (its
    # default): only those a resend of the prompt or a shared-prefix junction can resume at; R > 0:
    # also the ones before every multiple of R tokens; None: all of them.
    prefix_cache_retention_interval: int | None = 0
    # vLLM's --gdn-prefill-backend for Gated DeltaNet layers: "auto" picks FlashInfer's kernel on
    # Hopper and on Blackwell with 128-wide key heads (CUDA 13 assumed), Triton's elsewhere. Under
    # prefix caching FlashInfer's exports a state from inside a prefill chunk (no split at the
    # last block) and aligns blocks to 64 tokens.
    gdn_prefill_backend: str = "auto"
    # vLLM's attention_config.indexer_tp_shard_min_rows (DeepSeek sparse attention): a step with at
    # least this many prefill tokens splits their indexer scoring over the TP ranks (CUDA, no DCP);
    # below it every rank scores every row
    indexer_tp_shard_min_rows: int = 65536

    def __post_init__(self) -> None:
        if self.indexer_tp_shard_min_rows < 1:
            raise ConfigError(f"indexer_tp_shard_min_rows must be >= 1, got {self.indexer_tp_shard_min_rows}")
        if self.gdn_prefill_backend not in ("auto", "flashinfer", "triton"):
            raise ConfigError(f"gdn_prefill_backend must be one of auto, flashinfer, triton; got '{self.gdn_prefill_backend}'")
        if self.sliding_window is not None and self.sliding_window < 0:
            raise ConfigError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.sliding_window == 1:
            raise ConfigError("sliding_window must be >= 2 (a window of one token attends nothing before it)")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 0:
            raise ConfigError(f"attention_chunk_size must be >= 0, got {self.attention_chunk_size}")
        if self.sliding_window and self.attention_chunk_size:
            raise ConfigError("sliding_window and attention_chunk_size: one kind of local attention per model")
        if self.sliding_window and self.disable_sliding_window:
            raise ConfigError(f"sliding_window {self.sliding_window} and disable_sliding_window: give one of them")
        if self.full_attention_interval is not None and self.full_attention_interval < 0:
            raise ConfigError(f"full_attention_interval must be >= 0, got {self.full_attention_interval}")
        if self.prefix_cache_retention_interval is not None and self.prefix_cache_retention_interval < 0:
            raise ConfigError(f"prefix_cache_retention_interval must be >= 0 or null, got {self.prefix_cache_retention_interval}")

    @property
    def overridden(self) -> bool:
        return (self.sliding_window is not None or self.full_attention_interval is not None
                or self.attention_chunk_size is not None or self.prefix_cache_retention_interval != 0)


SPEC_METHODS = ("ngram", "suffix", "eagle", "eagle3", "mtp", "draft_model", "dflash")
SUFFIX_MAX_TREE_DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth: suffix decoding's default K
_HOST_PROPOSERS = ("ngram", "suffix")  # drafts proposed on the host, from tokens alone: no draft network


def num_speculative_tokens_in_force(method: str | None, k: int) -> int:
    """K as given, or where it is not (0), vLLM's default if the method has one: suffix decoding's
    tree depth ("Defaulted num_speculative_tokens to 24 for suffix decoding.")."""
    return SUFFIX_MAX_TREE_DEPTH if method == "suffix" and k == 0 else k

DFLASH_DEFAULT_LAYERS = 5  # (the published DFlash drafters': five target-shaped layers)
_EAGLE_FAMILY = ("eagle", "eagle3", "mtp")
_PARALLEL_DRAFTING = ("eagle", "eagle3", "draft_model")  # (P-EAGLE, PARD; vLLM's MTP modules draft in turn)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config), as the scheduler and the KV cache see
    it: each decode step verifies up to `num_speculative_tokens` draft tokens and keeps the
    accepted ones (core/spec_decode.py). Which drafts are accepted is drawn per request and
    output position from the acceptance rates and the replay's seed."""

    speculative_method: str | None = None  # ngram, suffix, eagle, eagle3, mtp, draft_model, dflash; None: off
    # K; suffix decoding takes it as the most drafts of a proposal [default: 24 with suffix]
    num_speculative_tokens: int = 0
    # P(draft i accepted | drafts before it accepted), the same at every position ...
    spec_acceptance_rate: float = 0.7
    # ... or vLLM's "Per-position acceptance rate" figures (P(draft i accepted)), comma-separated
    # (vLLM's synthetic_acceptance_rates) ...
    spec_position_acceptance_rates: str | None = None
    # ... or a mean acceptance length (1 + accepted drafts per verifying step), spread over the
    # positions as vLLM's synthetic rejection sampler does (synthetic_acceptance_length)
    spec_acceptance_length: float | None = None
    spec_draft_model: str | None = None  # draft_model: its model spec; eagle family: one target layer
    # Dynamic speculation (vLLM's num_speculative_tokens_per_batch_size): "1-16:5,17-64:3,65-256:1",
    # drafts proposed after a step of that many scheduled requests (at most num_speculative_tokens)
    spec_tokens_per_batch_size: str | None = None
    spec_draft_pass_overhead_ms: float = 0.1  # launch overhead of each draft forward pass
    spec_ngram_us_per_request: float = 5.0  # ngram, suffix: host time to propose for one request
    # ngram, suffix: P(the prompt lookup or the suffix tree finds a match) after a step in which a
    # request sampled, drawn per request and output position; without one a host proposer (suffix,
    # ngram on vLLM's V1 model runner) proposes no drafts and the request's next step decodes one
    # token, while V2's device n-gram drafts K that are all rejected (1.0: always a match)
    spec_ngram_match_rate: float = 1.0
    # suffix: the mean drafts of a proposal (vLLM's num_draft_tokens / num_drafts); each proposal's
    # length is drawn per request and output position from a geometric distribution cut at K
    # with this mean (suffix decoding proposes as far as its tree is confident) [required]
    spec_mean_draft_tokens: float | None = None
    spec_seed: int = 0  # seed of the acceptance draws
    # vLLM's parallel_drafting (P-EAGLE, PARD: a drafter trained for it): the K drafts come from one
    # pass of the draft network, each request taking K - 1 (EAGLE) or K (draft model) more batch slots
    spec_parallel_drafting: bool = False
    # dflash (block diffusion: all K drafts from one pass of K + 1 queries per request over the
    # drafter's own KV of the context, built from the target's hidden states): the drafter's
    # target-shaped decoder layers, unless spec_draft_model gives its config [default: 5]
    spec_draft_layers: int | None = None
    # mtp: the MTP modules the checkpoint ships (vLLM reads num_nextn_predict_layers from the model's
    # config) [default: the model spec's, else 1]. With more than one and K > 1, vLLM's multi-module
    # MTP: draft i comes from module i, every module runs over the step's tokens, and prefill
    # chunks keep K tokens of runway (EngineConfig.num_prefill_lookahead)
    spec_mtp_modules: int | None = None

    def __post_init__(self) -> None:
        method, k = self.speculative_method, self.num_speculative_tokens
        if method is None:
            if k:
                raise ConfigError(f"num_speculative_tokens={k} needs a speculative_method "
                                  f"({', '.join(SPEC_METHODS)})")
            if self.spec_parallel_drafting:
                raise ConfigError("spec_parallel_drafting needs a speculative_method (eagle, eagle3 or draft_model)")
            return
        if method not in SPEC_METHODS:
            raise ConfigError(f"speculative_method must be one of {', '.join(SPEC_METHODS)}; got '{method}'")
        k = num_speculative_tokens_in_force(method, k)
        object.__setattr__(self, "num_speculative_tokens", k)
        if k < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1 with speculative_method '{method}', got {k}")
        if not 0.0 <= self.spec_acceptance_rate <= 1.0:
            raise ConfigError(f"spec_acceptance_rate must be in [0, 1], got {self.spec_acceptance_rate}")
        self.conditional_acceptance_rates  # raises on a bad list
        self.batch_size_ranges  # raises on a bad schedule
        if method == "draft_model" and self.spec_draft_model is None:
            raise ConfigError("speculative_method 'draft_model' needs spec_draft_model (a model name, "
                              "e.g. llama-3.2-1b)")
        if self.spec_draft_model is not None:
            get_model_spec(self.spec_draft_model)
        if self.spec_draft_pass_overhead_ms < 0 or self.spec_ngram_us_per_request < 0:
            raise ConfigError("spec_draft_pass_overhead_ms and spec_ngram_us_per_request must be >= 0")
        if not 0.0 <= self.spec_ngram_match_rate <= 1.0:
            raise ConfigError(f"spec_ngram_match_rate must be in [0, 1], got {self.spec_ngram_match_rate}")
        if self.spec_draft_layers is not None:
            if method != "dflash":
                raise ConfigError(f"spec_draft_layers is the dflash drafter's, not '{method}''s")
            if self.spec_draft_layers < 1:
                raise ConfigError(f"spec_draft_layers must be >= 1, got {self.spec_draft_layers}")
            if self.spec_draft_model is not None:
                raise ConfigError("spec_draft_layers or spec_draft_model: the drafter's config gives its layers")
        if self.spec_mtp_modules is not None:
            if method != "mtp":
                raise ConfigError(f"spec_mtp_modules is the mtp method's (the checkpoint's MTP modules), not '{method}''s")
            if self.spec_mtp_modules < 1:
                raise ConfigError(f"spec_mtp_modules must be >= 1, got {self.spec_mtp_modules}")
        if self.spec_parallel_drafting and method not in _PARALLEL_DRAFTING:
            raise ConfigError(f"spec_parallel_drafting: vLLM drafts in parallel with the EAGLE and draft-model "
                              f"methods ({', '.join(_PARALLEL_DRAFTING)}), not '{method}'")
        if self.spec_ngram_match_rate != 1.0 and not self.proposes_on_host:
            raise ConfigError(f"spec_ngram_match_rate is the n-gram and suffix proposers' (speculative_method 'ngram' "
                              f"or 'suffix'), not '{method}''s: a drafter network always proposes")
        if method == "suffix":
            if self.spec_mean_draft_tokens is None:
                raise ConfigError("speculative_method 'suffix' needs spec_mean_draft_tokens: how many drafts a proposal "
                                  "has on average (vLLM's spec-decode metrics: num_draft_tokens / num_drafts)")
            if not 1.0 <= self.spec_mean_draft_tokens <= k:
                raise ConfigError(f"spec_mean_draft_tokens must be in [1, {k}] (num_speculative_tokens), "
                                  f"got {self.spec_mean_draft_tokens}")
            if self.spec_tokens_per_batch_size is not None:  # (vLLM's suffix proposer asserts K is its own)
                raise ConfigError("spec_tokens_per_batch_size is not supported with suffix decoding (its proposer "
                                  "takes num_speculative_tokens as its cap)")
        elif self.spec_mean_draft_tokens is not None:
            raise ConfigError(f"spec_mean_draft_tokens is suffix decoding's (speculative_method 'suffix'), not "
                              f"'{method}''s: it proposes num_speculative_tokens drafts")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the scheduled tokens for the drafter's own forward passes (vLLM's
        VllmConfig.num_lookahead_tokens): methods with a draft network reserve K, dflash K + 1
        (its query block: the bonus token's and the K drafts')."""
        if self.speculative_method == "dflash":
            return self.num_speculative_tokens + 1
        if self.speculative_method in _EAGLE_FAMILY or self.speculative_method == "draft_model":
            return self.num_speculative_tokens
        return 0

    @property
    def draft_slots(self) -> int:
        """Extra batch slots each scheduled request takes for drafting (vLLM's
        max_num_new_slots_for_drafting): a separate draft model's first pass keeps one more
        token; drafting in parallel, a draft model's K query positions are all new, an EAGLE
        head's K - 1 masked ones (the first reuses the request's own row)."""
        draft_model = self.speculative_method == "draft_model"
        if self.spec_parallel_drafting:
            return self.num_speculative_tokens - (0 if draft_model else 1)
        return 1 if draft_model else 0

    def draft_spec(self, target: ModelSpec) -> ModelSpec | None:
        """The draft network's shape: the draft model's, or for the EAGLE family one decoder
        layer shaped like the target's expert layers (with the LM head), attending the whole context, with
        the dense MLP of the published heads where a mixture of experts has one
        (`eagle_head_intermediate_size`), for dflash `spec_draft_layers` such layers; None for ngram."""
        if self.spec_draft_model is not None:
            return get_model_spec(self.spec_draft_model)
        if self.uses_target_hidden_states:
            n = self.num_draft_layers(target)
            what = f"{n} DFlash layers" if self.speculative_method == "dflash" else \
                f"{n} MTP modules" if n > 1 else "1 draft layer"
            layer = dataclasses.replace(target, name=f"{target.name} ({what})", num_layers=n,
                                        sliding_window=0, full_attention_interval=0, num_dense_layers=0,
                                        linear_attention="", layer_pattern="")  # (Qwen3-Next's MTP layer attends)
            if target.eagle_head_intermediate_size:
                dense = f"{n} dense DFlash layers" if self.speculative_method == "dflash" else "1 dense draft layer"
                layer = dataclasses.replace(layer, name=f"{target.name} ({dense})",
                                            intermediate_size=target.eagle_head_intermediate_size,
                                            num_experts=0, num_experts_per_tok=0, expert_weight_bytes=2.0,
                                            shared_expert_intermediate_size=0)
            return layer
        return None

    @property
    def proposes_on_host(self) -> bool:
        """The drafts come from a lookup on the host (ngram, suffix), not from a draft network."""
        return self.speculative_method in _HOST_PROPOSERS

    @property
    def is_eagle_family(self) -> bool:
        return self.speculative_method in _EAGLE_FAMILY

    @property
    def uses_target_hidden_states(self) -> bool:
        """The drafter reads the target's hidden states and shares its embedding and LM head
        (vLLM's use_eagle(): the EAGLE family and dflash)."""
        return self.is_eagle_family or self.speculative_method == "dflash"

    def num_draft_layers(self, target: ModelSpec) -> int:
        """Decoder layers of a drafter built from the target's shape: one for EAGLE heads, the MTP
        modules for mtp, `spec_draft_layers` for dflash."""
        if self.speculative_method == "dflash":
            return self.spec_draft_layers or DFLASH_DEFAULT_LAYERS
        if self.speculative_method == "mtp":
            return self.mtp_modules(target)
        return 1

    def mtp_modules(self, target: ModelSpec) -> int:
        """The MTP modules loaded (vLLM's n_predict: the checkpoint's num_nextn_predict_layers)."""
        return self.spec_mtp_modules or target.num_nextn_predict_layers or 1

    def multi_module_mtp(self, target: ModelSpec) -> bool:
        """vLLM's use_multi_module_mtp: more than one module and more than one draft, so that
        draft i comes from module i (module i mod n) rather than one module applied K times."""
        return (self.speculative_method == "mtp"
                and min(self.mtp_modules(target), self.num_speculative_tokens) > 1)

    def dflash_fc_params(self, target: ModelSpec, draft: ModelSpec) -> int:
        """dflash: the projection of the target's hidden states at as many tapped layers as the
        drafter has layers (the upstream default) to the drafter's width, whole on every GPU
        (vLLM's ReplicatedLinear); 0 for other methods."""
        if self.speculative_method != "dflash":
            return 0
        return draft.num_layers * target.hidden_size * draft.hidden_size

    @property
    def batch_size_ranges(self) -> tuple[tuple[int, int, int], ...] | None:
        """spec_tokens_per_batch_size as sorted (first, last, drafts) ranges, vLLM's checks."""
        text = self.spec_tokens_per_batch_size
        if text is None:
            return None
        where = f"spec_tokens_per_batch_size '{text}'"
        ranges = []
        for part in str(text).split(","):
            span, sep, k = part.partition(":")
            first, dash, last = span.partition("-")
            try:
                entry = (int(first), int(last) if dash else int(first), int(k))
            except ValueError:
                raise ConfigError(f"{where}: expected FIRST-LAST:K entries, e.g. 1-16:5,17-256:2") from None
            if not sep or entry[0] <= 0 or entry[1] < entry[0] or entry[2] < 0:
                raise ConfigError(f"{where}: '{part}' must be FIRST-LAST:K with 1 <= FIRST <= LAST and K >= 0")
            ranges.append(entry)
        ranges.sort()
        if ranges[0][0] != 1:
            raise ConfigError(f"{where}: the first batch-size range must start at 1")
        if any(b[0] <= a[1] for a, b in zip(ranges, ranges[1:])):
            raise ConfigError(f"{where}: batch-size ranges must not overlap")
        return tuple(ranges)

    def drafts_for_batch(self, num_scheduled: int) -> int:
        """Drafts proposed after a step that scheduled `num_scheduled` requests: K, or under
        dynamic speculation the K of the last range starting at or below it (vLLM's dense
        lookup carries a range's K over the gap after it), at most num_speculative_tokens."""
        ranges = self.batch_size_ranges
        if ranges is None:
            return self.num_speculative_tokens
        k = ranges[0][2]
        for first, _, drafts in ranges:
            if first > num_scheduled:
                break
            k = drafts
        return min(k, self.num_speculative_tokens)

    @property
    def conditional_acceptance_rates(self) -> tuple[float, ...]:
        """P(draft i accepted | drafts 0..i-1 accepted), one per draft position."""
        k = self.num_speculative_tokens
        text = self.spec_position_acceptance_rates
        length = self.spec_acceptance_length
        if length is not None:
            if text is not None:
                raise ConfigError("spec_acceptance_length or spec_position_acceptance_rates, not both")
            if not 1.0 <= length <= k + 1:
                raise ConfigError(f"spec_acceptance_length must be in [1, {k + 1}] (1 + num_speculative_tokens), "
                                  f"got {length}")
            text = ",".join(repr(r) for r in acceptance_length_rates(length, k))
        if text is None:
            return (self.spec_acceptance_rate,) * k
        try:
            rates = [float(x) for x in str(text).split(",")]
        except ValueError:
            raise ConfigError(f"spec_position_acceptance_rates must be comma-separated numbers, got '{text}'") from None
        if len(rates) != k:
            raise ConfigError(f"spec_position_acceptance_rates has {len(rates)} rates; num_speculative_tokens is {k}")
        if any(not 0.0 <= r <= 1.0 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
            raise ConfigError(f"spec_position_acceptance_rates must be in [0, 1] and non-increasing "
                              f"(draft i is accepted only after draft i-1), got '{text}'")
        out, before = [], 1.0
        for r in rates:
            out.append(r / before if before > 0 else 0.0)
            before = r
        return tuple(out)


def acceptance_length_rates(length: float, k: int) -> list[float]:
    """Per-position (unconditional) acceptance rates of a mean acceptance length, as vLLM's
    synthetic rejection sampler spreads it (the minimum-variance schedule): the first
    floor(length - 1) drafts always accepted, the next with the fraction left, none after."""
    drafts = length - 1
    full = int(drafts)
    return ([1.0] * full + [drafts - full] + [0.0] * (k - full - 1))[:k]


SPARSE_BLOCK_MULTIPLE = 64  # DeepSeek sparse attention's kernels: blocks of a multiple of 64 tokens


@dataclass(frozen=True, slots=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        auto_fit = self.scheduler.max_model_len == -1  # (vLLM checks everything with the model's length first)
        if auto_fit:
            object.__setattr__(self, "scheduler", dataclasses.replace(self.scheduler, max_model_len=None))
        sc = self.scheduler
        if sc.max_num_seqs is None or sc.max_num_batched_tokens is None:  # (the defaults, on this GPU)
            if sc.vllm_batch_defaults:
                tokens, seqs = vllm_batch_defaults(self.hardware.gpu, self.max_model_len, sc.enable_chunked_prefill,
                                                   sc.max_num_seqs, sc.max_num_batched_tokens, sc.performance_mode,
                                                   self.hardware.batched_dp_moe)
            else:
                scale = PERFORMANCE_MODE_BATCH_SCALE[sc.performance_mode]
                tokens, seqs = (sc.max_num_batched_tokens or FIXED_BATCH_DEFAULTS[0] * scale,
                                sc.max_num_seqs or FIXED_BATCH_DEFAULTS[1] * scale)
            defaulted = tuple(name for name in ("max_num_seqs", "max_num_batched_tokens") if getattr(sc, name) is None)
            object.__setattr__(self, "scheduler", dataclasses.replace(
                sc, max_num_seqs=seqs, max_num_batched_tokens=tokens, defaulted_batch_options=defaulted))
        self.scheduler.verify_max_model_len(self.max_model_len)
        window, given = self._disabled_window, self.scheduler.max_model_len
        if window and given is not None and given > window < get_model_spec(self.hardware.model).max_position_embeddings:
            raise ConfigError(f"User-specified max_model_len ({given}) is greater than the derived max_model_len "
                              f"(sliding_window={window}: --disable-sliding-window caps it at the model's window)")
        if self.scheduler.disable_chunked_mm_input:
            self._verify_unchunked_mm_input()
        if self.scheduler.prefill_schedule_interval > 1:
            self._verify_prefill_interval()
        self._verify_model_runner()
        if self.speculative.enabled:
            self._verify_speculative()
        if self.hardware.data_parallel_size > 1:
            self._verify_data_parallel()
        if self.hardware.decode_context_parallel_size > 1:
            self._verify_decode_context_parallel()
        if self.hardware.prefill_context_parallel_size > 1:
            self._verify_prefill_context_parallel()
        if self.hardware.use_ubatching:
            self._verify_dual_batch_overlap()
        if self.hardware.pipeline_parallel_size > 1:
            self._verify_pipeline_parallel()
        if self.has_sliding_window:
            self._verify_sliding_window()
        elif self.attention.prefix_cache_retention_interval not in (0, None):
            self._verify_retention()
        if self.has_linear_attention:
            self._verify_linear_attention()
        if self.hardware.model_spec().is_sparse:
            self._verify_sparse_attention()
        if self.cache.kv_cache_dtype in PER_TOKEN_HEAD_KV_DTYPES and self.hardware.model_spec().is_mla:
            raise ConfigError(f"kv_cache_dtype {self.cache.kv_cache_dtype}: vLLM runs per-token-head KV quantization on "
                              f"its Triton attention backend, which has no latent attention ({self.hardware.model})")
        if self.cache.prefix_match_unit is not None:
            self._verify_prefix_match_unit()
        if self.cache.kv_cache_dtype in ROCM_PACKED_KV_DTYPES:
            self._verify_rocm_packed_kv()
        if self.cache.kv_cache_dtype in DS_MLA_KV_DTYPES:
            self._verify_ds_mla_kv()
        if self.cache.kv_skip_layer_names or self.cache.kv_cache_dtype in BOUNDARY_SKIP_KV_DTYPES:
            self._verify_kv_skip_layers()
        if self.cache.kv_cache_dtype in NVFP4_KV_DTYPES:
            self._verify_nvfp4_kv()
        for name in ("cpu_offload_params", "offload_params"):
            if getattr(self.cache, name) and not self.hardware.model_spec().is_moe:
                raise ConfigError(f"{name} {getattr(self.cache, name)}: {self.hardware.model} has no routed experts, "
                                  "so no parameter matches and vLLM would offload nothing")
        if self.cache.kv_offloading_size is not None:
            self._verify_kv_offloading()
        elif any(getattr(self.cache, f.name) != f.default for f in fields(CacheConfig)
                 if f.name.startswith("kv_offloading_") and f.name != "kv_offloading_size"):
            raise ConfigError("kv_offloading_block_size, kv_offloading_prompt_only, kv_offloading_policy, "
                              "kv_offloading_store_threshold and kv_offloading_max_tracker_size set KV "
                              "offloading's CPU tier: they need kv_offloading_size")
        if auto_fit:
            self._auto_fit_max_model_len()

    def _auto_fit_max_model_len(self) -> None:
        """vLLM's --max-model-len auto (-1): the longest request whose blocks the KV cache holds,
        if shorter than the model's length (_auto_fit_max_model_len)."""
        from simkv.capacity import compute_capacity, estimated_max_model_len

        fitted = estimated_max_model_len(self, compute_capacity(self, check_fit=False))
        if fitted <= 0:
            raise ConfigError("Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single "
                              "token. Try increasing `gpu_memory_utilization`.")
        object.__setattr__(self, "scheduler", dataclasses.replace(
            self.scheduler, max_model_len=min(fitted, self.max_model_len), max_model_len_fitted=True))

    def _verify_unchunked_mm_input(self) -> None:
        """vLLM's checks of disable_chunked_mm_input (compute_mm_encoder_budget, VllmConfig)."""
        sc = self.scheduler
        if sc.mm_max_tokens_per_item is not None and sc.mm_max_tokens_per_item > sc.max_num_batched_tokens:
            raise ConfigError(f"Chunked MM input disabled but max_tokens_per_mm_item ({sc.mm_max_tokens_per_item}) "
                              f"is larger than max_num_batched_tokens ({sc.max_num_batched_tokens}). Please "
                              "increase max_num_batched_tokens.")
        if self.mamba_align:
            raise ConfigError("Chunked MM input is required because we need the flexibility to schedule a multiple "
                              "of block_size tokens even if they are in the middle of a mm input "
                              "(disable_chunked_mm_input with a linear-attention model under prefix caching)")

    def _verify_prefill_interval(self) -> None:
        """vLLM's prefill cadence (core/scheduler.py) is modelled for vLLM v1's engine."""
        sc = self.scheduler
        unsupported = [(sc.parallel_sampling == "fork", "vLLM v0's forked parallel sampling"),
                       (sc.admission_order != "after_running", f"admission_order '{sc.admission_order}'"),
                       (sc.preemption_mode != "recompute", f"preemption_mode '{sc.preemption_mode}'")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"prefill_schedule_interval {sc.prefill_schedule_interval} is not modelled with "
                                  f"{what} yet")

    def _verify_kv_offloading(self) -> None:
        """KV offloading (core/kv_offload.py) is modelled for one full-attention KV-cache group
        (an EAGLE-family drafter's layer in it), for the groups of a model with sliding-window
        or chunked local layers (core/kv_offload_hybrid.py) and for those of a model with
        linear-attention layers (core/kv_offload_mamba.py), with vLLM's policies."""
        cache, sched, groups = self.cache, self.scheduler, self.kv_cache_groups
        windows = groups.has_sliding_window
        unsupported = [(not cache.enable_prefix_caching, "prefix caching off"),
                       (cache.allocator != "paged", f"allocator '{cache.allocator}'"),
                       (cache.prefix_caching_hash_bits < 63, "prefix_caching_hash_bits < 63"),
                       (cache.num_lookahead_tokens > 0, "num_lookahead_tokens"),
                       (sched.preemption_mode != "recompute", f"preemption_mode '{sched.preemption_mode}'"),
                       (sched.admission_order != "after_running", f"admission_order '{sched.admission_order}'"),
                       (sched.preemption_victim != "newest", f"preemption_victim '{sched.preemption_victim}'")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"kv_offloading_size (KV offloading to CPU) is not modelled with {what} yet")
        # (decode context parallelism: a chunk is the manager's blocks, each GPU its share of their tokens)
        manager_bs, tpc = self.kv_manager_block_size, cache.kv_offloading_block_size
        if tpc is not None and tpc % manager_bs:
            raise ConfigError(f"kv_offloading_block_size {tpc} must be a multiple of the KV-cache manager's block "
                              f"({manager_bs} tokens: block_size {cache.block_size} x decode_context_parallel_size "
                              f"{self.hardware.decode_context_parallel_size}; use {-(-tpc // manager_bs) * manager_bs})")
        retention = self.attention.prefix_cache_retention_interval
        tokens_per_chunk = cache.offload_blocks_per_chunk * cache.block_size
        if (windows or self.has_linear_attention) and retention and retention % tokens_per_chunk:  # (vLLM's text)
            raise ConfigError(f"prefix_cache_retention_interval ({retention}) must be a multiple of tokens_per_chunk "
                              f"({tokens_per_chunk}).")

    @property
    def layer_windows(self) -> list[int]:
        """Each layer's attention window (0: the whole context); under chunked local attention
        each local layer's chunk size (`attention_chunk_size`)."""
        a = self.attention
        spec = get_model_spec(self.hardware.model)
        if self.attention_chunk_size:
            window = self.attention_chunk_size
        elif a.sliding_window is not None or spec.attention_chunk_size or a.disable_sliding_window:  # (an override, or chunking off)
            window = a.sliding_window or 0
        else:
            window = None  # the model's sliding windows
        return spec.layer_windows(window, a.full_attention_interval)

    @property
    def attention_chunk_size(self) -> int:
        """The local layers' chunk under chunked local attention (Llama 4), 0 without (a
        sliding_window override makes them slide instead)."""
        a = self.attention
        if a.sliding_window is not None:
            return 0
        return get_model_spec(self.hardware.model).attention_chunk_size if a.attention_chunk_size is None \
            else a.attention_chunk_size

    @property
    def draft_network(self) -> ModelSpec | None:
        """The draft network as served (SpeculativeConfig.draft_spec; None for ngram): MTP layers
        come with the target's checkpoint and take its --quantization, as vLLM aligns them; EAGLE
        heads and draft models are checkpoints of their own, loaded as they are."""
        hw = self.hardware
        target = hw.model_spec() if self.speculative.speculative_method == "mtp" else get_model_spec(hw.model)
        return self.speculative.draft_spec(target)

    @property
    def has_sliding_window(self) -> bool:
        """Some layers attend only a window: a sliding one, or their attention chunk."""
        return any(self.layer_windows)

    @property
    def has_linear_attention(self) -> bool:
        """Some layers are linear attention (Gated DeltaNet, Mamba2): a state per request, no K/V."""
        return bool(get_model_spec(self.hardware.model).linear_attention)

    @property
    def linear_state_bytes(self) -> int:
        """One linear-attention layer's state for one request on one GPU, as served (its draft
        tokens' convolution inputs included; ModelSpec.linear_state_bytes)."""
        hw = self.hardware
        return hw.model_spec().linear_state_bytes(hw.tensor_parallel_size, self.speculative.num_speculative_tokens)

    @property
    def state_blocks_per_group(self) -> int:
        """Blocks a request holds at most in each linear-attention group (vLLM's
        MambaSpec.max_memory_usage_bytes): without prefix caching its state, and under speculative
        decoding one per draft token (num_speculative_blocks); with prefix caching (mamba_cache_mode
        'align') two states (the step after a block boundary), and a prefill checkpoint's where the
        kernels export one."""
        if self.mamba_align:
            return 2 + self.speculative.num_speculative_tokens + int(self.mamba_prefill_checkpoints)
        return 1 + self.speculative.num_speculative_tokens

    @property
    def state_blocks_per_request(self) -> int:
        """`state_blocks_per_group` over all the linear-attention groups."""
        return self.kv_cache_groups.num_linear_groups * self.state_blocks_per_group

    @property
    def mamba_align(self) -> bool:
        """vLLM's mamba_cache_mode 'align', which it picks for a model with linear-attention layers
        when prefix caching is on (core/mamba_align.py); 'none' otherwise."""
        return self.cache.enable_prefix_caching and self.has_linear_attention

    @property
    def mamba_prefill_checkpoints(self) -> bool:
        """Whether the linear-attention kernels export a state from inside a prefill chunk (vLLM's
        num_prefill_checkpoint_blocks 1): Mamba2's always, Gated DeltaNet's on FlashInfer's prefill."""
        spec = self.hardware.model_spec()
        if spec.linear_attention != "gated_deltanet":
            return bool(spec.linear_attention)
        return gdn_prefill_backend(self.attention.gdn_prefill_backend, get_gpu_spec(self.hardware.gpu), spec) == "flashinfer"

    @property
    def kv_cache_layer_windows(self) -> list[int]:
        """The windows of every layer that holds KV: the model's, then the draft network's. An
        EAGLE-family draft layer attends the whole context (the published EAGLE heads of
        sliding-window models, e.g. gpt-oss's, are Llama layers without a window); vLLM buckets
        it with the target's full-attention layers. Linear-attention layers: LINEAR_ATTENTION."""
        from simkv.core.kv_cache_groups import LINEAR_ATTENTION

        windows = self.layer_windows
        spec = get_model_spec(self.hardware.model)
        if spec.layer_pattern:  # (only its M and * layers hold a cache)
            windows = [LINEAR_ATTENTION if c == "M" else 0 for c in spec.layer_pattern if c in "M*"]
        elif spec.linear_attention:
            linear = spec.linear_attention_layers()
            windows = [LINEAR_ATTENTION if lin else w for w, lin in zip(windows, linear, strict=True)]
        if self.speculative.enabled and self.speculative.uses_target_hidden_states:
            windows = windows + [0] * self.speculative.num_draft_layers(spec)
        return windows

    @property
    def kv_cache_groups(self):
        """The KV-cache groups vLLM forms for the model and its draft layers (core/kv_cache_groups.py)."""
        from simkv.core.kv_cache_groups import group_layers

        # (vLLM turns its hybrid manager off for chunked local attention with an EAGLE drafter)
        disable = self.attention.disable_hybrid_kv_cache_manager or bool(
            self.attention_chunk_size and self.speculative.enabled and self.speculative.is_eagle_family)
        return group_layers(self.kv_cache_layer_windows, disable, chunked=bool(self.attention_chunk_size))

    def _verify_sliding_window(self) -> None:
        cache, sched = self.cache, self.scheduler
        unsupported = [(self.speculative.speculative_method == "draft_model",
                        "speculative_method 'draft_model' (ngram and the EAGLE family are modelled)"),
                       (sched.preemption_mode != "recompute", f"preemption_mode '{sched.preemption_mode}'"),
                       (sched.admission_order != "after_running", f"admission_order '{sched.admission_order}'"),
                       (sched.preemption_victim != "newest", f"preemption_victim '{sched.preemption_victim}'"),
                       (cache.num_lookahead_tokens > 0, "num_lookahead_tokens"),
                       (cache.allocator != "paged", f"allocator '{cache.allocator}'")]
        if self.kv_cache_groups.has_sliding_window:
            unsupported += [(cache.enable_prefix_caching and cache.prefix_caching_hash_bits < 63,
                             "prefix_caching_hash_bits < 63"),
                            (not cache.reserve_null_block, "reserve_null_block off (freed window blocks point at it)")]
        if self.attention_chunk_size:
            unsupported += [(all(self.layer_windows), "every layer local (no full_attention_interval)")]
        for bad, what in unsupported:
            if bad:
                kind = "chunked local attention" if self.attention_chunk_size else "sliding-window attention"
                raise ConfigError(f"{kind} (model {self.hardware.model}) is not modelled with {what}")
        self._verify_retention()

    def _verify_linear_attention(self) -> None:
        cache, sched, hw = self.cache, self.scheduler, self.hardware
        where = f"linear attention (model {hw.model})"
        if self.mamba_align:
            if not sched.enable_chunked_prefill:  # (vLLM asserts it, with this text)
                raise ConfigError("Chunked prefill is required for Mamba prefix caching.")
            align = f"{where} with prefix caching (vLLM's mamba_cache_mode 'align')"
            if cache.prefix_caching_hash_bits < 63:
                raise ConfigError(f"{align} is not modelled with prefix_caching_hash_bits < 63 yet; pass "
                                  "--no-enable-prefix-caching (vLLM's mamba_cache_mode 'none': one state per request)")
        if hw.decode_context_parallel_size > 1:  # (vLLM asserts it)
            raise ConfigError("DCP not support mamba now.")
        method = self.speculative.speculative_method
        unsupported = [(method not in (None, "ngram", "suffix", "mtp"), f"speculative_method '{method}' (ngram, suffix and mtp are)"),
                       (self.attention.overridden and self.attention.prefix_cache_retention_interval == 0
                        or self.attention.sliding_window is not None or self.attention.full_attention_interval is not None
                        or self.attention.attention_chunk_size is not None,
                        "sliding-window or chunked-attention overrides"),
                       (self.attention.disable_hybrid_kv_cache_manager,
                        "disable_hybrid_kv_cache_manager (its layers need their own KV-cache groups)"),
                       (sched.preemption_mode != "recompute", f"preemption_mode '{sched.preemption_mode}'"),
                       (sched.admission_order != "after_running", f"admission_order '{sched.admission_order}'"),
                       (sched.preemption_victim != "newest", f"preemption_victim '{sched.preemption_victim}'"),
                       (cache.num_lookahead_tokens > 0, "num_lookahead_tokens"),
                       (cache.allocator != "paged", f"allocator '{cache.allocator}'"),
                       (not cache.reserve_null_block, "reserve_null_block off")]
        groups = self.kv_cache_groups
        unsupported.append((len(groups.groups) - groups.num_linear_groups > 1,
                            "its attention layers in more than one KV-cache group"))
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"{where} is not modelled with {what}")
        need = linear_attention_block_size(hw.model_spec(), hw.tensor_parallel_size, cache.kv_element,
                                           cache.block_size, self.speculative.num_speculative_tokens,
                                           self._checkpoint_alignment())
        if cache.block_size < need:
            raise ConfigError(f"{where}: block_size {cache.block_size} gives an attention page smaller than a "
                              f"linear-attention layer's state; vLLM raises it to {need} tokens (as "
                              "EngineConfig.from_flat does)")

    def _checkpoint_alignment(self) -> int:
        """Tokens vLLM aligns a linear-attention model's blocks to for the kernels' prefill
        checkpoints: FlashInfer's Gated DeltaNet prefill's 64 under prefix caching, else 1."""
        return _FLASHINFER_GDN_CHECKPOINT_ALIGNMENT if self.mamba_align and self.mamba_prefill_checkpoints \
            and self.hardware.model_spec().linear_attention == "gated_deltanet" else 1

    def _verify_retention(self) -> None:
        """vLLM's checks of prefix_cache_retention_interval, with its texts."""
        interval = self.attention.prefix_cache_retention_interval
        if interval == 0 or interval is None:
            return
        groups = self.kv_cache_groups
        if (not groups.has_sliding_window or groups.chunked) and not groups.num_linear_groups:
            raise ConfigError("prefix_cache_retention_interval is set but this model has no sliding-window or Mamba "
                              "KV cache group, so retention has no effect. Set it to 0 (it only applies to "
                              "sliding-window and Mamba attention).")
        if interval % self.cache.block_size:
            raise ConfigError(f"prefix_cache_retention_interval ({interval}) must be non-negative and a multiple of "
                              f"scheduler_block_size ({self.cache.block_size}).")

    def _verify_sparse_attention(self) -> None:
        """DeepSeek sparse attention (backends/roofline.py prices it): vLLM 0.33 runs it on Hopper
        and Blackwell (FlashMLA sparse and its kin) with blocks of a multiple of 64 tokens."""
        hw, bs = self.hardware, self.cache.block_size
        where = f"model {hw.model}: DeepSeek sparse attention (index_topk)"
        if bs % SPARSE_BLOCK_MULTIPLE:
            raise ConfigError(f"{where} runs on kernels that take blocks of a multiple of {SPARSE_BLOCK_MULTIPLE} "
                              f"tokens: block_size {bs} (leave it out: simkv picks {SPARSE_BLOCK_MULTIPLE}, as vLLM does)")
        gpu = get_gpu_spec(hw.gpu)
        if gpu.platform == "cuda" and gpu.cuda_major < 9:
            raise ConfigError(f"{where}: vLLM has no sparse MLA backend for {gpu.name} (compute capability "
                              f"{gpu.compute_capability}; Hopper or Blackwell needed)")
        if sparse_mla_layout(gpu, self.cache.kv_cache_dtype) is None:
            raise ConfigError(f"{where}: no sparse MLA backend of vLLM's takes kv_cache_dtype "
                              f"{self.cache.kv_cache_dtype} on {gpu.name}"
                              + (" (its SM120 kernels store fp8_ds_mla: use auto or fp8)" if gpu.cuda_major == 12 else ""))
        unsupported = [(hw.decode_context_parallel_size > 1, "decode_context_parallel_size > 1"),
                       (self.cache.allocator != "paged", f"allocator '{self.cache.allocator}'")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"{where} is not modelled with {what} yet")

    def _verify_data_parallel(self) -> None:
        unsupported = [(self.scheduler.preemption_mode != "recompute", f"preemption_mode '{self.scheduler.preemption_mode}'"),
                       (self.cache.allocator != "paged", f"allocator '{self.cache.allocator}'")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"data_parallel_size > 1 is not modelled with {what}")

    def _verify_pipeline_parallel(self) -> None:
        """Pipeline parallelism (core/scheduler.py, replay/pipeline.py) is modelled for vLLM v1's
        engine, with speculative decoding under async scheduling (where the drafts stay on the
        device)."""
        sched, cache = self.scheduler, self.cache
        unsupported = [(self.speculative.enabled and not sched.async_scheduling,
                        "speculative decoding without async scheduling"),
                       (sched.prefill_schedule_interval > 1, "prefill_schedule_interval > 1"),
                       (sched.parallel_sampling == "fork", "vLLM v0's forked parallel sampling"),
                       (sched.preemption_mode != "recompute", f"preemption_mode '{sched.preemption_mode}'"),
                       (sched.admission_order != "after_running", f"admission_order '{sched.admission_order}'"),
                       (sched.preemption_victim != "newest", f"preemption_victim '{sched.preemption_victim}'"),
                       (sched.max_num_admissions_per_step is not None, "max_num_admissions_per_step"),
                       (cache.allocator != "paged", f"allocator '{cache.allocator}'"),
                       (cache.num_lookahead_tokens > 0, "num_lookahead_tokens")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"pipeline_parallel_size > 1 is not modelled with {what} yet")

    def _verify_decode_context_parallel(self) -> None:
        if self.has_sliding_window:  # (vLLM asserts it)
            raise ConfigError("DCP not support chunked local attn now." if self.attention_chunk_size
                              else "DCP not support sliding window attn now.")
        unsupported = [(self.scheduler.preemption_mode != "recompute", f"preemption_mode '{self.scheduler.preemption_mode}'"),
                       (self.cache.allocator != "paged", f"allocator '{self.cache.allocator}'")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"decode_context_parallel_size > 1 is not modelled with {what}")

    def _verify_prefill_context_parallel(self) -> None:
        """vLLM 0.33 runs PCP on its V2 model runner (PCPManager.validate_config), with its texts;
        then what simkv does not model with it."""
        if self.model_runner_in_force == "v1":
            raise ConfigError("Model Runner V1 does not support: prefill context parallel")
        if self.scheduler.enable_lora:
            raise ConfigError("MRV2 PCP does not support LoRA yet.")
        if self.hardware.has_vision_encoder:
            raise ConfigError("MRV2 PCP does not support MM inputs yet.")
        spec = self.speculative
        if spec.enabled and (spec.speculative_method != "mtp"
                             or spec.multi_module_mtp(self.hardware.model_spec())):
            raise ConfigError("MRV2 PCP only supports DSpark or single-module MTP speculative decoding.")
        mode = self.scheduler.preemption_mode
        unsupported = [(spec.enabled and self.hardware.data_parallel_size > 1,
                        "MTP and data-parallel ranks together"),
                       (mode != "recompute", f"preemption_mode '{mode}'"),
                       (self.cache.allocator != "paged", f"allocator '{self.cache.allocator}'"),
                       (bool(self.cache.cpu_offload_gb or self.cache.offload_group_size),
                        "weights kept in host memory (--cpu-offload-gb, --offload-group-size)")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"prefill_context_parallel_size > 1 is not modelled with {what} yet")

    def _verify_kv_skip_layers(self) -> None:
        """kv_cache_dtype_skip_layers and TurboQuant (which skips its boundary layers): what simkv
        models of them (a model whose layers all attend the whole context, an fp8, TurboQuant or
        16-bit cache), and entries that match a layer."""
        spec = self.hardware.model_spec()
        entries = self.cache.kv_skip_layer_names
        dtype = self.cache.kv_cache_dtype
        what = "kv_cache_dtype_skip_layers" if dtype not in BOUNDARY_SKIP_KV_DTYPES else f"kv_cache_dtype {dtype}"
        unsupported = [(spec.is_mla, "latent attention"),
                       (self.has_sliding_window or bool(self.attention_chunk_size), "sliding-window or chunked "
                        "local attention layers"),
                       (self.has_linear_attention and bool(entries), "linear-attention layers"),
                       (dtype in PER_TOKEN_HEAD_KV_DTYPES or dtype in OCTAVE_KV_DTYPES, f"kv_cache_dtype {dtype}"),
                       # (an EAGLE head's layers come after the target's, vLLM's start_layer_id: never skipped)
                       (self.draft_network is not None and self.speculative.speculative_method not in ("eagle", "eagle3"),
                        "a drafter's layers (MTP, DFlash, a draft model)")]
        for bad, bad_what in unsupported:
            if bad:
                raise ConfigError(f"{what} is not modelled with {bad_what} yet")
        for entry in entries:
            if entry == "sliding_window" or int(entry) >= spec.num_layers:
                raise ConfigError(f"kv_cache_dtype_skip_layers: '{entry}' matches no layer of {self.hardware.model} "
                                  f"(its layers 0-{spec.num_layers - 1} all attend the whole context), so vLLM "
                                  "would skip nothing for it")

    def _verify_nvfp4_kv(self) -> None:
        """An NVFP4 KV cache as vLLM 0.33 runs it: on FlashInfer (CUDA only), whose FA2 path
        (Ampere, Ada, Hopper, consumer Blackwell) takes plain nvfp4 only, no 64-wide heads and no
        decode context parallelism, and trtllm-gen path (data-center Blackwell) both; not with
        latent attention. vLLM's words where it has them."""
        dtype, gpu, spec = self.cache.kv_cache_dtype, get_gpu_spec(self.hardware.gpu), self.hardware.model_spec()
        if spec.is_mla:
            raise ConfigError("nvfp4 KV cache is not supported with MLA (Multi-head Latent Attention) models")
        if gpu.platform != "cuda":
            raise ConfigError(f"kv_cache_dtype {dtype}: vLLM runs it on FlashInfer, which {self.hardware.gpu} "
                              f"({gpu.platform}) does not have")
        if gpu.cuda_major in (8, 9, 12):  # (FlashInfer's FA2 path)
            if dtype != "nvfp4":
                raise ConfigError(f"kv_cache_dtype {dtype}: on {self.hardware.gpu} vLLM writes NVFP4 through FlashInfer's "
                                  "FA2 path, whose slot-mapping writer has no scale search (use nvfp4)")
            if spec.head_dim == 64:
                raise ConfigError(f"kv_cache_dtype nvfp4 on {self.hardware.gpu}: fa2 prefill misreads an NVFP4 KV cache "
                                  f"at head_size 64 ({self.hardware.model})")
            if self.hardware.decode_context_parallel_size > 1:
                raise ConfigError("The DCP prefill wrapper cannot read NVFP4 block scales.")
        if self.cache.kv_skip_layer_names:  # (sliding-window layers: every group's page packed alike, one block size)
            raise ConfigError(f"kv_cache_dtype {dtype} is not modelled with kv_cache_dtype_skip_layers yet")

    def _verify_prefix_match_unit(self) -> None:
        """vLLM's --prefix-match-unit (resolve_scheduler_and_hash_block_size): with one KV-cache
        group and prefix caching, anything but the block is an error (vLLM's words); with several
        (sliding-window or linear-attention layers) a unit that divides the blocks sets how finely
        blocks are hashed, so hits may land inside a block, which simkv does not model: it takes
        the block itself. Without prefix caching nothing is hashed and it changes nothing."""
        unit, cache = self.cache.prefix_match_unit, self.cache
        block = self.kv_manager_block_size
        if not cache.enable_prefix_caching or (unit == block and not self.has_linear_attention):
            return
        if len(self.kv_cache_groups.groups) == 1:
            raise ConfigError(f"Invalid prefix_match_unit={unit}; with a single KV cache group, prefix-cache hits "
                              f"land on the block size ({block}). Unset it or set it to {block}.")
        if self.has_linear_attention:  # (it also aligns the states' checkpoints: vLLM's block size moves with it)
            raise ConfigError("prefix_match_unit is not modelled with linear-attention layers and prefix caching")
        if block % unit:
            sizes = [block] * len(self.kv_cache_groups.groups)
            raise ConfigError(f"Invalid prefix_match_unit={unit}; prefix-cacheable KV cache group block sizes must "
                              f"be divisible by prefix_match_unit. Got group block sizes={sizes}, "
                              f"prefix-cacheable={sizes}.")
        raise ConfigError(f"prefix_match_unit {unit} below the block size {block}: prefix-cache hits inside a block "
                          "are not modelled (leave it out, or set it to the block)")

    def _verify_rocm_packed_kv(self) -> None:
        """UltraQuant and Octave KV caches as vLLM 0.33 runs them: on ROCm only (its ULTRAQUANT and
        ROCM_OCTAVE backends), never with latent attention; Octave's kernels on CDNA3 (MI300X,
        MI325X) or RDNA3, at head_dim 256 with 64 rotary dims; UltraQuant's scale groups need a
        head_dim that is a multiple of 32. vLLM's words where it has them."""
        dtype, gpu, spec = self.cache.kv_cache_dtype, get_gpu_spec(self.hardware.gpu), self.hardware.model_spec()
        octave = dtype in OCTAVE_KV_DTYPES
        backend = "ROCM_OCTAVE" if octave else "ULTRAQUANT"
        if gpu.platform != "rocm":
            raise ConfigError(f"kv_cache_dtype {dtype}: vLLM runs it on its ROCm attention backend {backend}, which "
                              f"{self.hardware.gpu} ({gpu.platform}) does not have")
        if spec.is_mla:
            raise ConfigError(f"kv_cache_dtype {dtype}: vLLM's ROCm MLA backends do not take it, and {backend} has no "
                              f"latent attention ({self.hardware.model})")
        if octave:
            if gpu.compute_capability != 9.4 and int(gpu.compute_capability) != 11:  # (gfx942: CDNA3; gfx11: RDNA3)
                raise ConfigError(f"kv_cache_dtype {dtype} on {self.hardware.gpu}: ROCM_OCTAVE supports RDNA3 and CDNA3 "
                                  "only")
            if (spec.head_dim, spec.rotary_dim) != (OCTAVE_HEAD_DIM, OCTAVE_ROTARY_DIM):
                raise ConfigError(f"kv_cache_dtype {dtype}: ROCM_OCTAVE kernels need ROCm, head_size={OCTAVE_HEAD_DIM} "
                                  f"and {OCTAVE_ROTARY_DIM} rotary dims; got head_size={spec.head_dim}, rotary "
                                  f"dims={spec.rotary_dim} ({self.hardware.model})")
        elif spec.head_dim % ULTRAQUANT_GROUP:
            raise ConfigError(f"kv_cache_dtype {dtype}: head_dim={spec.head_dim} must be a multiple of "
                              f"group_size={ULTRAQUANT_GROUP} ({self.hardware.model})")
        if octave and (self.has_sliding_window or self.attention_chunk_size):
            raise ConfigError(f"kv_cache_dtype {dtype} is not modelled with sliding-window or chunked local attention "
                              "layers yet")

    def _verify_ds_mla_kv(self) -> None:
        """vLLM's sparse-MLA layouts by name: a sparse latent-attention model on CUDA (ROCm's
        sparse backend takes neither), nvfp4_ds_mla on data-center Blackwell (FLASHMLA_SPARSE's
        SM100 kernels) at DeepSeek-V3.2's latent shape, whose 352-byte record vLLM fixes."""
        dtype, gpu, spec = self.cache.kv_cache_dtype, get_gpu_spec(self.hardware.gpu), self.hardware.model_spec()
        if not spec.is_sparse:
            raise ConfigError(f"kv_cache_dtype {dtype}: vLLM's sparse latent-attention layout (FLASHMLA_SPARSE's), "
                              f"and {self.hardware.model} has no sparse attention (use fp8)")
        if gpu.platform != "cuda":
            raise ConfigError(f"kv_cache_dtype {dtype}: vLLM's sparse MLA backend on {self.hardware.gpu} "
                              "(ROCM_AITER_MLA_SPARSE) takes auto, float16, bfloat16, fp8 and fp8_e4m3 only")
        if dtype == "nvfp4_ds_mla":
            if gpu.cuda_major != 10:
                raise ConfigError(f"kv_cache_dtype {dtype} on {self.hardware.gpu}: FLASHMLA_SPARSE only supports the "
                                  "nvfp4_ds_mla kv-cache dtype on SM100 (Blackwell)")
            if (spec.kv_lora_rank, spec.qk_rope_head_dim) != (512, 64):
                raise ConfigError(f"kv_cache_dtype {dtype} is modelled at DeepSeek-V3.2's latent shape only (512 "
                                  f"latent and 64 rotary dims; {self.hardware.model}: {spec.kv_lora_rank} and "
                                  f"{spec.qk_rope_head_dim})")

    @property
    def kv_element(self) -> int | str:
        """What sizes the served model's cache entries (ModelSpec.kv_bytes_per_token): `kv_element_for`
        the model."""
        return self.kv_element_for(self.hardware.model_spec())

    def kv_element_for(self, spec: ModelSpec) -> int | str:
        """What sizes `spec`'s cache entries (the served model's or a drafter's): CacheConfig.kv_element,
        but on a sparse latent-attention model the layout of the backend vLLM picks
        (`sparse_mla_layout`)."""
        if spec.is_sparse:
            return sparse_mla_layout(get_gpu_spec(self.hardware.gpu), self.cache.kv_cache_dtype) or 2
        return self.cache.kv_element

    @property
    def kv_skip_layer_indices(self) -> frozenset[int]:
        """Decoder layers whose K and V stay in the model's dtype: kv_cache_dtype_skip_layers' and,
        under TurboQuant or UltraQuant, their boundary layers (`turboquant_boundary_layers`)."""
        skipped = {int(e) for e in self.cache.kv_skip_layer_names}
        if self.cache.kv_cache_dtype in BOUNDARY_SKIP_KV_DTYPES and not self.has_linear_attention:
            skipped |= set(turboquant_boundary_layers(self.hardware.model_spec().num_layers))
        return frozenset(skipped)

    @property
    def kv_skip_layers(self) -> int:
        """How many layers `kv_skip_layer_indices` keeps unquantized."""
        return len(self.kv_skip_layer_indices)

    def kv_spec(self) -> ModelSpec:
        """The served model (HardwareConfig.model_spec) with the layers its KV cache keeps
        unquantized: the spec whose kv_bytes_per_token sizes the cache and its reads."""
        spec = self.hardware.model_spec()
        return dataclasses.replace(spec, kv_skip_layers=self.kv_skip_layers) if self.kv_skip_layers else spec

    def _verify_dual_batch_overlap(self) -> None:
        """What simkv does not model dual batch overlap with (what vLLM's V2 runner refuses it with)."""
        hw = self.hardware
        unsupported = [(self.speculative.enabled, "speculative decoding"),
                       (hw.pipeline_parallel_size > 1, "pipeline parallelism"),
                       (hw.decode_context_parallel_size > 1 or hw.prefill_context_parallel_size > 1,
                        "context parallelism"),
                       (self.scheduler.enable_lora, "LoRA"),
                       (hw.has_vision_encoder, "multimodal models"),
                       (self.has_linear_attention, "hybrid models")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"{hw.ubatching_option} is not modelled with {what} (vLLM's V2 model runner "
                                  "refuses microbatching with it)")

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight (vLLM's max_concurrent_batches): one, two under async scheduling;
        under pipeline parallelism one per stage, one more under async scheduling."""
        pp = self.hardware.pipeline_parallel_size
        return (pp if pp > 1 else 1) + (1 if self.scheduler.async_scheduling else 0)

    @property
    def max_in_flight_tokens(self) -> int:
        """vLLM's bound on tokens scheduled but not yet processed: a batch's budget per batch in
        flight. Sliding-window groups hold their window plus this (their blocks are freed on the
        processed tokens)."""
        return self.scheduler.max_num_batched_tokens * self.max_concurrent_batches

    @property
    def kv_manager_block_size(self) -> int:
        """Tokens per block of the KV-cache manager: block_size, times the decode context
        parallelism whose GPUs each store block_size of them (vLLM's manager block size)."""
        return self.cache.block_size * self.hardware.decode_context_parallel_size

    def for_kv_manager(self) -> "EngineConfig":
        """The config the engine core runs on: its blocks are the KV-cache manager's."""
        if self.hardware.decode_context_parallel_size == 1:
            return self
        return dataclasses.replace(self, cache=dataclasses.replace(self.cache, block_size=self.kv_manager_block_size))

    @property
    def model_runner_in_force(self) -> str:
        """vLLM's model runner, 'v1' or 'v2': the one given, else V2 (vLLM 0.33's default) unless
        the config asks for a feature V2 lacks (`_v2_unsupported`), as vLLM's use_v2_model_runner
        picks."""
        runner = self.scheduler.model_runner
        if runner != "auto":
            return runner
        return "v1" if self._v2_unsupported() else "v2"

    def _v2_unsupported(self) -> list[str]:
        """What vLLM 0.33's V2 model runner does not support among what simkv models, in vLLM's
        words (its _get_v2_model_runner_unsupported_features)."""
        spec = self.speculative
        out = []
        if spec.speculative_method == "suffix":
            out.append("speculative method 'suffix'")
        if spec.spec_parallel_drafting:  # (EAGLE heads and draft models: simkv's methods that draft in parallel)
            out.append("parallel drafting for EAGLE speculative decoding")
        if self.hardware.use_ubatching and self.scheduler.model_runner == "auto":  # (V2 takes DBO only when asked for)
            out.append("dual batch overlap")
        return out

    @property
    def ngram_drafts_on_device(self) -> bool:
        """The n-gram drafter runs on the device (vLLM's V2 runner): K drafts after every step, a
        lookup without a match giving drafts that are all rejected. On V1 it runs on the host and
        proposes none without a match."""
        return self.speculative.speculative_method == "ngram" and self.model_runner_in_force == "v2"

    def _verify_model_runner(self) -> None:
        """vLLM's refusals: V2 with a feature it lacks; async scheduling on V1 with a host
        proposer or pipeline stages (vLLM's texts)."""
        if self.scheduler.model_runner == "v2" and self._v2_unsupported():
            raise ConfigError(f"Model Runner V2 does not yet support: {', '.join(self._v2_unsupported())}")
        if self.model_runner_in_force == "v1" and self.speculative.multi_module_mtp(self.hardware.model_spec()):
            raise ConfigError("multi-module MTP is vLLM's V2 model runner's (its MultiModuleMTPSpeculator): with "
                              "model_runner 'v1' it is not modelled")
        if not self.scheduler.async_scheduling or self.model_runner_in_force != "v1":
            return
        spec = self.speculative
        what = (f"{spec.speculative_method}-based speculative decoding" if spec.proposes_on_host
                else "pipeline parallelism" if self.hardware.pipeline_parallel_size > 1 else None)
        if what is not None:
            raise ConfigError(f"Async scheduling is not supported by the V1 model runner with {what}.")

    def _verify_speculative(self) -> None:
        spec, cache, sched = self.speculative, self.cache, self.scheduler
        unsupported = [(sched.preemption_mode != "recompute", f"preemption_mode '{sched.preemption_mode}'"),
                       (cache.allocator != "paged", f"allocator '{cache.allocator}'"),
                       (sched.admission_order != "after_running", f"admission_order '{sched.admission_order}'"),
                       (sched.preemption_victim != "newest", f"preemption_victim '{sched.preemption_victim}'"),
                       (cache.num_lookahead_tokens > 0, "num_lookahead_tokens (speculative decoding sets it)"),
                       (spec.is_eagle_family and cache.enable_prefix_caching and cache.prefix_caching_hash_bits < 63,
                        "prefix_caching_hash_bits < 63 with an EAGLE-family method")]
        for bad, what in unsupported:
            if bad:
                raise ConfigError(f"speculative decoding is not modelled with {what}")
        if spec.speculative_method == "dflash":
            model = self.hardware.model_spec()
            for bad, what in [(self.has_sliding_window, "sliding-window or chunked local attention layers"),
                              (self.has_linear_attention, "linear-attention layers"),
                              (model.is_mla, "latent attention (MLA)")]:
                if bad:
                    raise ConfigError(f"speculative_method 'dflash' is not modelled with {what}; it is with "
                                      "standard-attention targets")
        if spec.multi_module_mtp(self.hardware.model_spec()):
            if self.has_linear_attention:
                raise ConfigError("multi-module MTP (spec_mtp_modules > 1 with num_speculative_tokens > 1) is not "
                                  "modelled with linear-attention layers")
            if self.has_sliding_window and cache.enable_prefix_caching:  # (checked without; with, ~1 case in 10 differs)
                raise ConfigError("multi-module MTP (spec_mtp_modules > 1 with num_speculative_tokens > 1) with prefix "
                                  "caching is not modelled with sliding-window or chunked local attention layers "
                                  "(without prefix caching it is)")
            if cache.enable_prefix_caching and self.kv_manager_block_size < spec.num_speculative_tokens:
                raise ConfigError(f"Multi-module MTP with prefix caching requires scheduler_block_size "
                                  f"(={self.kv_manager_block_size}) >= num_speculative_tokens "
                                  f"(={spec.num_speculative_tokens}).")
        if sched.max_num_batched_tokens <= spec.num_lookahead_tokens:
            raise ConfigError("VllmConfig does not have enough slots to schedule a token and support the "
                              "speculative decoding settings.")

    @property
    def max_num_active(self) -> int:
        """The running requests the scheduler admits: max_num_active_seqs, else max_num_seqs; under
        dflash at most max_num_batched_tokens // (K + 1), vLLM's override (its draft pass needs K + 1
        query tokens per request within the batch)."""
        sched = self.scheduler
        active = sched.max_num_active_seqs or sched.max_num_seqs
        if self.speculative.speculative_method == "dflash":
            active = min(active, sched.max_num_batched_tokens // self.speculative.num_lookahead_tokens)
        return active

    @property
    def num_prefill_lookahead(self) -> int:
        """vLLM's num_prefill_lookahead_tokens: the prompt tokens past a prefill chunk that the
        drafter reads. One for the EAGLE family and dflash, which the scheduler heeds only where a
        chunk reaches a multimodal item (vLLM shifts the encoder's window by it); K
        under multi-module MTP, whose modules each read one token further: a prefill chunk never
        ends fewer than K tokens before the prompt's end, the blocks holding a chunk's last K - 1
        tokens are not cached yet, and block keys cover the K tokens after the block. 0 otherwise."""
        spec = self.speculative
        if not spec.enabled or not spec.uses_target_hidden_states:
            return 0
        return spec.num_speculative_tokens if spec.multi_module_mtp(self.hardware.model_spec()) else 1

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past each request's scheduled tokens."""
        return self.cache.num_lookahead_tokens + self.speculative.num_lookahead_tokens

    @property
    def spec_step_blocks(self) -> int:
        """Blocks of one speculative step (1 + K + lookahead slots): what a pull must leave free
        under P/D (vLLM's _spec_decode_step_blocks); 0 without speculative decoding."""
        k = self.speculative.num_speculative_tokens
        return -(-(1 + k + self.num_lookahead_tokens) // self.cache.block_size) if k else 0

    @property
    def max_model_len(self) -> int:
        if self.scheduler.max_model_len is not None:
            return self.scheduler.max_model_len
        return min(get_model_spec(self.hardware.model).max_position_embeddings, self._disabled_window or math.inf)

    @property
    def _disabled_window(self) -> int | None:
        """The model's sliding window under disable_sliding_window (vLLM then derives max_model_len
        from it when it is the shorter), None otherwise."""
        if not self.attention.disable_sliding_window:
            return None
        return get_model_spec(self.hardware.model).sliding_window or None

    def to_dict(self) -> dict:
        """Every engine option in force, flat, with vLLM's names."""
        out: dict = {}
        for part in (self.cache, self.scheduler, self.hardware):
            out.update(dataclasses.asdict(part))
        if self.cache.kv_cache_memory_bytes is None:  # (only when given: configs without it read as before)
            del out["kv_cache_memory_bytes"]
        if not self.cache.cpu_offload_gb:  # (likewise)
            del out["cpu_offload_gb"]
        if not self.cache.cpu_offload_params:  # (likewise)
            del out["cpu_offload_params"]
        if not self.cache.kv_cache_dtype_skip_layers:  # (likewise)
            del out["kv_cache_dtype_skip_layers"]
        if self.hardware.data_parallel_size == 1:  # (only with data parallelism: configs without it read as before)
            del out["data_parallel_size"]
        if self.hardware.quantization is None:  # (likewise)
            del out["quantization"]
        if self.hardware.mm_encoder_tp_mode == "weights":  # (likewise)
            del out["mm_encoder_tp_mode"]
        for key in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):  # (likewise)
            if out[key] == "auto":
                del out[key]
        if not self.hardware.language_model_only:  # (likewise)
            del out["language_model_only"]
        if self.hardware.decode_context_parallel_size == 1:
            del out["decode_context_parallel_size"]
        # (only when set: configs without them read as before)
        defaults = {f.name: f.default for f in dataclasses.fields(HardwareConfig)}
        for key in ("prefill_context_parallel_size", "enable_expert_parallel", "all2all_backend",
                    "expert_placement_strategy", "enable_eplb", "num_redundant_experts", "enable_dbo",
                    "ubatch_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if out[key] == defaults[key]:
                del out[key]
        if self.scheduler.max_num_active_seqs is None:  # (the defaults: configs read as before)
            del out["max_num_active_seqs"]
        if self.scheduler.max_num_scheduled_tokens is None:  # (likewise)
            del out["max_num_scheduled_tokens"]
        if self.scheduler.vllm_batch_defaults:  # (the default; the values in force are written beside it)
            del out["vllm_batch_defaults"]
        if self.scheduler.performance_mode == "balanced":  # (likewise)
            del out["performance_mode"]
        del out["defaulted_batch_options"]
        if not self.scheduler.max_model_len_fitted:  # (configs without it read as before)
            del out["max_model_len_fitted"]
        if self.scheduler.prefill_schedule_interval == 1:
            del out["prefill_schedule_interval"]
        for key in ("max_num_queued_reqs", "max_num_queued_tokens"):
            if out[key] is None:
                del out[key]
        if self.scheduler.parallel_sampling == "fan_out":  # (the default: configs read as before)
            del out["parallel_sampling"]
        if not self.scheduler.enable_lora:  # (only with LoRA: configs without it read as before)
            del out["enable_lora"], out["max_loras"], out["max_lora_rank"], out["max_cpu_loras"], out["lora_load_gbs"]
        if not self.cache.skip_mm_profiling:  # (the default: configs read as before)
            del out["skip_mm_profiling"]
        if not self.cache.offload_group_size:  # (likewise)
            del out["offload_group_size"], out["offload_num_in_group"], out["offload_prefetch_step"]
        if not self.cache.offload_params:  # (likewise)
            del out["offload_params"]
        if self.scheduler.mm_max_tokens_per_item is None:  # (only for multimodal traces: configs read as before)
            del out["mm_max_tokens_per_item"]
        if not self.scheduler.disable_chunked_mm_input:  # (likewise)
            del out["disable_chunked_mm_input"]
        if self.scheduler.limit_mm_per_prompt is None:  # (likewise)
            del out["limit_mm_per_prompt"]
        if self.scheduler.ec_role is None:  # (only under encoder disaggregation: likewise)
            del out["ec_role"], out["ec_store_gbs"]
        if not self.scheduler.has_clients:  # (likewise)
            for key in ("client_ttft_timeout_s", "client_timeout_s", "client_max_retries", "client_retry_backoff_s"):
                del out[key]
        if self.scheduler.client_retry_max_backoff_s is None and not self.scheduler.client_retry_jitter:  # (likewise)
            del out["client_retry_max_backoff_s"], out["client_retry_jitter"]
        if self.scheduler.model_runner == "auto":  # (the default: configs read as before)
            del out["model_runner"]
        if self.scheduler.client_max_concurrency is None:  # (likewise)
            del out["client_max_concurrency"]
        if self.scheduler.client_max_active_sessions is None:  # (likewise)
            del out["client_max_active_sessions"]
        if not self.scheduler.client_early_stop:  # (likewise)
            del out["client_early_stop"]
        if self.scheduler.client_request_rate is None:  # (likewise)
            del out["client_request_rate"]
            if not self.scheduler.client_rotation:  # (its random conversation sampling draws from it)
                del out["client_seed"]
        if not self.scheduler.client_rotation:  # (likewise)
            del out["client_rotation"], out["client_conversation_sampling"], out["client_max_requests"]
            del out["client_warmup"]
        if self.scheduler.client_max_inflight_tokens is None:  # (likewise)
            del out["client_max_inflight_tokens"]
        if self.speculative.enabled:  # (only then: configs without it read as before)
            out.update(dataclasses.asdict(self.speculative))
            if self.speculative.spec_ngram_match_rate == 1.0:  # (likewise)
                del out["spec_ngram_match_rate"]
            if not self.speculative.spec_parallel_drafting:  # (likewise)
                del out["spec_parallel_drafting"]
            for key in ("spec_draft_layers", "spec_acceptance_length", "spec_mtp_modules",
                        "spec_mean_draft_tokens"):  # (likewise)
                if out[key] is None:
                    del out[key]
        if (self.has_sliding_window or self.attention.overridden or self.attention.disable_hybrid_kv_cache_manager
                or self.mamba_align or self.attention.disable_sliding_window):
            out.update(dataclasses.asdict(self.attention))
            if not self.attention.disable_sliding_window:  # (configs without it read as before)
                del out["disable_sliding_window"]
            if self.attention.attention_chunk_size is None:  # (configs without it read as before)
                del out["attention_chunk_size"]
            if not self.mamba_align:  # (likewise)
                del out["gdn_prefill_backend"]
        out["max_model_len"] = self.max_model_len
        return out

    def given_options(self) -> dict:
        """to_dict() less the batch sizes defaulted for this GPU and max_model_len: a config built
        from them with other options (a P/D pool's) defaults those again, as its own vLLM server would."""
        out = self.to_dict()
        for name in self.scheduler.defaulted_batch_options:
            del out[name]
        if out.pop("max_model_len_fitted", False):  # (fitted again to the derived config's memory)
            out["max_model_len"] = -1
        return out

    @classmethod
    def from_flat(cls, options: dict) -> "EngineConfig":
        """Build from a flat {option: value} mapping (CLI, --config files). Unknown keys raise."""
        groups = {klass: {} for klass in OPTION_GROUPS}
        names = {f.name: klass for klass in groups for f in fields(klass)}
        types = {f.name: f.type for klass in groups for f in fields(klass)}
        for key, value in options.items():
            norm = key.replace("-", "_")
            if norm not in names or norm in OPTION_RECORDS:
                raise ConfigError(f"unknown option '{key}'")
            _check_type(key, value, types[norm])
            groups[names[norm]][norm] = value
        checkpoint_dtype = _checkpoint_kv_cache_dtype(groups[HardwareConfig], groups[CacheConfig])
        if checkpoint_dtype:  # (vLLM's resolve_kv_cache_dtype_string: `auto` is what the checkpoint asks)
            groups[CacheConfig]["kv_cache_dtype"] = checkpoint_dtype
        if "block_size" not in groups[CacheConfig]:
            block_size = _backend_block_size(groups[HardwareConfig], groups[CacheConfig])
            if block_size is not None:
                groups[CacheConfig]["block_size"] = block_size
        block_size = _linear_attention_block_size(groups[HardwareConfig], groups[CacheConfig],
                                                  groups[SpeculativeConfig], groups[AttentionConfig])
        if block_size is not None:
            groups[CacheConfig]["block_size"] = block_size
        block_size = _skip_layers_block_size(groups[HardwareConfig], groups[CacheConfig])
        if block_size is not None:
            groups[CacheConfig]["block_size"] = block_size
        return cls(CacheConfig(**groups[CacheConfig]), SchedulerConfig(**groups[SchedulerConfig]),
                   HardwareConfig(**groups[HardwareConfig]), SpeculativeConfig(**groups[SpeculativeConfig]),
                   AttentionConfig(**groups[AttentionConfig]))


# The configs a flat option belongs to, and the fields EngineConfig sets as records of what it
# derived (not options one gives)
OPTION_GROUPS = (CacheConfig, SchedulerConfig, HardwareConfig, SpeculativeConfig, AttentionConfig)
OPTION_RECORDS = ("defaulted_batch_options", "max_model_len_fitted")


def engine_option_names() -> tuple[str, ...]:
    """Every engine option from_flat takes (vLLM's names where vLLM has the option)."""
    return tuple(f.name for klass in OPTION_GROUPS for f in fields(klass) if f.name not in OPTION_RECORDS)


_KERNEL_BLOCK_ALIGNMENT = 16  # the smallest kernel block of vLLM's attention backends (FlashAttention, FlashInfer, Triton)


def linear_attention_block_size(spec: ModelSpec, tensor_parallel_size: int, kv_dtype_bytes: int | str,
                                block_size: int, num_speculative_tokens: int = 0, checkpoint_alignment: int = 1) -> int:
    """The block size vLLM 0.33 runs a model with linear-attention layers at, given `block_size`
    (Platform._align_hybrid_block_size): every group's pages must be the same size, so the
    attention block grows until one attention layer's page holds one linear layer's state,
    a multiple of max(16, block_size) tokens (and, under prefix caching, of the kernels' prefill
    checkpoint alignment); the state's page is then padded to it."""
    if not spec.linear_attention:
        return block_size
    state = spec.linear_state_bytes(tensor_parallel_size, num_speculative_tokens)
    per_token = spec.kv_bytes_per_layer_token(kv_dtype_bytes, tensor_parallel_size)
    align = math.lcm(max(_KERNEL_BLOCK_ALIGNMENT, block_size), checkpoint_alignment)
    need = align * -(-state // (align * per_token))
    need = _KERNEL_BLOCK_ALIGNMENT * -(-need // _KERNEL_BLOCK_ALIGNMENT)
    return max(block_size, need)


def turboquant_boundary_layers(num_layers: int, n: int = 2) -> list[int]:
    """The layers vLLM 0.33 keeps at the model's dtype under a TurboQuant KV cache on a model whose
    layers all attend (TurboQuantConfig.get_boundary_skip_layers): the first and last n, at most
    half the layers each. (On a model with linear-attention layers none: its attention page is
    the packed one, which `linear_attention_block_size` aligns the state's page to.)"""
    n = min(n, num_layers // 2)
    return sorted(set(range(n)) | set(range(num_layers - n, num_layers)))


def skip_layers_block_size(kv_cache_dtype: str, block_size: int) -> int:
    """The block size vLLM 0.33 runs at, given `block_size`, when some layers keep their K and V
    unquantized (Platform._align_heterogeneous_kv_block_size): the block grows, in steps of
    max(16, block_size), until a quantized layer's page covers a skipped layer's page of 16
    tokens (the backends' smallest kernel block), even over a --block-size given. All layers then
    share one group of that block size, each with pages of its own dtype. An fp8 cache under a
    bf16 model: 16 -> 32."""
    primary, skipped = kv_dtype_bytes(kv_cache_dtype), kv_dtype_bytes("auto")
    if skipped <= primary:
        return block_size
    align = max(_KERNEL_BLOCK_ALIGNMENT, block_size)
    return max(block_size, align * -(-(skipped * _KERNEL_BLOCK_ALIGNMENT) // (align * primary)))


def sparse_mla_layout(gpu, kv_cache_dtype: str) -> int | str | None:
    """The layout a sparse latent-attention model's latents take under `kv_cache_dtype` on `gpu`:
    the backend vLLM 0.33 picks there and how it renames the dtype (scripts/oracle_sparse_mla_kv.py).
    Hopper: FLASHMLA_SPARSE takes auto/bfloat16 and fp8 as its fp8_ds_mla layout (656 B at
    DeepSeek-V3.2's shape), FlashInfer's SM90 kernels fp8_e4m3 as plain fp8 (576 B). Data-center
    Blackwell: FlashInfer's sparse backend (vLLM's first choice for fp8) plain fp8 and fp8_e4m3,
    FLASHMLA_SPARSE fp8_ds_mla and nvfp4_ds_mla when named. Consumer Blackwell (SM120): only
    FlashInfer's SM120 kernels, which store fp8_ds_mla whatever is asked. ROCm: AITER's, plain.
    Returns the element's bytes or the layout's name, or None where no backend takes the dtype
    (the layouts asked for by name, which need CUDA and nvfp4_ds_mla SM100, are checked with
    vLLM's words in EngineConfig._verify_ds_mla_kv)."""
    if kv_cache_dtype == "fp8_e5m2":
        return None  # (no sparse MLA backend takes e5m2)
    major = gpu.cuda_major if gpu.platform == "cuda" else 0
    if major == 12:  # (FLASHINFER_MLA_SPARSE_SM120: auto and fp8 as fp8_ds_mla; nothing else)
        return "fp8_ds_mla" if kv_cache_dtype in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla") else None
    if kv_cache_dtype in ("fp8_ds_mla", "nvfp4_ds_mla"):
        return kv_cache_dtype
    if kv_cache_dtype == "fp8":
        return "fp8_ds_mla" if major == 9 else 1
    return kv_element(kv_cache_dtype)


def _checkpoint_kv_cache_dtype(hardware: dict, cache: dict) -> str | None:
    """The KV dtype a ModelOpt checkpoint asks for, where kv_cache_dtype is auto (given or not):
    vLLM runs `auto` as it (ModelSpec.checkpoint_kv_cache_dtype). None otherwise, or for a bad
    model name that HardwareConfig names."""
    if cache.get("kv_cache_dtype", "auto") != "auto":
        return None
    try:
        return get_model_spec(hardware.get("model", HardwareConfig().model)).checkpoint_kv_cache_dtype or None
    except ValueError:
        return None


def _skip_layers_block_size(hardware: dict, cache: dict) -> int | None:
    """`skip_layers_block_size` for from_flat's options (None: no skipped layers, or a bad value
    that the configs' own checks name)."""
    try:
        dtype = cache.get("kv_cache_dtype", CacheConfig().kv_cache_dtype)
        entries = str(cache.get("kv_cache_dtype_skip_layers", "")).strip(",").strip()
        if dtype in BOUNDARY_SKIP_KV_DTYPES and not entries:  # (its boundary layers, unless linear attention)
            entries = not get_model_spec(hardware.get("model", HardwareConfig().model)).linear_attention
        if not entries or dtype not in KV_CACHE_DTYPES or dtype in PER_TOKEN_HEAD_KV_DTYPES:
            return None
        block_size = int(cache.get("block_size", CacheConfig().block_size))
        return skip_layers_block_size(dtype, block_size) if block_size >= 1 else None
    except (ValueError, TypeError):
        return None


def _linear_attention_block_size(hardware: dict, cache: dict, speculative: dict, attention: dict) -> int | None:
    """`linear_attention_block_size` for from_flat's options (None: no linear attention, or a bad
    value that the configs' own checks name)."""
    defaults = HardwareConfig()
    try:
        spec = get_model_spec(hardware.get("model", defaults.model)).quantized(hardware.get("quantization"))
        dtypes = (hardware.get("mamba_cache_dtype", "auto"), hardware.get("mamba_ssm_cache_dtype", "auto"))
        if not all(d in MAMBA_DTYPE_BYTES for d in dtypes):
            return None  # (HardwareConfig names the bad value)
        spec = spec.with_mamba_cache_dtypes(*dtypes)
        tp = int(hardware.get("tensor_parallel_size", 1))
        block_size = int(cache.get("block_size", CacheConfig().block_size))
        if not spec.linear_attention or tp < 1 or block_size < 1:
            return None
        kv_bytes = kv_element(cache.get("kv_cache_dtype", CacheConfig().kv_cache_dtype))
        method = speculative.get("speculative_method")
        k = num_speculative_tokens_in_force(method, int(speculative.get("num_speculative_tokens", 0))) if method else 0
        alignment = 1
        if spec.linear_attention == "gated_deltanet" and cache.get("enable_prefix_caching", CacheConfig().enable_prefix_caching):
            backend = gdn_prefill_backend(attention.get("gdn_prefill_backend", AttentionConfig().gdn_prefill_backend),
                                          get_gpu_spec(hardware.get("gpu", defaults.gpu)), spec)
            alignment = _FLASHINFER_GDN_CHECKPOINT_ALIGNMENT if backend == "flashinfer" else 1
        return linear_attention_block_size(spec, tp, kv_bytes, block_size, k, alignment)
    except (ValueError, TypeError, ConfigError):
        return None


_FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64  # vLLM's FLASHINFER_GDN_CHECKPOINT_ALIGNMENT


def gdn_prefill_backend(requested: str, gpu, spec: ModelSpec) -> str:
    """The Gated DeltaNet prefill kernel vLLM 0.33 runs (its _resolve_gdn_prefill_backend):
    FlashInfer's on Hopper (compute capability 9.0) and on Blackwell (10.x, 12.x) with 128-wide
    key heads, assuming a CUDA 13 runtime there; Triton's (FLA) elsewhere, ROCm included."""
    if requested != "auto":
        return requested
    if gpu.platform != "cuda":
        return "triton"
    if gpu.compute_capability == 9.0:
        return "flashinfer"
    if gpu.cuda_major in (10, 12) and spec.linear_key_head_dim == 128:
        return "flashinfer"
    return "triton"


def _backend_block_size(hardware: dict, cache: dict) -> int | None:
    """The block size vLLM 0.33 picks when none is given, where its attention backend needs
    another than 16 (None: 16). Latent attention: on Hopper an fp8 cache runs FlashMLA,
    64-token blocks; on Blackwell FlashInfer MLA takes 32 or 64 (32) where it takes the model's
    qk_nope_head_dim (64, 128 or 192), CUTLASS MLA 128 otherwise. UltraQuant on a model with
    linear attention (whose attention layers then all run UltraQuant's backend): 64, its FlyDSL
    decode kernel's block."""
    defaults = HardwareConfig()
    try:
        spec = get_model_spec(hardware.get("model", defaults.model))
        gpu = get_gpu_spec(hardware.get("gpu", defaults.gpu))
    except ValueError:
        return None  # (HardwareConfig names the bad value)
    if cache.get("kv_cache_dtype") in ULTRAQUANT_KV_DTYPES and spec.linear_attention:
        return ULTRAQUANT_BLOCK_SIZE  # (its one attention backend's preferred block; dense models keep
        #                                their boundary layers on another backend, and 16)
    if not spec.is_mla:
        return None
    if spec.is_sparse:  # (the sparse MLA backends and the indexer's take multiples of 64)
        return SPARSE_BLOCK_MULTIPLE
    major = gpu.cuda_major
    if major == 9 and is_fp8_kv(cache.get("kv_cache_dtype")):
        return 64
    if major == 10:
        return 32 if spec.head_dim - spec.qk_rope_head_dim in (64, 128, 192) else 128
    return None
