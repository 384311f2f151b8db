"""The study scripts' runs: the bundled Azure slice at a load multiple, and a replay's summary,
each through the venv's `simkv` command (as the docs' command lines run them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIMKV = [str(Path(sys.executable).parent / "simkv")]  # the venv's entry point
AZURE = ROOT / "traces" / "azure_conv_slice.parquet"


def scaled_trace(tmp: Path, load: str, trace: Path = AZURE) -> Path:
    """`trace` at `load` times its rate (arrival times divided by it), written under `tmp`."""
    out = tmp / f"x{load}.parquet"
    subprocess.run(SIMKV + ["trace", "transform", str(trace), "--time-scale", repr(1 / float(load)),
                            "--out", str(out)], check=True, capture_output=True)
    return out


def replay_summary(trace: Path, options: list[str], tmp: Path) -> dict:
    """`simkv replay TRACE OPTIONS`'s summary.json (the run's files go under `tmp`)."""
    out = tmp / "run"
    subprocess.run(SIMKV + ["replay", str(trace), "--out", str(out), "--quiet"] + options, check=True)
    return json.loads((out / "summary.json").read_text())
