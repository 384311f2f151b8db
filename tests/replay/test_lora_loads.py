"""Where the worker keeps LoRA adapters and what loading them costs (`--max-cpu-loras`,
`--lora-load-gbs`): vLLM 0.33's LRU caches of adapters in host memory and in GPU slots, and the
steps that wait for a load (docs/semantics.md#lora-adapters---enable-lora---max-loras)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simkv.backends.factory import make_roofline
from simkv.backends.lora_adapters import AdapterResidency, adapter_residency
from simkv.capacity import lora_slot_bytes
from simkv.config import ConfigError, EngineConfig
from simkv.replay.api import replay
from simkv.specs import get_model_spec
from simkv.traces.lora import assign_adapters
from simkv.traces.schema import read_trace, take_rows, trace_from_frame
from tests.cli_runs import cli_fails
from tests.core.helpers import assert_decode_runs_change_no_bytes, drive_lora_worker


def test_the_worker_keeps_the_most_recent_adapters_in_host_memory_and_in_slots() -> None:
    """Two GPU slots, three adapters in host memory; a disk read costs 10 s, a slot copy 1 s."""
    worker = AdapterResidency(max_loras=2, max_cpu_loras=3, load_s=10.0, copy_s=1.0)
    assert worker.activate((1, 2)) == 22.0  # both read from disk and copied into the slots
    assert worker.activate((1, 2)) == 0.0 and worker.all_active((2, 1))
    assert worker.activate((3,)) == 11.0  # read; the slot of 1 (least recent) is taken
    assert list(worker.gpu) == [2, 3] and list(worker.cpu) == [1, 2, 3]
    assert not worker.all_active((1, 3))
    assert worker.activate((1,)) == 1.0  # still in host memory: a copy only, into 2's slot
    assert worker.activate((4,)) == 11.0  # host memory full: 2 (least recent) is dropped
    assert list(worker.cpu) == [3, 1, 4] and list(worker.gpu) == [1, 4]
    assert worker.activate((2,)) == 11.0  # read again
    assert (worker.num_disk_loads, worker.num_slot_loads, worker.seconds) == (5, 6, 56.0)
    assert worker.summary() == {"disk_loads": 5, "slot_loads": 6, "load_seconds": 56.0}


RECORDED = json.loads((Path(__file__).parent / "data" / "lora_worker_vllm_cases.json").read_text())["cases"]


@pytest.mark.parametrize("index", range(len(RECORDED)))
def test_recorded_vllm_worker_cases(index: int) -> None:
    """vLLM 0.33's LRUCacheWorkerLoRAManager on random steps (scripts/oracle_lora_worker.py):
    every step's disk reads and slot copies and both caches' order after it."""
    case = RECORDED[index]
    assert drive_lora_worker(case) == case["vllm"]


def test_recorded_worker_cases_need_the_host_cache_recency() -> None:
    """A host-memory hit that did not count as a use breaks recorded cases."""

    class Untouched(AdapterResidency):
        def activate(self, adapters):
            for adapter in adapters:
                if adapter not in self.cpu:
                    if len(self.cpu) >= self.max_cpu_loras:
                        self.gpu.pop(self.cpu.popitem(last=False)[0], None)
                    self.cpu[adapter] = None
                    self.num_disk_loads += 1
                if adapter in self.gpu:
                    self.gpu.move_to_end(adapter)
                else:
                    if len(self.gpu) >= self.max_loras:
                        self.gpu.popitem(last=False)
                    self.gpu[adapter] = None
                    self.num_slot_loads += 1
            return 0.0

    broken = sum(drive_lora_worker(c, Untouched(c["max_loras"], c["max_cpu_loras"], 1.0, 0.0)) != c["vllm"]
                 for c in RECORDED)
    assert broken >= 20, broken  # (29 of 40)


def test_a_step_touches_its_adapters_in_id_order() -> None:
    """The order a step walks its adapters in decides which of them a later load evicts."""
    worker = AdapterResidency(max_loras=2, max_cpu_loras=2, load_s=1.0, copy_s=0.0)
    worker.activate((5, 7))
    worker.activate((9,))  # 5 was touched first: it goes
    assert list(worker.gpu) == [7, 9] and list(worker.cpu) == [7, 9]


def test_loads_are_priced_from_the_adapters_bytes() -> None:
    """llama-3-8b at rank 16: every linear layer's A and B in bf16, read whole from disk at
    lora_load_gbs and copied, each GPU its share, at the PCIe bandwidth."""
    shapes = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    whole = 2 * 16 * sum(i + o for i, o in shapes) * 32
    assert whole == 83_886_080
    config = EngineConfig.from_flat({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 8})
    worker = adapter_residency(config, make_roofline(config))
    assert (worker.max_loras, worker.max_cpu_loras) == (4, 8)
    assert worker.load_s == pytest.approx(whole / 2e9) and worker.copy_s == pytest.approx(whole / 63e9)
    tp2 = EngineConfig.from_flat({"enable_lora": True, "tensor_parallel_size": 2, "lora_load_gbs": 4.0,
                                  "pcie_bandwidth_gbs": 50.0})
    worker = adapter_residency(tp2, make_roofline(tp2))
    share = lora_slot_bytes(get_model_spec("llama-3-8b"), 2, 16)
    assert share < whole and worker.load_s == pytest.approx(whole / 4e9) and worker.copy_s == pytest.approx(share / 50e9)
    assert worker.max_cpu_loras == 1  # (vLLM's default: max_loras)
    from simkv.backends.cost_models import UnitCostModel

    unit = adapter_residency(config, UnitCostModel())
    assert (unit.load_s, unit.copy_s) == (0.0, 0.0)  # (counted, not priced)
    assert adapter_residency(EngineConfig.from_flat({}), make_roofline(config)) is None


def _all_at_once(n: int, adapters: int):
    """n requests at t = 0, request i on adapter i % adapters: the schedule does not depend on time."""
    rng = np.random.default_rng(2)
    return trace_from_frame(pd.DataFrame({
        "arrival_time_s": np.zeros(n), "prompt_tokens": rng.integers(50, 400, n),
        "output_tokens": rng.integers(5, 40, n),
        "lora_name": np.array([f"lora-{i % adapters}" for i in range(n)], dtype=object)}))


def test_each_step_that_loads_lasts_the_loads_longer() -> None:
    trace = _all_at_once(40, 5)
    base = {"enable_lora": True, "max_loras": 2, "num_gpu_blocks": 4000}
    fast = replay(trace, EngineConfig.from_flat({**base, "lora_load_gbs": 1000.0}))
    slow = replay(trace, EngineConfig.from_flat({**base, "lora_load_gbs": 1.0}))
    for key in ("num_running", "num_waiting", "num_prefill_tokens", "num_decode_tokens"):
        assert np.array_equal(fast.steps[key], slow.steps[key]), key  # (the same steps, only longer)
    f, s = fast.summary["lora"], slow.summary["lora"]
    assert (f["disk_loads"], f["slot_loads"]) == (s["disk_loads"], s["slot_loads"])
    assert f["disk_loads"] >= 5 and f["slot_loads"] >= 5
    extra = np.asarray(slow.steps["duration_s"]) - np.asarray(fast.steps["duration_s"])
    per_load = 83_886_080 / 1e9 - 83_886_080 / 1000e9
    assert extra.sum() == pytest.approx(f["disk_loads"] * per_load, abs=1e-6 * len(extra))
    assert ((extra > 1e-6).sum() > 0) and (extra[extra > 1e-6] >= per_load - 1e-6).all()
    assert s["load_seconds"] - f["load_seconds"] == pytest.approx(f["disk_loads"] * per_load)
    assert slow.summary["duration_s"] > fast.summary["duration_s"] + f["disk_loads"] * per_load * 0.99


def _adapter_slice(n_adapters: int = 8):
    trace = take_rows(read_trace("traces/azure_conv_slice.parquet"), np.arange(500))
    return assign_adapters(trace, n_adapters, 1.0, seed=4)


def test_host_memory_for_every_adapter_reads_each_once() -> None:
    trace = _adapter_slice()
    default = replay(trace, EngineConfig.from_flat({"enable_lora": True, "max_loras": 2}))
    roomy = replay(trace, EngineConfig.from_flat({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 8}))
    d, r = default.summary["lora"], roomy.summary["lora"]
    assert (d["max_cpu_loras"], r["max_cpu_loras"]) == (2, 8)
    assert r["disk_loads"] == 8 and d["disk_loads"] == d["slot_loads"] > 8
    assert r["slot_loads"] > 8 and r["load_seconds"] < d["load_seconds"]
    assert roomy.summary["ttft_s"]["p50"] < default.summary["ttft_s"]["p50"]
    assert roomy.summary["duration_s"] < default.summary["duration_s"]


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}, {"max_cpu_loras": 3},
                                     {"max_num_active_seqs": 8, "max_cpu_loras": 4}],
                         ids=["sync", "async", "host-memory", "active-limit"])
def test_decode_runs_change_no_bytes_with_adapter_loads(options, tmp_path) -> None:
    """A decode run whose adapters are all in slots only touches them; one that would load steps."""
    config = EngineConfig.from_flat({"enable_lora": True, "max_loras": 2, **options})
    res = assert_decode_runs_change_no_bytes(_adapter_slice(6), config, tmp_path)
    assert res.summary["lora"]["slot_loads"] > 6


def test_max_cpu_loras_below_max_loras_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"max_cpu_loras \(2\) must be >= max_loras \(4\)"):
        EngineConfig.from_flat({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2})
    with pytest.raises(ConfigError, match="lora_load_gbs must be > 0"):
        EngineConfig.from_flat({"enable_lora": True, "lora_load_gbs": 0.0})
    out = cli_fails(["replay", "traces/req400.parquet", "--enable-lora", "--max-loras", "3", "--max-cpu-loras", "1"])
    assert "max_cpu_loras (1) must be >= max_loras (3)" in out


def test_a_new_workers_adapter_caches_are_empty():
    """AdapterResidency.reset (a new pod, simkv/replay/autoscale.py): the next step loads every
    adapter again, from disk; the counters are kept."""
    residency = AdapterResidency(max_loras=2, max_cpu_loras=4, load_s=1.0, copy_s=0.1)
    residency.activate([1, 2])
    assert residency.activate([1, 2]) == 0.0
    residency.reset()
    assert residency.activate([1, 2]) > 0.0 and residency.num_disk_loads == 4
