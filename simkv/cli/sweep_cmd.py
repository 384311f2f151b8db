"""`simkv sweep TRACE... --grid KEY=V1,V2 --out DIR`: the cross product of options over traces."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import click
import numpy as np

from simkv.backends.factory import COST_MODELS
from simkv.calibration.cli_support import CostModelChoice
from simkv.cli.replay_cmd import VLLM_SERVE_HELP, load_config_file, served_options
from simkv.config import ConfigError, HardwareConfig


def _check_cost_model(value) -> None:
    from simkv.sweep import SweepError

    if value in COST_MODELS or (isinstance(value, str) and value.endswith(".json") and os.path.isfile(value)):
        return
    raise SweepError(f"cost_model: '{value}' is neither one of {', '.join(COST_MODELS)} nor an existing calib.json")


def plan(traces: tuple[str, ...], grids: tuple[str, ...], sets: tuple[str, ...], config_file: str | None,
         cost_model: str, goodput: tuple[str, ...] = (), vllm_serve: str | None = None,
         vllm_bench: str | None = None, out_dir: str | None = None, vllm_multi_turn: str | None = None):
    """Cells and swept keys from the command line; raises SweepError / click.BadParameter.
    `vllm_bench`: a `vllm bench serve` command whose traffic is written into `out_dir` as one
    more trace (its --max-concurrency and --goodput fixed unless given); `vllm_multi_turn`: vLLM's
    multi-turn benchmark's command likewise (its clients fixed unless given)."""
    from simkv.replay.goodput import GoodputError, check_slo_classes, parse_goodput, slo_classes
    from simkv.sweep import SweepError, make_cells, parse_assignment, parse_grid
    from simkv.sweep.grid import TEXT_KEYS, normalize_key, typed_value

    try:
        slo = parse_goodput(goodput)
    except GoodputError as exc:
        raise SweepError(str(exc)) from None
    fixed = {}
    for key, value in (load_config_file(config_file) if config_file else {}).items():
        key = normalize_key(key, "--config")
        fixed[key] = typed_value(key, value, "--config") if key in TEXT_KEYS else value
    given = dict(parse_assignment(text, "--set") for text in sets)
    grid = parse_grid(list(grids))
    if vllm_serve:
        try:
            fixed.update(served_options(vllm_serve, model_given="model" in given or "model" in grid))
        except ConfigError as exc:
            raise SweepError(str(exc)) from None
    fixed.update(given)
    if vllm_bench:
        bench_path, bench_goodput = _bench_trace(vllm_bench, fixed, out_dir)
        traces = (*traces, bench_path)
        if not goodput and bench_goodput:
            try:
                slo = parse_goodput(bench_goodput)
            except GoodputError as exc:
                raise SweepError(str(exc)) from None
    if vllm_multi_turn:
        traces = (*traces, _multi_turn_trace(vllm_multi_turn, fixed, out_dir))
    if not traces:
        raise SweepError("TRACE: give one or more traces, --vllm-bench or --vllm-multi-turn")
    from simkv.traces.schema import read_trace

    read = functools.lru_cache(maxsize=None)(read_trace)  # (the class checks below read each trace once)
    if slo_classes(slo):  # (an SLO for a class a trace lacks: said before any cell runs)
        from simkv.replay.classes import trace_labels

        for path in traces:
            try:
                check_slo_classes(slo, trace_labels(read(path)), str(path))
            except GoodputError as exc:
                raise SweepError(str(exc)) from None
    _check_replica_classes(traces, grid.get("class_replicas", [fixed.get("class_replicas")]), read)
    for value in grid.get("cost_model", [fixed.get("cost_model", cost_model)]):
        _check_cost_model(value)
    for trace in traces:
        if not os.path.isfile(trace):
            raise SweepError(f"TRACE: no such file '{trace}'")
    if len(set(map(os.path.normpath, traces))) != len(traces):
        raise SweepError("TRACE: a trace is given twice")
    cells = make_cells(list(traces), grid, fixed, cost_model, slo)
    _check_retries(cells)
    return cells, list(grid)


def _check_retries(cells) -> None:
    """Clients' retries (client_max_retries) with nothing to retry in any cell are refused, as a
    replay refuses them; beside cells that have a use for them, a cell without (a grid's
    baseline) runs without them (simkv/sweep/worker.py)."""
    from simkv.replay.api import retries_have_use
    from simkv.sweep import SweepError
    from simkv.sweep.worker import cell_specs

    retrying = [cell for cell in cells if dict(cell.options).get("client_max_retries")]
    for cell in retrying:
        try:
            config, _, fleet, _ = cell_specs(cell.options, cell.fleet)
            if retries_have_use(config, fleet):
                return
        except ValueError:
            return  # (a cell that does not build says so itself when it runs)
    if retrying:
        raise SweepError("client_max_retries retries requests that timed out: no cell has anything to retry "
                         "(give client_timeout_s or client_ttft_timeout_s, a queue limit, max_num_queued_reqs "
                         "or max_num_queued_tokens, replica_failures, replica_mtbf_s or node_mtbf_s)")


