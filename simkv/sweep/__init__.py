"""Sweeps: the cross product of engine options over traces, one replay per cell, run on local
processes or a Ray cluster, gathered into a table (parquet + markdown) and inline-SVG plots."""

from simkv.sweep.grid import Cell, SweepError, make_cells, parse_assignment, parse_grid, parse_value
from simkv.sweep.runner import SweepResult, run_sweep

__all__ = ["Cell", "SweepError", "SweepResult", "make_cells", "parse_assignment", "parse_grid", "parse_value",
           "run_sweep"]
