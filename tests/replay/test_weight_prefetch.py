"""vLLM's prefetch weight offloading (--offload-group-size, --offload-num-in-group,
--offload-prefetch-step): which layers leave the GPU, the buffers that stay, and the waits for
copies a step's layers cannot hide."""

import json

import pytest
from click.testing import CliRunner

from simkv.backends.factory import make_backend
from simkv.backends.weight_prefetch import PrefetchSchedule, next_prefetch_index, offloaded_layers
from simkv.capacity import compute_capacity, decoder_layer_bytes_per_gpu, prefetched_weight_bytes, resident_weight_bytes
from simkv.cli.main import main
from simkv.config import ConfigError, EngineConfig
from tests.core.helpers import make_step


def _config(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": "llama-3-70b", "quantization": "fp8", "max_model_len": 8192} | options)


def test_the_last_layers_of_each_group_are_offloaded_and_prefetched_in_turn():
    """vLLM's example: group 8, 2 a group offloads layers 6, 7, 14, 15, ...; a finished layer's
    buffer takes the layer `step` ahead, around to the first ones, each buffer keeping its layers."""
    assert offloaded_layers(24, 8, 2) == [6, 7, 14, 15, 22, 23]
    assert len(offloaded_layers(80, 8, 1)) == 10 and offloaded_layers(5, 8, 1) == []
    assert [next_prefetch_index(j, 2, 6) for j in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [next_prefetch_index(j, 2, 5) for j in range(5)] == [2, 3, 4, 1, 0]  # (5 layers in 2 buffers)
    assert [next_prefetch_index(j, 1, 3) for j in range(3)] == [1, 2, 0]


def test_copies_are_waited_for_when_the_layers_between_cannot_hide_them():
    """Four layers of 1 s, the last two offloaded, one buffer, copies of 3 s: the first offloaded
    layer's copy starts when the step before ends (1 s of waiting after two layers), the second's
    when the first has run (3 s): 4 s a step. With copies of 0.5 s the first hides behind the two
    layers before it, the second cannot (no layer runs between the one that frees its buffer and
    itself): 0.5 s. With a layer between offloaded ones and a buffer each, copies of 1 s hide.
    The copy stream bounds a step from below: ten layers all offloaded, copies of 1 s, take at
    least 10 s however short the layers."""
    assert PrefetchSchedule(4, [2, 3], 1, 3.0).stall(1.0, 0.0) == pytest.approx(4.0)
    assert PrefetchSchedule(4, [2, 3], 1, 0.5).stall(1.0, 0.0) == pytest.approx(0.5)
    assert PrefetchSchedule(4, [0, 2], 2, 1.0).stall(1.0, 2.0) == 0.0
    ten = PrefetchSchedule(10, list(range(10)), 2, 1.0)
    assert 10 * 0.01 + ten.stall(0.01, 0.0) == pytest.approx(10.0, abs=0.02)
    wider = PrefetchSchedule(10, [4, 9], 2, 3.0)
    assert wider.stall(0.5, 0.1) < PrefetchSchedule(10, [4, 9], 1, 3.0).stall(0.5, 0.1)  # (a second buffer helps)


def test_offloaded_layers_leave_their_memory_but_their_buffers_stay():
    """Group 8, 1 a group: 10 of llama-3-70b's 80 layers leave each GPU, 2 layers' buffers
    stay (prefetch step 2): the KV cache gains 8 layers' weights, in whole blocks."""
    layer = decoder_layer_bytes_per_gpu(_config())
    prefetch = _config(offload_group_size=8, offload_prefetch_step=2)
    assert prefetched_weight_bytes(prefetch) == (10 * layer, 2 * layer)
    assert resident_weight_bytes(_config()) - resident_weight_bytes(prefetch) == pytest.approx(8 * layer)
    base, off = compute_capacity(_config()), compute_capacity(prefetch)
    assert off.available_kv_bytes - base.available_kv_bytes == pytest.approx(8 * layer, abs=1)
    tp2 = _config(tensor_parallel_size=2)
    assert decoder_layer_bytes_per_gpu(tp2) == pytest.approx(layer / 2)


def test_a_step_waits_for_copies_at_the_host_links_rate():
    """A decode step of llama-3-70b (fp8) with 10 layers offloaded over a 63 GB/s link: each copy
    (0.8 GB) takes longer than the 8 layers between, so the step lasts about the ten copies;
    over a 900 GB/s link the copies hide and the step is the plain one."""
    step = make_step(decodes=8, context=8 * 1000)
    plain = make_backend("roofline", _config()).execute(step)
    slow = make_backend("roofline", _config(offload_group_size=8, offload_prefetch_step=2))
    copies = 10 * decoder_layer_bytes_per_gpu(_config()) / 63e9
    assert slow.execute(step) >= copies > 4 * plain
    assert slow.describe()["weight_prefetch"]["offloaded_layers"] == 10
    fast = make_backend("roofline", _config(offload_group_size=8, offload_prefetch_step=2, pcie_bandwidth_gbs=900))
    assert fast.execute(step) == pytest.approx(plain)
    assert make_backend("unit", _config(offload_group_size=8)).execute(step) == 1.0
    from simkv.backends.lora_adapters import lora_priced

    lora = make_backend("roofline", _config(offload_group_size=8, enable_lora=True))
    assert lora_priced(lora) and lora.lora_seconds(64, 2) > 0  # (the roofline's own, passed through)


def test_replay_and_capacity_with_prefetched_weights(tmp_path):
    runner = CliRunner()
    base = ["--model", "llama-3-70b", "--quantization", "fp8"]
    out = tmp_path / "run"
    result = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(out), "--quiet", *base,
                                  "--offload-group-size", "8", "--offload-prefetch-step", "2"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["offload_group_size"] == 8
    waits = summary["cost_model"]["weight_prefetch"]["wait_s"]
    assert 0 < waits < summary["duration_s"]  # (over PCIe the copies are waited for, part of the time)
    assert summary["num_gpu_blocks"] == compute_capacity(_config(offload_group_size=8, offload_prefetch_step=2)).num_gpu_blocks
    cap = runner.invoke(main, ["capacity", *base, "--offload-group-size", "8", "--json"])
    assert cap.exit_code == 0, cap.output
    assert json.loads(cap.output)["weight_prefetch"]["offloaded_layers"] == 10


def test_data_parallel_ranks_wait_in_lockstep():
    """Each data-parallel rank's GPUs offload their own layers (their share of the experts) and
    copy them in each lockstep step: over PCIe the steps wait for the copies, as one engine's."""
    from simkv.replay.api import replay
    from simkv.traces import read_trace

    trace = read_trace("traces/req400.parquet")
    base = {"model": "qwen3-30b-a3b", "data_parallel_size": 2}
    plain = replay(trace, EngineConfig.from_flat(base))
    prefetch_config = EngineConfig.from_flat(base | {"offload_group_size": 4, "offload_prefetch_step": 2})
    prefetch = replay(trace, prefetch_config)
    assert prefetch.summary["num_gpu_blocks"] > plain.summary["num_gpu_blocks"]
    assert prefetch.summary["duration_s"] > 5 * plain.summary["duration_s"]
    assert prefetch.summary["cost_model"]["weight_prefetch"]["wait_s"] > 0.5 * prefetch.summary["duration_s"]
    fast = replay(trace, EngineConfig.from_flat(base | {"offload_group_size": 4, "offload_prefetch_step": 2,
                                                        "pcie_bandwidth_gbs": 900}))
    assert fast.summary["cost_model"]["weight_prefetch"]["wait_s"] < 0.05 * fast.summary["duration_s"]


def test_a_stages_copies_carry_on_from_pass_to_pass():
    """`run` (pipeline stages): the copies stream on from one pass to the next. Four layers of
    1 s, the last two offloaded into one buffer, copies of 3 s: a pass waits 4 s when it
    follows the one before at once, 3 s when it starts 12 s later (the next pass's first copy
    is done by then; the second still waits for the layer before it)."""
    schedule = PrefetchSchedule(4, [2, 3], 1, 3.0)
    assert schedule.run(0.0, 1.0) == pytest.approx(4.0)  # (ends at 8 s)
    assert schedule.run(8.0, 1.0) == pytest.approx(4.0)  # (ends at 16 s)
    assert schedule.run(28.0, 1.0) == pytest.approx(3.0)


def test_pipeline_stages_prefetch_their_own_layers():
    """-pp 2: each stage offloads the last of every 4 of its own 40 layers (10 each) and keeps 2
    buffers, so each stage's GPU holds 8 layers less; over PCIe every stage waits for its
    copies, over a 900 GB/s link the copies hide and the replay is the plain one's."""
    from simkv.replay.api import replay
    from simkv.traces import read_trace

    base = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    layer = decoder_layer_bytes_per_gpu(_config(**base))
    plain_cap = compute_capacity(_config(**base))
    prefetch_cap = compute_capacity(_config(**base, offload_group_size=4, offload_prefetch_step=2))
    assert plain_cap.pipeline_stage_weight_bytes - prefetch_cap.pipeline_stage_weight_bytes == pytest.approx(
        8 * layer, abs=2)
    trace = read_trace("traces/req400.parquet")
    plain = replay(trace, _config(**base)).summary
    slow = replay(trace, _config(**base, offload_group_size=4, offload_prefetch_step=2)).summary
    fast = replay(trace, _config(**base, offload_group_size=4, offload_prefetch_step=2, pcie_bandwidth_gbs=900)).summary
    assert slow["duration_s"] > 3 * plain["duration_s"] and slow["cost_model"]["weight_prefetch"]["wait_s"] > 0
    assert fast["duration_s"] == pytest.approx(plain["duration_s"], rel=0.02)


@pytest.mark.parametrize("options, text", [
    (dict(offload_group_size=2, offload_num_in_group=3), r"offload_num_in_group \(3\) must be <= offload_group_size \(2\)"),
    (dict(offload_group_size=2, offload_prefetch_step=0), "offload_prefetch_step \\(0\\) must be >= 1"),
    (dict(offload_group_size=8, cpu_offload_gb=4), "picks the prefetch backend and ignores cpu_offload_gb"),
    (dict(offload_group_size=-1), "offload_group_size must be >= 0"),
])
def test_bad_options_are_refused(options, text):
    with pytest.raises(ConfigError, match=text):
        _config(**options)


def test_refused_on_the_gpu_backend_and_with_a_calibration(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(tmp_path / "g"), "--quiet",
                                  "--backend", "gpu", "--device", "cpu", "--model", "tiny-llama",
                                  "--offload-group-size", "2"])
    assert result.exit_code != 0 and "simulated only" in result.output
    calib = tmp_path / "calib.json"
    calib.write_text("{}")
    result = runner.invoke(main, ["replay", "traces/req400.parquet", "--out", str(tmp_path / "c"), "--quiet",
                                  "--cost-model", str(calib), "--offload-group-size", "2"])
    assert result.exit_code != 0 and "--offload-group-size" in result.output
    assert not (tmp_path / "g").exists() and not (tmp_path / "c").exists()


def _ds(**options) -> EngineConfig:
    return EngineConfig.from_flat({"model": "deepseek-v3", "gpu": "H100-SXM", "tensor_parallel_size": 8,
                                   "offload_group_size": 4, "offload_num_in_group": 2} | options)


def test_offload_params_take_only_the_experts_of_the_offloaded_expert_layers():
    """--offload-params experts: DeepSeek-V3's first three layers are dense, so of the layers the
    groups pick (2, 3, 6, 7, ..., 58, 59) layer 2 stays whole on the GPU; each other one leaves its
    routed experts (this GPU's TP share) in host memory and copies them in every pass."""
    from simkv.backends.weight_prefetch import copy_seconds_per_layer, offloaded_positions

    config = _ds(offload_params="experts")
    spec = config.hardware.model_spec()
    positions = offloaded_positions(config, spec.num_layers)
    assert positions[:3] == [3, 6, 7] and len(positions) == len(offloaded_layers(61, 4, 2)) - 1 == 29
    per_layer = spec.routed_expert_bytes / 8 / spec.num_moe_layers
    offloaded, buffers = prefetched_weight_bytes(config)
    assert offloaded == pytest.approx(29 * per_layer) and buffers == pytest.approx(per_layer)
    assert copy_seconds_per_layer(config) == pytest.approx(per_layer / 63e9)
    assert prefetched_weight_bytes(_ds(offload_params="w2_weight"))[0] == pytest.approx(29 * per_layer / 3)
    # without --offload-params each offloaded layer leaves whole (the layers' mean)
    whole = prefetched_weight_bytes(_ds(gpu="H200"))
    assert whole[0] == pytest.approx(30 * decoder_layer_bytes_per_gpu(_ds(gpu="H200")))
    backend = make_backend("roofline", config)
    assert backend.describe()["weight_prefetch"]["offloaded_layers"] == 29


def test_a_later_pipeline_stage_counts_the_dense_layers_by_their_model_index():
    """A stage's layers are counted from its first (which layers the groups pick), but whether one
    has experts is the model's: the dense layers sit in the first stage."""
    from simkv.backends.weight_prefetch import offloaded_positions, stage_schedules

    config = _ds(offload_params="experts", gpu="H200", tensor_parallel_size=4, pipeline_parallel_size=2)
    first, second = stage_schedules(config)
    assert sorted(first.module_at) == offloaded_positions(config, 31, 0) == [p for p in offloaded_layers(31, 4, 2) if p >= 3]
    assert sorted(second.module_at) == offloaded_layers(30, 4, 2)  # (layers 31 to 60: all with experts)


@pytest.mark.parametrize("options, text", [
    ({"offload_params": "experts", "offload_group_size": 0}, "give offload_group_size too"),
    ({"offload_params": "gate"}, "'gate' is not a parameter name segment"),
    ({"offload_params": "experts", "model": "llama-3-70b"}, "has no routed experts"),
])
def test_offload_params_are_checked(options, text):
    with pytest.raises(ConfigError, match=text):
        _ds(**options)
