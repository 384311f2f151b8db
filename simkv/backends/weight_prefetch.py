"""vLLM's prefetch weight offloading (`--offload-group-size G --offload-num-in-group N
--offload-prefetch-step S`; its PrefetchOffloader), on top of the roofline.

Of every G decoder layers the last N live in pinned host memory (`offloaded_layers`). The GPU
keeps S static buffers of one layer each; offloaded layer j runs from buffer j mod S. The copies
run on their own stream, one after another, over the host link: the first S are started before
the model runs, and when offloaded layer j has run, the copy of layer j + S (vLLM's
`_get_next_prefetch_index`; past the last one, around to the first ones, for the next forward
pass) goes into the buffer j freed. An offloaded layer waits for its copy. So every forward pass
copies every offloaded layer once, and a copy is hidden when the layers run between the one
that freed its buffer and its own take at least as long.

`PrefetchSchedule.stall` plays a step's layers on the compute stream (each the same share of the
roofline's device time) against the copies, three identical steps in a row, with the step's
time outside its layers (LM head, sampling, the host's share) between them, and returns what the
third one waits for copies: the steady state of a run of such steps. The copies take each GPU's
share of a layer's weights at the host link's rate (`pcie_bandwidth_gbs`); each GPU has a link
of its own. An assumption, not a measurement.
"""

from __future__ import annotations

from simkv.config import EngineConfig
from simkv.core.outputs import SchedulerOutput


def offloaded_layers(num_layers: int, group_size: int, num_in_group: int) -> list[int]:
    """The decoder layers vLLM's PrefetchOffloader keeps in host memory: the last
    `num_in_group` of every `group_size`."""
    return [i for i in range(num_layers) if i % group_size >= group_size - num_in_group]


def offloaded_positions(config: EngineConfig, num_layers: int, first_layer: int = 0) -> list[int]:
    """The positions, among a GPU's `num_layers` decoder layers from model layer `first_layer`,
    of those vLLM offloads (`offloaded_layers`); with --offload-params, only those with routed
    experts (the model's layers from num_dense_layers on: vLLM skips a layer none of whose
    parameters match, and counts its offloaded modules without it)."""
    cc = config.cache
    positions = offloaded_layers(num_layers, cc.offload_group_size, cc.offload_num_in_group)
    if cc.offload_params:
        dense = config.hardware.model_spec().num_dense_layers
        positions = [p for p in positions if first_layer + p >= dense]
    return positions


def next_prefetch_index(index: int, prefetch_step: int, count: int) -> int:
    """The offloaded layer whose copy starts when offloaded layer `index` has run (vLLM's
    `_get_next_prefetch_index`): `prefetch_step` ahead, around to the first ones, keeping each
    buffer's layers."""
    following = (index + prefetch_step) % count
    if prefetch_step < count and following % prefetch_step != index % prefetch_step:
        following = index % prefetch_step
    return following


class PrefetchSchedule:
    """A forward pass's decoder layers against the offloaded layers' copies."""

    _STEPS = 3  # (identical steps played; the last one's wait is the steady state's)

    def __init__(self, num_layers: int, positions: list[int], prefetch_step: int, copy_s: float) -> None:
        self.num_layers = num_layers
        self.module_at = {p: j for j, p in enumerate(positions)}
        count = len(positions)
        self.follows = [next_prefetch_index(j, prefetch_step, count) for j in range(count)]
        self.first = min(prefetch_step, count)
        self.copy_s = copy_s
        self._memo: dict[tuple[int, int], float] = {}
        self._stream: list | None = None  # (`run`'s copy stream, carried on from pass to pass)

    def stall(self, layer_s: float, gap_s: float) -> float:
        """Seconds a step whose layers take `layer_s` each, with `gap_s` outside its layers,
        waits for copies (0 when every copy is hidden): the last of `_STEPS` identical steps,
        the steady state of a run of them."""
        if not self.module_at:
            return 0.0
        key = (round(layer_s * 1e9), round(gap_s * 1e9))  # (nanosecond buckets)
        wait = self._memo.get(key)
        if wait is None:
            stream, start = self._new_stream(), 0.0
            for _ in range(self._STEPS):
                start, wait = self._pass(stream, start, layer_s)
                start += gap_s
            self._memo[key] = wait
        return wait

    def run(self, start_s: float, layer_s: float) -> float:
        """One pass of the layers from `start_s` (seconds, after every earlier pass of this
        schedule), its copies on a stream that carries on from those passes: what it waits for.
        Pipeline stages (simkv/replay/pipeline.py) time each stage's passes so, in order."""
        if not self.module_at:
            return 0.0
        if self._stream is None:
            self._stream = self._new_stream()
        return self._pass(self._stream, start_s, layer_s)[1]

    def _new_stream(self) -> list:
        """[when each offloaded layer's copy is done, when the copy stream is free]: the first
        copies started before the first pass."""
        ready = [0.0] * len(self.follows)
        copy_free = 0.0
        for j in range(self.first):
            copy_free += self.copy_s
            ready[j] = copy_free
        return [ready, copy_free]

    def _pass(self, stream: list, start_s: float, layer_s: float) -> tuple[float, float]:
        """The layers from `start_s` against `stream`'s copies (updated): (the pass's end, what it
        waited)."""
        ready, copy_free = stream
        copy_s, follows, module_at = self.copy_s, self.follows, self.module_at
        now, wait = start_s, 0.0
        for layer in range(self.num_layers):
            j = module_at.get(layer)
            if j is not None and ready[j] > now:
                wait += ready[j] - now
                now = ready[j]
            now += layer_s
            if j is not None:
                copy_free = max(now, copy_free) + copy_s
                ready[follows[j]] = copy_free
        stream[1] = copy_free
        return now, wait