def _check_replica_classes(traces, values, read) -> None:
    """Each class that class_replicas names (`values`: its canonical texts, None for none) must
    be a request class of every trace (`read`: a trace by its path); said before any cell runs."""
    from simkv.replay.classes import missing_class
    from simkv.sweep import SweepError

    names = list(dict.fromkeys(_without_pool(item.partition("=")[0]) for value in values if value
                               for item in value.split(";")))
    if not names:
        return
    for path in traces:
        if not os.path.isfile(path):
            continue  # (said below)
        labels = getattr(read(path), "request_class", None)
        if labels is None:
            raise SweepError(f"class_replicas: {path} has no request_class column (label it with `simkv trace "
                             "transform --request-class` or `simkv trace merge`)")
        missing = missing_class(names, np.asarray(labels, dtype=object))
        if missing:
            raise SweepError(f"class_replicas: {path} {missing[1]}")


def _without_pool(name: str) -> str:
    """A class name without a P/D pool's prefix (prefill:docs -> docs)."""
    pool, sep, rest = name.partition(":")
    return rest if sep and pool in ("prefill", "decode") else name


def _bench_trace(command: str, fixed: dict, out_dir: str) -> tuple[str, tuple[str, ...]]:
    """Write the bench command's traffic into the sweep folder, its client limit into `fixed`;
    the trace's path and the command's --goodput."""
    from simkv.cli.replay_cmd import _say_once
    from simkv.cli.vllm_bench_command import bench_command
    from simkv.sweep import SweepError
    from simkv.traces.schema import write_trace

    try:
        bench = bench_command(command, str(fixed.get("model", HardwareConfig().model)))
    except ConfigError as exc:
        raise SweepError(str(exc)) from None
    if bench.note():
        _say_once(bench.note())
    if bench.max_concurrency is not None:
        fixed.setdefault("client_max_concurrency", bench.max_concurrency)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = str(Path(out_dir) / "vllm_bench_trace.parquet")
    write_trace(bench.trace, path)
    return path, bench.goodput


def _multi_turn_trace(command: str, fixed: dict, out_dir: str) -> str:
    """Write the multi-turn benchmark command's conversations into the sweep folder, its clients
    (and its model) into `fixed` where not given; the trace's path."""
    from simkv.cli.replay_cmd import _say_once
    from simkv.cli.vllm_command_line import CommandLineError
    from simkv.cli.vllm_multi_turn_command import multi_turn_command
    from simkv.cli.vllm_serve import ServeCommandError, resolve_model
    from simkv.sweep import SweepError
    from simkv.traces.schema import write_trace

    try:
        bench = multi_turn_command(command)
        if bench.model is not None:
            fixed.setdefault("model", resolve_model(bench.model))
    except (CommandLineError, ConfigError, ServeCommandError) as exc:
        raise SweepError(str(exc)) from None
    if bench.note():
        _say_once(bench.note())
    for key, value in bench.client_options.items():
        fixed.setdefault(key, value)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = str(Path(out_dir) / "vllm_multi_turn_trace.parquet")
    write_trace(bench.trace, path)
    return path


@click.command("sweep")
@click.argument("traces", nargs=-1, required=False)
@click.option("--grid", "grids", multiple=True, metavar="KEY=V1,V2,...",
              help="Swept option (engine option names, cost_model, step_base_s, step_per_token_s, replicas, router, "
                   "prefix_aware's cache_threshold, balance_abs, balance_rel, class_replicas as "
                   "'none,docs=3,docs=2-3;chat=0', and replica_sets (replicas of other engines) as "
                   "'none,2-3:gpu=H200,0-3:gpu=H200' (sets of one value joined by ';')); repeatable.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Fixed option; repeatable.")
@click.option("--config", "config_file", default=None, help="YAML or JSON file of fixed engine options.")
@click.option("--vllm-serve", "vllm_serve", default=None, metavar="COMMAND|@FILE", help=VLLM_SERVE_HELP)
@click.option("--vllm-bench", "vllm_bench", default=None, metavar="COMMAND|@FILE",
              help="One more trace: the traffic of a `vllm bench serve` command, written into the sweep folder "
                   "(its --max-concurrency and --goodput hold in every cell unless given).")
