"""Measure the grid on the real backend and write calib.json (partial results kept on any stop)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

from simkv.atomic import atomic_write_text
from simkv.calibration.costmodel import FORMAT, FORMAT_VERSION
from simkv.calibration.fit import fit_rows
from simkv.calibration.grid import PRESETS, GridPoint, blocks_for, build_grid


def write_json_atomic(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def nearest_fitting(measured: list[dict], point: GridPoint) -> dict | None:
    """The largest measured point of the same family (what is known to fit)."""
    same = [m for m in measured if m["shape"]["family"] == point.family]
    return max(same, key=lambda m: m["features"][0], default=None)


def _dominated(point: GridPoint, failed: list[GridPoint]) -> bool:
    """At least as large as a point that already ran out of memory (same family)."""
    f = point.features
    return any(p.family == point.family and f[0] >= p.features[0] and f[4] + f[3] >= p.features[4] + p.features[3]
               for p in failed)


def measure_grid(runner, points: list[GridPoint], warmup: int = 2, repeats: int = 5, budget_s: float | None = None,
                 on_point: Callable[[dict, int, int], None] | None = None, statistic: str = "median") -> dict:
    """Measure every point: `warmup` untimed runs and one timed run each, in grid order; then
    `repeats - 1` more rounds over all measured points (interleaved, so a burst of load on a
    shared host spreads over many points instead of spoiling one). Each point keeps the
    median (or mean) of its samples.

    Stops early (keeping what it has) when the time budget is spent. An out-of-memory point is
    recorded with the nearest measured point that fits; larger points of its family are skipped."""
    from gpu_backend.backend import StepTimer, is_oom
    from gpu_backend.synthetic import run_synthetic, synthetic_output

    timer = StepTimer(runner.device)
    measured, ooms, skipped = [], [], []
    failed: list[GridPoint] = []
    outputs = []
    t_start = time.perf_counter()
    stopped_by_budget = False

    def over_budget(next_cost: float) -> bool:
        return budget_s is not None and time.perf_counter() - t_start + next_cost > budget_s

    for i, point in enumerate(points):
        elapsed = time.perf_counter() - t_start
        if measured and over_budget(elapsed / max(len(measured) + len(ooms), 1)):
            stopped_by_budget = True
            skipped.extend({**p.describe(), "reason": "time budget"} for p in points[i:])
            break
        if _dominated(point, failed):
            skipped.append({**point.describe(), "reason": "larger than a point that ran out of memory"})
            continue
        out = synthetic_output(point.prefills, point.decodes, runner.block_size, runner.num_gpu_blocks)
        try:
            for _ in range(warmup):
                run_synthetic(runner, out)
            samples = [timer.time(run_synthetic, runner, out)[1]]
        except Exception as exc:  # noqa: BLE001 - only OOM is handled, the rest re-raised
            if not is_oom(exc):
                raise
            if runner.device.type == "cuda":
                import torch

                torch.cuda.empty_cache()
            near = nearest_fitting(measured, point)
            ooms.append({"shape": point.describe(), "features": list(point.features), "error": str(exc).splitlines()[0],
                         "nearest_fitting": near["shape"] if near else None})
            failed.append(point)
            if on_point:
                on_point({"oom": ooms[-1]}, i + 1, len(points))
            continue
        row = grid_row(point, samples, statistic)
        measured.append(row)
        outputs.append(out)
        if on_point:
            on_point(row, i + 1, len(points))
    rounds = 1
    for _ in range(repeats - 1):
        round_cost = sum(r["samples_s"][-1] for r in measured)
        if over_budget(round_cost):
            stopped_by_budget = stopped_by_budget or budget_s is not None
            break
        for row, out in zip(measured, outputs):
            row["samples_s"].append(timer.time(run_synthetic, runner, out)[1])
            summarise_samples(row, statistic)
        rounds += 1
    return {"measured": measured, "oom": ooms, "skipped": skipped, "stopped_by_budget": stopped_by_budget,
            "rounds": rounds, "measure_time_s": time.perf_counter() - t_start}


def activation_reserve(spec, max_num_batched_tokens: int) -> int:
    """Bytes left free for a step's activations when sizing a calibration pool (bf16 MLP and
    attention buffers of the largest step, plus 1 GiB)."""
    return max_num_batched_tokens * 2 * (2 * spec.widest_mlp + 4 * spec.hidden_size) + (1 << 30)


def plan_pool_blocks(points: list[GridPoint], block_size: int, runner_bytes_per_block: int, device: str,
                     activation_reserve: int) -> int:
    """Blocks for the calibration KV pool: the largest point's, capped by free device memory."""
    need = max((blocks_for(p, block_size) for p in points), default=1) + 1
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        cap = int((free * 0.9 - activation_reserve) // runner_bytes_per_block)
        return max(2, min(need, cap))
    return need


def new_record(model: str, runner, dtype: str, preset: str, points: list[GridPoint], dropped: list, num_blocks: int,
               settings: dict) -> dict:
    """The head of a calib.json (no measured points, no fit yet)."""
    from gpu_backend.backend import timing_label
    from gpu_backend.env import canonical_gpu, device_info, library_versions
    from kernels.tuning import describe_tuning

    dev = device_info(runner.device)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model": model, "device": dev,
        "gpu": canonical_gpu(dev["name"]) if dev["type"] == "cuda" else None,
        "dtype": dtype, "kernel_backend": runner.kernel_backend, "layer_ops": runner.ops.name,
        "kernel_tuning": describe_tuning(runner.kernel_tuning), "versions": library_versions(),
        "timing": timing_label(runner.device), "block_size": runner.block_size, "kv_pool_blocks": num_blocks,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "settings": settings,
        "grid": {"design": PRESETS[preset], "num_points": len(points), "dropped": dropped, "measured": []},
        "complete": False,
    }


