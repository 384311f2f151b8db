"""GpuBackend inside the lead's replay: same scheduler objects, same schedule, gpu summary, OOM."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from gpu_backend.backend import DeviceOOMError, GpuBackend
from gpu_backend.replay import run_gpu_replay
from gpu_backend.runner import ModelRunner
from simkv.cli.main import main
from simkv.config import EngineConfig
from simkv.core.block_pool import BlockPool
from simkv.core.kv_cache_manager import KVCacheManager
from simkv.core.scheduler import Scheduler
from simkv.replay.api import replay
from simkv.traces.schema import trace_from_frame, write_trace
from tests.gpu_backend.lockstep import lockstep

OPTS = {"model": "tiny-llama", "num_gpu_blocks": 64, "max_num_batched_tokens": 96, "max_num_seqs": 8,
        "block_size": 16, "max_model_len": 256}


def _trace(n=12, at_zero=True, seed=1, out=(2, 12)):
    rng = np.random.default_rng(seed)
    arr = np.zeros(n) if at_zero else np.sort(rng.uniform(0, 0.05, n))
    return trace_from_frame(pd.DataFrame({"arrival_time_s": arr, "prompt_tokens": rng.integers(8, 90, n),
                                          "output_tokens": rng.integers(out[0], out[1], n)}))


def test_same_engine_objects_and_same_schedule_as_simulation():
    trace = _trace(out=(20, 60))
    config = EngineConfig.from_flat(OPTS | {"num_gpu_blocks": 20})  # small pool: preemptions happen
    result = run_gpu_replay(trace, config, device="cpu", warmup_steps=1)
    sched = result.run.scheduler
    assert type(sched) is Scheduler
    assert type(sched.kv_cache_manager) is KVCacheManager
    assert type(sched.kv_cache_manager.block_pool) is BlockPool
    sim = replay(trace, config, "unit", use_decode_runs=False)
    # All arrivals at t=0: the schedule cannot depend on durations, so it must be identical.
    for col in ("num_prefill_tokens", "num_decode_tokens", "num_blocks_used", "num_preemptions", "num_running"):
        assert np.array_equal(result.steps[col], sim.steps[col]), col
    assert result.summary["num_preemptions"] == sim.summary["num_preemptions"] > 0
    s = result.summary
    assert s["backend"] == "gpu" and s["device"] == "cpu" and s["versions"]["torch"] == torch.__version__
    assert s["layer_ops"] == "torch attention, torch element-wise ops" and s["kernel_tuning"] is None
    assert s["cuda_piecewise_sizes"] == [] and s["cuda_piecewise_graphs"] == "off"
    assert s["num_finished"] == len(trace)
    assert np.all(result.steps["duration_s"] > 0)
    # the terminal table says where the steps ran, not the GPU spec a simulation would assume
    from rich.console import Console

    from simkv.replay.report import print_summary

    console = Console(record=True, width=120)
    print_summary(s, console=console)
    text = console.export_text()
    assert "model / device" in text and "CPU" in text and "measured, torch kernels" in text and "H100" not in text


def test_oom_reports_shape_and_keeps_partial_results(tmp_path, monkeypatch):
    trace_path = tmp_path / "t.parquet"
    write_trace(_trace(8, at_zero=False), trace_path)
    calls = {"n": 0}
    orig = ModelRunner.run

    def flaky(self, output):
        calls["n"] += 1
        if calls["n"] > 4 and output.num_prefill_tokens > 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return orig(self, output)

    monkeypatch.setattr(ModelRunner, "run", flaky)
    monkeypatch.setattr("gpu_backend.synthetic.warm_up", lambda runner, steps=3: None)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["replay", str(trace_path), "--backend", "gpu", "--device", "cpu",
                                    "--model", "tiny-llama", "--num-gpu-blocks", "64", "--max-model-len", "256", "--out", str(out)])
    assert res.exit_code != 0
    assert "out of memory" in res.output and "--max-num-batched-tokens" in res.output
    err = json.loads((out / "error.json").read_text())
    assert err["shape"]["num_prefill_tokens"] > 0 and "suggestion" in err
    partial = pd.read_parquet(out / "partial_steps.parquet")
    assert len(partial) == err["steps_measured"] >= 1 and (partial["duration_s"] > 0).all()


def test_backend_direct_oom_error_type(monkeypatch):
    runner = ModelRunner("tiny-llama", 16, 16, "cpu")
    backend = GpuBackend(runner, warmup_steps=0)
    monkeypatch.setattr(runner, "run", lambda out: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory")))
    from gpu_backend.synthetic import synthetic_output

    with pytest.raises(DeviceOOMError) as info:
        backend.execute(synthetic_output([(0, 40)], [10, 20], 16, 16))
    assert info.value.shape["num_prefill_tokens"] == 40 and info.value.shape["num_decodes"] == 2


def test_cli_gpu_replay_writes_outputs_and_report(tmp_path):
    trace_path = tmp_path / "t.parquet"
    write_trace(_trace(6, at_zero=False), trace_path)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["replay", str(trace_path), "--backend", "gpu", "--device", "cpu", "--quiet",
                                    "--model", "tiny-llama", "--num-gpu-blocks", "64", "--max-model-len", "256", "--out", str(out)])
    assert res.exit_code == 0, res.output
    for f in ("summary.json", "requests.parquet", "steps.parquet", "report.html", "measured_steps.parquet"):
        assert (out / f).is_file(), f
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "gpu" and summary["cost_model"]["cost_model"] == "gpu"
    html = (out / "report.html").read_text()
    assert "<svg" in html and "src=\"http" not in html


@pytest.mark.cuda
def test_fused_layer_ops_match_torch_operators_on_cuda():
    """The compiled fused element-wise kernels inside the bf16 forward give the logits of the
    same forward with torch operators (the two round differently, within bf16 tolerance)."""
    from simkv.core.request import Request

    config = EngineConfig.from_flat(OPTS)
    sched = Scheduler(config, 64, detail=True)
    fused = ModelRunner("tiny-llama", 64, 16, "cuda", "bf16", seed=5)
    plain = ModelRunner("tiny-llama", 64, 16, "cuda", "bf16", seed=5, fused_ops=False)
    assert "fused Triton" in fused.ops.name and "torch element-wise" in plain.ops.name
    plain.model.copy_weights_from(fused.model)
    requests = [Request(str(i), i, 0.0, p, 4) for i, p in enumerate((20, 37, 70))]
    for _, a, b in lockstep(sched, requests, plain, fused, share_tokens=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=0.05, atol=0.05)


@pytest.mark.cuda
def test_cuda_runner_matches_cpu_reference():
    from simkv.core.request import Request

    config = EngineConfig.from_flat(OPTS)
    sched = Scheduler(config, 64, detail=True)
    cpu = ModelRunner("tiny-llama", 64, 16, "cpu", "fp32", seed=5)
    cuda = ModelRunner("tiny-llama", 64, 16, "cuda", "bf16", seed=5)
    cuda.model.copy_weights_from(cpu.model)  # each device draws its own random weights
    requests = [Request(str(i), i, 0.0, p, 4) for i, p in enumerate((20, 37, 70))]
    steps = 0
    for _, a, b in lockstep(sched, requests, cpu, cuda, share_tokens=True):
        torch.testing.assert_close(b.float().cpu(), a, rtol=0.05, atol=0.05)
        steps += 1
    assert steps >= 4


def test_a_position_past_the_rotary_tables_is_refused_before_the_forward():
    from gpu_backend.synthetic import synthetic_output

    runner = ModelRunner("tiny-llama", 16, 16, "cpu")
    with pytest.raises(ValueError, match="reaches position .* past the model's"):
        runner.run(synthetic_output([], [runner.max_positions + 1], 16, 16))
    runner.run(synthetic_output([], [runner.max_positions], 16, 16))  # the last position is fine


def test_clients_that_give_up_on_the_real_backend(monkeypatch):
    """Client time-outs run on the real backend as in a simulation, with its measured steps: the
    clients whose deadline (the first quartile of the end-to-end latencies of the same replay
    without them: wall-clock steps vary from run to run, and at the median a faster second run
    could leave no client late) passes give up and are aborted, and retry once; the runner drops an aborted request's rows of the
    persistent batch and its sampled ids at the next step (a retry is a request of its own that
    samples anew), as vLLM's runner drops those its finished_req_ids name."""
    from gpu_backend.runner import ModelRunner
    from simkv.core.request import RequestStatus

    trace = _trace(n=24, at_zero=False, out=(10, 60))
    config = EngineConfig.from_flat(OPTS)
    patient = run_gpu_replay(trace, config, device="cpu", warmup_steps=1)
    deadline = float(patient.requests["e2e_s"].quantile(0.25))
    runners, aborted = [], []
    prepare = ModelRunner.prepare

    def watched(self, output):
        runners.append(self)
        aborted.extend(output.aborted or ())
        return prepare(self, output)

    monkeypatch.setattr(ModelRunner, "prepare", watched)
    config = EngineConfig.from_flat(OPTS | {"client_timeout_s": deadline, "client_max_retries": 1})
    result = run_gpu_replay(trace, config, device="cpu", warmup_steps=1)
    status = result.requests["status"]
    client = result.summary["client"]
    assert set(status) <= {"finished", "timed_out"} and client["aborted"] > 0 and client["retries"] > 0
    assert (status == "finished").sum() + client["timed_out_requests"] == len(trace)
    assert result.summary["backend"] == "gpu"
    runner = runners[-1]
    assert aborted and all(q.status == RequestStatus.ABORTED for q in aborted)
    assert not any(q in runner.block_rows._rows for q in aborted)
