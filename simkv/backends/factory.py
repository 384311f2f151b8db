"""Build a cost-model backend by name."""

from __future__ import annotations

from simkv.backends.cost_models import LinearCostModel, UnitCostModel
from simkv.backends.roofline import RooflineCostModel
from simkv.backends.roofline_fit import is_roofline_fit, read_roofline_fit
from simkv.config import EngineConfig
from simkv.specs import get_gpu_spec

COST_MODELS = ("unit", "linear", "roofline")


def make_backend(name: str, config: EngineConfig, step_base_s: float = 0.015, step_per_token_s: float = 2e-5,
                 step_noise: str = "none", noise_seed: int = 0):
    backend = _cost_model(name, config, step_base_s, step_per_token_s, step_noise, noise_seed)
    if config.cache.offload_group_size and name not in ("unit", "linear"):  # (waits for prefetched layers)
        from simkv.backends.weight_prefetch import PrefetchOffloadBackend

        backend = PrefetchOffloadBackend(backend, config)
    if config.speculative.enabled:  # the drafter's passes come on top (simkv/backends/drafting.py)
        from simkv.backends.drafting import SpeculativeBackend

        return SpeculativeBackend(backend, config)
    return backend


def _cost_model(name: str, config: EngineConfig, step_base_s: float, step_per_token_s: float, step_noise: str,
                noise_seed: int):
    if step_noise != "none" and not name.endswith(".json"):
        raise ValueError("--step-noise needs a calibrated cost model (--cost-model calib.json): its variation "
                         "comes from the calibration's repeated samples")
    if name == "unit":
        return UnitCostModel()
    if name == "linear":
        return LinearCostModel(step_base_s, step_per_token_s)
    if name == "roofline":
        return make_roofline(config)
    if name.endswith(".json") and is_roofline_fit(name):  # fitted by `simkv calibrate --from-bench`
        if step_noise != "none":
            raise ValueError(f"--step-noise needs a calib.json's repeated samples; {name} is a roofline fit")
        hw = config.hardware
        params, frontend_s, warnings = read_roofline_fit(name, hw.model, hw.gpu, hw.tensor_parallel_size)
        return make_roofline(config, params, {"fit_file": name, "warnings": warnings, "frontend_latency_s": frontend_s})
    if name.endswith(".json"):  # a calib.json fitted by `simkv calibrate` (simkv/calibration/)
        from simkv.calibration.costmodel import cost_model_from_file

        if config.cache.cpu_offload_gb or config.cache.offload_group_size:
            raise ValueError(f"--cost-model {name}: a calibration times steps with every weight in GPU memory; "
                             "weight offloading's host-link traffic (--cpu-offload-gb, --offload-group-size) "
                             "is the roofline's")
        hw = config.hardware
        if hw.quantization or hw.decode_context_parallel_size > 1 or hw.prefill_context_parallel_size > 1:
            what = ("--quantization " + hw.quantization if hw.quantization
                    else "decode context parallelism" if hw.decode_context_parallel_size > 1
                    else "prefill context parallelism")
            raise ValueError(f"--cost-model {name}: a calibration times the GPU backend's bf16 weights on one "
                             f"GPU; {what} is the roofline's")
        if config.has_sliding_window:
            raise ValueError(f"--cost-model {name}: a calibration is fitted on layers that attend the whole "
                             f"context; {config.hardware.model} here has sliding-window layers (use the roofline)")

        return cost_model_from_file(name, model=config.hardware.model, gpu=config.hardware.gpu,
                                    step_noise=step_noise, noise_seed=noise_seed)
    raise ValueError(f"unknown cost model '{name}'; choose one of {', '.join(COST_MODELS)} or a calib.json path")


def weight_offload_shares(config: EngineConfig) -> tuple[float, float]:
    """The shares of a GPU's weights --cpu-offload-gb keeps in host memory: (of the weights outside
    the routed experts, of the routed experts); the same share of all without --cpu-offload-params,
    only the experts' with it; (0, 0) without offloading. Under pipeline stages, of a stage's GPU,
    its layers taken as an even share."""
    if not config.cache.cpu_offload_gb:
        return 0.0, 0.0
    from simkv.capacity import expert_bytes_named, offloaded_weight_bytes

    hw = config.hardware
    pp = hw.pipeline_parallel_size
    spec = hw.model_spec()
    weights = spec.weight_bytes_per_gpu(hw.tensor_parallel_size, hw.expert_shards) / pp
    offloaded = offloaded_weight_bytes(config, weights, spec.num_layers / pp)
    if not config.cache.cpu_offload_params:
        return offloaded / weights, offloaded / weights
    return 0.0, offloaded / (expert_bytes_named(config, ("experts",)) / pp)


def make_roofline(config: EngineConfig, params: dict | None = None, fitted_from: dict | None = None) -> RooflineCostModel:
    """The roofline of `config`'s model and GPU, with default or given (fitted) efficiencies and
    overheads; `fitted_from`: the fit file's name, warnings and front-end latency
    (simkv/backends/roofline_fit.py)."""
    hw = config.hardware
    model = RooflineCostModel(config.kv_spec(), get_gpu_spec(hw.gpu), hw.tensor_parallel_size,
                              config.kv_element, layer_windows=config.layer_windows,
                              attention_chunked=bool(config.attention_chunk_size),
                              num_speculative_tokens=config.speculative.num_speculative_tokens,
                              data_parallel_size=hw.data_parallel_size, block_size=config.cache.block_size,
                              decode_context_parallel_size=hw.decode_context_parallel_size,
                              lora_rank=config.scheduler.max_lora_rank if config.scheduler.enable_lora else 0,
                              tp_link_gbs=hw.link_gbs(hw.tensor_parallel_size),
                              dp_link_gbs=hw.link_gbs(hw.tensor_parallel_size * hw.expert_shards),
                              prefill_context_parallel_size=hw.prefill_context_parallel_size,
                              pcp_link_gbs=hw.link_gbs(hw.tensor_parallel_size * hw.prefill_context_parallel_size),
                              all_to_all=hw.all_to_all, round_robin_experts=hw.round_robin_experts,
                              gpus_per_node=hw.gpus_per_node,
                              inter_node_gbs=hw.inter_node_gbs,
                              ubatching=((hw.num_ubatches, hw.dbo_decode_token_threshold,
                                          hw.dbo_prefill_token_threshold) if hw.use_ubatching else None),
                              indexer_tp_shard_min_rows=config.attention.indexer_tp_shard_min_rows,
                              weight_offload_shares=weight_offload_shares(config),
                              pcie_gbs=config.cache.pcie_bandwidth_gbs,
                              **(params or {}))
    if fitted_from is not None:
        model.fitted_from = fitted_from
    return model
