"""`simkv calibrate --model M [--device cuda] --out calib.json`: measure, fit, record."""

from __future__ import annotations

import click

from simkv.cli.model_option import ModelName


@click.command("calibrate")
@click.option("--model", type=ModelName(), default=None,
              help="Model to profile, shipped or a Hugging Face config.json of a dense Llama-architecture "
                   "decoder (required unless --from-steps).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, help="[default: cuda if present]")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="[default: bf16 on cuda, fp32 on cpu]")
@click.option("--out", "out_path", default="calib.json", show_default=True)
@click.option("--grid", "preset", type=click.Choice(["tiny", "default"]), default=None,
              help="Grid of step shapes [default: tiny on cpu, default on cuda].")
@click.option("--budget-s", type=float, default=None, help="Stop measuring after this many seconds (fit what was measured).")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed runs per grid point.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Timed runs per grid point (median kept).")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Largest step measured [default: as a replay on this GPU takes it (vLLM's API-server default: "
                   "8,192 on an H100 or H200, 16,384 on a B200); 8,192 on cpu or an unknown GPU].")
@click.option("--max-num-seqs", type=int, default=None,
              help="Most sequences in a measured step [default: as a replay on this GPU takes it (1,024 on an H100, "
                   "H200 or B200); 256 on cpu or an unknown GPU]. A replay with more running than were measured "
                   "extrapolates the fit, and says so.")
@click.option("--statistic", type=click.Choice(["median", "mean"]), default="median", show_default=True,
              help="Per-point value fitted: the median of the repeats, or their mean (closer to what a long replay sums on a noisy host).")
@click.option("--holdout", type=float, default=0.2, show_default=True, help="Fraction of grid points held out.")
@click.option("--enforce-eager", is_flag=True, help="Measure decode steps without CUDA graphs (as replay --enforce-eager).")
@click.option("--cudagraph-mode", type=click.Choice(["full_decode_only", "full_and_piecewise"]), default="full_decode_only",
              show_default=True, help="As replay --cudagraph-mode (vLLM's cudagraph_mode): decode-only steps from full CUDA graphs, "
                                      "and with full_and_piecewise also steps with prefill chunks of up to "
                                      "min(2 * max_num_seqs, 512) tokens from piecewise graphs (attention eager between).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--from-steps", "from_steps", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="Fit on the steps of a measured replay folder (simkv replay --backend gpu --out DIR) instead of "
                   "profiling a grid; repeatable. Measures nothing, needs no GPU.")
@click.option("--with-grid", "with_grid", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With --from-steps: also fit the grid points of this calib.json.")
@click.option("--refit", "refit", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Fit this calib.json's measured grid points again (with --statistic and this simkv's formula); "
                   "measures nothing, needs no GPU.")
@click.option("--from-bench", "from_bench", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Fit the roofline's efficiencies and overheads to a real vLLM server: a `vllm bench serve "
                   "--save-detailed` result of the trace `simkv trace export` wrote (with --sim). Needs no GPU.")