def grid_row(point: GridPoint, samples: list[float], statistic: str) -> dict:
    """A measured point as calib.json records it (`grid.measured`)."""
    row = {"label": point.label(), "shape": point.describe(), "features": list(point.features), "samples_s": samples}
    summarise_samples(row, statistic)
    return row


def summarise_samples(row: dict, statistic: str) -> None:
    """A grid point's median, mean and fitted value (`statistic` of its samples)."""
    xs = row["samples_s"]
    row["median_s"] = statistics.median(xs)
    row["mean_s"] = statistics.fmean(xs)
    row["value_s"] = row["mean_s"] if statistic == "mean" else row["median_s"]


def calibrate(model: str, out: str | Path, device: str = "cpu", dtype: str | None = None, preset: str = "tiny",
              warmup: int = 2, repeats: int = 5, budget_s: float | None = None, block_size: int = 16,
              max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, seed: int = 0,
              holdout_fraction: float = 0.2, progress: Callable | None = None, log: Callable[[str], None] = print,
              statistic: str = "median", enforce_eager: bool = False,
              cudagraph_mode: str = "full_decode_only") -> dict:
    """The whole calibration: build the runner, measure the grid, fit, write `out`. Returns the record."""
    from gpu_backend.runner import ModelRunner, default_dtype
    from simkv.specs import get_model_spec

    out = Path(out)
    spec = get_model_spec(model)
    t0 = time.perf_counter()
    dtype = dtype or default_dtype(device)
    points, dropped = build_grid(preset, max_num_batched_tokens, max_num_seqs, spec.max_position_embeddings,
                                 None, block_size, seed)
    # Weights first (they are resident whatever the pool), then the pool sized to what is left.
    runner = ModelRunner(model, 0, block_size, device, dtype, seed=seed)
    num_blocks = plan_pool_blocks(points, block_size, runner.bytes_per_block(), device,
                                  activation_reserve(spec, max_num_batched_tokens) if device.startswith("cuda") else 0)
    runner.allocate_pool(num_blocks)
    points, more_dropped = build_grid(preset, max_num_batched_tokens, max_num_seqs, spec.max_position_embeddings,
                                      num_blocks, block_size, seed)
    dropped = more_dropped
    record = new_record(model, runner, dtype, preset, points, dropped, num_blocks,
                        {"preset": preset, "warmup": warmup, "repeats": repeats, "statistic": statistic,
                         "budget_s": budget_s, "seed": seed, "max_num_batched_tokens": max_num_batched_tokens,
                         "max_num_seqs": max_num_seqs})
    from gpu_backend.backend import prepare_for_timing

    # the same preparation as a replay: kernels compiled, CUDA graphs captured
    prepare_for_timing(runner, 2, max_num_seqs, enforce_eager, cudagraph_mode)
    record.update(runner.graph_fields())
    write_json_atomic(out, record)  # the file exists from the start; filled as points come in
    last_save = [time.perf_counter()]

    def on_point(row: dict, done: int, total: int) -> None:
        if "oom" in row:
            record.setdefault("oom", []).append(row["oom"])
            near = row["oom"]["nearest_fitting"]
            log(f"out of memory at {row['oom']['shape']}; nearest measured shape that fits: {near}")
        else:
            record["grid"]["measured"].append(row)
        if time.perf_counter() - last_save[0] > 2.0:
            write_json_atomic(out, record)
            last_save[0] = time.perf_counter()
        if progress:
            progress(done, total, row)

    try:
        result = measure_grid(runner, points, warmup, repeats, budget_s, on_point, statistic)
    except BaseException:
        record["error"] = "interrupted"
        write_json_atomic(out, record)
        raise
    record["grid"]["skipped"] = result["skipped"]
    record["oom"] = result["oom"]
    record["stopped_by_budget"] = result["stopped_by_budget"]
    record["rounds"] = result["rounds"]
    record["measure_time_s"] = result["measure_time_s"]
    measured = result["measured"]
    if len(measured) >= 3:
        record["fit"] = fit_rows(measured, holdout_fraction, seed, graph_sizes=runner.graph_sizes,
                                 piecewise_sizes=runner.piecewise_sizes)
    record["complete"] = not result["stopped_by_budget"] and not result["oom"]
    record["total_time_s"] = time.perf_counter() - t0
    write_json_atomic(out, record)
    return record
