"""The sweep folder: DIR/cells/<cell-id>/summary.json (finished) or error.txt (failed), written atomically."""

from __future__ import annotations

import json
from pathlib import Path


from simkv.atomic import atomic_write_text


def cell_dir(out_dir: Path, cell_id: str) -> Path:
    return out_dir / "cells" / cell_id


def load_finished(out_dir: Path, cell_id: str) -> dict | None:
    """The summary of a cell finished by an earlier run, or None (absent or unreadable: run it again)."""
    path = cell_dir(out_dir, cell_id) / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def record(out_dir: Path, outcome: dict, cell_spec: dict) -> None:
    """Store one worker outcome: summary.json for a finished cell, error.txt for a failed one."""
    folder = cell_dir(out_dir, outcome["cell_id"])
    if outcome["status"] == "ok":
        atomic_write_text(folder / "summary.json", json.dumps(outcome["summary"], indent=2) + "\n")
        (folder / "error.txt").unlink(missing_ok=True)
    else:
        text = (outcome["error"] + "\n\ncell: " + json.dumps(cell_spec, sort_keys=True) + "\n"
                + (("\n" + outcome["detail"]) if outcome.get("detail") else ""))
        atomic_write_text(folder / "error.txt", text)
