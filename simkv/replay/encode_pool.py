"""Encoder disaggregation (`simkv replay --encode-replicas N`): encode instances in front of the
engines, as vLLM 0.33 runs them (its --ec-transfer-config over shared storage and its EPD proxy).

A request with images goes first, whole and with max_tokens 1, to an encode instance (vLLM's
`mm_encoder_only`: no language model and no KV cache; `ec_role` "ec_producer"). Its scheduler is
the engine core's (core/scheduler.py): it consumes the prompt in chunks within the token budget,
encodes the items the chunks reach within the encoder budget and cache, and the request ends
once its prompt is consumed. What it encodes goes to the embedding store, which every encode
instance reads: an image already stored is not encoded again. When the encode instance
answers, the proxy sends the request on, after `hop_ms`, to the engines (one, a fleet, or P/D
pools: `ec_role` "ec_consumer"), which load the embeddings from the store instead of encoding
them. Requests without images go to the engines directly.

Nothing flows back from the engines to the encode pool, so the replay runs in two passes: the
encode pool on the requests with images, then the engines on the trace with those requests
arriving when the proxy sends them on. Each request's latencies are then counted from its
client's send (`encode_s`: the time before the engines got it). That is exact for open-loop
traffic; conversations paced on their replies and clients that give up would couple the two
passes and are refused.

Time: an encode instance's step is the roofline's fixed step overhead, the vision encoder's
roofline (simkv/backends/vision_encoder.py) and writing the embeddings to the store; an
engine's step adds reading them (each embedding `hidden_size` x 2 bytes, times the DeepStack
mergers, at `ec_store_gbs`; an assumption, not a measurement).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from simkv.config import ConfigError, EngineConfig
from simkv.traces.schema import take_rows

# the roofline's fixed cost of a step (scheduling, launches): the encode instance's besides its encoder
_STEP_OVERHEAD_S = 1.0e-3


@dataclass(frozen=True)
class EncodeSpec:
    """The encode pool: its replicas, their router, the engine options it sets over the common
    ones (`encode_options`: ((option, value), ...)), the store's bandwidth and the proxy's hop."""

    num_encode: int = 1
    router: str = "least_outstanding"
    encode_options: tuple = ()
    ec_store_gbs: float = 10.0
    hop_ms: float = 1.0

    def __post_init__(self) -> None:
        from simkv.replay.router import ROUTERS

        if not isinstance(self.num_encode, int) or isinstance(self.num_encode, bool) or self.num_encode < 1:
            raise ConfigError(f"encode replicas must be a whole number >= 1, got {self.num_encode!r}")
        if self.router not in ROUTERS:
            raise ConfigError(f"encode_router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if not self.ec_store_gbs > 0:
            raise ConfigError(f"ec_store_gbs must be > 0 (GB/s), got {self.ec_store_gbs}")
        if not self.hop_ms >= 0:
            raise ConfigError(f"encode_hop_ms must be >= 0, got {self.hop_ms}")

    def encode_config(self, base: EngineConfig) -> EngineConfig:
        """An encode instance's config: `base` with the pool's options, no prefix caching (vLLM
        turns it off: there is no KV cache), synchronous scheduling, and room for every request
        it may hold (it allocates no KV blocks: none can run short)."""
        options = base.given_options() | dict(self.encode_options)
        for key in ("speculative_method", "num_speculative_tokens", "kv_offloading_size", "enable_lora",
                    "pipeline_parallel_size", "data_parallel_size"):
            options.pop(key, None)
        options |= {"enable_prefix_caching": False, "async_scheduling": False, "ec_role": "ec_producer",
                    "ec_store_gbs": self.ec_store_gbs}
        try:
            config = EngineConfig.from_flat(options)
        except (ConfigError, TypeError, ValueError) as exc:
            raise ConfigError(f"encode pool: {exc}") from None
        blocks = config.scheduler.max_num_seqs * -(-config.max_model_len // config.cache.block_size) + 1
        return dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_gpu_blocks=blocks))

    def consumer_config(self, base: EngineConfig) -> EngineConfig:
        return dataclasses.replace(base, scheduler=dataclasses.replace(
            base.scheduler, ec_role="ec_consumer", ec_store_gbs=self.ec_store_gbs))

    def to_dict(self) -> dict:
        return {"encode_replicas": self.num_encode, "encode_router": self.router,
                "encode_options": dict(self.encode_options), "ec_store_gbs": self.ec_store_gbs,
                "encode_hop_ms": self.hop_ms}


class EncodeOnlyBackend:
    """An encode instance's steps: no language model, so the fixed step overhead; the encoder and
    the store's writes come on top (ReplayEngine.encoder_ticks)."""

    name = "encode_only"
    supports_decode_runs = False
    needs_request_detail = False

    def execute(self, output) -> float:
        return _STEP_OVERHEAD_S

    def describe(self) -> dict:
        return {"form": "encode instance: fixed step overhead + vision encoder roofline + store writes",
                "step_overhead_s": _STEP_OVERHEAD_S}


