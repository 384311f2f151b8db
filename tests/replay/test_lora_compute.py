"""What LoRA adapters cost a step (`--enable-lora`): the scheduler counts each step's tokens of
requests with an adapter and their distinct adapters, and the roofline prices vLLM's punica
kernels from them (docs/semantics.md#lora-adapters---enable-lora---max-loras)."""

import numpy as np
import pandas as pd
import pytest

from simkv.backends.factory import make_roofline
from simkv.config import EngineConfig
from simkv.core.outputs import ScheduledChunk, SchedulerOutput
from simkv.core.request import Request
from simkv.replay.api import replay
from simkv.traces.lora import assign_adapters
from simkv.traces.schema import read_trace, take_rows, trace_from_frame


def _roofline(**options):
    return make_roofline(EngineConfig.from_flat({"enable_lora": True, **options}))


def _shapes_8b():  # llama-3-8b, one GPU: q, k, v, o, gate, up, down
    h, q, kv, inter = 4096, 4096, 1024, 14336
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def test_the_roofline_prices_shrink_and_expand_adapter_reads_and_launches() -> None:
    model = _roofline(max_lora_rank=16)
    shapes = _shapes_8b()
    width = sum(i + o for i, o in shapes)
    layers, rank = 32, 16
    flops = 2 * rank * width * layers  # per token: x @ A and (x A) @ B, every linear layer
    per_adapter = 2 * rank * width * layers  # bf16 A and B, read once a step
    per_token = 2 * sum(i + 2 * o for i, o in shapes) * layers  # input read, output read and written
    fixed = 12 * layers * 3e-6  # zero, shrink and expand of four linear groups a layer
    assert model.lora_seconds(0, 0) == 0.0  # (vLLM's no-LoRA flag: no kernel runs)
    for tokens, adapters in ((1, 1), (64, 8), (8192, 2)):
        expected = max(flops * tokens / model.flop_rate,
                       (per_adapter * adapters + per_token * tokens) / model.byte_rate) + fixed
        assert model.lora_seconds(tokens, adapters) == pytest.approx(expected, rel=1e-12)
    # a decode step of 64 sequences on 8 adapters: memory-bound, the launches a large share
    assert model.lora_seconds(64, 8) > model.lora_seconds(64, 1) > fixed
    # the slots' width is the kernels' width; TP shards each layer's TP side
    assert _roofline(max_lora_rank=64).lora_seconds(4096, 1) > model.lora_seconds(4096, 1)
    assert _roofline(tensor_parallel_size=2).lora_seconds(4096, 4) < model.lora_seconds(4096, 4)


def test_a_step_pays_its_lora_kernels_and_only_with_adapter_tokens() -> None:
    model = _roofline()
    request = Request("r", 0, 0.0, 512, 8)

    def step(lora_tokens, adapters):
        return SchedulerOutput(0, [ScheduledChunk(request, 0, 512)], 3, 3 * 600, None, [], 4, 0, 0, 0, 0,
                               num_lora_tokens=lora_tokens, num_active_loras=adapters)

    base = model.execute(step(0, 0))
    assert model.execute(step(515, 2)) == pytest.approx(base + model.lora_seconds(515, 2), rel=1e-12)
    assert model.describe()["lora_kernel_s"] == 3e-6
    assert "lora_kernel_s" not in make_roofline(EngineConfig.from_flat({})).describe()
    # experts, latent attention: not modelled (no shapes), so nothing priced
    moe = _roofline(model="qwen3-30b-a3b")
    assert not moe.lora_modelled and moe.lora_seconds(512, 2) == 0.0


class _Recorder:
    """A cost model that lists every step's LoRA counts beside the ones its request lists give."""

    name = "recorder"
    supports_decode_runs = False
    needs_request_detail = True

    def __init__(self):
        self.rows = []

    def execute(self, out: SchedulerOutput) -> float:
        tokens, adapters = 0, set()
        for chunk in out.chunks:
            if chunk.request.lora_id:
                tokens += chunk.num_new_tokens
                adapters.add(chunk.request.lora_id)
        for decode in out.decodes:
            if decode.request.lora_id:
                tokens += 1
                adapters.add(decode.request.lora_id)
        self.rows.append((out.num_lora_tokens, out.num_active_loras, tokens, len(adapters),
                          out.total_num_scheduled_tokens, len(out.preempted)))
        return 0.01 + 1e-5 * out.total_num_scheduled_tokens

    def describe(self) -> dict:
        return {"cost_model": self.name}