@click.option("--vllm-multi-turn", "vllm_multi_turn", default=None, metavar="COMMAND|@FILE",
              help="One more trace: the conversations of vLLM's multi-turn benchmark command "
                   "(benchmark_serving_multi_turn.py --input-file GEN.json ...), written into the sweep folder "
                   "(its clients hold in every cell unless given).")
@click.option("--cost-model", default="roofline", show_default=True, type=CostModelChoice(COST_MODELS),
              help="Cost model of every cell unless swept.")
@click.option("--goodput", "goodput", multiple=True, metavar="[CLASS:]KEY:MS",
              help="Latency SLO judged in every cell (vLLM's --goodput: ttft, tpot or e2el and a limit in ms; "
                   "CLASS:KEY:MS for one request class); "
                   "adds the slo_attainment and goodput_req_s columns.")
@click.option("--gpu-price", "gpu_prices", multiple=True, metavar="GPU=USD",
              help="What a GPU-hour costs, per GPU kind (e.g. H100-SXM=2.49): adds the usd_spent and "
                   "usd_per_1m_output_tokens columns (the GPU-hours each cell's setup paid, as simkv replay "
                   "--gpu-price prices them); a cell on a GPU without a price is not costed.")
@click.option("--out", "out_dir", required=True, help="Sweep folder (resumable: finished cells are kept).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Local processes [default: CPU count, at most the number of cells]")
@click.option("--ray-address", default=None, help="Ray cluster to join [default: RAY_ADDRESS, else a local one]")
@click.option("--quiet", is_flag=True, help="No progress bar or summary line.")
def sweep_cmd(traces: tuple[str, ...], grids: tuple[str, ...], sets: tuple[str, ...], config_file: str | None,
              cost_model: str, out_dir: str, executor: str, workers: int | None, ray_address: str | None,
              quiet: bool, goodput: tuple[str, ...], vllm_serve: str | None, vllm_bench: str | None,
              vllm_multi_turn: str | None, gpu_prices: tuple[str, ...]) -> None:
    """Replay every TRACE under every combination of the --grid options; write DIR/sweep.parquet,
    DIR/sweep.md and DIR/plots.html. Exits 1 when a cell failed (the table is still written)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from simkv.studies.serving_cost import PriceError, parse_prices
    from simkv.sweep import SweepError, run_sweep

    try:
        prices = parse_prices(gpu_prices)
    except PriceError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpu-price") from None
    try:
        cells, swept_keys = plan(traces, grids, sets, config_file, cost_model, goodput, vllm_serve, vllm_bench,
                                 out_dir, vllm_multi_turn)
    except click.BadParameter as exc:
        raise click.ClickException(exc.format_message()) from None
    except SweepError as exc:
        raise click.ClickException(str(exc)) from None
    workers = workers or min(os.cpu_count() or 1, max(len(cells), 1))
    columns = (TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
               TimeElapsedColumn())
    with Progress(*columns, disable=quiet, transient=True) as progress:
        task = progress.add_task("sweep", total=len(cells), failed=0)
        failed = 0

        def on_start(total: int, resumed: int) -> None:
            progress.update(task, completed=resumed)

        def on_done(outcome: dict) -> None:
            nonlocal failed
            failed += outcome["status"] != "ok"
            progress.update(task, advance=1, failed=failed)

        try:
            result = run_sweep(cells, swept_keys, out_dir, executor, workers, ray_address, on_done, on_start,
                               prices=prices)
        except SweepError as exc:
            raise click.ClickException(str(exc)) from None
    out = Path(out_dir)
    if not quiet:
        again = (f" ({result.num_stale} of them again: made by an earlier simkv with other options in force)"
                 if result.num_stale else "")
        click.echo(f"{result.num_cells} cells: {result.num_resumed} already done, {result.num_run} run{again}, "
                   f"{len(result.failed)} failed ({result.wall_time_s:.1f} s). "
                   f"Wrote {out / 'sweep.parquet'}, {out / 'sweep.md'}, {out / 'plots.html'}")
    unpriced = sum(1 for row in result.rows if prices and row["status"] == "ok" and row.get("usd_spent") is None)
    if unpriced:
        click.echo(f"warning: {unpriced} cells not costed: a GPU without a --gpu-price", err=True)
    if result.failed:
        for row in result.failed:
            click.echo(f"cell {row['cell']} failed ({out / 'cells' / row['cell_id'] / 'error.txt'}): {row['error']}",
                       err=True)
        raise SystemExit(1)
