"""`simkv replay --backend gpu`: the lead's replay with the real backend plugged in.

The replay engine, scheduler, KV-cache manager and block pool are the simulator's, unchanged;
only the step durations come from running the steps. The KV pool gets exactly the
scheduler's `num_gpu_blocks` blocks, so block ids are used as they are.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from simkv.config import EngineConfig


def with_num_gpu_blocks(config: EngineConfig, num_gpu_blocks: int) -> EngineConfig:
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_gpu_blocks=int(num_gpu_blocks)))


#: On CPU the pool is host memory; without --num-gpu-blocks it is capped at this many blocks.
CPU_DEFAULT_MAX_BLOCKS = 4096


def plan_num_gpu_blocks(config: EngineConfig, runner) -> int:
    """The pool size: the configured one, else what the device has left after the weights
    (vLLM's rule: total * gpu_memory_utilization - resident - activation reserve)."""
    from simkv.capacity import activation_reserve_bytes, compute_capacity

    if config.cache.num_gpu_blocks is not None:
        return config.cache.num_gpu_blocks
    per_block = runner.bytes_per_block()
    if runner.device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(runner.device).total_memory
        budget = total * config.cache.gpu_memory_utilization - torch.cuda.memory_allocated(runner.device)
        budget -= activation_reserve_bytes(config)
        blocks = int(budget // per_block)
        if blocks < 2:
            raise ValueError("no device memory left for the KV cache after the weights; "
                             "raise --gpu-memory-utilization or pass --num-gpu-blocks")
        return blocks
    return min(compute_capacity(config).num_gpu_blocks, CPU_DEFAULT_MAX_BLOCKS)


def gpu_summary_fields(backend) -> dict:
    d = backend.describe()
    return {"backend": "gpu", "device": d["device"]["type"], "device_name": d["device"]["name"],
            "device_info": d["device"], "dtype": d["dtype"], "kernel_backend": d["kernel_backend"],
            "layer_ops": d["layer_ops"], "kernel_tuning": d["kernel_tuning"], "timing": d["timing"],
            **backend.runner.graph_fields(),
            "versions": d["versions"]}


def save_partial(out_dir: Path, backend, error: BaseException) -> None:
    """What was measured before a failure: every executed step's shape and duration."""
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    if backend.measured:
        pd.DataFrame(backend.measured).to_parquet(out_dir / "partial_steps.parquet", index=False)
    info = {"error": str(error), "type": type(error).__name__, "steps_measured": len(backend.measured),
            **{k: v for k, v in gpu_summary_fields(backend).items() if k != "device_info"}}
    for key in ("shape", "suggestion"):
        if hasattr(error, key):
            info[key] = getattr(error, key)
    (out_dir / "error.json").write_text(json.dumps(info, indent=2) + "\n")


def run_gpu_replay(trace, config: EngineConfig, out_dir: str | Path | None = None, device: str = "cpu",
                   dtype: str | None = None, seed: int = 0, warmup_steps: int = 3, on_progress=None,
                   save_outputs: bool = False, enforce_eager: bool = False, calibrate_alongside: str | None = None,
                   cudagraph_mode: str = "full_decode_only", goodput: dict | None = None):
    """Replay `trace` on the real backend; returns the lead's ReplayResult (summary marked gpu).

    `out_dir` receives partial results on failure (and the outputs when `save_outputs`).
    `calibrate_alongside`: a calib.json path; grid points are timed between the steps
    (`gpu_backend/interleaved.py`) and fitted there after the replay. `goodput`: latency SLOs
    in ms, judged as in a simulated replay."""
    from gpu_backend.backend import GpuBackend
    from gpu_backend.runner import ModelRunner
    from simkv.replay.api import replay, save

    if config.scheduler.async_scheduling:
        raise ValueError("async_scheduling is simulated only: the gpu backend runs each step to its end before "
                         "scheduling the next (drop --async-scheduling, or replay with --cost-model calib.json)")
    hw = config.hardware
    runner = ModelRunner(hw.model, 0, config.cache.block_size, device, dtype, seed=seed,
                         max_model_len=config.max_model_len)
    num_blocks = plan_num_gpu_blocks(config, runner)
    config = with_num_gpu_blocks(config, num_blocks)
    runner.allocate_pool(num_blocks)
    backend = GpuBackend(runner, warmup_steps=warmup_steps, max_num_seqs=config.scheduler.max_num_seqs,
                         enforce_eager=enforce_eager, cudagraph_mode=cudagraph_mode)
    grid = None
    if calibrate_alongside:
        from gpu_backend.interleaved import InterleavedGrid

        grid = InterleavedGrid(runner, config, seed=seed, enforce_eager=enforce_eager, cudagraph_mode=cudagraph_mode)
        backend.after_step = grid.after_step
    try:
        result = replay(trace, config, backend=backend, use_decode_runs=False, on_progress=on_progress,
                        pause_collector=False, goodput=goodput)  # torch may make cycles holding device memory
    except BaseException as exc:
        if out_dir is not None:
            save_partial(Path(out_dir), backend, exc)
        raise
    result.summary.update(gpu_summary_fields(backend))
    if grid is not None:
        grid.write(calibrate_alongside, hw.model)
        result.summary["calibrated_alongside"] = {"file": str(calibrate_alongside), "grid_points": len(grid.points),
                                                  "points_per_step": grid.points_per_step}
    if out_dir is not None and backend.measured:  # per-step shapes and measured durations
        import pandas as pd

        from simkv.atomic import atomic_write

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        frame = pd.DataFrame(backend.measured)
        atomic_write(Path(out_dir) / "measured_steps.parquet", lambda tmp: frame.to_parquet(tmp, index=False))
    if save_outputs and out_dir is not None:
        save(result, out_dir)
    return result


def run_gpu_replay_cli(trace, config: EngineConfig, out_dir, device: str | None, dtype: str | None, on_progress=None,
                       enforce_eager: bool = False, calibrate_alongside: str | None = None,
                       cudagraph_mode: str = "full_decode_only", goodput: dict | None = None):
    """`simkv replay --backend gpu`: device defaults to cuda when present; failures become
    click errors naming the step shape and the setting that fits (partial results saved)."""
    import click
    import torch

    from gpu_backend.backend import DeviceOOMError

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return run_gpu_replay(trace, config, out_dir, device, dtype, on_progress=on_progress,
                              enforce_eager=enforce_eager, calibrate_alongside=calibrate_alongside,
                              cudagraph_mode=cudagraph_mode, goodput=goodput)
    except DeviceOOMError as exc:
        raise click.ClickException(f"{exc}\nPartial results (steps measured so far) are in {out_dir}/"
                                   "partial_steps.parquet and error.json") from None
    except RuntimeError as exc:
        if "CUDA" in str(exc) or "device" in str(exc):
            import traceback

            traceback.print_exc(file=sys.stderr)  # where it failed: a device fault is rarely reproduced
            raise click.ClickException(str(exc)) from None
        raise