@click.option("--sim", "sim_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="With --from-bench: a simulated replay of the exported trace with the server's settings.")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With --from-bench: the trace --sim replayed, when it has moved since.")
@click.option("--max-evals", type=int, default=400, show_default=True,
              help="With --from-bench: replays the fit may run.")
@click.option("--quiet", is_flag=True)
def calibrate_cmd(model, device, dtype, out_path, preset, budget_s, warmup, repeats, block_size,
                  max_num_batched_tokens, max_num_seqs, statistic, holdout, seed, enforce_eager, from_steps, with_grid,
                  refit, from_bench, sim_dir, trace_path, max_evals, quiet, cudagraph_mode) -> None:
    """Profile a designed grid of step shapes on the real backend (decode batches, prefill chunks,
    mixed steps), fit the cost model, and write calib.json (usable as `simkv replay --cost-model`).

    With --from-steps, fit the same formula on the steps a measured replay executed (ragged
    contexts, the traffic's own mix of shapes); check it on another trace slice.

    With --from-bench and --sim, fit the roofline to a real vLLM server's benchmark of an exported
    trace and write a roofline fit (`simkv replay --cost-model fit.json`; docs/validate_vllm.md)."""
    if from_bench or sim_dir:
        if not (from_bench and sim_dir):
            raise click.UsageError("--from-bench and --sim go together: the benchmark's result and a simulated "
                                   "replay of the same trace with the server's settings")
        if refit or from_steps or model:
            raise click.UsageError("--from-bench is a mode of its own (no --model, --refit or --from-steps)")
        _from_bench(from_bench, sim_dir, trace_path, max_evals, out_path, quiet)
        return
    if refit and from_steps:
        raise click.UsageError("--refit and --from-steps are separate modes: give one")
    if refit:
        _refit(refit, out_path, statistic, model, holdout, seed, quiet)
        return
    if from_steps:
        _from_steps(list(from_steps), with_grid, out_path, model, holdout, seed, quiet)
        return
    if with_grid:
        raise click.UsageError("--with-grid only goes with --from-steps")
    if model is None:
        raise click.UsageError("Missing option '--model' (or give --from-steps DIR)")
    from simkv.specs import get_model_spec

    why = get_model_spec(model).simulated_only
    if why:
        raise click.UsageError(f"--model {model} has {why}: simulated only (the GPU backend runs dense "
                               "Llama-architecture decoders that attend the whole context); calibrate one of those")
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gpu_backend.backend import is_oom
    from simkv.calibration.profile import calibrate

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: torch sees no CUDA device")
    preset = preset or ("default" if device == "cuda" else "tiny")
    max_num_batched_tokens, max_num_seqs = calibration_batch(device, model, max_num_batched_tokens, max_num_seqs)
    columns = [TextColumn("calibrating {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn()]
    with Progress(*columns, disable=quiet, transient=True) as progress:
        task = progress.add_task(model, total=None)

        def on_progress(done, total, row):
            progress.update(task, completed=done, total=total,
                            description=f"{model}: {row.get('label', 'oom')}")

        try:
            record = calibrate(model, out_path, device, dtype, preset, warmup, repeats, budget_s, block_size,
                               max_num_batched_tokens, max_num_seqs, seed, holdout, on_progress,
                               log=lambda s: progress.console.print(s), statistic=statistic, enforce_eager=enforce_eager,
                               cudagraph_mode=cudagraph_mode)
        except Exception as exc:
            if is_oom(exc):
                raise click.ClickException(f"out of memory while loading the model or the KV pool: {exc}. "
                                           f"Partial record in {out_path}") from None
            raise
    n = len(record["grid"]["measured"])
    fit = record.get("fit")
    if fit is None:
        raise click.ClickException(f"only {n} grid points measured: too few to fit (raise --budget-s). "
                                   f"Measurements kept in {out_path}")
    if not quiet:
        h = fit["holdout"]
        click.echo(f"measured {n} of {record['grid']['num_points']} grid points ({record['rounds']} rounds) "
                   f"in {record['measure_time_s']:.1f} s"
                   + (" (stopped by the time budget)" if record.get("stopped_by_budget") else ""))
        for o in record.get("oom", []):
            click.echo(f"out of memory at {o['shape']}; nearest shape that fits: {o['nearest_fitting']}")
        click.echo(f"fit: {fit['form']}")
        click.echo("     " + ", ".join(f"{k}={v:.4g}" for k, v in fit["coefficients"].items()) + f", knee={fit['knee']:.0f}")
        if h["n"]:
            click.echo(f"held-out points: {h['n']}, mean |rel error| {100 * h['mape']:.1f} %, max {100 * h['max_ape']:.1f} %")
        click.echo(f"wrote {out_path}")


def _echo_fit(fit: dict, what: str, out_path: str) -> None:
    click.echo(f"fit: {fit['form']}")
    click.echo("     " + ", ".join(f"{k}={v:.4g}" for k, v in fit["coefficients"].items()) + f", knee={fit['knee']:.0f}")
    h = fit["holdout"]
    if h["n"]:
        click.echo(f"held-out {what}: {h['n']}, mean |rel error| {100 * h['mape']:.1f} %, max {100 * h['max_ape']:.1f} %")
    click.echo(f"wrote {out_path}")


def _refit(path: str, out_path: str, statistic: str, model: str | None, holdout: float, seed: int, quiet: bool) -> None:
    from simkv.calibration.costmodel import CalibrationError
    from simkv.calibration.refit import refit_calibration

    try:
        record = refit_calibration(path, out_path, statistic, holdout, seed, model=model)
    except (CalibrationError, ValueError, KeyError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if not quiet:
        click.echo(f"refitted {len(record['grid']['measured'])} grid points of {path} on the {statistic} of their samples")
        _echo_fit(record["fit"], "points", out_path)


def _from_steps(dirs: list[str], with_grid: str | None, out_path: str, model: str | None, holdout: float, seed: int,
                quiet: bool) -> None:
    from simkv.calibration.costmodel import CalibrationError
    from simkv.calibration.from_steps import calibrate_from_steps

    try:
        record = calibrate_from_steps(dirs, out_path, with_grid, holdout, seed)
    except (CalibrationError, ValueError, OSError) as exc:  # bad folders, columns or parquet files
        raise click.ClickException(str(exc)) from None
    if model is not None and record["model"] != model:
        raise click.ClickException(f"--model {model}, but the measured steps are of model '{record['model']}'")
    if not quiet:
        fit, src = record["fit"], record["source"]
        steps = sum(s["steps"] for s in src["measured_steps"])
        dropped = sum(s["left_out_compiling"] for s in src["measured_steps"])
        click.echo(f"fitted on {steps} measured steps from {len(dirs)} replay(s)"
                   + (f" and {src['grid_points']} grid points" if src["grid_points"] else "")
                   + (f"; {dropped} steps that compiled kernels left out" if dropped else ""))
        _echo_fit(fit, "steps", out_path)


def _from_bench(bench: str, sim_dir: str, trace_path: str | None, max_evals: int, out_path: str, quiet: bool) -> None:
    import json

    from simkv.atomic import atomic_write_text
    from simkv.calibration.from_bench import fit_from_bench

    def progress(evals: int, loss: float) -> None:
        if not quiet:
            click.echo(f"\r  {evals} replays, loss {loss:.5f}", nl=False, err=True)

    import time

    started = time.perf_counter()
    try:
        doc = fit_from_bench(bench, sim_dir, trace_path, max_evals, progress)
    except (ValueError, KeyError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    from pathlib import Path

    atomic_write_text(Path(out_path), json.dumps(doc, indent=2) + "\n")
    if quiet:
        return
    fit = doc["fit"]
    click.echo("", err=True)
    click.echo(f"fitted {doc['model']} on {doc['gpu']} (TP {doc['tensor_parallel_size']}) to {fit['requests']} "
               f"requests in {fit['evaluations']} replays ({time.perf_counter() - started:.1f} s):")
    for name, value in doc["params"].items():
        click.echo(f"  {name:<20} {value:.6g}" + ("   (at its bound)" if name in fit["at_bounds"] else ""))
    click.echo(f"  {'frontend_latency_s':<20} {doc['frontend_latency_s']:.6g}   (added to every TTFT and E2E)")
    for label, key in (("roofline defaults", "at_defaults"), ("fitted", "fitted")):
        a = fit[key]
        click.echo(f"  {label:<18} TTFT / E2E median |error| per request {100 * a['ttft_median_abs_rel_error']:.1f} % / "
                   f"{100 * a['e2e_median_abs_rel_error']:.1f} %; duration {100 * a['duration_s']:+.1f} %, "
                   f"TTFT p50 {100 * a['ttft_s.p50']:+.1f} %, ITL p50 {100 * a['itl_s.p50']:+.1f} %")
    click.echo(f"wrote {out_path} (simkv replay --cost-model {out_path}; check it on another slice with simkv compare)")


def calibration_batch(device: str, model: str, max_num_batched_tokens: int | None,
                      max_num_seqs: int | None) -> tuple[int, int]:
    """The largest step a calibration measures: the options given, the others as a replay on the
    device's GPU defaults them (`simkv.config.vllm_batch_defaults`), so that the grid reaches the
    batches the replay will run; on cpu or a GPU simkv does not know, 8,192 tokens and 256 sequences."""
    from simkv.config import FIXED_BATCH_DEFAULTS, vllm_batch_defaults
    from simkv.specs import canonical_gpu, get_model_spec

    gpu = None
    if device.startswith("cuda"):
        import torch

        gpu = canonical_gpu(torch.cuda.get_device_name(0))
    if gpu is None:
        tokens, seqs = FIXED_BATCH_DEFAULTS
        return max_num_batched_tokens or tokens, max_num_seqs or seqs
    return vllm_batch_defaults(gpu, get_model_spec(model).max_position_embeddings,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