def copy_seconds_per_layer(config: EngineConfig) -> float:
    """An offloaded layer's copy into a GPU's buffer: its share of the layer's weights (with
    --offload-params, of its named expert parameters) over the host link (each GPU its own)."""
    from simkv.capacity import prefetched_layer_bytes

    return prefetched_layer_bytes(config) / (config.cache.pcie_bandwidth_gbs * 1e9)


def layer_schedule(config: EngineConfig, num_layers: int, first_layer: int = 0) -> PrefetchSchedule:
    """The schedule of a GPU holding `num_layers` decoder layers from model layer `first_layer`
    (all of them, or a pipeline stage's: vLLM's PrefetchOffloader counts a stage's layers from
    its first)."""
    cc = config.cache
    return PrefetchSchedule(num_layers, offloaded_positions(config, num_layers, first_layer),
                            cc.offload_prefetch_step, copy_seconds_per_layer(config))


def stage_schedules(config: EngineConfig) -> list[PrefetchSchedule]:
    """Each pipeline stage's schedule: vLLM's PrefetchOffloader on a stage wraps that stage's
    layers, counted from its first, so each stage offloads the last N of every G of its own."""
    from simkv.capacity import pipeline_layers

    hw = config.hardware
    layers = pipeline_layers(hw.model_spec().num_layers, hw.pipeline_parallel_size)
    return [layer_schedule(config, n, sum(layers[:i])) for i, n in enumerate(layers)]


def prefetch_backend(backend):
    """The PrefetchOffloadBackend in `backend`'s chain of wrappers (None if there is none)."""
    while backend is not None and not isinstance(backend, PrefetchOffloadBackend):
        backend = backend.__dict__.get("inner")
    return backend


class PrefetchOffloadBackend:
    """The roofline plus the waits for prefetched layers (no decode runs: a step's wait is not
    affine in its context)."""

    supports_decode_runs = False

    def __init__(self, inner, config: EngineConfig) -> None:
        cc = config.cache
        self.inner = inner
        self.schedule = layer_schedule(config, config.hardware.model_spec().num_layers)
        self.fixed_s = getattr(inner, "fixed_s", 0.0)
        self.wait_seconds = 0.0  # the steps' waits for copies so far
        self.info = {"offloaded_layers": len(self.schedule.follows), "prefetch_step": cc.offload_prefetch_step,
                     "copy_s_per_layer": self.schedule.copy_s, "pcie_gbs": cc.pcie_bandwidth_gbs}

    def __getattr__(self, name: str):
        """Everything else is the wrapped cost model's (its name, host share and front-end
        latency, LoRA's prices, a fit's range, ...)."""
        if name == "inner":  # (not set yet: no recursion while unpickling or before __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def execute(self, output: SchedulerOutput) -> float:
        return self._with_wait(self.inner.execute(output))

    def dp_step_seconds(self, outputs: list[SchedulerOutput], num_dummy: int = 0, extra_s: float = 0.0,
                        overlap_host: bool = False) -> float:
        """A lockstep step of data-parallel ranks: every rank's GPUs offload their own layers (their
        share of the routed experts) and wait alike, so the step waits as its layers do."""
        return self._with_wait(self.inner.dp_step_seconds(outputs, num_dummy, extra_s, overlap_host))

    def _with_wait(self, seconds: float) -> float:
        layers = max(seconds - self.fixed_s, 0.0)  # (the device's share; its layers taken as all of it)
        wait = self.schedule.stall(layers / self.schedule.num_layers, seconds - layers)
        self.wait_seconds += wait
        return seconds + wait

    def describe(self) -> dict:
        """The wrapped model's, with the offloading and the steps' waits for copies so far."""
        return self.inner.describe() | {"weight_prefetch": self.info | {"wait_s": self.wait_seconds}}