def check_encode_pool(trace, config: EngineConfig, backend, fleet) -> None:
    """What two passes cannot replay, refused with what to change."""
    from simkv.backends.vision_encoder import vision_encoder_cost

    if getattr(trace, "mm_items", None) is None or not len(trace.mm_items):
        raise ConfigError(f"{trace.source}: --encode-replicas: the trace has no multimodal items (mm_* columns) "
                          "for an encode pool to encode")
    if vision_encoder_cost(config) is None:
        raise ConfigError(f"--encode-replicas: {config.hardware.model} has no vision encoder in its spec to time"
                          + (" (--language-model-only leaves it out)" if config.hardware.language_model_only else ""))
    if backend is not None:
        raise ConfigError("--encode-replicas is simulated only (the gpu backend runs one text-only engine)")
    sc = config.scheduler
    if getattr(trace, "session_id", None) is not None and sc.session_pacing:
        raise ConfigError(f"{trace.source}: --encode-replicas with conversations paced on their replies is not "
                          "modelled (the encode pool and the engines would depend on each other); give "
                          "--no-session-pacing to send every turn at its own time")
    if sc.has_clients or sc.max_num_queued_reqs is not None or sc.max_num_queued_tokens is not None:
        raise ConfigError("--encode-replicas with clients that give up or an admission limit is not modelled")
    if fleet is not None and fleet.num_replicas > 1 and config.hardware.data_parallel_size > 1:
        raise ConfigError("--encode-replicas: a fleet of data-parallel engines is not modelled")


def run_encode_pool(trace, config: EngineConfig, spec: EncodeSpec):
    """The encode pass: (each row's time the engines get it, NaN for rows without items; the
    pool's summary section; its config)."""
    from simkv.capacity import compute_capacity
    from simkv.replay.fleet import fleet_tables, run_fleet
    from simkv.replay.results import dist
    from simkv.replay.router import Router

    rows = np.flatnonzero(np.diff(trace.mm_item_offsets) > 0)
    sub = take_rows(trace, rows)
    sub = dataclasses.replace(sub, output_tokens=np.ones(len(sub), dtype=sub.output_tokens.dtype), hash_ids=None,
                              hash_offsets=None, hash_block_tokens=None, lora_name=None,
                              n=None if sub.n is None else np.ones_like(sub.n))
    encode_config = spec.encode_config(config)
    capacity = compute_capacity(encode_config)
    store: set = set()

    def prepare(engine):  # (one store for every encode instance: shared storage)
        engine.scheduler.ec_store = store

    router = Router(spec.router, spec.num_encode)
    backends = [EncodeOnlyBackend() for _ in range(spec.num_encode)]
    runs, routing = run_fleet(sub, encode_config, backends, encode_config.cache.num_gpu_blocks, router, capacity,
                              use_decode_runs=False, prepare=prepare)
    requests, _, _ = fleet_tables(runs, routing, sub)
    ready = np.full(len(trace), np.nan)
    finish = requests["finish_time_s"].to_numpy()
    ready[rows] = finish + spec.hop_ms / 1e3
    encode_s = finish - requests["arrival_time_s"].to_numpy()
    duration = float(np.nanmax(finish)) if len(finish) else 0.0
    section = spec.to_dict() | {
        "requests": int(len(rows)),
        "items_encoded": sum(run.scheduler.num_encoded_items for run in runs),
        "items_found_in_store": sum(run.scheduler.num_loaded_items for run in runs),
        "encoder_seconds": sum(run.encoder[1] for run in runs),
        "encoder_busy_fraction": (sum(run.encoder[1] for run in runs) / (duration * spec.num_encode)
                                  if duration else 0.0),
        "encode_s": dist(encode_s),
        "config": {k: v for k, v in encode_config.to_dict().items()
                   if k in ("max_num_seqs", "max_num_batched_tokens", "gpu", "tensor_parallel_size")}}
    return ready, section


def delayed_trace(trace, ready: np.ndarray):
    """The trace as the engines see it: rows with items arriving when the proxy sends them on, in
    arrival order; and, for each of its rows, the original row."""
    arrival = np.where(np.isnan(ready), trace.arrival_time_s, ready)
    order = np.argsort(arrival, kind="stable")
    shifted = dataclasses.replace(trace, arrival_time_s=arrival)
    return take_rows(shifted, order), order


def client_view(requests, trace, order: np.ndarray):
    """The engines' request table in the trace's row order, its latencies counted from the
    client's send: `encode_s` (send to the engines' arrival) added to TTFT and E2E."""
    frame = requests.copy()
    frame.index = order
    frame = frame.sort_index()
    sent = trace.arrival_time_s
    encode_s = frame["arrival_time_s"].to_numpy() - sent
    frame["arrival_time_s"] = sent
    for column in ("ttft_s", "e2e_s"):
        frame[column] = frame[column].to_numpy() + encode_s
    frame.insert(frame.columns.get_loc("arrival_time_s") + 1, "encode_s", encode_s)
    return frame.reset_index(drop=True)
