"""The console simkv prints its tables on.

Rich lays a table out for the terminal's width, and where stdout is not a terminal (a pipe, a
file, a CI log) for 80 columns, where the per-replica tables lose digits to ellipses. Not on a
terminal, and without COLUMNS, simkv lays them out for PIPE_WIDTH columns instead.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

PIPE_WIDTH = 120


def console() -> Console:
    """A Console as wide as the terminal, or PIPE_WIDTH columns where stdout is none (COLUMNS wins)."""
    on_terminal = hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
    return Console() if on_terminal or os.environ.get("COLUMNS") else Console(width=PIPE_WIDTH)