@pytest.mark.parametrize("options", [
    {}, {"async_scheduling": True},
    {"max_num_batched_tokens": 40, "max_num_seqs": 40, "long_prefill_token_threshold": 32},  # chunks beside decodes
    {"num_gpu_blocks": 60, "max_model_len": 512, "max_num_batched_tokens": 512},  # preemptions
], ids=["sync", "async", "budget", "preempting"])
def test_the_scheduler_counts_each_steps_adapter_tokens(options) -> None:
    rng = np.random.default_rng(5)
    n = 120
    frame = pd.DataFrame({"arrival_time_s": np.sort(rng.uniform(0, 3, n)),
                          "prompt_tokens": rng.integers(8, 200, n), "output_tokens": rng.integers(1, 60, n),
                          "lora_name": rng.choice(np.array(["a", "b", "c", None], dtype=object), n)})
    trace = trace_from_frame(frame)
    recorder = _Recorder()
    replay(trace, EngineConfig.from_flat({"enable_lora": True, "max_loras": 2, **options}), backend=recorder)
    rows = np.array(recorder.rows)
    assert (rows[:, 0] == rows[:, 2]).all() and (rows[:, 1] == rows[:, 3]).all()
    assert rows[:, 0].sum() > 0 and (rows[:, 0] < rows[:, 4]).any() and (rows[:, 1] == 2).any()
    assert (rows[:, 1] <= 2).all()  # (max_loras)
    if "num_gpu_blocks" in options:
        assert rows[:, 5].sum() > 0  # (requests were preempted)


def _adapter_slice(n_adapters: int):
    trace = take_rows(read_trace("traces/azure_conv_slice.parquet"), np.arange(400))
    return assign_adapters(trace, n_adapters, 1.0, seed=3)


def test_adapters_slow_the_steps_that_run_them(tmp_path) -> None:
    """Same trace, same cache: adapters on every request lengthen ITL; enable_lora with no request
    naming an adapter changes no step (vLLM launches no LoRA kernel then)."""
    trace = _adapter_slice(4)
    plain = trace_from_frame(pd.DataFrame({"arrival_time_s": trace.arrival_time_s,
                                           "prompt_tokens": trace.prompt_tokens,
                                           "output_tokens": trace.output_tokens}))
    fixed = {"num_gpu_blocks": 20_000}
    base = replay(plain, EngineConfig.from_flat(fixed))
    unused = replay(plain, EngineConfig.from_flat({**fixed, "enable_lora": True, "max_loras": 4}))
    assert all(np.array_equal(unused.steps[k], base.steps[k]) for k in base.steps) and unused.steps.keys() == base.steps.keys()
    assert unused.summary["lora"]["compute_modelled"] is True
    lora = replay(trace, EngineConfig.from_flat({**fixed, "enable_lora": True, "max_loras": 4}))
    assert lora.summary["lora"]["deferrals"] == 0
    assert lora.summary["itl_s"]["p50"] > 1.1 * base.summary["itl_s"]["p50"]
    unit = replay(trace, EngineConfig.from_flat({**fixed, "enable_lora": True, "max_loras": 4}), "unit")
    assert unit.summary["lora"]["compute_modelled"] is False


def test_capacity_prices_a_decode_steps_lora_kernels() -> None:
    """`simkv capacity --enable-lora` adds the roofline's price of the adapters' kernels in a
    decode step, for one sequence and for a full batch on max_loras adapters."""
    import json

    from tests.cli_runs import cli_ok

    out = json.loads(cli_ok(["capacity", "--enable-lora", "--max-loras", "16", "--json"]))
    kernels = out["lora"]["decode_step_kernels_s"]
    model = _roofline(max_loras=16)
    assert kernels["one_token"] == model.lora_seconds(1, 1)
    assert kernels["full_batch"] == model.lora_seconds(1024, 16) > kernels["one_token"]  # (vLLM's max_num_seqs on an H100)
    assert kernels["full_batch_sequences"] == 1024 and kernels["launch_s"] == 3e-6
    assert "decode_step_kernels_s" not in json.loads(
        cli_ok(["capacity", "--enable-lora", "--model", "qwen3-30b-a3b", "--json"]))["lora"]
    assert "LoRA kernels per decode step" in cli_ok(["capacity", "--enable-lora"])
    loads = json.loads(cli_ok(["capacity", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "8",
                               "--lora-load-gbs", "4", "--json"]))["lora"]["adapter_load_s"]
    assert loads == {"max_cpu_loras": 8, "disk_read": pytest.approx(83_886_080 / 4e9),
                     "slot_copy": pytest.approx(83_886_080 / 63e9), "lora_load_gbs": 4.0}
    assert "LoRA adapter load" in cli_ok(["capacity", "--enable-lora"])
