"""Where the worker keeps LoRA adapters, and what loading them costs a step (vLLM 0.33's
LRUCacheWorkerLoRAManager with its LRUCacheLoRAModelManager).

Before each step's forward pass the model runner makes the adapters of the step's scheduled
requests active. The worker holds two LRU caches of adapters:
- **CPU** (`--max-cpu-loras`, vLLM's default: max_loras): adapters read from their checkpoints
  and kept in host memory. One that is not there is read from disk first; when the cache is full
  its least recently used adapter is dropped, and leaves its GPU slot too.
- **GPU** (`max_loras` slots): an adapter not in a slot is copied into one, the least recently
  used slot's adapter making room when all are taken.
Each step touches its adapters in both caches (most recent last). vLLM walks them in the order
of a Python set of names (hash order, which changes from process to process); simkv walks them in
adapter id order (first appearance in the trace), so a replay is deterministic.

Both loads happen on the worker before the step's forward pass, and the step lasts that much
longer. They are priced from the adapter's bytes at `max_lora_rank` (every linear layer of the
decoder layers, bf16: `simkv.capacity.lora_slot_bytes`):
- a disk read of the whole adapter (every tensor-parallel worker reads its own copy at once) at
  `lora_load_gbs` GB/s. This includes vLLM's host-side work (parsing the safetensors file, pinning,
  packing q/k/v and gate/up), and it is an assumption, not a measurement;
- a copy of the GPU's share of it into the slot at `pcie_bandwidth_gbs`.
Cost models that do not price LoRA (the unit, linear and calibrated ones: only the roofline
prices the adapters' kernels) and architectures whose LoRA shapes are not modelled (experts,
latent or linear attention) count the loads and price them at 0.
"""

from __future__ import annotations

from collections import OrderedDict


class AdapterResidency:
    """The worker's CPU and GPU adapter caches; `activate` a step's adapters, get its load time."""

    def __init__(self, max_loras: int, max_cpu_loras: int, load_s: float, copy_s: float) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.load_s = load_s  # one adapter from disk into CPU memory
        self.copy_s = copy_s  # one adapter from CPU memory into a GPU slot
        self.cpu: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.num_disk_loads = 0
        self.num_slot_loads = 0
        self.seconds = 0.0

    def reset(self) -> None:
        """A new worker's caches: no adapter in host memory or in a GPU slot (counters kept)."""
        self.cpu.clear()
        self.gpu.clear()

    def activate(self, adapters) -> float:
        """Make `adapters` (ids, in the order the worker walks them) active for a step: the
        seconds the loads take (0.0 when every one was in a GPU slot)."""
        cpu, gpu = self.cpu, self.gpu
        disk = slots = 0
        for adapter in adapters:
            if adapter in cpu:
                cpu.move_to_end(adapter)
            else:
                if len(cpu) >= self.max_cpu_loras:  # (dropped from host memory, it leaves its slot too)
                    oldest, _ = cpu.popitem(last=False)
                    gpu.pop(oldest, None)
                cpu[adapter] = None
                disk += 1
            if adapter in gpu:
                gpu.move_to_end(adapter)
            else:
                if len(gpu) >= self.max_loras:
                    gpu.popitem(last=False)
                gpu[adapter] = None
                slots += 1
        if not (disk or slots):
            return 0.0
        self.num_disk_loads += disk
        self.num_slot_loads += slots
        seconds = disk * self.load_s + slots * self.copy_s
        self.seconds += seconds
        return seconds

    def all_active(self, adapters) -> bool:
        """Every one of `adapters` is in a GPU slot (a step of them loads nothing)."""
        gpu = self.gpu
        return all(adapter in gpu for adapter in adapters)

    def summary(self) -> dict:
        return {"disk_loads": self.num_disk_loads, "slot_loads": self.num_slot_loads, "load_seconds": self.seconds}


def adapter_residency(config, backend) -> AdapterResidency | None:
    """The worker's adapter caches for `config` (None without LoRA), priced where `backend`
    prices LoRA (its `lora_modelled`: the roofline, for dense decoders with standard attention)."""
    from simkv.capacity import lora_slot_bytes
    from simkv.specs import get_model_spec

    sc = config.scheduler
    if not sc.enable_lora:
        return None
    load_s = copy_s = 0.0
    if lora_priced(backend):
        spec = get_model_spec(config.hardware.model)
        load_s = lora_slot_bytes(spec, 1, sc.max_lora_rank) / (sc.lora_load_gbs * 1e9)
        copy_s = (lora_slot_bytes(spec, config.hardware.tensor_parallel_size, sc.max_lora_rank)
                  / (config.cache.pcie_bandwidth_gbs * 1e9))
    return AdapterResidency(sc.max_loras, sc.cpu_loras, load_s, copy_s)


def lora_priced(backend) -> bool:
    """Whether `backend` (or the cost model it wraps) prices LoRA's kernels and loads."""
    return bool(getattr(getattr(backend, "inner", backend), "lora_modelled", False))
