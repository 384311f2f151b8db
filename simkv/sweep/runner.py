"""run_sweep(): resume what is finished, run the rest on an executor, store each cell as it lands,
then write the table (sweep.parquet, sweep.md) and plots.html."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from simkv.atomic import atomic_write_bytes, atomic_write_text
from simkv.sweep import store
from simkv.sweep.grid import Cell, SweepError
from simkv.sweep.plots import plots_html
from simkv.sweep.table import build_rows, markdown, parquet_bytes, to_arrow


@dataclass
class SweepResult:
    rows: list[dict]
    num_cells: int
    num_resumed: int  # finished by an earlier run, not recomputed
    num_run: int
    failed: list[dict]  # rows of failed cells
    wall_time_s: float
    out_dir: Path
    num_stale: int = 0  # finished by an earlier simkv with other options in force: run again


def run_sweep(cells: list[Cell], swept_keys: list[str], out_dir: str | Path, executor: str = "local",
              workers: int = 1, ray_address: str | None = None,
              on_cell_done: Callable[[dict], None] | None = None,
              on_start: Callable[[int, int], None] | None = None,
              prices: dict[str, float] | None = None) -> SweepResult:
    """Run every cell not finished yet in `out_dir`; a failed cell is recorded and the others go on.
    `on_start(total, resumed)` is called once, `on_cell_done(outcome)` once per cell run. With
    `prices` (USD per GPU-hour, per GPU kind) each cell's cost is priced into the table, not into
    the cells' own records: a resumed sweep reprices them."""
    if executor not in ("local", "ray"):
        raise SweepError(f"--executor: unknown executor '{executor}'; choose local or ray")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    specs = {c.cell_id: c.task() for c in cells}
    outcomes: dict[str, dict] = {}
    stale = 0
    for cell in cells:
        summary = store.load_finished(out, cell.cell_id)
        if summary is not None and not _made_with(summary, cell):
            summary, stale = None, stale + 1
        if summary is not None:
            outcomes[cell.cell_id] = {"cell_id": cell.cell_id, "status": "ok", "summary": summary}
    resumed = len(outcomes)
    todo = [specs[c.cell_id] for c in cells if c.cell_id not in outcomes]
    todo = list({t["cell_id"]: t for t in todo}.values())  # a cell listed twice runs once
    _write_manifest(out, cells, swept_keys)
    if on_start:
        on_start(len(cells), resumed)
    if todo:
        if executor == "ray":
            from simkv.sweep.executors import run_ray
            stream = run_ray(todo, ray_address)
        else:
            from simkv.sweep.executors import run_local
            stream = run_local(todo, workers)
        for outcome in stream:
            store.record(out, outcome, specs[outcome["cell_id"]])
            outcomes[outcome["cell_id"]] = outcome
            if on_cell_done:
                on_cell_done(outcome)
    if prices:
        outcomes = {cell_id: _priced(outcome, cells, prices) for cell_id, outcome in outcomes.items()}
    rows = build_rows(cells, outcomes, swept_keys)
    write_table(out, rows, swept_keys)
    return SweepResult(rows, len(cells), resumed, len(todo), [r for r in rows if r["status"] != "ok"],
                       time.perf_counter() - t0, out, stale)


def _priced(outcome: dict, cells: list[Cell], prices: dict[str, float]) -> dict:
    """A finished cell's outcome with its summary's `cost` (simkv replay --gpu-price's); a cell
    on a GPU without a price is not costed."""
    from simkv.studies.serving_cost import PriceError, replay_cost, replay_gpu_hours
    from simkv.sweep.worker import cell_specs

    if outcome["status"] != "ok":
        return outcome
    cell = next(c for c in cells if c.cell_id == outcome["cell_id"])
    summary = outcome["summary"]
    try:
        config, encode, fleet, disaggregation = cell_specs(cell.options, cell.fleet)
        hours = replay_gpu_hours(summary, config, fleet, disaggregation, encode)
        cost = replay_cost(summary, hours, prices)
    except PriceError:
        return outcome
    return outcome | {"summary": summary | {"cost": cost}}


def _made_with(summary: dict, cell: Cell) -> bool:
    """Whether a finished cell's summary was made with the engine options this simkv puts in force
    for the cell. The cell id hashes the options given, so a summary from an older simkv whose
    defaults differed (batch sizes before 2026-12-06, say) has the same id: such a cell is run
    again. P/D cells, whose pools derive their own options, and cells whose options no longer
    build are taken as they are (the latter fail when run)."""
    from simkv.config import ConfigError, EngineConfig
    from simkv.sweep.grid import PD_KEYS

    if any(k in PD_KEYS for k, _ in cell.fleet):
        return True
    try:
        expected = EngineConfig.from_flat(dict(cell.options)).to_dict()
    except (ConfigError, TypeError, ValueError):
        return True
    expected = json.loads(json.dumps(expected))  # (as summary.json holds it: a tuple reads back as a list)
    made = summary.get("config") or {}
    return all(made[k] == v for k, v in expected.items() if k in made and k != "num_gpu_blocks")


def _write_manifest(out: Path, cells: list[Cell], swept_keys: list[str]) -> None:
    manifest = {"swept_keys": swept_keys, "cells": [c.task() | {"index": c.index} for c in cells]}
    atomic_write_text(out / "sweep.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def write_table(out: Path, rows: list[dict], swept_keys: list[str]) -> None:
    """sweep.parquet, sweep.md and plots.html, each written whole or not at all."""
    atomic_write_bytes(out / "sweep.parquet", parquet_bytes(to_arrow(rows, swept_keys)))
    atomic_write_text(out / "sweep.md", markdown(rows, "simkv sweep"))
    atomic_write_text(out / "plots.html", plots_html(rows, swept_keys, "simkv sweep"))
